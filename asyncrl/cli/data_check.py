"""``rl-learner check-data``: a run's data file checked as the run will read it, before GPU hours are spent.

Every row goes through the run's own checks — the row's keys and UTF-8 (``common.data.task_files``), the chat
template, characters the tokenizer cannot encode and the prompt's token count (``common.data.prompts.Prompter``) — but
where the run refuses the whole file at its first bad row, this collects every one. Then, over the rows those checks
accept::

    prompt tokens     the prompt as the dispatcher encodes it (chat template, special tokens once)
    answer tokens     the reference answer as a response would hold it (no special tokens)
    too long          prompt tokens > model.max_model_len - rollout.max_new_tokens (task.overlong: skip | refuse)
    long answers      answer tokens > rollout.max_new_tokens (no response could hold the reference)
    duplicates        rows whose prompt, as the model sees it, equals an earlier row's
    empty answers     an answer of whitespace only (the reader accepts it; most verifiers raise on it)
    unknown           each character the tokenizer can only map to its unknown token, and its rows (refused)
    self-check        verify(answer, answer) with the verifier the run's ``task`` reward function binds

Min, median, p95 and max are by nearest rank. A JSONL file is read here line by line, so that every line that does not
parse is named; Parquet and ``save_to_disk`` folders are read by ``common.data.task_files.read_rows`` (pyarrow parses
them whole; its one refusal, a string that is not UTF-8, names the first such row only).

What exits 1 (:func:`failures`): what the run would refuse — a refused row, a prompt too long under
``task.overlong = "refuse"``, a file with no row to serve — and a reference answer the verifier raises on (the reward
worker would fail every group of that row, which is then dead-lettered, never trained). Everything else is a warning
(:func:`warnings`): the run trains on such a file as it is, and a verifier need not accept its own reference as a
response (a LaTeX answer a response must box); ``strict`` makes warnings fail too.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

# common.data.task_files reads and checks rows for the run, stopping at the first bad one; its per-row checks are used
# here row by row, so that check-data and the run cannot disagree about a row.
from asyncrl.common.data.task_files import (
    TaskFileError,
    _example,
    _Keys,
    _prompt_tokens,
    json_row,
    jsonl_lines,
    read_rows,
)
from asyncrl.common.data.tasks import TaskExample
from asyncrl.common.environments.protocol import run_prompter

if TYPE_CHECKING:
    from asyncrl.common.config import RunConfig
    from asyncrl.common.data.prompts import Prompter

SECOND_TURN_TOKENS = 16
"""The least a second model turn needs after the first: the environment's answer in the chat template's markers
and a few tokens of reply."""
MAX_LISTED = 10
"""Rows named per finding in the text report (``--json`` lists all)."""

# Properties of built-in verifiers that common/rewards/verifiers.py does not declare, so they are kept here by name.
NOT_RUN = {"code_tests": "its reference answer is the tests a program must pass; checking it would run the sandbox"}
"""Verifiers the self-check does not call, and why."""
NOT_A_RESPONSE = {
    "countdown": "its reference answer is the numbers and target (JSON), not an expression",
    "regex": "its reference answer is what the pattern captures, not a response the pattern matches",
}
"""Verifiers whose reference answer is not a response they accept: only an answer they raise on is reported."""


class DataCheckError(ValueError):
    """A run whose data cannot be checked as configured (exit 2): a task that cannot be made, no such file, no
    tokenizer."""


@dataclass
class SelfCheck:
    """Whether one verifier gives each row's reference answer, taken as the response, a score of 1.0."""

    verifier: str
    verify: Callable[[str, str], float]
    checked: int = 0
    passed: int = 0
    below: list[tuple[str, float]] = field(default_factory=list)
    """``(row, score)`` of each reference answer scoring below 1.0."""
    raised: list[tuple[str, str]] = field(default_factory=list)
    """``(row, error)`` of each reference answer the verifier raises on (a reward worker would fail every group)."""
    note: str = field(init=False, default="")
    """Why the self-check is not run, or why a score below 1.0 is expected (see :data:`NOT_A_RESPONSE`)."""

    def __post_init__(self) -> None:
        self.note = NOT_RUN.get(self.verifier) or NOT_A_RESPONSE.get(self.verifier, "")

    def run(self, where: str, answer: str) -> None:
        if self.verifier in NOT_RUN:
            return
        self.checked += 1
        try:
            score = float(self.verify(answer, answer))
        except Exception as exc:  # any error, as the reward worker meets it on every group of this row
            self.raised.append((where, f"{type(exc).__name__}: {exc}"))
            return
        if score == 1.0:
            self.passed += 1
        elif self.verifier not in NOT_A_RESPONSE:
            self.below.append((where, score))


