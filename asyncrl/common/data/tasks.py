"""Tasks: the task protocol, its registry, and the built-in seeded tasks with ground truth.

A task turns a ``random.Random`` into a :class:`TaskExample` (a prompt and the answer its
verifier checks against; see ``common/rewards/verifiers.py``, whose registry uses the same names).
Tasks are registered by name, so the run config's ``task.name`` selects one and
``task.options`` are its constructor's keyword arguments::

    task = get_task("arithmetic", ops="+-", max_digits=3)
    example = task.sample(random.Random(0))   # TaskExample(prompt='...=', answer='...')

The built-in tasks' prompts and answers use only :data:`TASK_ALPHABET`, from which the tiny model's
character-level tokenizer is built. A data file (the ``file`` task, ``common/data/file_task.py``, reading rows with
``common/data/task_files.py``) may hold any text: its rows are checked against the run's own tokenizer when the
learner loads it (:meth:`Task.fit`), so a ``?`` is refused only where that tokenizer maps it to its unknown token (the
tiny model's does; a byte-level BPE has none).

Built-in formats (the prompt ends with ``=``; the model continues with the answer):

==============  ========================  ==================================================
task            prompt                    answer
==============  ========================  ==================================================
``arithmetic``  ``12+7=``                 ``19``
``reverse``     ``rev:abcde=``            ``edcba``
``copy``        ``cp:abcde=``             ``abcde``
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

import inspect
import json
import math
import random
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from asyncrl.common.registry import Registry
from asyncrl.common.wire.messages import PromptGroup

if TYPE_CHECKING:
    from asyncrl.common.config import TaskSection
    from asyncrl.common.data.prompts import Prompter

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
    messages: tuple[dict[str, str], ...] | None = None
    """A chat row's messages (``role``, ``content``), which the run's chat template turns into the prompt."""
    extra: str = ""
    """A data row's other fields as a JSON object (``""``: none), which travel to the reward functions."""


class TaskError(ValueError):
    """A task the run cannot serve as configured; the message says why (and where, for a data file)."""


class Task(ABC):
    """A source of prompts. Subclasses register with :func:`register_task`, which sets ``name``."""

    name: ClassVar[str]
    built_to_check: ClassVar[bool] = False
    """Whether :func:`check_task_options` builds the task to check its options: a generated task builds in
    microseconds, reading and importing nothing, so its constructor's own bounds refuse a value when a config is
    checked (``rl-learner resolve``), not when the learner starts. A data file or an optional package's task is only
    matched against its constructor's signature there."""
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
        "refuse"``: :class:`~asyncrl.common.data.task_files.TaskFileError` naming the row) or skipped and counted
        (``"skip"``). A generated task's prompts are a few dozen characters over :data:`TASK_ALPHABET`, bounded by its
        options, so it has nothing to check; a data file checks every row
        (:class:`~asyncrl.common.data.file_task.FileTask`).
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

TASKS: Registry[type[Task]] = Registry("task", group="tasks")
"""Task classes by name (the config's ``task.name``)."""
task_names = TASKS.names


def register_task(name: str) -> Callable[[type[Task]], type[Task]]:
    """Class decorator: register a :class:`Task` under ``name`` (which becomes its ``name``)."""

    def wrap(cls: type[Task]) -> type[Task]:
        TASKS.register(name)(cls)
        cls.name = name
        return cls

    return wrap


# User data files (common/data/file_task.py, which imports this module), imported when a run names them.
TASKS.register_path("file", "asyncrl.common.data.file_task:FileTask")
# Adapters that need optional packages (common/data/gyms.py), imported when a run names them.
TASKS.register_path("reasoning_gym", "asyncrl.common.data.gyms:ReasoningGymTask")
TASKS.register_path("textarena", "asyncrl.common.data.gyms:TextArenaTask")


def get_task(name: str, **options: Any) -> Task:
    """Build the task registered as ``name`` with ``options`` (its constructor's keyword arguments)."""
    return _fitting(name, options)(**options)


def check_task_options(name: str, options: dict[str, Any]) -> type[Task]:
    """The task class registered as ``name``, once ``options`` are known to fit it (``ValueError`` names them
    otherwise): they fit its constructor's signature, and a task :attr:`~Task.built_to_check` is built with them, so
    that its constructor refuses a value out of its bounds (``max_digits = 1e9``). No other task is built, so no data
    file is read."""
    cls = _fitting(name, options)
    if cls.built_to_check:
        cls(**options)
    return cls


