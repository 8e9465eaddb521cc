"""The learner's eval rounds: issue the held-out prompts every ``eval.every`` steps, collect their scored groups apart
from training, and write ``eval/*`` rows (what an eval group is and how it travels: ``common/data/evaluation.py``).

:class:`EvalRounds` is owned by the batch source, which hands it every replay entry marked ``purpose = "eval"``
before admission — so no eval group is ever judged by the staleness floor, counted by admission or trained::

    issue_if_due(v)   at v = 0, every eval.every-th version and the last (learner.steps): one round of the eval set,
                      issued at version v (the policy it evaluates), queued ahead of every training group
    collect(entry)    an eval entry: checked against the round's issue record, kept, acknowledged at once
    close_due()       a round whose groups are all back (or whose eval.deadline_s passed) becomes one row

A row is ``{"step": v, "version": v, "time": …, "eval/…": …}`` appended to metrics.jsonl — the step is the one at
which the round was issued, recorded when its groups are back — and goes to Prometheus
(``asyncrl_learner_eval_*``) and to the Redis key ``eval`` that rl-top shows. Rounds live in this learner's memory:
a learner that dies loses its open rounds (their late groups reach the next learner, which acknowledges and drops
them), and a resumed run issues its rounds again from the checkpoint's step on.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path

from asyncrl.common.config import RunConfig
from asyncrl.common.data.evaluation import eval_examples, eval_groups, round_figures
from asyncrl.common.data.prompts import Prompter
from asyncrl.common.observability import metrics as m
from asyncrl.common.observability.logs import get_logger, worth_logging
from asyncrl.common.plane.control import ControlPlane
from asyncrl.common.plane.replay import ReplayEntry, ReplayReader
from asyncrl.common.plane.run_secret import run_secret
from asyncrl.common.wire.messages import PromptGroup, ScoredGroup
from asyncrl.common.wire.provenance import episode_tokens, issue_mismatch

log = get_logger("eval")
SHOWN_ROUNDS = 8
"""Rounds kept in Redis for rl-top (the newest)."""


@dataclass
class Round:
    """One eval round: issued at ``step`` (policy ``step``), waiting for its groups."""

    step: int
    issued_at: float
    issued: dict[str, PromptGroup]
    scored: dict[str, ScoredGroup] = field(default_factory=dict)

    @property
    def complete(self) -> bool:
        return len(self.scored) == len(self.issued)


class EvalRounds:
    """Issues, collects and records the eval rounds of one run (see the module docstring)."""

    def __init__(self, config: RunConfig, plane: ControlPlane, prompter: Prompter, reader: ReplayReader) -> None:
        self.config = config
        self.plane = plane
        self.reader = reader
        self.encode = prompter.encode
        self.examples = eval_examples(config, prompter)  # a bad held-out file fails here, before training starts
        self.metrics_path = config.run_dir / "metrics.jsonl"
        self.open: dict[int, Round] = {}
        self.rows: list[dict[str, float]] = []  # recorded by this learner, oldest first
        self._issued: set[int] | None = None  # steps with a round: read from metrics.jsonl at the first issue
        self._dropped = 0  # eval entries of no open round (late, duplicate, an earlier learner's) or refused
        log.info("evaluation on", prompts=len(self.examples), every=config.eval.every, k=config.eval.num_samples)

    def due(self, version: int) -> bool:
        every = self.config.eval.every
        if not every or (version % every and version != self.config.learner.steps):
            return False
        return version not in self._issued_steps()

    def _issued_steps(self) -> set[int]:
        if self._issued is None:  # a resumed run: the rounds its metrics.jsonl already holds are not issued again
            self._issued = recorded_steps(self.metrics_path)
        return self._issued

    def issue_if_due(self, version: int) -> bool:
        """Issue the round of ``version`` if one is due and not issued yet (by this learner)."""
        if not self.due(version):
            return False
        secret = run_secret(self.plane.client, self.plane.keys)
        groups = eval_groups(self.config, self.examples, self.encode, version, version, secret=secret)
        self.plane.prompts.issue_eval(groups)
        self.open[version] = Round(version, time.time(), {g.group_id: g for g in groups})
        self._issued_steps().add(version)
        log.info("issued an eval round", step=version, groups=len(groups))
        return True

    def collect(self, entry: ReplayEntry) -> None:
        """Keep an eval entry for its round (or drop one no open round waits for); acknowledge it either way."""
        rollout = entry.group.rollout
        round_ = next((r for r in self.open.values() if rollout.group_id in r.issued), None)
        issued = round_.issued.get(rollout.group_id) if round_ is not None else None
        reason = issue_mismatch(
            issued, rollout, self.config.rollout.max_new_tokens, episode_tokens=episode_tokens(self.config)
        )
        if round_ is not None and reason is None and rollout.group_id not in round_.scored:
            round_.scored[rollout.group_id] = entry.group
        else:
            self._drop(rollout.group_id, reason or "a duplicate of a group already scored")
        self.reader.ack([entry.entry_id])

    def _drop(self, group_id: str, reason: str) -> None:
        self._dropped += 1
        if worth_logging(self._dropped):
            log.info("dropped an eval group no open round takes", group=group_id[:80], reason=reason, n=self._dropped)

    def close_due(self, now: float | None = None, force: bool = False) -> list[dict[str, float]]:
        """Record every complete round, and those past ``eval.deadline_s`` (all open ones with ``force``)."""
        now = time.time() if now is None else now
        rows = []
        for step, round_ in sorted(self.open.items()):
            if round_.complete or force or now - round_.issued_at > self.config.eval.deadline_s:
                rows.append(self._record(self.open.pop(step), now))
        return rows

    def _record(self, round_: Round, now: float) -> dict[str, float]:
        missing = len(round_.issued) - len(round_.scored)
        self.plane.prompts.retire_eval(round_.issued)
        row = {
            "step": float(round_.step),
            "version": float(round_.step),
            "time": now,
            "eval/step": float(round_.step),
            "eval/version": float(round_.step),
            "eval/k": float(self.config.eval.num_samples),
            "eval/groups": float(len(round_.scored)),
            "eval/missing": float(missing),
            "eval/seconds": now - round_.issued_at,
            **round_figures(list(round_.scored.values()), self.config.eval.success_threshold),
        }
        self._write(row)
        self._publish(row, missing)
        if missing:
            log.warning(
                "eval round recorded without all its groups",
                step=round_.step,
                missing=missing,
                action="check actors and reward workers (rl-top); raise eval.deadline_s if the round is just slow",
            )
        return row

    def _write(self, row: dict[str, float]) -> None:
        self.rows.append(row)
        self.metrics_path.parent.mkdir(parents=True, exist_ok=True)
        with Path(self.metrics_path).open("a") as f:
            f.write(json.dumps(row) + "\n")
        figures = {k.removeprefix("eval/"): round(v, 4) for k, v in row.items() if k in SCORES}
        log.info("eval", step=int(row["step"]), groups=int(row["eval/groups"]), **figures)

    def _publish(self, row: dict[str, float], missing: int) -> None:
        for key in SCORES:
            if key in row:
                m.LEARNER_EVAL_SCORE.labels(figure=key.removeprefix("eval/")).set(row[key])
        m.LEARNER_EVAL_STEP.set(row["step"])
        m.LEARNER_EVAL_ROUNDS.inc()
        m.LEARNER_EVAL_MISSING.inc(missing)
        self.plane.client.set(self.plane.keys.eval, json.dumps(self.rows[-SHOWN_ROUNDS:]))


def recorded_steps(metrics_path: Path) -> set[int]:
    """Steps of the eval rows in metrics.jsonl (``eval/step``)."""
    if not metrics_path.is_file():
        return set()
    steps = set()
    for line in metrics_path.read_text().splitlines():
        if '"eval/step"' in line:
            try:
                steps.add(int(json.loads(line)["eval/step"]))
            except (ValueError, KeyError, TypeError):
                continue  # a half-written line
    return steps


SCORES = ("eval/pass@k", "eval/mean@k", "eval/accuracy")
"""The figures of a row that go to Prometheus (``asyncrl_learner_eval_score{figure}``) and the log line."""