@dataclass
class Report:
    """What :func:`check_file` found in one data file (rows named ``line N`` in JSONL, ``row N`` in tables)."""

    file: str
    model: str
    chat: bool
    overlong: str
    max_model_len: int
    max_new_tokens: int
    checks: list[SelfCheck]
    read: int = 0
    checked: int = 0
    refused: list[tuple[int, str, str]] = field(default_factory=list)
    """``(row number, row, reason)``, the reason as the run words it; row number 0 is the whole file."""
    prompt_tokens: list[int] = field(default_factory=list)
    answer_tokens: list[int] = field(default_factory=list)
    too_long: list[tuple[str, int]] = field(default_factory=list)
    long_answers: list[tuple[str, int]] = field(default_factory=list)
    duplicates: list[list[tuple[str, str]]] = field(default_factory=list)
    """Rows sharing one prompt text, each ``(row, answer)``, the first occurrence first."""
    empty_answers: list[str] = field(default_factory=list)
    unknown: dict[str, list[str]] = field(default_factory=dict)
    """Each character the tokenizer can only map to its unknown token, and the rows holding it."""
    episode_tokens: int | None = None
    """A multi-turn run's tokens after the prompt per episode (``environment.max_episode_tokens``; 0: up to
    ``model.max_model_len``); None for one turn."""
    no_second_turn: list[tuple[str, int]] = field(default_factory=list)
    """``(row, prompt tokens)`` of each first observation that leaves no room for a second model turn."""

    def refuse(self, where: str, reason: str) -> None:
        self.refused.append((row_number(where), where, reason.removeprefix(f"{where}: ")))

    @property
    def refused_rows(self) -> int:
        """Rows refused (not counting a refusal of the whole file)."""
        return sum(number > 0 for number, _, _ in self.refused)

    def leaves_a_second_turn(self, prompt_tokens: int) -> bool:
        """Whether after this prompt and a first model turn of ``max_new_tokens`` an episode still has room for an
        observation and a second model turn (:data:`SECOND_TURN_TOKENS`)."""
        room = self.max_model_len - prompt_tokens
        room = min(room, self.episode_tokens) if self.episode_tokens else room
        return room >= self.max_new_tokens + SECOND_TURN_TOKENS

    @property
    def limit_tokens(self) -> int:
        """The longest prompt the run serves: a longer one could never get a whole response."""
        return self.max_model_len - self.max_new_tokens

    @property
    def servable(self) -> int:
        """Rows the run would serve: accepted by every check, and short enough."""
        return len(self.prompt_tokens) - len(self.too_long)


# --------------------------------------------------------------------------- checking


def check_run_data(config: RunConfig) -> Report:
    """The run's ``[task]`` file checked under ``model.path``'s tokenizer and chat template, with the run's verifiers.

    Raises :class:`DataCheckError` when it cannot be: the task is not a file, the file or the tokenizer is missing,
    or the prompt settings do not fit the tokenizer (``task.chat = true`` without a template).
    """
    from asyncrl.common.data.prompts import PromptError
    from asyncrl.learner.intake.dispatcher import task_options

    generated = config.task.name != "file"
    if not generated and not (path := Path(task_options(config.task)["path"])).exists():
        raise DataCheckError(f"{path}: no such file (task.path)")
    tokenizer = _tokenizer(config.model.path)
    try:
        prompter = run_prompter(tokenizer, config)
    except PromptError as exc:
        raise DataCheckError(str(exc)) from None

    def answer_tokens(text: str) -> int:
        return len(tokenizer(text, add_special_tokens=False)["input_ids"])

    if generated:
        return check_generated(config, prompter, answer_tokens, run_verifiers(config))
    return check_file(config, prompter, answer_tokens, run_verifiers(config))


def check_eval_data(config: RunConfig) -> Report | None:
    """The run's eval file (``eval.path``) checked as :func:`check_run_data` checks the task's: read with the eval's
    keys (the task's unless ``[eval]`` names its own), split and limit, against the eval's response budget. None when
    the run evaluates no file."""
    if not (config.eval.every and config.eval.name == "file"):
        return None
    return check_run_data(as_eval_run(config))


