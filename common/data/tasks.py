"""Prompt sources: small seeded tasks with ground truth, and user data files.

A task turns a ``random.Random`` into a :class:`TaskExample` (a prompt and the answer its
verifier checks against; see ``common/rewards/verifiers.py``, whose registry uses the same names).
Tasks are registered by name, so the run config's ``task.name`` selects one and
``task.options`` are its constructor's keyword arguments::

    task = get_task("arithmetic", ops="+-", max_digits=3)
    example = task.sample(random.Random(0))   # TaskExample(prompt='...=', answer='...')

The built-in tasks' prompts and answers use only :data:`TASK_ALPHABET`, from which the tiny model's
character-level tokenizer is built. A data file may hold any text: its rows are checked against the run's own
tokenizer when the learner loads it (:meth:`Task.fit`), so a ``?`` is refused only where that tokenizer maps it to
its unknown token (the tiny model's does; a byte-level BPE has none).

Built-in formats (the prompt ends with ``=``; the model continues with the answer):

==============  ========================  ==================================================
task            prompt                    answer
==============  ========================  ==================================================
``arithmetic``  ``12+7=``                 ``19``
``reverse``     ``rev:abcde=``            ``edcba``
``countdown``   ``cd:3,5,7>22=``          ``{"numbers": [3, 5, 7], "target": 22, "solution": "(3*5)+7"}``
``file``        a row's prompt or         a row's answer (JSON-encoded when not a string)
                ``messages``
==============  ========================  ==================================================

Countdown: reach the target with ``+ - * /`` over the given numbers, each used at most once
(not all need be used). The generator builds the target from a random expression over a subset
of the numbers, so every example has a solution; it is kept in the answer as ``solution``
(verifiers ignore it; a supervised warm-start can learn from it).
"""

from __future__ import annotations

import copy
import inspect
import itertools
import json
import random
import sys
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from asyncrl.common.observability.logs import get_logger
from asyncrl.common.registry import Registry
from asyncrl.common.wire.messages import PromptGroup

if TYPE_CHECKING:
    from asyncrl.common.config import TaskSection
    from asyncrl.common.data.prompts import Prompter

TASK_ALPHABET = '0123456789abcdefghijklmnopqrstuvwxyz+-*/=()<>:,{}[]" \n'
"""Every character a prompt or answer may contain, in a fixed order (a tokenizer's id order)."""

_ALPHABET_SET = frozenset(TASK_ALPHABET)
log = get_logger("tasks")
_LETTERS = "abcdefghijklmnopqrstuvwxyz"


def outside_alphabet(text: str) -> set[str]:
    """The characters of ``text`` that are not in :data:`TASK_ALPHABET` (empty when all are)."""
    return set(text) - _ALPHABET_SET


@dataclass(frozen=True)
class TaskExample:
    """One prompt and the ground truth its verifier compares the model's response with."""

    prompt: str
    answer: str
    """A plain string; for structured tasks (countdown) a JSON document."""
    messages: tuple[dict[str, str], ...] | None = None
    """A chat row's messages (``role``, ``content``), which the run's chat template turns into the prompt."""
    extra: str = ""
    """A data row's other fields as a JSON object (``""``: none), which travel to the reward functions."""


class Task(ABC):
    """A source of prompts. Subclasses register with :func:`register_task`, which sets ``name``."""

    name: ClassVar[str]
    skipped: Sequence[str] = ()
    """Rows :meth:`fit` left out because their prompt is too long to serve (where each is; a data file's)."""

    @abstractmethod
    def sample(self, rng: random.Random) -> TaskExample:
        """Draw one example; all randomness comes from ``rng``, so a seed fixes the sequence."""

    def fresh(self) -> Task:
        """This task with no position in its data (stateless tasks return themselves)."""
        return self

    def fit(self, prompter: Prompter, max_tokens: int, overlong: str = "refuse") -> None:
        """Check the prompts this task serves against the run's ``prompter`` (its tokenizer and chat template).

        The learner calls it once, when it builds the task, with ``max_tokens = model.max_model_len −
        rollout.max_new_tokens``: a longer prompt could never get a whole response, so it is refused (``overlong =
        "refuse"``: :class:`TaskFileError` naming the row) or skipped and counted (``"skip"``). A generated task's
        prompts are a few dozen characters over :data:`TASK_ALPHABET`, bounded by its options, so it has nothing to
        check; a data file checks every row (:class:`FileTask`).
        """
        return  # nothing to check for a generated task

    def write_jsonl(self, path: str | Path, n: int, seed: int) -> Path:
        """Write ``n`` examples drawn with ``random.Random(seed)`` as JSONL rows ``{"prompt", "answer"}``.

        Draws from :meth:`fresh`, so the same seed writes the same file, whatever this task drew before.
        """
        if n < 0:
            raise ValueError(f"n must be >= 0, got {n}")
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        rng, task = random.Random(seed), self.fresh()
        with path.open("w", encoding="utf-8") as f:
            for _ in range(n):
                example = task.sample(rng)
                f.write(json.dumps({"prompt": example.prompt, "answer": example.answer}) + "\n")
        return path


