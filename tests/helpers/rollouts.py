"""Tiny hand-built rollout groups: the texts, finish reasons and lengths a reward function reads, over token ids
that decode to those texts under the tests' character tokenizer (:func:`tokenizer_dir`)."""

from __future__ import annotations

import atexit
import dataclasses
import functools
import shutil
import tempfile
import uuid
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from asyncrl.common.plane.control import ControlPlane
from asyncrl.common.wire.messages import PromptGroup, RolloutGroup, ScoredGroup


@functools.cache
def char_tokenizer():
    """The character tokenizer of the tests' tiny models (one token per character of the task alphabet)."""
    from asyncrl.common.data.tasks import TASK_ALPHABET
    from asyncrl.common.tiny_models.character import build_char_tokenizer

    return build_char_tokenizer(TASK_ALPHABET)


@functools.cache
def tokenizer_dir() -> Path:
    """A folder holding only :func:`char_tokenizer`'s files: the ``model.path`` of a run whose reward workers decode
    responses but load no model (removed when the test process exits)."""
    from asyncrl.common.tiny_models.character import _save_tokenizer

    folder = Path(tempfile.mkdtemp(prefix="asyncrl-test-tokenizer-"))
    atexit.register(shutil.rmtree, folder, True)
    _save_tokenizer(char_tokenizer(), folder)
    return folder


def encode(text: str) -> list[int]:
    """``text``'s token ids under :func:`char_tokenizer` (no BOS): they decode back to ``text``."""
    return list(char_tokenizer().encode(text, add_special_tokens=False))


def make_group(
    texts: Sequence[str],
    *,
    finish_reasons: Sequence[str] | None = None,
    lengths: Sequence[int] | None = None,
    task: str = "arithmetic",
    prompt: str = "12+7=",
    answer: str = "19",
    group_id: str | None = None,
) -> RolloutGroup:
    """A group with one response per text. Without ``lengths``, each response's token ids are its text's under the
    character tokenizer (what a reward worker decodes and scores); with ``lengths``, they are zeros of those sizes
    (for code that reads lengths, not texts). Log-probs and versions are zeros: no reward function reads them.
    """
    if lengths is None:
        ids = [encode(t) for t in texts]
        lengths, token_ids = [len(i) for i in ids], np.asarray([t for i in ids for t in i], np.int32)
    else:
        lengths = list(lengths)
        token_ids = np.zeros(sum(lengths), np.int32)
    total = sum(lengths)
    return RolloutGroup(
        group_id=group_id or uuid.uuid4().hex,
        task=task,
        prompt=prompt,
        prompt_ids=np.zeros(len(prompt), np.int32),
        answer=answer,
        token_ids=token_ids,
        logprobs=np.zeros(total, np.float32),
        versions=np.zeros(total, np.int32),
        lengths=np.asarray(lengths, np.int32),
        texts=list(texts),
        finish_reasons=list(finish_reasons or ["stop"] * len(texts)),
        actor_id="test-actor",
    )


def issue(plane: ControlPlane, *groups: RolloutGroup) -> None:
    """Store each group's issue record as the learner's dispatcher does when it releases a prompt group: reward
    workers and the learner accept only groups that answer a record in flight (``common/wire/provenance.py``)."""
    records = [
        PromptGroup(
            group_id=g.group_id,
            task=g.task,
            prompt=g.prompt,
            prompt_ids=g.prompt_ids,
            answer=g.answer,
            num_samples=g.num_samples,
            issued_version=g.issued_version,
        )
        for g in groups
    ]
    plane.prompts.record_issued(records)
    plane.prompts.save_groups(records, {})


def answer(issued: PromptGroup, rewards=(1.0, 0.0), version: int = 0, **changes) -> ScoredGroup:
    """What an actor and a reward worker make of ``issued``: two responses of 3 and 2 tokens (ids 5..7, then the end
    of a sequence: "123" and "2" under the tiny models' character tokenizer), scored ``rewards``."""
    lengths = [3, 2]
    rollout = RolloutGroup(
        group_id=issued.group_id,
        task=issued.task,
        prompt=issued.prompt,
        prompt_ids=issued.prompt_ids,
        answer=issued.answer,
        token_ids=np.array([5, 6, 7, 6, 2], np.int32),
        logprobs=np.full(5, -1.5, np.float32),
        versions=np.full(5, version, np.int32),
        lengths=np.asarray(lengths, np.int32),
        texts=["123", "2"],  # the decode of the ids: the learner trains only ids whose scored text it checked
        finish_reasons=["stop", "stop"],
        issued_version=issued.issued_version,
    )
    rollout = dataclasses.replace(rollout, **changes)
    return ScoredGroup(rollout=rollout, rewards=np.asarray(rewards, np.float32))
