"""User data files read into rows, and rows into examples: the checks a data row must pass, and their limits.

Reads a JSONL or Parquet file, or a folder written by ``datasets``' ``save_to_disk`` (with pyarrow alone), into
``(where, row)`` pairs (:func:`read_rows`), refusing what cannot be parsed or is too large or nested too deep
(:data:`MAX_LINE_BYTES`, :data:`MAX_ROW_DEPTH`, :data:`MAX_JSON_FILE_BYTES`); turns a row into a :class:`TaskExample`
through its prompt and answer keys (``_example``), and checks that example's prompt against the run's tokenizer
(``_prompt_tokens``). Every refusal is one :class:`TaskFileError` naming the file, the line (or row) and the reason.

The ``file`` task (``common/data/file_task.py``) serves a file's rows through these checks; ``asyncrl check-data``
(``cli/data_check.py``) runs the same per-row checks over every row, and the preference data of offline DPO
(``learner/intake/preferences.py``) is read with :func:`read_rows`.
"""

from __future__ import annotations

import copy
import itertools
import json
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from asyncrl.common.data.tasks import TaskError, TaskExample

if TYPE_CHECKING:
    from asyncrl.common.data.prompts import Prompter


class TaskFileError(TaskError):
    """A data file that cannot be used; the message names the file and the line (or row)."""


MAX_LINE_BYTES = 64 * 2**20
"""Longest JSONL line read: a file with no line end (``/dev/zero``) would otherwise be read into memory forever."""
MAX_ROW_DEPTH = 64
"""Deepest nesting of objects and arrays in a data row (deeper ones exhaust the stack when copied or encoded)."""
MAX_JSON_FILE_BYTES = 16 * 2**20
"""Largest ``state.json`` / ``dataset_dict.json`` read from a ``save_to_disk`` folder."""


def _prompt_tokens(prompter: Prompter, where: str, example: TaskExample) -> int:
    """How many tokens the dispatcher will send for ``example``'s prompt; refuses what the run cannot encode."""
    try:
        text = prompter.text(example)
    except ValueError as exc:
        raise TaskFileError(f"{where}: {exc}") from None
    unknown = prompter.unknown(text + example.answer)
    if unknown:
        raise TaskFileError(
            f"{where}: characters the model's tokenizer cannot encode (it has no token for them): {unknown!r}"
        )
    return len(prompter.encode(text))


@dataclass(frozen=True)
class _Keys:
    """Where a row holds its prompt and its answer (dotted paths into nested objects)."""

    prompt: str = "prompt"
    answer: str = "answer"


def read_rows(path: Path, split: str = "") -> list[tuple[str, Any]]:
    """``(where, row)`` for every row of a JSONL or Parquet data file, or of a ``save_to_disk`` folder (``split``
    names the split of a ``DatasetDict``); ``where`` ("line 3", "row 3") names it in errors. A file that cannot be
    parsed raises :class:`TaskFileError` naming the line."""
    if path.is_dir():
        return _dataset_folder_rows(path, split)
    if split:
        raise TaskFileError(f"{path}: task.split is for a folder written by save_to_disk (a DatasetDict), not a file")
    return _parquet_rows(path) if path.suffix.lower() in (".parquet", ".pq") else _jsonl_rows(path)


def _jsonl_rows(path: Path) -> list[tuple[str, Any]]:
    """``(line N, parsed object)`` for every non-blank line."""
    rows = []
    for number, raw in jsonl_lines(path):  # decoded line by line, so that a bad byte is reported with its line
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise TaskFileError(f"{path}:line {number}: not valid UTF-8 (byte {e.start + 1}: {e.reason})") from None
        if line.strip():
            rows.append((f"line {number}", json_row(line, f"{path}:line {number}")))
    return rows


def jsonl_lines(path: Path) -> Iterator[tuple[int, bytes]]:
    """``(line number, bytes)`` of every line; a line longer than :data:`MAX_LINE_BYTES` raises
    :class:`TaskFileError` naming it, having read no more than that."""
    try:
        with path.open("rb") as f:
            for number in itertools.count(1):
                raw = f.readline(MAX_LINE_BYTES + 1)
                if not raw:
                    return
                if len(raw) > MAX_LINE_BYTES and not raw.endswith(b"\n"):
                    raise TaskFileError(
                        f"{path}:line {number}: longer than {MAX_LINE_BYTES // 2**20} MiB without a line end "
                        "(a JSONL file holds one JSON object per line)"
                    )
                yield number, raw
    except OSError as exc:
        raise TaskFileError(f"{path}: cannot read the file: {exc.strerror or exc}") from None