def prompt_group(
    group_id: str,
    task: str,
    example: TaskExample,
    encode: Callable[[str], list[int]],
    num_samples: int,
    version: int = 0,
    issued_at: float | None = None,
) -> PromptGroup:
    """One prompt group for ``example``: its prompt tokenized by ``encode`` (special tokens as the model expects:
    :class:`asyncrl.common.data.prompts.Prompter`); the ids are made here, once, and travel unchanged to the learner."""
    return PromptGroup(
        group_id=group_id,
        task=task,
        prompt=example.prompt,
        prompt_ids=np.asarray(encode(example.prompt), dtype=np.int32),
        answer=example.answer,
        num_samples=num_samples,
        issued_version=version,
        issued_at=time.time() if issued_at is None else issued_at,
        extra=example.extra,
    )


# --------------------------------------------------------------------------- registry

TASKS: Registry[type[Task]] = Registry("task")
"""Task classes by name (the config's ``task.name``)."""
task_names = TASKS.names


def register_task(name: str) -> Callable[[type[Task]], type[Task]]:
    """Class decorator: register a :class:`Task` under ``name`` (which becomes its ``name``)."""

    def wrap(cls: type[Task]) -> type[Task]:
        TASKS.register(name)(cls)
        cls.name = name
        return cls

    return wrap


# Adapters that need optional packages (common/environments/gyms.py), imported when a run names them.
TASKS.register_path("reasoning_gym", "asyncrl.common.environments.gyms:ReasoningGymTask")
TASKS.register_path("textarena", "asyncrl.common.environments.gyms:TextArenaTask")


def get_task(name: str, **options: Any) -> Task:
    """Build the task registered as ``name`` with ``options`` (its constructor's keyword arguments)."""
    return check_task_options(name, options)(**options)


def check_task_options(name: str, options: dict[str, Any]) -> type[Task]:
    """The task class registered as ``name``, once ``options`` are known to fit its constructor (``ValueError``
    names them otherwise); nothing is built, so no data file is read."""
    cls = TASKS.get(name)
    try:
        inspect.signature(cls).bind(**options)
    except TypeError as e:
        raise ValueError(f"task {name!r}: bad options {sorted(options)}: {e}") from None
    return cls


def task_label(section: TaskSection) -> str:
    """The task name the run's prompt groups carry, which is also the verifier that scores them.

    A built-in task's own name; for ``file``, ``task.options["verifier"]`` (default ``"file"``), since a file holds
    prompts of any kind. Reward workers take this from the config and only compare it with a group's ``task``:
    a name that arrives on the wire never selects (or imports) anything.
    """
    if section.name != "file":
        return section.name
    return str(section.options.get("verifier", "file"))


def _check_range(task: str, option: str, value: int, low: int, high: int) -> None:
    if not (isinstance(value, int) and low <= value <= high):
        raise ValueError(f"task {task!r}: {option} must be an integer in [{low}, {high}], got {value!r}")


# --------------------------------------------------------------------------- built-in tasks


@register_task("arithmetic")
class ArithmeticTask(Task):
    """``a+b=``, ``a-b=`` or ``a*b=`` over non-negative integers of up to ``max_digits`` digits."""

    _OPS: ClassVar[dict[str, Callable[[int, int], int]]] = {
        "+": lambda a, b: a + b,
        "-": lambda a, b: a - b,
        "*": lambda a, b: a * b,
    }

    def __init__(self, ops: str = "+*", max_digits: int = 2) -> None:
        if not ops or set(ops) - set(self._OPS):
            raise ValueError(f"task 'arithmetic': ops must be a non-empty string over '+-*', got {ops!r}")
        _check_range("arithmetic", "max_digits", max_digits, 1, 9)
        self.ops = "".join(sorted(set(ops), key=ops.index))
        self.max_digits = max_digits

    def sample(self, rng: random.Random) -> TaskExample:
        high = 10**self.max_digits - 1
        a, b, op = rng.randint(0, high), rng.randint(0, high), rng.choice(self.ops)
        return TaskExample(f"{a}{op}{b}=", str(self._OPS[op](a, b)))


