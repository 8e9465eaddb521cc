"""``runs/<name>/samples.jsonl``: what a person reads to catch what the numbers hide (reward hacking, a degenerate
format, a verifier that accepts garbage).

Every ``monitoring.samples_every`` steps the learner appends a handful of the responses it has just trained on —
``monitoring.samples_per_step`` drawn at random (seeded by the run's seed and the step), plus the step's worst and
best by reward — one JSON object per response::

    {"step": 12, "version": 12, "pick": "best", "group_id": "g-0041", "response_index": 3,
     "prompt": "12+7=", "response": "19", "reward": 1.0, "details": {"task": 1.0},
     "advantage": 0.94, "finish_reason": "stop", "staleness": 1, "tokens": 2}

A row also has its group's ``timeline``: wall-clock seconds at which the group was ``issued``, ``taken`` by an actor,
``generated``, ``stored`` in the replay stream (scored) and its batch was complete (``batch_complete``); the means of
the stages between them are the step's ``latency/*``.

A multi-turn episode's row also has its ``turns`` — ``{"by": "model" | "environment", "text": …, "tokens": n}`` in
order, the text with the chat template's markers, so tool calls and their results show where they were — and
``trained_tokens``, the model's tokens (the only ones trained).

``advantage`` is the response's advantage as the update used it (the mean over its tokens for a token-level
estimator such as GAE); ``staleness`` is the version trained minus one minus its oldest token's version, as in
``rollout/staleness_max``. Texts are cut at :data:`MAX_TEXT` characters. The newest rows also go to the run's Redis
(``asyncrl:<run>:samples``) for ``rl-top``. A resume cuts the file back to the checkpoint's step like
metrics.jsonl (``learner/checkpoint/history.py: truncate_metrics``).
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import numpy as np

from asyncrl.common.private import open_private
from asyncrl.common.wire.messages import ScoredGroup, segments

MAX_TEXT = 2000
"""Characters kept of a prompt or a response."""


class SampleLog:
    """Appends sampled rows of trained responses to samples.jsonl every ``every`` steps (0: never)."""

    def __init__(self, path: Path, every: int, per_step: int, seed: int) -> None:
        self.path = path
        self.every = every
        self.per_step = per_step
        self.seed = seed
        self.decode: Callable[[list[int]], str] | None = None
        """Token ids to text (the run's tokenizer, set once the learner has loaded it): an episode's turns."""

    def due(self, step: int) -> bool:
        return self.every > 0 and step % self.every == 0

    def rows(
        self,
        step: int,
        groups: Sequence[ScoredGroup],
        advantages: dict[tuple[str, int], float],
        timelines: Mapping[str, dict[str, float]] | None = None,
    ) -> list[dict]:
        """The rows of step ``step``: random picks, then the worst and the best response (each response once), each
        with its group's ``timeline`` where ``timelines`` has it."""
        responses = [(g, i) for g in groups for i in range(g.rollout.num_samples)]
        if not responses:
            return []
        rewards = np.array([float(g.rewards[i]) for g, i in responses])
        worst, best = int(np.argmin(rewards)), int(np.argmax(rewards))
        others = [k for k in range(len(responses)) if k not in (worst, best)]
        picks = random.Random(self.seed * 1_000_003 + step).sample(others, min(self.per_step, len(others)))
        chosen = [(k, "random") for k in sorted(picks)] + [(worst, "worst"), (best, "best")][: len({worst, best})]
        rows = [_row(step, pick, *responses[k], advantages) | _turns(*responses[k], self.decode) for k, pick in chosen]
        for row in rows:
            if (timeline := (timelines or {}).get(row["group_id"])) is not None:
                row["timeline"] = timeline
        return rows

    def write(
        self,
        step: int,
        groups: Sequence[ScoredGroup],
        advantages: dict[tuple[str, int], float],
        timelines: Mapping[str, dict[str, float]] | None = None,
    ) -> list[dict]:
        """Append step ``step``'s rows when it is due; returns them (empty when not due)."""
        if not self.due(step):
            return []
        rows = self.rows(step, groups, advantages, timelines)
        with open_private(self.path, "a") as f:  # 0600: prompts and responses
            f.writelines(json.dumps(row) + "\n" for row in rows)
        return rows


def row_advantages(keys: Sequence[tuple[str, int]], advantages, response_mask) -> dict[tuple[str, int], float]:
    """``(group id, response index)`` → the mean advantage over the response's tokens, from the update's
    ``[B, T]`` advantages and response mask (rows in ``keys`` order)."""
    mask = response_mask.float()
    means = (advantages.float() * mask).sum(-1) / mask.sum(-1).clamp(min=1)
    return {key: float(value) for key, value in zip(keys, means.tolist(), strict=True)}


def _row(step: int, pick: str, group: ScoredGroup, i: int, advantages: dict[tuple[str, int], float]) -> dict:
    rollout = group.rollout
    _, _, versions = rollout.response(i)
    return {
        "step": step,
        "version": step,
        "pick": pick,
        "group_id": rollout.group_id,
        "response_index": i,
        "prompt": rollout.prompt[:MAX_TEXT],
        "response": rollout.texts[i][:MAX_TEXT],
        "reward": float(group.rewards[i]),
        "details": dict(group.details[i]) if group.details else {},
        "advantage": advantages.get((rollout.group_id, i)),  # None: a response a pairwise loss did not train on
        "finish_reason": rollout.finish_reasons[i],
        "staleness": int(step - 1 - versions.min()) if len(versions) else 0,
        "tokens": len(versions),
    }


def _turns(group: ScoredGroup, i: int, decode: Callable[[list[int]], str] | None) -> dict:
    """``turns`` and ``trained_tokens`` of an episode (a response with a loss mask); nothing for other responses."""
    rollout = group.rollout
    if not len(rollout.loss_mask) or decode is None:
        return {}
    ids, trained = rollout.response(i)[0], rollout.trained(i)
    row_starts = {start for start, _ in rollout.rows(i)[1:]}
    turns = [
        {"by": _by(by_model, s in row_starts), "text": decode(ids[s:e].tolist())[:MAX_TEXT], "tokens": e - s}
        for s, e, by_model in segments(trained)
    ]
    return {"turns": turns, "trained_tokens": int(trained.sum()), "rows": len(row_starts) + 1}


def _by(by_model: bool, starts_row: bool) -> str:
    """Who wrote a segment of an episode: ``model``, ``environment``, or ``context`` — the whole conversation as the
    chat template served it again for the next turn (an episode kept per turn starts a row with it)."""
    return "model" if by_model else "context" if starts_row else "environment"
