"""Prompt groups in Redis: the queue actors take from, the in-flight ledger, and the dispatcher's records.

Delivery semantics of the queue (a list): FIFO; ``take_prompts`` pops atomically, so each group goes to one actor.
A group that an actor gives back (SIGTERM) goes to the *front*. A group popped by an actor that then dies is not in
the queue any more: the in-flight ledger (issue time, actor) is what lets the dispatcher find and re-issue it.

Eval groups (``purpose = "eval"``, ``common/data/evaluation.py``) have a queue of their own, ``eval_prompts``, which
``take_prompts`` pops first: they overtake every training group. They have an issue record but no ledger entry.

Keys (:class:`asyncrl.common.plane.control.RunKeys`): ``prompts`` (the queue), ``inflight`` (ledger: group id → JSON
:class:`LedgerEntry`), ``groups`` (the issue record of every group in flight: its encoded
:class:`~asyncrl.common.wire.messages.PromptGroup`), ``dispatch`` (the dispatcher's counters, each change applied
exactly once by :func:`add_counts` under a one-time token ``once:<token>``), ``done`` (ids of completed groups).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from asyncrl.common.observability.logs import get_logger
from asyncrl.common.plane import replies
from asyncrl.common.plane.dead_letters import dead_letter
from asyncrl.common.wire.messages import Decoder, Limits, PromptGroup, WireError, decode_blob, encode_blob

if TYPE_CHECKING:
    import redis
    import redis.client
    from redis.typing import EncodableT, FieldT

    from asyncrl.common.plane.keys import RunKeys

log = get_logger("control")
REFUSED_KEPT = 100_000
"""Refused group ids kept for the dispatcher at most (it takes them every poll; a learner down for long drops the
oldest, which their deadline still retires)."""


@dataclass(frozen=True)
class LedgerEntry:
    """Where one issued prompt group is: when and at which version it was issued, and by whom it is held.

    Holders (process ids; "" for none) and when they change (:class:`PromptLedger`)::

        taken by actor A            actor = A                 take_prompt
        pushed by A to worker W     actor = A, scorer = W     pushed (only while A still holds it)
        received by W               actor = "", scorer = W    received
        written to the replay       actor = "", scorer = ""   stored (only the deadline applies from then on)

    The dispatcher re-issues a group as soon as either holder's heartbeat is gone: a group queued in A's socket dies
    with A, one queued in W's socket or in W's hands dies with W.
    """

    issued_at: float
    version: int
    actor: str = ""
    attempts: int = 1
    scorer: str = ""
    """The reward worker the group was pushed to, until it is in the replay stream."""


@dataclass(frozen=True)
class Standing:
    """What the learner needs to know of an arriving group's id: trained before, and what was issued under it."""

    completed: bool
    issued: PromptGroup | None
    """The issue record while the group is in flight; None once completed or lost (or when never issued)."""


