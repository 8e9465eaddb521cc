"""Prompt sources: small seeded tasks with ground truth, and user data files.

A task turns a ``random.Random`` into a :class:`TaskExample` (a prompt and the answer its
verifier checks against; see ``actors/verifiers.py``, whose registry uses the same names).
Tasks are registered by name, so the run config's ``task.name`` selects one and
``task.options`` are its constructor's keyword arguments::

    task = get_task("arithmetic", ops="+-", max_digits=3)
    example = task.sample(random.Random(0))   # TaskExample(prompt='...=', answer='...')

Every prompt and answer uses only :data:`TASK_ALPHABET`, from which the tiny model's
character-level tokenizer is built: a character outside it could not be tokenized.

Built-in formats (the prompt ends with ``=``; the model continues with the answer):

==============  ========================  ==================================================
task            prompt                    answer
==============  ========================  ==================================================
``arithmetic``  ``12+7=``                 ``19``
``reverse``     ``rev:abcde=``            ``edcba``
``countdown``   ``cd:3,5,7>22=``          ``{"numbers": [3, 5, 7], "target": 22, "solution": "(3*5)+7"}``
``file``        the file's ``prompt``     the file's ``answer`` (JSON-encoded when not a string)
==============  ========================  ==================================================

Countdown: reach the target with ``+ - * /`` over the given numbers, each used at most once
(not all need be used). The generator builds the target from a random expression over a subset
of the numbers, so every example has a solution; it is kept in the answer as ``solution``
(verifiers ignore it; a supervised warm-start can learn from it).
"""

from __future__ import annotations

import copy
import inspect
import json
import random
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from common.registry import Registry
from common.wire import PromptGroup

if TYPE_CHECKING:
    from common.config import TaskSection

TASK_ALPHABET = '0123456789abcdefghijklmnopqrstuvwxyz+-*/=()<>:,{}[]" \n'
"""Every character a prompt or answer may contain, in a fixed order (a tokenizer's id order)."""

_ALPHABET_SET = frozenset(TASK_ALPHABET)
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


