"""Where the learner's batches come from: admission, the replay stream, and the record of what was trained.

:class:`BatchSource` owns the dispatcher (prompt admission, re-issue), the replay reader, the trained log and the
staleness floor. One step asks it twice::

    take(v)            release groups under the staleness bound; read scored groups until groups_per_step are
                       admitted; drop (and count) duplicates, forgeries, stale and zero-variance groups
    settle(step, …)    record which groups the step trained (acknowledged now or once a checkpoint holds them),
                       and retire them from the ledger

An arriving group is judged in this order (:meth:`BatchSource.admit`): a **duplicate** (trained before, or twice
in this batch: a re-issued group's two copies) is acknowledged; a group that does not answer its id's issue
record is **refused** (``common/wire/provenance.py``: dead-lettered, its id stays in flight for the real one); a group
with a token older than the staleness floor is **stale** and a group with equal rewards under dynamic sampling is
**zero_variance** — both discarded, so admission releases replacements.

Eval groups (``purpose = "eval"``) are routed to :class:`asyncrl.learner.intake.evaluation.EvalRounds` before any of
this: they are never admitted, judged stale, counted by admission or trained.

Recovery: entries read and never acknowledged (an earlier learner's, or after a resume those its later steps
trained) come back first (:meth:`BatchSource.recover`); entries read beyond one batch are carried to the next.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import TypedDict

import numpy as np

from asyncrl.common.config import RunConfig
from asyncrl.common.data.prompts import model_vocab_size
from asyncrl.common.environments.protocol import run_prompter
from asyncrl.common.observability.logs import get_logger, worth_logging
from asyncrl.common.plane.control import ControlPlane
from asyncrl.common.plane.dead_letters import dead_letter, newest_reason
from asyncrl.common.plane.prompt_ledger import Standing
from asyncrl.common.plane.replay import ReplayEntry, ReplayReader
from asyncrl.common.rewards.response_text import ResponseTexts
from asyncrl.common.staleness import StalenessBound
from asyncrl.common.wire.messages import Limits, ScoredGroup, encode_blob
from asyncrl.common.wire.provenance import episode_tokens, issue_mismatch
from asyncrl.learner.intake.dispatcher import Dispatcher
from asyncrl.learner.intake.evaluation import EvalRounds
from asyncrl.learner.intake.trained import Rewind, TrainedLog, replay_position


class Position(TypedDict):
    """What a checkpoint records of the data (:meth:`BatchSource.position`)."""

    dispatch: dict[str, int]
    replay: dict[str, object]


log = get_logger("learner")
RECOVER_MAX = 100_000
"""Most pending replay entries taken back at start (trained since the last checkpoint, or read and not trained)."""


class Verdict(StrEnum):
    """What admission decides on an arriving group (:meth:`BatchSource.admit`), judged in this order. Each but
    ``ok`` is why a group is not trained, and a ``groups/<name>`` count of metrics.jsonl."""

    DUPLICATE = "duplicate"
    """Its id was already trained, or decided on earlier in this batch."""
    REFUSED = "refused"
    """It does not answer its issue record, or its texts are not the decode of its ids: dead-lettered."""
    STALE = "stale"
    """Its oldest token is older than the staleness bound allows."""
    ZERO_VARIANCE = "zero_variance"
    """Every response has the same reward, with dynamic sampling on: no signal."""
    OK = "ok"
    """Admitted: trained in this step."""

    @property
    def settles(self) -> bool:
        """Whether this decides the group for good, so that another copy of it in the batch is a duplicate (a
        refused copy does not: the group it claims to be may still arrive)."""
        return self in (Verdict.OK, Verdict.STALE, Verdict.ZERO_VARIANCE)

    @property
    def metric(self) -> str:
        """Its count's name in metrics.jsonl (two keep their historical names)."""
        historical = {Verdict.DUPLICATE: "duplicates", Verdict.STALE: "dropped_stale"}
        return f"groups/{historical.get(self, self)}"


DROPPED = tuple(v for v in Verdict if v is not Verdict.OK)
"""The verdicts that keep a group out of the batch."""