@register_task("reverse")
class ReverseTask(Task):
    """``rev:abcde=`` → ``edcba``: reverse a random lowercase string of ``min_length``..``max_length``."""

    def __init__(self, min_length: int = 3, max_length: int = 8) -> None:
        _check_range("reverse", "min_length", min_length, 1, 256)
        _check_range("reverse", "max_length", max_length, min_length, 256)
        self.min_length, self.max_length = min_length, max_length

    def sample(self, rng: random.Random) -> TaskExample:
        text = "".join(rng.choices(_LETTERS, k=rng.randint(self.min_length, self.max_length)))
        return TaskExample(f"rev:{text}=", text[::-1])


@register_task("countdown")
class CountdownTask(Task):
    """``cd:3,5,7>22=``: reach the target with ``+ - * /`` over the numbers, each used at most once.

    ``count`` numbers are drawn from 1..``max_number`` (repeats allowed). The target is the value of a
    random expression tree over 2..``count`` of them whose every intermediate value is a positive integer
    (subtraction only when it stays positive, division only when exact), so a solution always exists.
    """

    def __init__(self, count: int = 3, max_number: int = 10) -> None:
        _check_range("countdown", "count", count, 2, 6)
        _check_range("countdown", "max_number", max_number, 1, 100)
        self.count, self.max_number = count, max_number

    def sample(self, rng: random.Random) -> TaskExample:
        numbers = [rng.randint(1, self.max_number) for _ in range(self.count)]
        used = rng.sample(numbers, rng.randint(2, self.count))
        solution, target = _random_expression(used, rng)
        answer = json.dumps({"numbers": numbers, "target": target, "solution": solution})
        return TaskExample(f"cd:{','.join(map(str, numbers))}>{target}=", answer)


