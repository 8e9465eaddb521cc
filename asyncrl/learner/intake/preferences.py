"""Preference pairs for DPO: read a file, tokenize, collate pairs into rows; and write a synthetic file from a task.

A preference file is JSONL (one object per line) or Parquet (needs ``pyarrow``) with three text fields::

    {"prompt": "3+4=", "chosen": "7", "rejected": "8"}

Each pair becomes two rows, ``prompt + chosen + </s>`` and ``prompt + rejected + </s>``, tokenized with the model's
tokenizer (its own special tokens, e.g. ``<s>``, on the prompt; no chat template). :func:`collate_pairs` lays P pairs
out as ``[2P, T]`` tensors with row ``2i`` the chosen and row ``2i + 1`` the rejected response of pair ``i``, right
padded, and ``response_mask`` True on the response tokens only (``</s>`` included). So a micro-batch of an even
number of rows never splits a pair, and the registered ``dpo`` loss finds each pair in adjacent rows.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from asyncrl.common.data.task_files import TaskFileError, read_rows
from asyncrl.common.data.tasks import Task, TaskExample
from asyncrl.common.observability.logs import get_logger

log = get_logger("preferences")

FIELDS = ("prompt", "chosen", "rejected")


class PreferenceFileError(ValueError):
    """A preference file that cannot be used; the message names the file, the line (or row) and the field."""


@dataclass(frozen=True)
class PreferencePair:
    """A prompt and two responses to it, the ``chosen`` one preferred over the ``rejected`` one."""

    prompt: str
    chosen: str
    rejected: str


@dataclass(frozen=True)
class EncodedPair:
    """Token ids of one pair: the prompt (with the tokenizer's special tokens) and each response (ending in EOS)."""

    prompt: tuple[int, ...]
    chosen: tuple[int, ...]
    rejected: tuple[int, ...]


# --------------------------------------------------------------------------- reading


def read_preferences(path: str | Path) -> list[PreferencePair]:
    """Every pair in a JSONL or Parquet file; raises :class:`PreferenceFileError` naming the first bad row."""
    path = Path(path)
    if not path.is_file():
        raise PreferenceFileError(f"{path}: no such file")
    try:
        rows = read_rows(path)
    except TaskFileError as exc:
        raise PreferenceFileError(str(exc)) from None
    pairs = [_pair(row, f"{path}:{where}") for where, row in rows]
    if not pairs:
        raise PreferenceFileError(f"{path}: no preference pairs")
    return pairs


def _pair(row: Any, where: str) -> PreferencePair:
    """One row as a pair; ``where`` (file and line) names it in every error."""
    if not isinstance(row, dict):
        raise PreferenceFileError(f"{where}: expected an object with {', '.join(FIELDS)}, got {type(row).__name__}")
    for field in FIELDS:
        if field not in row or row[field] is None:
            raise PreferenceFileError(f"{where}: missing field {field!r}")
        if not isinstance(row[field], str):
            raise PreferenceFileError(f"{where}: field {field!r} must be a string, got {type(row[field]).__name__}")
    return PreferencePair(row["prompt"], row["chosen"], row["rejected"])


# --------------------------------------------------------------------------- tokenizing and collating


def encode_pairs(pairs: Sequence[PreferencePair], tokenizer: Any, max_length: int) -> list[EncodedPair]:
    """Tokenize pairs; each response gets the tokenizer's EOS and is cut at the end to fit ``max_length`` in all.

    The prompt is never cut: a pair whose prompt leaves no room for one response token is skipped and counted in a
    warning (with the first few file positions), so one overlong row does not stop a run over a large file.
    """
    encoded, skipped = [], []
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    for index, pair in enumerate(pairs):
        prompt = tuple(tokenizer(pair.prompt)["input_ids"])
        room = max_length - len(prompt)
        if room < 1:
            skipped.append(index)
            continue
        chosen, rejected = (
            tuple([*tokenizer(text, add_special_tokens=False)["input_ids"], *eos][:room])
            for text in (pair.chosen, pair.rejected)
        )
        encoded.append(EncodedPair(prompt, chosen, rejected))
    if skipped:
        log.warning("skipped pairs whose prompt fills max_length", skipped=len(skipped), first=skipped[:5])
    return encoded


def collate_pairs(pairs: Sequence[EncodedPair], pad_id: int) -> dict[str, Tensor]:
    """``[2P, T]`` right-padded rows: ``2i`` = prompt + chosen, ``2i + 1`` = prompt + rejected of pair ``i``.

    Returns ``input_ids`` int64, ``attention_mask`` int64 (1 on real tokens) and ``response_mask`` bool (True on
    response tokens only), the layout of :class:`asyncrl.learner.update.batch.TrainBatch`.
    """
    if not pairs:
        raise ValueError("collate_pairs needs at least one pair")
    rows = [(pair.prompt, response) for pair in pairs for response in (pair.chosen, pair.rejected)]
    width = max(len(prompt) + len(response) for prompt, response in rows)
    input_ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
    response_mask = torch.zeros((len(rows), width), dtype=torch.bool)
    for row, (prompt, response) in enumerate(rows):
        start, end = len(prompt), len(prompt) + len(response)
        input_ids[row, :end] = torch.tensor([*prompt, *response], dtype=torch.long)
        attention_mask[row, :end] = 1
        response_mask[row, start:end] = True
    return {"input_ids": input_ids, "attention_mask": attention_mask, "response_mask": response_mask}


# --------------------------------------------------------------------------- synthetic pairs


def _wrong_integer(example: TaskExample, rng: random.Random) -> str:
    """The right answer moved by 1..10 either way (``arithmetic``): close enough to be a plausible mistake."""
    return str(int(example.answer) + rng.choice([-1, 1]) * rng.randint(1, 10))


def _wrong_text(example: TaskExample, rng: random.Random) -> str:
    """One character of the answer replaced by a different letter (``reverse``, ``copy``)."""
    index = rng.randrange(len(example.answer))
    letter = rng.choice([c for c in "abcdefghijklmnopqrstuvwxyz" if c != example.answer[index]])
    return example.answer[:index] + letter + example.answer[index + 1 :]


WRONG_ANSWERS: dict[str, Callable[[TaskExample, random.Random], str]] = {
    "arithmetic": _wrong_integer,
    "reverse": _wrong_text,
    "copy": _wrong_text,
}
"""Tasks whose answer is the response text itself, and how to make a wrong one for the rejected side."""


def write_synthetic_preferences(task: Task, path: str | Path, n: int, seed: int) -> Path:
    """Write ``n`` pairs drawn from ``task`` with ``random.Random(seed)``: chosen = the answer, rejected = a wrong one.

    For tests and demos (``rl-learner make-preferences``). The same seed writes the same file.
    """
    if task.name not in WRONG_ANSWERS:
        raise ValueError(f"no synthetic preferences for task {task.name!r}; supported: {', '.join(WRONG_ANSWERS)}")
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    wrong, rng, task = WRONG_ANSWERS[task.name], random.Random(seed), task.fresh()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        for _ in range(n):
            example = task.sample(rng)
            row = {"prompt": example.prompt, "chosen": example.answer, "rejected": wrong(example, rng)}
            f.write(json.dumps(row) + "\n")
    return path