def as_eval_run(config: RunConfig) -> RunConfig:
    """``config`` with its ``[task]`` reading the eval file as evaluation reads it (``common/data/evaluation.py``)."""
    from asyncrl.common.data.evaluation import eval_max_new_tokens

    section, task = config.eval, config.task
    keys = {"prompt_key": section.prompt_key or task.prompt_key, "answer_key": section.answer_key or task.answer_key}
    reading = {"name": "file", "path": section.path, "split": section.split, "limit": section.limit, **keys}
    rollout = config.rollout.model_copy(update={"max_new_tokens": eval_max_new_tokens(config)})
    return config.model_copy(update={"task": task.model_copy(update=reading), "rollout": rollout})


def _tokenizer(model_path: str) -> Any:
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(model_path)
    except (OSError, ValueError) as exc:
        raise DataCheckError(f"model.path {model_path}: cannot load its tokenizer ({exc})") from None


def run_verifiers(config: RunConfig) -> list[tuple[str, Callable[[str, str], float]]]:
    """``(verifier name, verify)`` of each ``task`` reward function, bound from the config as the reward workers
    bind it (:func:`asyncrl.common.rewards.functions.bind_functions`)."""
    # The very verifier the reward workers bind from this config: the check runs it on the data's own answers.
    from asyncrl.common.data.tasks import task_label
    from asyncrl.common.rewards.functions import bind_functions, task_verifier

    functions = [f for f in config.reward.functions if f.name == "task"]
    bound = bind_functions(functions, task_label(config.task)) if functions else []
    return [(str(f.options["verifier"]), task_verifier(f.options)) for f in bound]


def check_file(
    config: RunConfig,
    prompter: Prompter,
    answer_tokens: Callable[[str], int],
    verifiers: Iterable[tuple[str, Callable[[str, str], float]]],
) -> Report:
    """Every row of the run's data file through the run's checks, under ``prompter``; ``answer_tokens`` counts a
    reference answer's tokens as a response, ``verifiers`` are the run's (:func:`run_verifiers`)."""
    from asyncrl.learner.intake.dispatcher import task_options

    options = task_options(config.task)
    report = _report(config, prompter, verifiers, str(options["path"]))
    rows, unreadable = file_rows(Path(options["path"]), options["split"])
    lines = sum(where != "file" for where, _ in unreadable)
    report.read = len(rows) + lines
    rows = rows[: options["limit"]] if options["limit"] else rows  # as the run: the first rows that parse
    report.checked = len(rows) + lines
    for where, reason in unreadable:
        report.refuse(where, reason)
    keys, texts = _Keys(options["prompt_key"], options["answer_key"]), {}
    for where, row in rows:
        try:
            example = _example(row, where, keys)
        except TaskFileError as exc:
            report.refuse(where, str(exc))
            continue
        _check_example(report, prompter, answer_tokens, where, example, texts)
    report.duplicates = [group for group in texts.values() if len(group) > 1]
    report.refused.sort()
    return report


GENERATED_ROWS = 256
"""Prompts a generated task's check draws (with ``run.seed``): what the run's first steps will serve."""


def check_generated(
    config: RunConfig,
    prompter: Prompter,
    answer_tokens: Callable[[str], int],
    verifiers: Iterable[tuple[str, Callable[[str, str], float]]],
    rows: int = GENERATED_ROWS,
) -> Report:
    """A generated task (a built-in, a gym, a game) checked as a data file is: ``rows`` of its prompts, drawn with the
    run's seed, through the same checks (characters the tokenizer cannot encode — a game's ``♥`` that would reach the
    model as the unknown token —, lengths, answers, the verifiers). Prompts that repeat are not reported: a generated
    task repeats by design."""
    import random

    from asyncrl.common.data.tasks import get_task, task_label
    from asyncrl.learner.intake.dispatcher import task_options

    try:
        task = get_task(config.task.name, **task_options(config.task)).fresh()
    except (ValueError, ImportError) as exc:
        raise DataCheckError(f"task {config.task.name!r} cannot be made: {exc}") from None
    drawn = f"task {task_label(config.task)!r}: {rows} prompts drawn with run.seed = {config.run.seed}"
    report = _report(config, prompter, verifiers, drawn)
    report.read = report.checked = rows
    rng = random.Random(config.run.seed)
    for i in range(rows):
        _check_example(report, prompter, answer_tokens, f"row {i + 1}", task.sample(rng), {})
    report.refused.sort()
    return report