def _fitting(name: str, options: dict[str, Any]) -> type[Task]:
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

    built_to_check = True

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
    """``rev:abcde=`` → ``edcba``: reverse a random lowercase string of ``min_length``..``max_length`` letters.

    Lengths are uniform, or with ``tail`` > 0 heavy-tailed: a Pareto law of index ``tail`` cut at ``max_length``,
    P(L ≥ x) = (``min_length`` / x)^``tail``, so most strings are short and a few long ones hold much of the answer
    tokens — the uneven responses a synchronous batch waits on. With ``tail = 1`` over 2..96 letters, 60% of strings
    have at most 4 letters, one in ten has 20 or more, one in fifty all 96, and 8% of them hold half the letters.
    """

    built_to_check = True

    def __init__(self, min_length: int = 3, max_length: int = 8, tail: float = 0.0) -> None:
        _check_range(self.name, "min_length", min_length, 1, 256)
        _check_range(self.name, "max_length", max_length, min_length, 256)
        self.min_length, self.max_length, self.tail = min_length, max_length, _check_tail(self.name, tail)

    prefix: ClassVar[str] = "rev"

    def sample(self, rng: random.Random) -> TaskExample:
        text = "".join(rng.choices(_LETTERS, k=self._length(rng)))
        return TaskExample(f"{self.prefix}:{text}=", self.transform(text))

    @staticmethod
    def transform(text: str) -> str:
        return text[::-1]

    def _length(self, rng: random.Random) -> int:
        return tailed_length(rng, self.min_length, self.max_length, self.tail)


def tailed_length(rng: random.Random, low: int, high: int, tail: float) -> int:
    """A length in ``low``..``high``: uniform when ``tail`` is 0, else Pareto of index ``tail`` cut at ``high``,
    P(L ≥ x) = (``low`` / x)^``tail``."""
    if not tail:
        return rng.randint(low, high)
    # the inverse of the CDF at u in (0, 1], in logarithms: a large power of a small u does not overflow
    log_length = math.log(low) - math.log(1.0 - rng.random()) / tail
    return high if log_length >= math.log(high + 1) else int(math.exp(log_length))


def _check_tail(task: str, tail: Any) -> float:
    if isinstance(tail, bool) or not (isinstance(tail, int | float) and (tail == 0 or 0.1 <= tail <= 10)):
        raise ValueError(f"task '{task}': tail must be 0 (uniform lengths) or in [0.1, 10], got {tail!r}")
    return float(tail)


@register_task("copy")
class CopyTask(ReverseTask):
    """``cp:abcde=`` → ``abcde``: copy the letters, with :class:`ReverseTask`'s lengths and options. Copying is what
    a small transformer learns first (an attention head that looks back), so a short warm start leaves it at partial
    skill on long strings, where reversing would need far more."""

    prefix = "cp"

    @staticmethod
    def transform(text: str) -> str:
        return text


@register_task("count")
class CountTask(Task):
    """``ct:17,21=`` → ``17 18 19 20 21``: count from the first two-digit number to the second, ``min_length`` to
    ``max_length`` numbers, their count drawn as :class:`ReverseTask` draws lengths (``tail``).

    The prompt is short and the answer up to ``3 · max_length − 1`` characters long, so sampling, not reading the
    prompt, is what a long answer costs. Each number follows from the one before (add one, carry into the tens) and
    the answer ends where it reaches the prompt's second number; a small model warm-started on it makes a slip now
    and then, and a long answer holds many chances to slip: partial skill that grows with the count.
    """

    built_to_check = True

    def __init__(self, min_length: int = 1, max_length: int = 32, tail: float = 0.0) -> None:
        _check_range("count", "min_length", min_length, 1, 90)
        _check_range("count", "max_length", max_length, min_length, 90)
        self.min_length, self.max_length, self.tail = min_length, max_length, _check_tail("count", tail)

    def sample(self, rng: random.Random) -> TaskExample:
        length = tailed_length(rng, self.min_length, self.max_length, self.tail)
        first = rng.randint(10, 100 - length)
        last = first + length - 1
        return TaskExample(f"ct:{first},{last}=", " ".join(map(str, range(first, last + 1))))


@register_task("countdown")
class CountdownTask(Task):
    """``cd:3,5,7>22=``: reach the target with ``+ - * /`` over the numbers, each used at most once.

    ``count`` numbers are drawn from 1..``max_number`` (repeats allowed). The target is the value of a
    random expression tree over 2..``count`` of them whose every intermediate value is a positive integer
    (subtraction only when it stays positive, division only when exact), so a solution always exists.
    """

    built_to_check = True

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
