"""Prompt admission for the learner: releases prompt groups under the staleness bound, re-issues lost ones.

Admission control (:class:`asyncrl.common.staleness.StalenessBound`, the one staleness rule of a run)::

    released_total = distinct groups ever released − groups counted lost, discarded or refused
    release(v)     releases max(0, capacity(v) − released_total) new groups

A re-issue does not count again (same group id), a completed group keeps counting (admission counts
groups released, not groups in flight), and a lost or discarded group (one that will never be trained)
stops counting, so a replacement is released in its place. The learner trains ``groups_per_step`` groups
per version, so a group released at version v is among the first (max_staleness + v + 1) × groups_per_step
and, trained roughly in release order, lands in a batch no later than step v + max_staleness. With
``max_staleness = 0`` at most (v + 1) × groups_per_step groups exist at version v — the batch of step v is
released only once v is reached: exactly synchronous on-policy training.

State lives in Redis under the run's namespace (:class:`asyncrl.common.plane.control.RunKeys`), so a restarted learner
carries on: the ledger (``inflight``: issue time, version, holder, attempts), the payload of every group in
flight (``groups``, for re-issue), the counters (``dispatch``: ``created`` numbers group ids and positions the
prompt stream, ``released`` is ``released_total``) and the ids of completed groups (``done``).

Crash safety of :meth:`Dispatcher.release`: ledger entries first, then payloads and counters in one
transaction (the commit point), then the queue. A crash before the commit leaves ledger entries without a
payload, which :meth:`Dispatcher.reissue_overdue` drops uncounted (their ids are reused); a crash after it
leaves groups recorded but never queued, which their deadline re-issues.

One dispatcher per run, called from one thread (the learner loop): it is not safe to run two at once.
"""

from __future__ import annotations

import dataclasses
import random
import time
from collections.abc import Callable, Collection, Iterable

from asyncrl.common.config import RunConfig, TaskSection
from asyncrl.common.data.prompts import Prompter
from asyncrl.common.data.tasks import TASKS, Task, check_task_options, get_task, prompt_group, task_label
from asyncrl.common.observability.logs import get_logger
from asyncrl.common.observability.metrics import (
    DISPATCHER_DUPLICATE_GROUPS,
    DISPATCHER_LOST_GROUPS,
    DISPATCHER_REFUSED_GROUPS,
    DISPATCHER_REISSUED_GROUPS,
    DISPATCHER_RELEASED_GROUPS,
    DISPATCHER_SKIPPED_ROWS,
)
from asyncrl.common.plane.control import ControlPlane
from asyncrl.common.plane.outage import outage_clock
from asyncrl.common.plane.prompt_ledger import LedgerEntry, Standing
from asyncrl.common.plane.run_secret import run_secret
from asyncrl.common.staleness import StalenessBound
from asyncrl.common.wire.messages import PromptGroup
from asyncrl.common.wire.seal import numbered_group_id

log = get_logger("dispatcher")
MAX_ATTEMPTS = 2
"""A group is issued at most this often (once, then re-issued once) before it is counted lost."""


def prompt_source(section: TaskSection) -> tuple[Task, str]:
    """The run's task and the name its groups carry (:func:`asyncrl.common.data.tasks.task_label`: its verifier)."""
    return get_task(section.name, **task_options(section)), task_label(section)


def check_task(section: TaskSection) -> None:
    """Whether ``task.name`` is registered and takes ``task.options`` (within a generated task's bounds:
    :func:`~asyncrl.common.data.tasks.check_task_options`), without reading any file; ``ValueError`` naming the
    setting otherwise."""
    options = task_options(section)
    TASKS.get(section.name, "task.name")
    try:
        check_task_options(section.name, options)
    except ValueError as exc:
        raise ValueError(f"task.options: {exc}") from None


FILE_SETTINGS = ("prompt_key", "answer_key", "split", "limit", "shuffle")
"""``[task]`` fields that are the ``file`` task's constructor options."""