def _random_expression(numbers: list[int], rng: random.Random) -> tuple[str, int]:
    """A random expression using each of ``numbers`` once (compound operands in parentheses), and its value."""
    if len(numbers) == 1:
        return str(numbers[0]), numbers[0]
    split = rng.randint(1, len(numbers) - 1)
    (left, a), (right, b) = _random_expression(numbers[:split], rng), _random_expression(numbers[split:], rng)
    ops = ["+", "*"] + (["-"] if a > b else []) + (["/"] if a % b == 0 else [])
    op = rng.choice(ops)
    value = {"+": a + b, "-": a - b, "*": a * b, "/": a // b}[op]
    return f"{_operand(left)}{op}{_operand(right)}", value


def _operand(expr: str) -> str:
    """``expr`` as an operand of a larger expression: a number stays bare, a compound one gets parentheses."""
    return expr if expr.isdigit() else f"({expr})"


# --------------------------------------------------------------------------- user data


class TaskError(ValueError):
    """A task the run cannot serve as configured; the message says why (and where, for a data file)."""


class TaskFileError(TaskError):
    """A data file that cannot be used; the message names the file and the line (or row)."""


MAX_NAMED_SKIPS = 20
"""Skipped rows named one log line each; beyond these one line counts the rest."""
MAX_LINE_BYTES = 64 * 2**20
"""Longest JSONL line read: a file with no line end (``/dev/zero``) would otherwise be read into memory forever."""
MAX_ROW_DEPTH = 64
"""Deepest nesting of objects and arrays in a data row (deeper ones exhaust the stack when copied or encoded)."""
MAX_JSON_FILE_BYTES = 16 * 2**20
"""Largest ``state.json`` / ``dataset_dict.json`` read from a ``save_to_disk`` folder."""


@register_task("file")
class FileTask(Task):
    """Examples from a user data file: JSONL, Parquet, or a folder written by ``datasets``' ``save_to_disk``.

    A row's prompt is the field at ``prompt_key`` — a string, or a list of chat messages (``role``, ``content``;
    a row without that field may hold ``messages`` instead) — and its answer the field at ``answer_key``; both may be
    dotted paths into nested objects (``reward_model.ground_truth``, as in verl's Parquet files). A non-string
    answer (a countdown object, a number) is stored JSON-encoded. The row's other fields travel to the reward
    functions as ``extra`` (a JSON object). ``split`` picks a split of a ``DatasetDict`` folder, ``limit`` keeps
    the first rows of the file (0 = all).

    Rows are read once. With ``shuffle`` (the default) they are served in a shuffled order drawn from the ``rng``
    passed to :meth:`sample` at the start of every pass, so each pass visits every row exactly once and a seed fixes
    the whole sequence; without it, in file order, pass after pass. The position is state: one task object serves
    one stream.

    A bad row refuses the whole file, with one :class:`TaskFileError` that names the file, the row and the reason:
    not JSON, not valid UTF-8 (bytes, or a lone surrogate from a ``\\ud800`` escape, which no message could carry),
    a missing, malformed or empty prompt, a missing answer, and — once the run's tokenizer is known (:meth:`fit`) —
    characters that tokenizer can only map to its unknown token, or ``messages`` in a run without a chat template.
    A prompt too long for the run to serve is skipped and counted, or refused, as ``task.overlong`` says.
    """

    def __init__(
        self,
        path: str | Path,
        prompt_key: str = "prompt",
        answer_key: str = "answer",
        split: str = "",
        limit: int = 0,
        shuffle: bool = True,
    ) -> None:
        if limit < 0:
            raise ValueError(f"task 'file': limit must be >= 0, got {limit}")
        self.path = Path(path)
        self.shuffle = shuffle
        keys = _Keys(prompt_key, answer_key)
        located = _read_examples(self.path, keys, split, limit)
        self.examples = [example for _, example in located]
        self._where = [where for where, _ in located]  # "path:line N" of each example, for later refusals
        self.skipped: list[str] = []
        self._order: list[int] = []
        self._next = 0

    def fit(self, prompter: Prompter, max_tokens: int, overlong: str = "refuse") -> None:
        """Check every row under the run's ``prompter``; refuse the file at the first bad row, and refuse or skip a row
        whose prompt is longer than ``max_tokens`` tokens (see :meth:`Task.fit`).

        Counted in tokens of the run's own tokenizer and chat template, as the dispatcher will encode the prompt
        (special tokens included), not characters.
        """
        if overlong not in ("refuse", "skip"):
            raise ValueError(f"overlong must be 'refuse' or 'skip', got {overlong!r}")
        kept: list[tuple[str, TaskExample]] = []
        for where, example in zip(self._where, self.examples, strict=True):
            n = _prompt_tokens(prompter, where, example)
            if n <= max_tokens:
                kept.append((where, example))
                continue
            reason = f"prompt is {n} tokens; the run can serve at most {max_tokens}"
            if overlong == "refuse":
                raise TaskFileError(f"{where}: {reason} (model.max_model_len - rollout.max_new_tokens)")
            self.skipped.append(where)
            if len(self.skipped) <= MAX_NAMED_SKIPS:
                log.warning("skipped a row whose prompt is too long to serve", row=where, reason=reason)
        if self.skipped:
            log.warning(
                "skipped rows whose prompts are too long to serve",
                file=self.path,
                skipped=len(self.skipped),
                kept=len(kept),
                limit_tokens=max_tokens,
                action="raise model.max_model_len or lower rollout.max_new_tokens to serve them; task.overlong = "
                '"refuse" refuses such a file instead',
            )
        if not kept:
            raise TaskFileError(
                f"{self.path}: every row's prompt is longer than the run can serve ({max_tokens} tokens)"
            )
        self._where, self.examples = [w for w, _ in kept], [e for _, e in kept]
        self._order, self._next = [], 0

    def sample(self, rng: random.Random) -> TaskExample:
        if self._next >= len(self._order):
            self._order = list(range(len(self.examples)))
            if self.shuffle:
                rng.shuffle(self._order)
            self._next = 0
        self._next += 1
        return self.examples[self._order[self._next - 1]]

    def fresh(self) -> FileTask:
        task = copy.copy(self)  # shares the read-only rows
        task._order, task._next = [], 0
        return task


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


def _read_examples(path: Path, keys: _Keys, split: str, limit: int) -> list[tuple[str, TaskExample]]:
    """``(where, example)`` for the rows of a data file (the first ``limit``; 0 = all); raises :class:`TaskFileError`
    naming the bad row."""
    if not path.exists():
        raise TaskFileError(f"{path}: no such file")
    rows = read_rows(path, split)
    if limit:
        rows = rows[:limit]
    examples = [(f"{path}:{where}", _example(row, f"{path}:{where}", keys)) for where, row in rows]
    if not examples:
        raise TaskFileError(f"{path}: no examples")
    return examples


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