class StepInterrupted(Exception):
    """SIGTERM arrived while the learner waited for a batch: the entries read so far stay pending for the next run."""


class NoActorsLeft(StepInterrupted):
    """No rollout actor, or no reward worker, alive for ``learner.no_actors_s``: nobody can make a batch, so the
    learner saves a checkpoint and stops instead of waiting out ``wait_for_batch_s``."""


class EveryGroupRefused(NoActorsLeft):
    """The reward workers dead-lettered every group of the last :data:`REFUSED_STREAK_BATCHES` batches' worth and
    none was trained: a new group would be refused too (an environment that cannot be replayed, a reward function
    that always fails), so the learner saves a checkpoint and stops, naming the newest reason."""


REFUSED_STREAK_BATCHES = 4
"""Batches' worth of groups (``learner.groups_per_step`` each) dead-lettered in a row, none trained between, that stop
the run (:class:`EveryGroupRefused`)."""


WATCHED_KINDS = {"actor": "rollout actor", "reward": "reward worker"}
"""The kinds of process without which no batch can be made, and how the message names them."""
FIRST_SIGHT_S = 120.0
"""Before any rollout actor has been seen, the learner waits at least this long for the first: an actor heartbeats
once its imports are done (vLLM's take tens of seconds on a loaded machine), and ``learner.no_actors_s`` is about
processes that are gone, not ones still starting. Reward workers, quick to start, get no such grace."""