class PromptLedger:
    """Prompt queue, in-flight ledger, issue records and dispatcher counters (``plane.prompts``)."""

    def __init__(self, client: redis.Redis, keys: RunKeys, limits: Limits | None = None) -> None:
        self.client = client
        self.keys = keys
        self._prompt_decoder = Decoder(PromptGroup, limits)

    def push_prompts(self, groups: Iterable[PromptGroup]) -> int:
        blobs = [encode_blob(g) for g in groups]
        return self.client.lpush(self.keys.prompts, *blobs) if blobs else self.queue_depth()

    def take_prompt(self, actor: str, timeout_s: float = 1.0) -> PromptGroup | None:
        """Pop the oldest prompt group (blocking up to ``timeout_s``) and record ``actor`` as its holder."""
        taken = self.take_prompts(actor, 1, timeout_s)
        return taken[0] if taken else None

    def take_prompts(self, actor: str, limit: int, timeout_s: float = 1.0) -> list[PromptGroup]:
        """Up to ``limit`` prompt groups, oldest first, each recorded as held by ``actor``: blocks up to ``timeout_s``
        for the first, then takes what else is queued in one atomic call, so that groups released together start
        generating together instead of one Redis round trip apart.

        Eval groups first: BRPOP pops the first non-empty list of those it is given, in order, and the rest are
        taken from the eval queue before the training queue. A malformed group is dead-lettered and skipped."""
        queues = [self.keys.eval_prompts, self.keys.prompts]
        item = self.client.brpop(queues, timeout=timeout_s)
        if item is None:
            return []
        blobs = [replies.blob(item[1])]
        if limit > 1:
            blobs += self.client.eval(_POP_UP_TO, len(queues), *queues, limit - 1)
        taken = []
        for blob in blobs:
            try:
                group = decode_blob(self._prompt_decoder, blob)
            except WireError as exc:
                log.warning("dead-lettered a malformed prompt group", field=exc.field, reason=exc.reason)
                dead_letter(self.client, self.keys, "prompts", str(exc), blob)
                continue
            self._update_ledger(group.group_id, actor=actor, scorer="")
            taken.append(group)
        return taken

    def return_prompts(self, groups: Iterable[PromptGroup]) -> None:
        """Give unfinished groups back; they are taken next (front of the queue)."""
        for group in groups:
            self.client.rpush(self._queue_of(group), encode_blob(group))
            self._update_ledger(group.group_id, actor="", scorer="")

    def _queue_of(self, group: PromptGroup) -> str:
        return self.keys.eval_prompts if group.purpose == "eval" else self.keys.prompts

    def issue_eval(self, groups: Iterable[PromptGroup]) -> None:
        """Store eval groups' issue records (``groups``: what provenance checks) and queue them, in one transaction.

        No ledger entry and no counter: admission never counts them and the dispatcher never re-issues them (the
        learner's eval round has its own deadline, ``eval.deadline_s``)."""
        blobs: dict[FieldT, EncodableT] = {g.group_id: encode_blob(g) for g in groups}
        if not blobs:
            return
        pipe = self.client.pipeline(transaction=True)
        pipe.hset(self.keys.groups, mapping=blobs)
        pipe.lpush(self.keys.eval_prompts, *blobs.values())
        pipe.execute()

    def retire_eval(self, group_ids: Iterable[str]) -> None:
        """Forget eval groups (scored or given up): their issue records and queued copies (a late twin then fails
        provenance in the reward worker, or reaches a learner that no longer waits for it)."""
        ids = list(group_ids)
        if not ids:
            return
        queued = [b for b in replies.maybe_blobs(self.client.hmget(self.keys.groups, ids)) if b is not None]
        pipe = self.client.pipeline(transaction=True)
        pipe.hdel(self.keys.groups, *ids)
        for blob in queued:
            _unqueue(pipe, self.keys.eval_prompts, blob)
        pipe.execute()

    def queue_depth(self) -> int:
        return int(self.client.llen(self.keys.prompts))

    def record_issued(self, groups: Iterable[PromptGroup]) -> None:
        mapping: dict[FieldT, EncodableT] = {
            g.group_id: json.dumps(LedgerEntry(g.issued_at, g.issued_version).__dict__) for g in groups
        }
        if mapping:
            self.client.hset(self.keys.inflight, mapping=mapping)

    def note_refused(self, group_id: str) -> None:
        """A reward worker dead-lettered the group for good: the dispatcher retires it at its next look,
        instead of holding its slot until ``learner.group_deadline_s`` and re-issuing it to be refused again. The list
        keeps the newest :data:`REFUSED_KEPT` ids (a flood of refusals cannot grow it without bound)."""
        pipe = self.client.pipeline(transaction=True)
        pipe.rpush(self.keys.refused, group_id)
        pipe.ltrim(self.keys.refused, -REFUSED_KEPT, -1)
        pipe.execute()

    def take_refused(self, limit: int = REFUSED_KEPT) -> list[str]:
        """Up to ``limit`` refused ids, oldest first, removed from the list."""
        taken = replies.maybe_blobs(self.client.lpop(self.keys.refused, limit) or [])  # pyright: ignore[reportArgumentType]
        return [g.decode() for g in taken if g is not None]

    def note_fault(self, group_id: str) -> int:
        """An environment fault ended an episode of the group; how many times that has happened to it so far."""
        return int(self.client.hincrby(self.keys.faults, group_id, 1))

    def pushed(self, group_id: str, actor: str, worker: str) -> bool:
        """``actor`` pushed the group to reward ``worker``: both hold it now (:class:`LedgerEntry`). Nothing changes
        when ``actor`` no longer holds it (``worker`` already received it, or it was re-issued meanwhile)."""
        return self._update_ledger(group_id, held_by=actor, scorer=worker)

    def received(self, group_id: str, worker: str) -> bool:
        """Reward ``worker`` took the group off its socket: it alone holds it (the actor's exit no longer matters)."""
        return self._update_ledger(group_id, actor="", scorer=worker)

    def stored(self, group_ids: Iterable[str]) -> int:
        """The groups are in the replay stream: no process holds them (a scorer's later exit re-issues none of them;
        only their deadline applies). Returns how many ledger entries changed.

        Two round trips for a whole batch (it runs on the reward worker's write path): one read, then one
        compare-and-set per held entry, pipelined. An entry that changed in between (re-issued to a new holder) is
        left as it is."""
        ids = list(group_ids)
        if not ids:
            return 0
        pipe = self.client.pipeline(transaction=False)
        for group_id, raw in zip(ids, self.client.hmget(self.keys.inflight, ids), strict=True):
            if raw is None:
                continue
            entry = json.loads(raw)
            if entry.get("actor") or entry.get("scorer"):
                cleared = json.dumps({**entry, "actor": "", "scorer": ""})
                pipe.eval(_COMPARE_AND_SET, 1, self.keys.inflight, group_id, raw, cleared)
        return sum(int(reply) == 1 for reply in pipe.execute()) if len(pipe) else 0

    def _update_ledger(self, group_id: str, held_by: str | None = None, **changes: Any) -> bool:
        """Change a ledger entry's fields, atomically: compare-and-set, so that a concurrent retirement is never undone
        (a read-modify-write would write the entry of a group the learner just completed back into the ledger)."""
        for _ in range(_CAS_TRIES):
            raw = self.client.hget(self.keys.inflight, group_id)
            if raw is None:
                return False  # no longer in flight, or issued by someone who keeps no ledger (a test or a tool)
            entry = json.loads(raw)
            if held_by is not None and entry.get("actor", "") != held_by:
                return False
            updated = json.dumps({**entry, **changes})
            swapped = int(self.client.eval(_COMPARE_AND_SET, 1, self.keys.inflight, group_id, raw, updated))
            if swapped >= 0:
                return swapped == 1
        log.warning("gave up changing a ledger entry that kept changing", group=group_id, changes=changes)
        return False

    def complete(self, group_ids: Iterable[str]) -> None:
        ids = list(group_ids)
        if ids:
            self.client.hdel(self.keys.inflight, *ids)

    def ledger(self) -> dict[str, LedgerEntry]:
        entries = replies.blob_map(self.client.hgetall(self.keys.inflight))
        return {k.decode(): LedgerEntry(**json.loads(v)) for k, v in entries.items()}

    def ledger_size(self) -> int:
        """Groups in the in-flight ledger (without reading them)."""
        return int(self.client.hlen(self.keys.inflight))

    def save_groups(self, groups: Iterable[PromptGroup], counts: Mapping[str, int]) -> None:
        """Store the payloads of issued groups and add ``counts`` to the dispatcher's counters, in one transaction.

        This is the dispatcher's commit point: a counter never claims a group whose payload is missing.
        """
        payloads: dict[FieldT, EncodableT] = {g.group_id: encode_blob(g) for g in groups}
        pipe = self.client.pipeline(transaction=True)
        if payloads:
            pipe.hset(self.keys.groups, mapping=payloads)
        add_counts(pipe, self.keys, counts)
        pipe.execute()

    def has_group(self, group_id: str) -> bool:
        """Whether an issued group's payload is stored (issued, neither completed nor lost)."""
        return bool(self.client.hexists(self.keys.groups, group_id))

    def load_group(self, group_id: str) -> PromptGroup | None:
        """The stored payload of an issued group; None when there is none (or it is unreadable: dead-lettered)."""
        return self._decode_stored(group_id, replies.maybe_blob(self.client.hget(self.keys.groups, group_id)))

    def lookup(self, group_ids: Iterable[str]) -> dict[str, Standing]:
        """Each group's :class:`Standing` (completed before? its issue record) in one round trip: ``SMISMEMBER``
        and ``HMGET`` pipelined, where :meth:`was_completed` and :meth:`load_group` take one each per group."""
        ids = list(dict.fromkeys(group_ids))
        if not ids:
            return {}
        pipe = self.client.pipeline(transaction=False)
        pipe.smismember(self.keys.done, ids)
        pipe.hmget(self.keys.groups, ids)
        done, blobs = pipe.execute()
        return {
            gid: Standing(bool(completed), self._decode_stored(gid, blob))
            for gid, completed, blob in zip(ids, done, blobs, strict=True)
        }

    def _decode_stored(self, group_id: str, blob: bytes | None) -> PromptGroup | None:
        if blob is None:
            return None
        try:
            return decode_blob(self._prompt_decoder, blob)
        except WireError as exc:
            log.warning("dead-lettered an unreadable stored prompt group", group=group_id, field=exc.field)
            dead_letter(self.client, self.keys, "groups", str(exc), blob)
            return None

    def replace_issued(self, group: PromptGroup, entry: LedgerEntry) -> int:
        """Give an issued group a new payload and ledger entry, removing its old copy from the queue.

        The old copy (if still queued) is removed so that re-issuing a group nobody has taken yet moves it
        instead of duplicating it. Returns how many queued copies were removed. Queue the new copy with
        :meth:`return_prompts` (front of the queue) afterwards.
        """
        old = replies.maybe_blob(self.client.hget(self.keys.groups, group.group_id))
        pipe = self.client.pipeline(transaction=True)
        pipe.hset(self.keys.groups, group.group_id, encode_blob(group))
        pipe.hset(self.keys.inflight, group.group_id, json.dumps(entry.__dict__))
        if old is not None:
            _unqueue(pipe, self.keys.prompts, old)
        results = pipe.execute()
        return int(results[2]) if old is not None else 0

    def retire_groups(
        self, group_ids: Iterable[str], counts: Mapping[str, int] | None = None, completed: bool = False
    ) -> int:
        """Remove groups from the ledger, the payload store and the queue in one transaction.

        ``completed`` also remembers their ids as done (:meth:`was_completed`); ``counts`` are added to the
        dispatcher's counters in the same transaction. Returns how many of them were in the ledger.
        """
        ids = list(group_ids)
        if not ids:
            return 0
        queued = [b for b in replies.maybe_blobs(self.client.hmget(self.keys.groups, ids)) if b is not None]
        pipe = self.client.pipeline(transaction=True)
        pipe.hdel(self.keys.inflight, *ids)
        pipe.hdel(self.keys.groups, *ids)
        pipe.hdel(self.keys.faults, *ids)
        for blob in queued:  # a re-issued copy nobody took yet would be wasted work
            _unqueue(pipe, self.keys.prompts, blob)
        if completed:
            pipe.sadd(self.keys.done, *ids)
        add_counts(pipe, self.keys, counts or {})
        return int(pipe.execute()[0])

    def was_completed(self, group_id: str) -> bool:
        return bool(self.client.sismember(self.keys.done, group_id))

    def completed_count(self) -> int:
        return int(self.client.scard(self.keys.done))

    def dispatch_counts(self) -> dict[str, int]:
        """The dispatcher's counters (a missing one is 0)."""
        return {k.decode(): int(v) for k, v in replies.blob_map(self.client.hgetall(self.keys.dispatch)).items()}

    def add_dispatch_counts(self, counts: Mapping[str, int]) -> None:
        pipe = self.client.pipeline(transaction=True)
        add_counts(pipe, self.keys, counts)
        pipe.execute()


