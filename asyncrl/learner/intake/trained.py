"""Which step trained each prompt group, and the replay acknowledgements held back until a checkpoint covers them.

Two Redis hashes under the run's namespace (beside :class:`asyncrl.common.plane.control.RunKeys`):

- ``trained``: group id → the step whose update used it. Kept for the whole run: it is the audit that every group
  was trained exactly once in the surviving history (each step has exactly ``groups_per_step`` ids; a group trained
  twice would leave its first step one short). A resume removes the ids of the steps it takes back.
- ``unacked``: replay entry id → ``[step, group id]`` of entries trained but not yet acknowledged. With periodic
  checkpoints (``checkpoint.every > 0``) an entry is acknowledged only once a checkpoint holds the update that used
  it (:meth:`TrainedLog.commit`), so a learner killed after the checkpoint still finds the later steps' groups in
  its pending list and trains them again from the restored weights (:meth:`TrainedLog.rewind`). Without periodic
  checkpoints there is nothing to go back to and entries are acknowledged at once, as before.

Crash safety: :meth:`TrainedLog.record` writes a step's ``trained`` and ``unacked`` entries (and the acks of what it
dropped) in one transaction, so a step is either recorded whole or not at all. :meth:`TrainedLog.commit` runs after
the checkpoint folder is renamed into place; a crash between the two leaves entries the checkpoint already holds in
``unacked`` — :meth:`TrainedLog.rewind` acknowledges those (step ≤ the checkpoint's) instead of training them again.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from asyncrl.common.observability.logs import get_logger
from asyncrl.common.plane import replies
from asyncrl.common.plane.control import ControlPlane
from asyncrl.common.plane.prompt_ledger import add_counts
from asyncrl.common.plane.replay import ReplayEntry, ReplayReader

log = get_logger("trained")


@dataclass(frozen=True)
class Rewind:
    """What going back to a checkpoint of ``step`` did to the run's Redis state."""

    step: int
    committed: int = 0
    """Entries acknowledged now: trained at or before ``step``, so the checkpoint holds them (crash before commit)."""
    retrain: dict[str, str] = field(default_factory=dict)
    """Group id → replay entry id of groups trained after ``step`` whose entries are still pending: trained again."""
    lost: list[str] = field(default_factory=list)
    """Groups trained after ``step`` whose entries were already acknowledged (resuming from an older checkpoint
    than the latest): they cannot be trained again, so they count as lost and admission releases replacements."""