def json_row(text: str, where: str) -> Any:
    """One JSON row parsed, or :class:`TaskFileError` naming ``where``: not JSON, nested deeper than
    :data:`MAX_ROW_DEPTH`, or a number longer than Python converts (``sys.get_int_max_str_digits``)."""
    try:
        row = json.loads(text)
    except json.JSONDecodeError as e:
        raise TaskFileError(f"{where}: not valid JSON ({e.msg})") from None
    except RecursionError:
        raise TaskFileError(f"{where}: nested more than {MAX_ROW_DEPTH} levels deep") from None
    except ValueError:  # an integer beyond the int-string conversion limit
        raise TaskFileError(
            f"{where}: a number of over {sys.get_int_max_str_digits()} digits; write it as a string"
        ) from None
    check_row_depth(row, where)
    return row


def check_row_depth(row: Any, where: str) -> None:
    """Refuse a row with objects or arrays nested deeper than :data:`MAX_ROW_DEPTH` (checked without recursion)."""
    stack = [(row, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, (dict, list)):
            if depth > MAX_ROW_DEPTH:
                raise TaskFileError(f"{where}: nested more than {MAX_ROW_DEPTH} levels deep")
            stack.extend((child, depth + 1) for child in (node.values() if isinstance(node, dict) else node))


def _pyarrow(path: Path) -> Any:
    try:
        import pyarrow as pa
    except ImportError:
        raise TaskFileError(
            f"{path}: reading Parquet or Arrow needs the 'pyarrow' package (pip install pyarrow)"
        ) from None
    return pa


def _parquet_rows(path: Path) -> list[tuple[str, Any]]:
    """``(row N, dict)`` for every row of a Parquet file (needs pyarrow)."""
    pa = _pyarrow(path)
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except (OSError, pa.ArrowException) as exc:
        raise TaskFileError(f"{path}: not a readable Parquet file ({exc})") from None
    return _table_rows(path, table)


def _dataset_folder_rows(path: Path, split: str) -> list[tuple[str, Any]]:
    """The rows of a folder written by ``Dataset.save_to_disk`` (``state.json`` lists its Arrow stream files) or
    ``DatasetDict.save_to_disk`` (``dataset_dict.json`` lists the splits, one such folder each), read with pyarrow:
    the ``datasets`` package is not needed."""
    splits_file = path / "dataset_dict.json"
    if splits_file.is_file():
        splits = _json_file(splits_file).get("splits") or []
        if not split and len(splits) == 1:
            split = splits[0]
        if split not in splits:
            wanted = f"has no split {split!r}" if split else "holds several splits: set task.split to one"
            raise TaskFileError(f"{path}: {wanted} (splits: {', '.join(map(str, splits))})")
        return _dataset_folder_rows(path / split, "")
    if split:
        raise TaskFileError(f"{path}: task.split names a split, but this folder is one Dataset (no dataset_dict.json)")
    state_file = path / "state.json"
    if not state_file.is_file():
        raise TaskFileError(
            f"{path}: a folder, but not one written by save_to_disk (no state.json or dataset_dict.json)"
        )
    pa = _pyarrow(path)
    tables = []
    for entry in _json_file(state_file).get("_data_files") or []:
        file = path / str(entry.get("filename", ""))
        try:
            with pa.memory_map(str(file)) as source:
                tables.append(pa.ipc.open_stream(source).read_all())
        except (OSError, pa.ArrowException) as exc:
            raise TaskFileError(f"{file}: not a readable Arrow file ({exc})") from None
    if not tables:
        raise TaskFileError(f"{path}: no examples")
    return _table_rows(path, pa.concat_tables(tables))


def _json_file(path: Path) -> dict[str, Any]:
    try:
        with path.open("rb") as f:
            raw = f.read(MAX_JSON_FILE_BYTES + 1)
    except OSError as exc:
        raise TaskFileError(f"{path}: not readable JSON ({exc})") from None
    if len(raw) > MAX_JSON_FILE_BYTES:
        raise TaskFileError(f"{path}: over {MAX_JSON_FILE_BYTES // 2**20} MiB, not a save_to_disk index")
    try:
        value = json_row(raw.decode("utf-8"), str(path))
    except UnicodeDecodeError as exc:
        raise TaskFileError(f"{path}: not readable JSON ({exc})") from None
    if not isinstance(value, dict):
        raise TaskFileError(f"{path}: expected a JSON object")
    return value


def _table_rows(path: Path, table: Any) -> list[tuple[str, Any]]:
    """``(row N, dict)`` for every row of an Arrow table; a string that is not UTF-8 is named by its row."""
    try:
        rows = table.to_pylist()
    except UnicodeDecodeError:  # a string column with bytes that are not UTF-8: find the row to name it
        for number in range(1, table.num_rows + 1):
            try:
                table.slice(number - 1, 1).to_pylist()
            except UnicodeDecodeError as e:
                raise TaskFileError(f"{path}:row {number}: not valid UTF-8 ({e.reason})") from None
        raise
    for number, row in enumerate(rows, start=1):
        check_row_depth(row, f"{path}:row {number}")
    return [(f"row {number}", row) for number, row in enumerate(rows, start=1)]


_MISSING = object()


def _lookup(row: dict[str, Any], key: str) -> Any:
    """``row[key]``, or the value at the dotted path ``key`` (``a.b`` = ``row["a"]["b"]``); :data:`_MISSING` if none."""
    if key in row:
        return row[key]
    node: Any = row
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return _MISSING
        node = node[part]
    return node


def _without(row: dict[str, Any], keys: tuple[str, ...]) -> dict[str, Any]:
    """A copy of ``row`` without the values at ``keys`` (dotted paths); an object left empty goes too."""
    out = copy.deepcopy(row)
    for key in keys:
        if key in out:
            del out[key]
            continue
        parts, node, parents = key.split("."), out, []
        for part in parts[:-1]:
            if not isinstance(node, dict) or not isinstance(node.get(part), dict):
                break
            parents.append((node, part))
            node = node[part]
        else:
            node.pop(parts[-1], None)
            for parent, part in reversed(parents):
                if not parent[part]:
                    del parent[part]
    return out


def _example(row: Any, where: str, keys: _Keys) -> TaskExample:
    """One row as an example; ``where`` (file and line) names it in every error."""
    if not isinstance(row, dict):
        raise TaskFileError(
            f"{where}: expected an object with {keys.prompt!r} and {keys.answer!r}, got {type(row).__name__}"
        )
    prompt_key = keys.prompt
    prompt = _lookup(row, prompt_key)
    if prompt is _MISSING and "messages" in row:  # a chat row, whatever the prompt key of the other rows
        prompt_key, prompt = "messages", row["messages"]
    answer = _lookup(row, keys.answer)
    for field, value in ((prompt_key, prompt), (keys.answer, answer)):
        if value is _MISSING:
            raise TaskFileError(f"{where}: missing field {field!r}")
        if value is None:
            raise TaskFileError(f"{where}: field {field!r} is null")
    messages = None
    if isinstance(prompt, list):
        messages = _messages(prompt, where, prompt_key)
        prompt = messages[-1]["content"]
    elif not isinstance(prompt, str):
        raise TaskFileError(
            f"{where}: field {prompt_key!r} must be a string or a list of messages, got {type(prompt).__name__}"
        )
    elif not prompt.strip():
        raise TaskFileError(f"{where}: field {prompt_key!r} is empty")
    answer = answer if isinstance(answer, str) else json.dumps(answer)
    _check_utf8(where, prompt_key, prompt)
    _check_utf8(where, keys.answer, answer)
    rest = _without(row, (prompt_key, keys.answer))
    extra = json.dumps(rest, default=str) if rest else ""  # ASCII JSON: a lone surrogate in a field is escaped
    return TaskExample(prompt, answer, messages, extra)


def _messages(value: list[Any], where: str, key: str) -> tuple[dict[str, str], ...]:
    """A row's chat messages, each ``{"role", "content"}`` with string values; at least one has content."""
    messages = []
    for i, message in enumerate(value):
        role = message.get("role") if isinstance(message, dict) else None
        content = message.get("content") if isinstance(message, dict) else None
        if not (isinstance(role, str) and role and isinstance(content, str)):
            raise TaskFileError(f"{where}: field {key!r}[{i}] is not a message with string 'role' and 'content'")
        _check_utf8(where, f"{key}[{i}].content", content)
        messages.append({"role": role, "content": content})
    if not any(m["content"].strip() for m in messages):
        raise TaskFileError(f"{where}: field {key!r} is empty")
    return tuple(messages)


def _check_utf8(where: str, field: str, text: str) -> None:
    """Refuse a string that has no UTF-8 form: a lone surrogate, e.g. from the JSON escape ``"\\udc80"``."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise TaskFileError(
            f"{where}: field {field!r} is not valid UTF-8 (character {e.start + 1}: {e.reason})"
        ) from None