_CAS_TRIES = 8
"""Attempts of a ledger entry's compare-and-set before giving up (each lost race is another writer's change)."""
_POP_UP_TO = """
local taken = {}
for _, key in ipairs(KEYS) do
  while #taken < tonumber(ARGV[1]) do
    local blob = redis.call('RPOP', key)
    if not blob then break end
    taken[#taken + 1] = blob
  end
end
return taken
"""
_COMPARE_AND_SET = """
local current = redis.call('HGET', KEYS[1], ARGV[1])
if not current then return 0 end
if current ~= ARGV[2] then return -1 end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[3])
return 1
"""
ONCE_TTL_S = 86_400
"""How long a counted transaction's one-time token is kept (a retry comes within ``transport.redis_outage_s``)."""
_ADD_ONCE = """
if redis.call('SET', KEYS[2], '1', 'NX', 'EX', ARGV[1]) then
  for i = 2, #ARGV, 2 do redis.call('HINCRBY', KEYS[1], ARGV[i], ARGV[i + 1]) end
end
return 0
"""


def _unqueue(pipe: redis.client.Pipeline, queue: str, blob: bytes) -> None:
    """Queue the removal of every copy of ``blob`` from ``queue`` (``LREM queue 0 blob``) in ``pipe``."""
    # redis-py annotates LREM's value as str, but sends any value it can encode, bytes as they are.
    pipe.lrem(queue, 0, blob)  # pyright: ignore[reportArgumentType]


def add_counts(pipe: redis.client.Pipeline, keys: RunKeys, counts: Mapping[str, int]) -> None:
    """Queue ``counts`` onto the dispatcher's counters (``dispatch``) in ``pipe``, to be added exactly once.

    A plain ``HINCRBY`` would add twice when the pipeline is sent again: redis-py retries it whole after a connection
    error, and when Redis ran and logged it just before it was killed (the reply lost), the retry runs it a second
    time — ``created`` would skip group ids and ``released`` would hold admission back. So the increments go in a
    script under a one-time token (``once:<token>``, kept :data:`ONCE_TTL_S`): the retry finds it and adds nothing.
    """
    if counts:
        args = [str(part) for name, delta in counts.items() for part in (name, int(delta))]
        pipe.eval(_ADD_ONCE, 2, keys.dispatch, keys.once(uuid.uuid4().hex), ONCE_TTL_S, *args)