class TrainedLog:
    """The ``trained`` and ``unacked`` hashes of one run, and the acknowledgements of its replay stream."""

    def __init__(self, plane: ControlPlane, reader: ReplayReader, defer_acks: bool) -> None:
        self.plane = plane
        self.reader = reader
        self.defer_acks = defer_acks
        self.trained_key = plane.keys.trained
        self.unacked_key = plane.keys.unacked

    def record(self, step: int, entries: Sequence[ReplayEntry], dropped: Sequence[str]) -> None:
        """After ``step``'s update: which groups it trained; acknowledge ``dropped`` entries (and, without deferred
        acknowledgements, the trained ones). One transaction."""
        pipe = self.plane.client.pipeline(transaction=True)
        if entries:
            pipe.hset(self.trained_key, mapping={e.group.rollout.group_id: step for e in entries})
        if self.defer_acks and entries:
            pipe.hset(
                self.unacked_key, mapping={e.entry_id: json.dumps([step, e.group.rollout.group_id]) for e in entries}
            )
        acks = list(dropped) + ([] if self.defer_acks else [e.entry_id for e in entries])
        if acks:
            pipe.xack(self.plane.keys.replay, self.reader.group, *acks)
        pipe.execute()

    def commit(self, step: int) -> int:
        """A checkpoint of ``step`` is on disk: acknowledge the entries it covers. Returns how many."""
        covered = [entry for entry, (trained_at, _) in self._unacked().items() if trained_at <= step]
        self._ack_and_forget(covered)
        return len(covered)

    def rewind(self, step: int) -> Rewind:
        """Take the run back to a checkpoint of ``step``: groups trained after it become untrained again.

        Their entries still pending are trained again (their ids leave the ``done`` set, so they are not taken for
        duplicates); entries acknowledged by a later checkpoint are gone, so their groups are counted lost
        (``restore_lost``) and ``released`` drops by as many, making admission release replacements.
        """
        unacked = self._unacked()
        covered = [entry for entry, (trained_at, _) in unacked.items() if trained_at <= step]
        retrain = {group: entry for entry, (trained_at, group) in unacked.items() if trained_at > step}
        later = [group for group, trained_at in self._trained_items() if trained_at > step]
        lost = [group for group in later if group not in retrain]
        pipe = self.plane.client.pipeline(transaction=True)
        if covered:
            pipe.xack(self.plane.keys.replay, self.reader.group, *covered)
        if covered or retrain:
            pipe.hdel(self.unacked_key, *covered, *retrain.values())  # retrained entries are recorded again
        if later:
            pipe.hdel(self.trained_key, *later)
        if retrain:
            pipe.srem(self.plane.keys.done, *retrain)
        self._count(pipe, {"restore_retrained": len(retrain), "restore_lost": len(lost), "released": -len(lost)})
        pipe.execute()
        return Rewind(step, len(covered), retrain, lost)

    def forget_missing(self, groups: Iterable[str]) -> int:
        """Groups to train again whose entries the stream no longer has (trimmed by ``MAXLEN``): count them lost
        and let admission release replacements. Returns how many."""
        missing = list(groups)
        if missing:
            pipe = self.plane.client.pipeline(transaction=True)
            self._count(pipe, {"restore_lost": len(missing), "released": -len(missing)})
            pipe.sadd(self.plane.keys.done, *missing)  # a late twin is a duplicate, not a new group
            pipe.execute()
            log.warning(
                "groups to train again were trimmed from the replay stream; counted lost, replacements released",
                count=len(missing),
                action="raise transport.replay_maxlen above checkpoint.every × learner.groups_per_step",
            )
        return len(missing)

    def trained_steps(self) -> dict[str, int]:
        """Group id → step of every group trained in the run's surviving history (for audits and tests)."""
        return dict(self._trained_items())

    def _count(self, pipe, counts: dict[str, int]) -> None:
        add_counts(pipe, self.plane.keys, {name: delta for name, delta in counts.items() if delta})

    def _ack_and_forget(self, entries: list[str]) -> None:
        if not entries:
            return
        pipe = self.plane.client.pipeline(transaction=True)
        pipe.xack(self.plane.keys.replay, self.reader.group, *entries)
        pipe.hdel(self.unacked_key, *entries)
        pipe.execute()

    def _unacked(self) -> dict[str, tuple[int, str]]:
        raw = replies.blob_map(self.plane.client.hgetall(self.unacked_key))
        out = {}
        for entry, value in raw.items():
            trained_at, group = json.loads(value)
            out[entry.decode()] = (int(trained_at), str(group))
        return out

    def _trained_items(self) -> Iterable[tuple[str, int]]:
        for group, trained_at in self.plane.client.hscan_iter(self.trained_key, count=1000):
            yield group.decode(), int(trained_at)


def replay_position(reader: ReplayReader) -> dict[str, object]:
    """The learner's consumer group in the replay stream: last-delivered id, entries pending, stream length."""
    client, key = reader.client, reader.keys.replay
    for info in client.xinfo_groups(key):
        name = info.get("name")
        if (name.decode() if isinstance(name, bytes) else name) == reader.group:
            last = info.get("last-delivered-id")
            return {
                "last_delivered_id": last.decode() if isinstance(last, bytes) else str(last),
                "pending": int(info.get("pending", 0)),
                "length": int(client.xlen(key)),
            }
    return {"length": int(client.xlen(key))}