class Task(ABC):
    """A source of prompts. Subclasses register with :func:`register_task`, which sets ``name``."""

    name: ClassVar[str]

    @abstractmethod
    def sample(self, rng: random.Random) -> TaskExample:
        """Draw one example; all randomness comes from ``rng``, so a seed fixes the sequence."""

    def fresh(self) -> Task:
        """This task with no position in its data (stateless tasks return themselves)."""
        return self

    def refuse_overlong(self, encode: Callable[[str], list[int]], max_tokens: int) -> None:
        """Raise :class:`ValueError` when a prompt this task serves is longer than ``max_tokens`` under ``encode``.

        The learner calls it once, when it builds the task, with the run's tokenizer and
        ``model.max_model_len − rollout.max_new_tokens``: a longer prompt could never get a whole response. A
        generated task's prompts are a few dozen characters, bounded by its options, so it has nothing to check;
        a data file checks every row (:class:`FileTask`).
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
                f.write(json.dumps(asdict(task.sample(rng))) + "\n")
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
    """One prompt group for ``example``: its prompt tokenized by ``encode`` (with BOS, as vLLM expects)."""
    return PromptGroup(
        group_id=group_id,
        task=task,
        prompt=example.prompt,
        prompt_ids=np.asarray(encode(example.prompt), dtype=np.int32),
        answer=example.answer,
        num_samples=num_samples,
        issued_version=version,
        issued_at=time.time() if issued_at is None else issued_at,
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


class TaskFileError(ValueError):
    """A data file that cannot be used; the message names the file and the line (or row)."""


@register_task("file")
class FileTask(Task):
    """Examples from a user JSONL or Parquet file with ``prompt`` and ``answer`` fields.

    Rows are read once, then served in a shuffled order that is drawn from the ``rng`` passed to
    :meth:`sample` at the start of every pass, so each pass visits every row exactly once and a seed
    fixes the whole sequence. The position is state: one task object serves one stream.
    A non-string ``answer`` (a countdown object, a number) is stored JSON-encoded. With
    ``check_alphabet`` (the default) a character outside :data:`TASK_ALPHABET` is an error, because
    the character-level tokenizer could not encode it.

    A bad row refuses the whole file, with one :class:`TaskFileError` that names the file, the row and the
    reason: not JSON, not valid UTF-8 (bytes, or a lone surrogate from a ``\\ud800`` escape, which no message
    could carry), a missing, non-string or empty prompt, characters outside the alphabet, and — once the run's
    tokenizer is known (:meth:`refuse_overlong`) — a prompt too long for the run to serve. Skipping bad rows
    instead would train on a silently different data set.
    """

    def __init__(self, path: str | Path, check_alphabet: bool = True) -> None:
        self.path = Path(path)
        self.check_alphabet = check_alphabet
        located = _read_examples(self.path, check_alphabet)
        self.examples = [example for _, example in located]
        self._where = [where for where, _ in located]  # "path:line N" of each example, for later refusals
        self._order: list[int] = []
        self._next = 0

    def refuse_overlong(self, encode: Callable[[str], list[int]], max_tokens: int) -> None:
        """Refuse the file at the first row whose prompt is longer than ``max_tokens`` tokens under ``encode``.

        Counted in tokens of the run's own tokenizer, not characters: the learner holds it when it loads the file,
        and a character bound would be exact only for the tiny model's one-token-per-character tokenizer (BOS
        included in the count, as in the ``prompt_ids`` an actor sends to vLLM).
        """
        for where, example in zip(self._where, self.examples, strict=True):
            n = len(encode(example.prompt))
            if n > max_tokens:
                raise TaskFileError(
                    f"{where}: prompt is {n} tokens; the run can serve at most {max_tokens} "
                    "(model.max_model_len - rollout.max_new_tokens)"
                )

    def sample(self, rng: random.Random) -> TaskExample:
        if self._next >= len(self._order):
            self._order = list(range(len(self.examples)))
            rng.shuffle(self._order)
            self._next = 0
        self._next += 1
        return self.examples[self._order[self._next - 1]]

    def fresh(self) -> FileTask:
        task = copy.copy(self)  # shares the read-only rows
        task._order, task._next = [], 0
        return task


def _read_examples(path: Path, check_alphabet: bool) -> list[tuple[str, TaskExample]]:
    """``(where, example)`` for all rows of a JSONL or Parquet file; raises :class:`TaskFileError` naming the bad
    row."""
    if not path.is_file():
        raise TaskFileError(f"{path}: no such file")
    rows = read_rows(path)
    examples = [(f"{path}:{where}", _example(row, f"{path}:{where}", check_alphabet)) for where, row in rows]
    if not examples:
        raise TaskFileError(f"{path}: no examples")
    return examples


def read_rows(path: Path) -> list[tuple[str, Any]]:
    """``(where, row)`` for every row of a JSONL or Parquet data file; ``where`` ("line 3", "row 3") names it in
    errors. A file that cannot be parsed raises :class:`TaskFileError` naming the line."""
    return _parquet_rows(path) if path.suffix.lower() in (".parquet", ".pq") else _jsonl_rows(path)


def _jsonl_rows(path: Path) -> list[tuple[str, Any]]:
    """``(line N, parsed object)`` for every non-blank line."""
    rows = []
    with path.open("rb") as f:  # decoded line by line, so that a bad byte is reported with its line
        for number, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise TaskFileError(f"{path}:line {number}: not valid UTF-8 (byte {e.start + 1}: {e.reason})") from None
            if not line.strip():
                continue
            try:
                rows.append((f"line {number}", json.loads(line)))
            except json.JSONDecodeError as e:
                raise TaskFileError(f"{path}:line {number}: not valid JSON ({e.msg})") from None
    return rows


def _parquet_rows(path: Path) -> list[tuple[str, Any]]:
    """``(row N, dict)`` for every row of a Parquet file (needs pyarrow)."""
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        raise TaskFileError(f"{path}: reading Parquet needs the 'pyarrow' package (pip install pyarrow)") from None
    try:
        table = pq.read_table(path)
    except (OSError, pa.ArrowException) as exc:
        raise TaskFileError(f"{path}: not a readable Parquet file ({exc})") from None
    try:
        rows = table.to_pylist()
    except UnicodeDecodeError:  # a string column with bytes that are not UTF-8: find the row to name it
        for number in range(1, table.num_rows + 1):
            try:
                table.slice(number - 1, 1).to_pylist()
            except UnicodeDecodeError as e:
                raise TaskFileError(f"{path}:row {number}: not valid UTF-8 ({e.reason})") from None
        raise
    return [(f"row {number}", row) for number, row in enumerate(rows, start=1)]


def _example(row: Any, where: str, check_alphabet: bool) -> TaskExample:
    """One row as an example; ``where`` (file and line) names it in every error."""
    if not isinstance(row, dict):
        raise TaskFileError(f"{where}: expected an object with 'prompt' and 'answer', got {type(row).__name__}")
    for field in ("prompt", "answer"):
        if row.get(field) is None:
            raise TaskFileError(f"{where}: missing field {field!r}")
    if not isinstance(row["prompt"], str):
        raise TaskFileError(f"{where}: field 'prompt' must be a string, got {type(row['prompt']).__name__}")
    if not row["prompt"].strip():
        raise TaskFileError(f"{where}: field 'prompt' is empty")
    answer = row["answer"] if isinstance(row["answer"], str) else json.dumps(row["answer"])
    example = TaskExample(row["prompt"], answer)
    _check_utf8(where, "prompt", example.prompt)
    _check_utf8(where, "answer", example.answer)
    bad = outside_alphabet(example.prompt + example.answer) if check_alphabet else set()
    if bad:
        raise TaskFileError(f"{where}: characters outside TASK_ALPHABET: {''.join(sorted(bad))!r}")
    return example


def _check_utf8(where: str, field: str, text: str) -> None:
    """Refuse a string that has no UTF-8 form: a lone surrogate, e.g. from the JSON escape ``"\\udc80"``."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise TaskFileError(
            f"{where}: field {field!r} is not valid UTF-8 (character {e.start + 1}: {e.reason})"
        ) from None