def task_options(section: TaskSection) -> dict:
    """The task constructor's options: ``task.options``, and for ``file`` the path from ``task.path`` and the
    :data:`FILE_SETTINGS` (``task.options["verifier"]`` names the verifier, not a constructor option)."""
    options = dict(section.options)
    if section.name != "file":
        return options
    options.pop("verifier", None)
    if section.path:
        options["path"] = section.path
    if not options.get("path"):
        raise ValueError("task 'file' needs a data file: set task.path to a JSONL, Parquet or save_to_disk folder")
    for name in FILE_SETTINGS:
        if name in options:
            raise ValueError(f"task 'file': set task.{name}, not task.options.{name}")
        options[name] = getattr(section, name)
    return options


def overdue_reason(
    entry: LedgerEntry, live: set[str] | None, deadline_s: float, now: float, paused_s: float = 0.0
) -> str | None:
    """Why an in-flight group should be re-issued (or given up), or None while it is fine.

    Its holders are the actor that took it and the reward worker it was pushed to (:class:`LedgerEntry`); with neither
    (still queued, or already in the replay stream) only the deadline applies. ``live`` is
    None while heartbeats cannot be trusted (Redis came back less than a heartbeat TTL ago: the holder's may not be
    renewed yet); ``paused_s`` seconds since the issue in which Redis was down do not count against the deadline.
    """
    if (holder := gone_holder(entry, live)) is not None:
        return f"holder {holder} is gone (heartbeat expired or it left)"
    age = now - entry.issued_at - paused_s
    if age > deadline_s:
        return f"not back {age:.1f}s after issue (deadline {deadline_s:g}s)"
    return None


def gone_holder(entry: LedgerEntry, live: set[str] | None) -> str | None:
    """The first of the group's holders — the actor that generates it, the reward worker it was pushed to — whose
    heartbeat is not in ``live`` (None while heartbeats cannot be trusted)."""
    for holder in (entry.actor, entry.scorer):
        if holder and live is not None and holder not in live:
            return holder
    return None