class ActorWatch:
    """Raises :class:`NoActorsLeft` from :meth:`check` once no process of a kind in :data:`WATCHED_KINDS` (rollout
    actors, reward workers) has been alive for ``limit_s`` (0: never). A process counts from its first heartbeat (an
    actor while its engine still starts); each kind's clock starts at the first look that finds none of it, so a
    learner started before its actors waits for the first: ``limit_s``, and for an actor at least
    :data:`FIRST_SIGHT_S`. Reads the registry at most once a second."""

    def __init__(self, registry, limit_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.registry, self.limit_s, self.clock = registry, limit_s, clock
        self.none_since: dict[str, float] = {}
        self.seen: set[str] = set()  # kinds of which a process has been alive at some look
        self._next_look = 0.0

    def check(self) -> None:
        now = self.clock()
        if not self.limit_s or now < self._next_look:
            return
        self._next_look = now + 1.0
        live, _lost = self.registry.processes()
        alive = {beat.kind for beat in live}
        for kind, called in WATCHED_KINDS.items():
            if kind in alive:
                self.none_since.pop(kind, None)
                self.seen.add(kind)
                continue
            since = self.none_since.setdefault(kind, now)
            limit = self.limit_s if kind in self.seen or kind != "actor" else max(self.limit_s, FIRST_SIGHT_S)
            if now - since > limit:
                raise NoActorsLeft(
                    f"no {called} alive for {limit:g}s (learner.no_actors_s): every {called} of the run is "
                    f"gone or none started; a checkpoint is saved; start {called}s, then the learner with "
                    "--resume latest"
                )


@dataclass
class Taken:
    """One batch: the admitted entries, the ids of those decided against, and why."""

    entries: list[ReplayEntry] = field(default_factory=list)
    dropped: list[str] = field(default_factory=list)
    """Replay entry ids judged and not admitted: acknowledged with the step (or at once when interrupted)."""
    verdicts: dict[Verdict, int] = field(default_factory=lambda: dict.fromkeys(DROPPED, 0))
    waited_s: float = 0.0
    """Seconds spent waiting for the batch: the learner's idle time in this step."""
    faulted_episodes: int = 0
    """Episodes an environment fault ended since the last batch (their groups generated again: ``actors/faults.py``)."""
    issued_at: dict[str, float] = field(default_factory=dict)
    """When each admitted group was issued (wall clock), from its issue record: the start of its timeline."""
    complete_at: float = 0.0
    """When the batch was complete (wall clock): the end of its groups' timelines."""

    @property
    def groups(self) -> list[ScoredGroup]:
        return [entry.group for entry in self.entries]

    def rewards(self) -> np.ndarray:
        """Every response's reward, float64 (also the responses a pairwise loss does not train on)."""
        return np.concatenate([entry.group.rewards for entry in self.entries]).astype(np.float64)

    def figures(self) -> dict[str, float]:
        """The ``groups/*`` counts of metrics.jsonl."""
        return {verdict.metric: float(n) for verdict, n in self.verdicts.items()}


class BatchSource:
    """Admits, reads and settles the scored groups of one run (see the module docstring)."""

    def __init__(self, config: RunConfig, plane: ControlPlane, tokenizer, newest_version: int) -> None:
        self.config = config
        self.plane = plane
        self.bound = StalenessBound.of(config)
        # Token ids are checked against the model's embedding rows, which may exceed the tokenizer's length (padded).
        limits = Limits(int(config.transport.max_message_mb * 2**20), model_vocab_size(config.model.path))
        self.reader = ReplayReader(plane.client, plane.keys, limits=limits)
        prompter = run_prompter(tokenizer, config)
        self.texts = ResponseTexts(tokenizer)
        self.dispatcher = Dispatcher(config, plane, prompter)
        self.evaluation = EvalRounds(config, plane, prompter, self.reader) if config.eval.every else None
        """The run's eval rounds (``learner/intake/evaluation.py``); eval entries go there before admission."""
        self.trained = TrainedLog(plane, self.reader, defer_acks=config.checkpoint.every > 0)
        self._faulted_total = self._faulted_episodes_total()  # counted on from the learner's start (or resume)
        self.actors = ActorWatch(plane.registry, config.learner.no_actors_s)
        self.newest_version = newest_version
        """The newest version any actor can hold; a token stamped above it was not sampled by this run's weights."""
        self._carry: list[ReplayEntry] = []  # recovered entries not yet trained, still pending in the stream
        self._retrain: dict[str, str] = {}  # group -> entry of groups a resume trains again
        self._refused = 0  # groups refused by provenance since this learner started
        self._dead_lettered_streak = 0  # groups retired as dead-lettered since the last admitted one

    # ------------------------------------------------------------------ one step

    def take(self, version: int, stop: threading.Event, on_wait: Callable[[], None]) -> Taken:
        """``groups_per_step`` admitted groups for the step after ``version``; ``on_wait`` runs while reading waits.

        Raises :class:`StepInterrupted` when ``stop`` is set while waiting, :class:`TimeoutError` past
        ``learner.wait_for_batch_s``.
        """
        if self.evaluation is not None:
            self.evaluation.issue_if_due(version)  # first: its groups are queued ahead of this step's
        self.dispatcher.release(version)
        want = self.config.learner.groups_per_step
        taken, started = Taken(), time.perf_counter()
        candidates, self._carry = self._carry, []
        decided: set[str] = set()  # ids admitted or discarded by this batch: a later copy of one is a duplicate
        while len(taken.entries) < want:
            if not candidates:
                self._check_waiting(taken, stop, started)
                self.dispatcher.release(version)
                held = {e.group.rollout.group_id for e in taken.entries}  # admitted: never lost or re-issued
                self.dispatcher.reissue_overdue(self.config.learner.group_deadline_s, held=held)
                self._retire_dead_lettered(taken)
                self._close_eval_rounds()
                on_wait()
                candidates = self.reader.read(want - len(taken.entries), block_ms=500)
            candidates = [entry for entry in candidates if not self._is_eval(entry)]  # eval: scored, never trained
            wanted = candidates[: want - len(taken.entries)]  # beyond: carried, or looked up one by one
            standings = self.dispatcher.standings(e.group.rollout.group_id for e in wanted)
            for entry in candidates:
                if len(taken.entries) == want:
                    self._carry.append(entry)  # recovered beyond one batch: next step's
                    continue
                group_id = entry.group.rollout.group_id
                # the standings were read before this batch decided on any of them: `decided` is what changed since
                verdict = self.admit(entry, version, decided, standings.get(group_id))
                if verdict.settles:
                    decided.add(group_id)
                if verdict is Verdict.OK:
                    self._dead_lettered_streak = 0
                    taken.entries.append(entry)
                    standing = standings.get(group_id)
                    if standing is not None and standing.issued is not None:
                        taken.issued_at[group_id] = standing.issued.issued_at
                else:
                    taken.dropped.append(entry.entry_id)
                    taken.verdicts[verdict] += 1
            candidates = []
        taken.waited_s = time.perf_counter() - started
        taken.complete_at = time.time()
        taken.faulted_episodes = self._faulted_since_last()
        self._close_eval_rounds()
        return taken

    def _faulted_episodes_total(self) -> int:
        """Episodes the actors of the run counted as ended by an environment fault (a counter in Redis)."""
        return self.plane.prompts.dispatch_counts().get("faulted_episodes", 0)

    def _faulted_since_last(self) -> int:
        """Episodes an environment fault ended since the last call (or the learner's start)."""
        total = self._faulted_episodes_total()
        since, self._faulted_total = total - self._faulted_total, total
        return since

    # ------------------------------------------------------------------ evaluation

    def _is_eval(self, entry: ReplayEntry) -> bool:
        """An eval group goes to its round (without ``[eval]``: acknowledged and dropped); True when it was one."""
        if entry.group.rollout.purpose != "eval":
            return False
        if self.evaluation is not None:
            self.evaluation.collect(entry)
        else:
            self.reader.ack([entry.entry_id])
        return True

    def _close_eval_rounds(self) -> None:
        if self.evaluation is not None:
            self.evaluation.close_due()

    def finish_eval(self, version: int, stop: threading.Event) -> None:
        """At the end of the run: issue the last round (policy ``version``) if due and wait for the open ones, at
        most ``eval.deadline_s``. Training groups read meanwhile stay pending (a resume trains them)."""
        if self.evaluation is None:
            return
        self.evaluation.issue_if_due(version)
        while self.evaluation.open and not stop.is_set():
            for entry in self.reader.read(64, block_ms=500):
                if not self._is_eval(entry):
                    self._carry.append(entry)
            self.evaluation.close_due()
        self.evaluation.close_due(force=True)

    def _check_waiting(self, taken: Taken, stop: threading.Event, started: float) -> None:
        if stop.is_set():
            self.reader.ack(taken.dropped)  # decided (discarded or duplicate); the admitted stay pending
            raise StepInterrupted
        try:
            self.actors.check()
        except NoActorsLeft:
            self.reader.ack(taken.dropped)  # as for SIGTERM: the admitted stay pending for the resume
            raise
        limit = self.config.learner.wait_for_batch_s
        if time.perf_counter() - started > limit:
            raise TimeoutError(
                f"no full batch within {limit}s: {len(taken.entries)}/{self.config.learner.groups_per_step} groups; "
                "are actors and reward workers running?"
            )

    def _retire_dead_lettered(self, taken: Taken) -> None:
        """Free the slots of the groups the reward workers dead-lettered (``Dispatcher.retire_refused``); raise
        :class:`EveryGroupRefused` once :data:`REFUSED_STREAK_BATCHES` batches' worth came in a row, none trained."""
        self._dead_lettered_streak += self.dispatcher.retire_refused()
        limit = REFUSED_STREAK_BATCHES * self.config.learner.groups_per_step
        if self._dead_lettered_streak < limit:
            return
        self.reader.ack(taken.dropped)  # as for SIGTERM: the admitted stay pending for the resume
        reason = (newest_reason(self.plane.client, self.plane.keys) or "unknown")[:300]
        raise EveryGroupRefused(
            f"the reward workers dead-lettered the last {self._dead_lettered_streak} groups and none was trained "
            f"(the newest: {reason}); a new group would fail the same way; a checkpoint is saved; fix what the "
            "reason names, then start the learner with --resume latest"
        )

    def admit(
        self, entry: ReplayEntry, version: int, in_batch: set[str], standing: Standing | None = None
    ) -> Verdict:
        """The :class:`Verdict` on ``entry`` arriving while the learner is at ``version``; ``standing``:
        its id's record, looked up with the rest of a read (one round trip per read, not two per group).

        ``in_batch``: ids this batch already decided on (admitted, or discarded as stale or zero-variance). Another copy
        of one is a duplicate, also when ``standing`` was read before that decision: a re-issued group's second copy
        in the same read must not be trained after its first was discarded (counted both discarded and trained).
        """
        group_id = entry.group.rollout.group_id
        if standing is None:
            standing = self.dispatcher.standings([group_id])[group_id]
        if group_id in in_batch or standing.completed:
            self.dispatcher.note_duplicate(group_id)
            return Verdict.DUPLICATE
        if group_id not in self._retrain:  # a group trained again after a resume was checked when first trained
            issued, rollout = standing.issued, entry.group.rollout
            reason = issue_mismatch(
                issued, rollout, self.config.rollout.max_new_tokens, self.newest_version, episode_tokens(self.config)
            )
            reason = reason or self.texts.mismatch(rollout)  # train only ids whose scored text is their decode
            if reason is not None:
                self._refuse(entry, reason)
                return Verdict.REFUSED
        oldest = int(entry.group.rollout.versions.min(initial=version))
        if oldest < self.bound.floor(version):
            self.dispatcher.discard([group_id])
            log.info(
                "dropped a stale group",
                group=group_id,
                issued=entry.group.rollout.issued_version,
                oldest_token=oldest,
                floor=self.bound.floor(version),
                actor=entry.group.rollout.actor_id,
            )
            return Verdict.STALE
        if self.config.algorithm.dynamic_sampling and len(set(entry.group.rewards.tolist())) == 1:
            self.dispatcher.discard([group_id])  # DAPO's dynamic sampling: no signal; admission releases another
            return Verdict.ZERO_VARIANCE
        return Verdict.OK

    def _refuse(self, entry: ReplayEntry, reason: str) -> None:
        """Dead-letter a group that does not answer what was issued under its id; log the 1st, 10th, 100th, …"""
        rollout = entry.group.rollout
        dead_letter(self.plane.client, self.plane.keys, "learner:refused", reason, encode_blob(entry.group))
        self._refused += 1
        if worth_logging(self._refused):
            log.warning(
                "refused a scored group that does not match its issue record",
                group=rollout.group_id[:80],
                actor=rollout.actor_id[:80],
                scorer=entry.group.scorer_id[:80],
                reason=reason,
                refused=self._refused,
                action=f"a peer that is not one of this run's actors may be sending to the reward workers; "
                f"inspect with XRANGE {self.plane.keys.dead} - +; bind beyond loopback only with CURVE keys",
            )

    def settle(self, step: int, taken: Taken) -> None:
        """``step`` trained ``taken``: record it (acknowledged now, or once a checkpoint holds it); retire the ids."""
        self.trained.record(step, taken.entries, taken.dropped)
        self.dispatcher.complete([e.group.rollout.group_id for e in taken.entries])

    def published(self, version: int) -> None:
        """The learner sent (or is sending) ``version``: actors may stamp tokens with it from now on."""
        self.newest_version = max(self.newest_version, version)

    # ------------------------------------------------------------------ start, checkpoints, resume

    def recover(self) -> None:
        """Entries this consumer read and never acknowledged come first: an earlier learner's (same consumer name),
        or, after a restore, the groups it trains again (XREADGROUP ``>`` would never return them)."""
        self._carry = self.reader.recover(count=RECOVER_MAX)
        if self._retrain:
            recovered = {e.group.rollout.group_id for e in self._carry}
            self.trained.forget_missing(g for g in self._retrain if g not in recovered)

    def position(self) -> Position:
        """What a checkpoint records of the data: the dispatcher's counters and the replay stream's position."""
        return {"dispatch": self.plane.prompts.dispatch_counts(), "replay": replay_position(self.reader)}

    def commit(self, step: int) -> int:
        """A checkpoint of ``step`` is on disk: acknowledge the entries it covers."""
        return self.trained.commit(step)

    def rewind(self, dispatch: dict[str, int], step: int) -> Rewind:
        """Go back to a checkpoint of ``step``: groups trained after it are trained again (or counted lost)."""
        self.dispatcher.adopt(dispatch, step)
        rewind = self.trained.rewind(step)
        self._retrain = rewind.retrain
        return rewind
