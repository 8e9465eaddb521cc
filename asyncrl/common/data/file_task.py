"""The ``file`` task: examples from a user data file, served pass after pass, and checked against the run.

:class:`FileTask` reads its file once through ``common/data/task_files.py`` (the readers and the per-row checks),
serves the rows shuffled or in file order, and — once the run's tokenizer is known (:meth:`FileTask.fit`) — refuses
the file at its first bad row, or skips and counts the rows whose prompts are too long to serve. The task registry
(``common/data/tasks.py``) names it ``file`` by import path, so the registry does not import this module.
"""

from __future__ import annotations

import copy
import random
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

from asyncrl.common.data.task_files import TaskFileError, _example, _Keys, _prompt_tokens, read_rows
from asyncrl.common.data.tasks import Task, TaskExample
from asyncrl.common.observability.logs import get_logger

if TYPE_CHECKING:
    from asyncrl.common.data.prompts import Prompter

log = get_logger("tasks")

MAX_NAMED_SKIPS = 20
"""Skipped rows named one log line each; beyond these one line counts the rest."""


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

    name: ClassVar[str] = "file"

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
        self.skipped = []
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
        skipped = self.skipped = list(self.skipped)  # Task declares a Sequence; this one grows
        for where, example in zip(self._where, self.examples, strict=True):
            n = _prompt_tokens(prompter, where, example)
            if n <= max_tokens:
                kept.append((where, example))
                continue
            reason = f"prompt is {n} tokens; the run can serve at most {max_tokens}"
            if overlong == "refuse":
                raise TaskFileError(f"{where}: {reason} (model.max_model_len - rollout.max_new_tokens)")
            skipped.append(where)
            if len(skipped) <= MAX_NAMED_SKIPS:
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