class Dispatcher:
    """Releases prompt groups into the run's prompt queue under admission control and tracks them.

    ``prompter`` makes each prompt (chat template, special tokens) and its token ids, once
    (:class:`asyncrl.common.data.prompts.Prompter`); a plain ``encode`` function (text → ids) stands for one without a
    template.
    """

    def __init__(self, config: RunConfig, plane: ControlPlane, prompter: Prompter | Callable[[str], list[int]]) -> None:
        self.config = config
        self.plane = plane
        self.prompter = prompter if isinstance(prompter, Prompter) else Prompter(encode=prompter)
        self.bound = StalenessBound.of(config)
        self.task, self.task_label = prompt_source(config.task)
        # A data file's rows are checked now (a bad one refuses the file, naming it; one too long to serve is skipped
        # or refused, as task.overlong says), so that no prompt fails in vLLM later.
        limit = config.model.max_model_len - config.rollout.max_new_tokens
        self.task.fit(self.prompter, limit, config.task.overlong)
        DISPATCHER_SKIPPED_ROWS.set(len(self.task.skipped))
        self._rng = random.Random(config.run.seed)
        self._drawn = 0  # examples drawn from the task so far (its position in the prompt stream)
        self._secret = run_secret(plane.client, plane.keys)
        self._gone_since: dict[str, float] = {}
        """Holders this learner has found gone, and when it first did (:meth:`_sent_to_the_gone`)."""
        self._started_at = time.time()
        """Deadlines count from here at the earliest: while no learner ran, nothing read the replay stream."""

    # -- admission
    def capacity(self, version: int) -> int:
        """How many groups may have been released (and not lost or discarded) at ``version``."""
        return self.bound.capacity(version)

    def release(self, version: int) -> int:
        """Release as many new groups as admission allows at policy ``version``; returns how many."""
        if version < 0:
            raise ValueError(f"version must be >= 0, got {version}")
        counts = self.plane.prompts.dispatch_counts()
        free = self.capacity(version) - counts.get("released", 0)
        if free <= 0:
            return 0
        groups = self._new_groups(counts.get("created", 0), free, version)
        self.plane.prompts.record_issued(groups)
        self.plane.prompts.save_groups(groups, {"created": free, "released": free})  # the commit point
        self.plane.prompts.push_prompts(groups)
        DISPATCHER_RELEASED_GROUPS.inc(free)
        log.debug("released prompt groups", count=free, version=version, first=groups[0].group_id)
        return free

    def adopt(self, counts: dict[str, int], step: int) -> bool:
        """Resume into a Redis that has no dispatcher state (it was lost or replaced): take the checkpoint's position.

        ``created`` continues numbering groups (and the prompt stream) after the checkpoint's, so no id is reused;
        ``released`` is set to the groups the ``step`` steps trained, so admission releases the next batches as a
        fresh run at that version would. The groups the old Redis held in flight are gone with it. Returns whether
        the state was adopted (False when Redis already has it: then Redis is authoritative).
        """
        if self.plane.prompts.dispatch_counts():
            return False
        trained = step * self.config.learner.groups_per_step
        self.plane.prompts.add_dispatch_counts({"created": int(counts.get("created", 0)), "released": trained})
        log.warning(
            "Redis has no dispatcher state for this run; continuing from the checkpoint's position",
            created=counts.get("created", 0),
            released=trained,
            action="none if Redis was replaced on purpose; the groups it held in flight are not re-issued",
        )
        return True

    def group_id(self, number: int) -> str:
        """The id of the run's ``number``-th group: unique within the run, across learner restarts, and ending in a tag
        keyed by the run secret (``common/wire/seal.py: group_tag``), so that nobody outside the run can predict it."""
        return numbered_group_id(self.config.run.name, number, self._secret)

    def _new_groups(self, first: int, count: int, version: int) -> list[PromptGroup]:
        """Groups number ``first`` .. ``first + count - 1``, drawing their prompts from the task."""
        self._seek(first)
        now = time.time()
        groups = []
        for number in range(first, first + count):
            example = self.task.sample(self._rng)
            self._drawn += 1  # per draw: a failure half-way makes the next _seek rewind
            groups.append(
                prompt_group(
                    self.group_id(number),
                    self.task_label,
                    self.prompter.apply(example),  # the prompt as the model sees it (chat-templated)
                    self.prompter.encode,
                    self.config.rollout.num_samples,
                    version,
                    now,
                )
            )
        return groups

    def _seek(self, position: int) -> None:
        """Put the prompt stream at ``position`` examples from the start of the run.

        A restarted learner replays the seeded stream up to the ``created`` counter, so group n gets the
        same prompt as in an uninterrupted run; after a failed release (drawn, never committed) it rewinds.
        """
        if self._drawn > position:
            self._rng, self.task, self._drawn = random.Random(self.config.run.seed), self.task.fresh(), 0
        for _ in range(position - self._drawn):
            self.task.sample(self._rng)
        self._drawn = position

    # -- re-issue
    def reissue_overdue(
        self, deadline_s: float, now: float | None = None, held: Collection[str] = ()
    ) -> tuple[int, int]:
        """Re-issue every in-flight group whose holder died or that is older than ``deadline_s``.

        A group's first time overdue re-issues it (front of the queue, fresh issue time, attempts 2); its
        second counts it lost (ledger entry and payload removed, no longer counted by admission, so the
        next :meth:`release` replaces it). Returns (re-issued, lost).

        ``held``: ids of groups the learner already holds (admitted into the batch it is assembling, to be completed
        when that step settles). They are never judged: a group is trained, discarded or lost, never two of them.

        A learner that starts gives every group a full deadline: time in which no learner ran does not count (a group
        scored while the learner was down waits in the replay stream; judged from its issue time, a restart slower than
        the deadline would re-issue every such group, and a second such restart would count them lost, answers and all).

        A Redis restart re-issues nothing by itself: for a heartbeat TTL after Redis came back, holders whose
        heartbeat expired while it was down are not judged yet, and the time it was down does not count against
        the deadline (``common/plane/outage.py``).
        """
        now = time.time() if now is None else now
        live: set[str] | None = {heartbeat.process_id for heartbeat in self.plane.registry.processes()[0]}
        clock = outage_clock(self.plane.client)
        if clock is not None and clock.recovered_within(self.config.transport.heartbeat_ttl_s, now):
            live = None  # Redis just came back: a heartbeat that expired while it was down is being renewed
        for back in self._gone_since.keys() & (live or set()):  # a heartbeat that expired and came back
            del self._gone_since[back]
        reissued, lost = 0, []
        # newest first: each re-issue goes to the front, so the oldest group ends up taken first
        ledger = self.plane.prompts.ledger().items()
        newest_first = sorted(ledger, key=lambda kv: (kv[1].issued_at, kv[0]), reverse=True)
        for group_id, entry in newest_first:
            if group_id in held:
                continue
            since = max(entry.issued_at, self._started_at)
            paused_s = since - entry.issued_at + (clock.down_between(since, now) if clock is not None else 0.0)
            reason = overdue_reason(entry, live, deadline_s, now, paused_s)
            if reason is None:
                continue
            group = self.plane.prompts.load_group(group_id)
            if group is None:
                self._drop_unknown(group_id, entry)
            elif self._sent_to_the_gone(entry, live, now):
                self._reissue(group, entry, reason, now, attempts=entry.attempts)
                reissued += 1
            elif entry.attempts >= MAX_ATTEMPTS:
                lost.append((group_id, entry, reason))
            else:
                self._reissue(group, entry, reason, now, attempts=entry.attempts + 1)
                reissued += 1
        self._lose(lost)
        return reissued, len(lost)

    def _sent_to_the_gone(self, entry: LedgerEntry, live: set[str] | None, now: float) -> bool:
        """Whether the group's holder was already known gone when the group was last issued: an actor whose peer list
        had not yet caught up (it refreshes every 2 s) pushed the re-issued group to the dead worker that the re-issue
        was for. That is the same failure, not a new one of the group's: it is re-issued without counting an attempt,
        so that one worker's death never costs a group. A poison group that kills each worker it reaches still counts
        its attempts: each of those workers was alive when the group reached it."""
        holder = gone_holder(entry, live)
        if holder is None:
            return False
        first_seen = self._gone_since.setdefault(holder, now)
        return first_seen <= entry.issued_at

    def _reissue(self, group: PromptGroup, entry: LedgerEntry, reason: str, now: float, attempts: int) -> None:
        fresh = dataclasses.replace(group, issued_at=now)
        self.plane.prompts.replace_issued(fresh, LedgerEntry(now, entry.version, "", attempts))
        self.plane.prompts.return_prompts([fresh])  # front of the queue: taken next
        self.plane.prompts.add_dispatch_counts({"reissued": 1})
        DISPATCHER_REISSUED_GROUPS.inc()
        log.warning(
            "re-issued a prompt group",
            group=group.group_id,
            actor=entry.actor or "(queued)",
            reason=reason,
            attempt=attempts,
            action="none if rare; if frequent, check actor health (rl-top) or raise learner.group_deadline_s",
        )

    def _lose(self, lost: list[tuple[str, LedgerEntry, str]]) -> None:
        if not lost:
            return
        # released -= n: admission releases a replacement for each lost group
        self.plane.prompts.retire_groups([g for g, _, _ in lost], {"released": -len(lost), "lost": len(lost)})
        DISPATCHER_LOST_GROUPS.inc(len(lost))
        for group_id, entry, reason in lost:
            log.warning(
                "lost a prompt group after its re-issue; releasing a replacement",
                group=group_id,
                actor=entry.actor or "(queued)",
                reason=reason,
                attempts=entry.attempts,
                action="if this repeats, check that actors and reward workers run (rl-top) and the deadline fits",
            )

    def _drop_unknown(self, group_id: str, entry: LedgerEntry) -> None:
        """A ledger entry without a payload: not (or no longer) the dispatcher's, e.g. left by a crash."""
        self.plane.prompts.retire_groups([group_id])
        log.warning(
            "dropped an overdue ledger entry with no stored prompt group",
            group=group_id,
            actor=entry.actor or "(queued)",
            action="none: a group the dispatcher did not commit (or already retired) is not re-issued",
        )

    # -- completion and duplicates
    def is_known(self, group_id: str) -> bool:
        """Whether ``group_id`` is in flight: released by this run, neither completed nor lost."""
        return self.plane.prompts.has_group(group_id)

    def standings(self, group_ids: Iterable[str]) -> dict[str, Standing]:
        """Whether each group was completed before (a second arrival is a re-issued group's twin) and its issue record
        while it is in flight (released, neither completed nor lost), in one Redis round trip."""
        return self.plane.prompts.lookup(group_ids)

    def complete(self, group_ids: Iterable[str]) -> int:
        """Mark groups trained: remove their ledger entries, payloads and queued copies, remember them as done.

        Admission is unchanged (completed groups keep counting). Returns how many were in flight.
        """
        return self.plane.prompts.retire_groups(group_ids, completed=True)

    def discard(self, group_ids: Iterable[str]) -> int:
        """Give up on groups that arrived but will not be trained (too stale, or filtered out).

        Like :meth:`complete` (their twins count as duplicates), but admission stops counting them, so
        replacements are released: with ``max_staleness = 0`` a batch could otherwise never fill again.
        Returns how many were in flight.
        """
        known = [g for g in dict.fromkeys(group_ids) if self.plane.prompts.has_group(g)]
        self.plane.prompts.retire_groups(known, {"released": -len(known), "discarded": len(known)}, completed=True)
        return len(known)

    def retire_refused(self) -> int:
        """Retire the groups the reward workers dead-lettered for good (``note_refused``): out of the
        ledger at once, remembered as done (a late copy is not scored again) and no longer counted by admission, so
        a replacement is released. Counted ``refused``. Returns how many were in flight."""
        ids = self.plane.prompts.take_refused()
        known = [g for g in dict.fromkeys(ids) if self.plane.prompts.has_group(g)]
        if known:
            self.plane.prompts.retire_groups(known, {"released": -len(known), "refused": len(known)}, completed=True)
            DISPATCHER_REFUSED_GROUPS.inc(len(known))
            log.warning(
                "retired prompt groups the reward workers refused; releasing replacements",
                groups=len(known),
                first=known[0],
                action="the reason of each is in the dead letters (rl-top; XRANGE of the run's dead stream)",
            )
        return len(known)

    def note_duplicate(self, group_id: str = "") -> None:
        """Count a group the learner dropped because it already trained that id."""
        self.plane.prompts.add_dispatch_counts({"duplicates": 1})
        DISPATCHER_DUPLICATE_GROUPS.inc()
        log.info("dropped a duplicate of a completed prompt group", group=group_id)

    def stats(self) -> dict[str, int]:
        """Counters for logs and monitors (all persisted in Redis, so they survive a learner restart)."""
        counts = self.plane.prompts.dispatch_counts()
        return {
            "released_total": counts.get("released", 0),
            "in_flight": self.plane.prompts.ledger_size(),
            "queued": self.plane.prompts.queue_depth(),
            "reissued_total": counts.get("reissued", 0),
            "lost_total": counts.get("lost", 0),
            "completed_total": self.plane.prompts.completed_count(),
            "duplicates_total": counts.get("duplicates", 0),
            "discarded_total": counts.get("discarded", 0),
            "refused_total": counts.get("refused", 0),
            "created_total": counts.get("created", 0),
        }