def _report(
    config: RunConfig, prompter: Prompter, verifiers: Iterable[tuple[str, Callable[[str, str], float]]], file: str
) -> Report:
    """An empty report of the run's data source ``file`` under the run's limits and verifiers."""
    return Report(
        file=file,
        model=config.model.path,
        chat=prompter.chat,
        overlong=config.task.overlong,
        max_model_len=config.model.max_model_len,
        max_new_tokens=config.rollout.max_new_tokens,
        checks=[SelfCheck(name, verify) for name, verify in verifiers],
        episode_tokens=episode_tokens(config),
    )


def episode_tokens(config: RunConfig) -> int | None:
    """:attr:`Report.episode_tokens` of the run."""
    return config.environment.max_episode_tokens if config.rollout.workflow == "multi_turn" else None


def _check_example(
    report: Report,
    prompter: Prompter,
    answer_tokens: Callable[[str], int],
    where: str,
    example: TaskExample,
    texts: dict[str, list[tuple[str, str]]],
) -> None:
    """One row the reader accepted: its answer, the verifiers, then its prompt under the run's tokenizer."""
    answer = example.answer
    if not answer.strip():
        report.empty_answers.append(where)
    n_answer = answer_tokens(answer)
    report.answer_tokens.append(n_answer)
    if n_answer > report.max_new_tokens:
        report.long_answers.append((where, n_answer))
    for check in report.checks:
        check.run(where, answer)
    try:
        n = _prompt_tokens(prompter, where, example)  # the run's check: template, unknown characters, length
    except TaskFileError as exc:
        report.refuse(where, str(exc))
        _note_unknown(report, prompter, where, example)
        return
    texts.setdefault(prompter.text(example), []).append((where, answer))
    report.prompt_tokens.append(n)
    if n > report.limit_tokens:
        report.too_long.append((where, n))
    elif report.episode_tokens is not None and not report.leaves_a_second_turn(n):
        report.no_second_turn.append((where, n))


def _note_unknown(report: Report, prompter: Prompter, where: str, example: TaskExample) -> None:
    try:
        text = prompter.text(example)
    except ValueError:  # messages without a chat template: refused for that, nothing was encoded
        return
    for char in prompter.unknown(text + example.answer):
        report.unknown.setdefault(char, []).append(where)


def file_rows(path: Path, split: str = "") -> tuple[list[tuple[str, Any]], list[tuple[str, str]]]:
    """``(rows, unreadable)``: ``(where, row)`` of every row that parses, and ``(where, reason)`` of every one that
    does not (``where`` = ``file`` when the file cannot be read at all).

    A JSONL file is read here line by line, as :func:`asyncrl.common.data.task_files.read_rows` reads it (with its
    reasons), since that stops at the first bad line; a table (Parquet, ``save_to_disk``) is read by ``read_rows``
    itself.
    """
    if split or path.is_dir() or path.suffix.lower() in (".parquet", ".pq"):
        try:
            return read_rows(path, split), []
        except TaskFileError as exc:  # the message names the file, and the first bad row where there is one
            return [], [("file", str(exc).removeprefix(f"{path}:").strip())]
    rows, unreadable = [], []
    try:
        for number, raw in jsonl_lines(path):  # a line without an end (/dev/zero) stops the read, naming it
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                unreadable.append((f"line {number}", f"not valid UTF-8 (byte {e.start + 1}: {e.reason})"))
                continue
            if line.strip():
                try:  # the run's own row checks: JSON, nesting depth, number length
                    rows.append((f"line {number}", json_row(line, f"line {number}")))
                except TaskFileError as exc:
                    unreadable.append((f"line {number}", str(exc).removeprefix(f"line {number}:").strip()))
    except TaskFileError as exc:
        unreadable.append(("file", str(exc).removeprefix(f"{path}:").strip()))
    return rows, unreadable


def row_number(where: str) -> int:
    """The number of ``line N`` or ``row N``; 0 for the whole file."""
    return int(where.rsplit(" ", 1)[-1]) if where[-1:].isdigit() else 0
