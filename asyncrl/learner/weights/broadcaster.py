"""The weight broadcaster: after a step, new weights to every live rollout actor.

Membership is the set of actors whose heartbeat says they are up (not ``starting`` or ``draining``). When it changes,
the group is re-formed under a new epoch at the next sync. A formation or broadcast that misses
``weight_sync.timeout_s`` raises inside :class:`WeightGroup`; the actors that never announced themselves for the epoch
are evicted (left out of the next ``EVICT_SYNCS`` formations) and the run goes on — nobody waits on a hung actor for
longer than the timeout, and a failed sync is never announced as done: the version is only bumped after a broadcast that
every member completed. A member that is gone (its heartbeat expired, e.g. after ``kill -9``, or it left) is not waited
for at all: while the group forms, the learner's rendezvous store looks at the registry every :data:`MEMBER_POLL_S` and
ends the wait as soon as one is (:class:`MemberWatch`), so the formation fails about a heartbeat TTL after the death,
not at the timeout. A formation that failed is marked given up (:func:`asyncrl.common.weights.group.abandon_formation`):
the members that came stop waiting in its rendezvous at once, and join the next one, instead of waiting there for the
time limit.

The broadcaster is the only owner of the transfer in flight and of the version the actors are told:

- :meth:`Broadcaster.publish` is a step's broadcast. It copies the weights into flat buckets and publishes the
  manifest on the caller's thread (a memcpy of the model), then hands the transfer to a background thread. With
  overlap (``weight_sync.overlap`` and ``max_staleness`` ≥ 1) it returns at once and the learner computes its next
  step while the copy is on the wire; the transfer is finished at the start of the next broadcast. Synchronous
  (``max_staleness = 0``: the next batch must come from these weights) it waits.
- :meth:`Broadcaster.finish` waits for the transfer in flight, then publishes its version (the ``version`` key the
  actors generate against): a failed sync is never announced as done.
- :meth:`Broadcaster.welcome` re-sends the current weights when an actor joins while the learner waits for data,
  and :meth:`Broadcaster.resend` after a resume.

One transfer at a time: a new one waits for the previous one before it touches the group.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import timedelta

import torch

from asyncrl.common.config import RunConfig, broadcast_overlaps
from asyncrl.common.observability.logs import get_logger
from asyncrl.common.plane.audit import Audit
from asyncrl.common.plane.control import ControlPlane
from asyncrl.common.plane.outage import settling
from asyncrl.common.weights.group import (
    GroupAddress,
    WeightGroup,
    WeightSyncError,
    abandon_formation,
    absent_ranks,
    group_backend,
    pack_bucket,
    plan_buckets,
    seal_buckets,
)
from asyncrl.common.weights.rendezvous import RedisStore
from asyncrl.common.wire.messages import WeightManifest, WireError

log = get_logger("broadcaster")
EVICT_SYNCS = 5
MEMBER_POLL_S = 0.5
"""How often a rendezvous wait looks at the registry for members that are gone."""
_JOINABLE = ("starting", "draining")


class MemberGone(TimeoutError):
    """A member of the formation the learner waits for is gone from the registry: waiting longer is pointless."""


class MemberWatch(RedisStore):
    """The learner's rendezvous store: a blocking wait also ends, raising :class:`MemberGone`, once ``gone()`` names
    a member (looked at every :data:`MEMBER_POLL_S`); the process group turns it into a failed formation."""

    def __init__(self, client, run: str, timeout_s: float, gone: Callable[[], Sequence[str]]) -> None:
        super().__init__(client, run, timeout_s)
        self.gone = gone

    def wait(self, keys: Sequence[str], timeout: timedelta | None = None) -> None:
        limit = self.timeout_s if timeout is None else timeout.total_seconds()
        deadline = time.monotonic() + limit
        while True:
            remaining = max(deadline - time.monotonic(), 0.0)
            try:
                return super().wait(keys, timedelta(seconds=min(MEMBER_POLL_S, remaining)))
            except TimeoutError:
                if remaining <= MEMBER_POLL_S:
                    raise TimeoutError(f"rendezvous keys {list(keys)} not set within {limit:g}s") from None
            if gone := self.gone():
                raise MemberGone(f"members {', '.join(gone)} are gone (heartbeat expired or left): not waited for")


class Broadcaster:
    def __init__(self, config: RunConfig, plane: ControlPlane, audit: Audit | None = None) -> None:
        self.config = config
        self.plane = plane
        self.audit = audit  # records each version sent, with its digest and members (common/plane/audit.py)
        # The rendezvous lives in the run's Redis: nothing listens for it, and only the run's processes can join.
        self.store = MemberWatch(plane.client, config.run.name, config.weight_sync.timeout_s, self._members_gone)
        self.backend = group_backend()
        # A restarted learner goes on from the last published manifest: a reused epoch would look to the actors
        # like the formation they already joined (of the dead learner), so they would not join this one.
        previous = _previous_manifest(plane)
        self.epoch = previous.group_epoch if previous else 0
        # Restore generation stamped on every manifest (the learner bumps it when it resumes from a checkpoint).
        self.restore = previous.restore if previous else 0
        # The version of the last manifest a previous learner of this run published (actors may hold it).
        self.newest_version = previous.version if previous else 0
        self.members: list[str] = []
        self.member_ranks: list[int] = []  # weight-group ranks of each member (its engine's workers)
        self.manifest: WeightManifest | None = None  # the last one published
        self._position = 0  # of the next broadcast in the last manifest's formation
        self.group: WeightGroup | None = None
        self.evicted: dict[str, int] = {}  # actor id -> syncs left out
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="weight-sync")
        self.overlap = broadcast_overlaps(config)
        self._in_flight: tuple[int, Future[dict[str, float]]] | None = None  # (version, its transfer)
        self._early: dict[str, float] = {}  # figures of a transfer finished before its step's broadcast

    def live_actors(self) -> list[str]:
        return sorted(self._live_ranks())

    def _live_ranks(self) -> dict[str, int]:
        """Live actors that can join → the weight-group ranks each takes (from its heartbeat)."""
        live, _ = self.plane.registry.processes()
        return {h.process_id: h.weight_ranks for h in live if h.kind == "actor" and h.state not in _JOINABLE}

    def _members_gone(self) -> list[str]:
        """Members of the current formation whose heartbeat is gone (none while Redis has just come back: a heartbeat
        that expired while it was down is being renewed)."""
        if not self.members or settling(self.plane.client, self.config.transport.heartbeat_ttl_s):
            return []
        live = {h.process_id for h in self.plane.registry.processes()[0]}
        return [member for member in self.members if member not in live]

    def has_newcomers(self) -> bool:
        """A live actor that is neither in the current group nor evicted: it holds no recent weights yet."""
        return any(a not in self.members and a not in self.evicted for a in self.live_actors())

    def publish(self, version: int, params: Callable[[], Mapping[str, torch.Tensor]]) -> dict[str, float]:
        """A step's broadcast of ``version``; returns the figures of the transfer that finished during this call.

        With overlap the figures are of the previous version's transfer (``version`` says which) and ``wait_s``
        is the time spent waiting for it — the part of the broadcast that overlap did not hide. Every
        ``weight_sync.sync_every``-th version is sent; the others report ``skipped``.
        """
        figures = self._early | self.finish()
        self._early = {}
        if version % self.config.weight_sync.sync_every:
            return figures | {"skipped": 1.0}
        self._start(version, params)
        return figures if self.overlap else self.finish()

    def welcome(self, version: int, params: Callable[[], Mapping[str, torch.Tensor]]) -> None:
        """An actor that joins while the learner waits for a batch gets ``version`` now rather than after the next
        step: it generates nothing until it holds weights within the staleness bound, and the next step may be
        waiting for exactly its groups. Nothing happens at version 0 (every actor starts from it) or while a
        transfer is still on the wire."""
        if version == 0 or (self._in_flight is not None and not self._in_flight[1].done()):
            return
        if not self.has_newcomers():
            return
        self._early = self.finish()
        log.info("re-sending the current weights to actors that joined", version=version)
        self._start(version, params)

    def resend(self, version: int, params: Callable[[], Mapping[str, torch.Tensor]]) -> None:
        """Send ``version`` now (after a resume, actors hold weights of the discarded steps, or none)."""
        self._start(version, params)

    def finish(self) -> dict[str, float]:
        """Wait for the transfer in flight, if any, then publish its version as the actors' current one — unless the
        transfer failed: the ``version`` key is the newest weights the actors were sent (``common/staleness.py``),
        and an actor judged against weights it never received would stop sampling for a version that never comes.
        The next sync that completes publishes the newest version."""
        if self._in_flight is None:
            return {}
        version, pending = self._in_flight
        waited = time.perf_counter()
        figures = pending.result()
        self._in_flight = None
        if figures.get("failed"):  # the transfer already said no version is coming (_transfer)
            published = self.plane.run.version()
            log.warning("weight version not published: its sync failed", version=version, published=published)
        else:
            self.plane.run.set_version(version)
        return figures | {"version": float(version), "wait_s": time.perf_counter() - waited}

    def _start(self, version: int, params_of: Callable[[], Mapping[str, torch.Tensor]]) -> None:
        """Snapshot ``params``, then seal, publish ``version``'s manifest and send in the background.

        When this returns, ``params`` may change (the next optimizer step): the buckets are copies. Hashing them
        (``weight_sync.digests``) happens on the background thread too, so with overlap it hides behind the next
        step like the transfer. The transfer's result is its figures; it never raises — a failed transfer evicts
        the actors that did not come and reports ``failed = 1``.
        """
        if self._in_flight is not None:
            self._in_flight[1].result()
        start = time.perf_counter()
        self._update_membership()
        params = dict(params_of())  # its only holder: packing lets each parameter go (see _pack)
        buckets = plan_buckets(params, int(self.config.weight_sync.bucket_mb * 2**20))
        flats = self._pack(buckets, params) if self.members else []
        unsealed = WeightManifest(
            version=version,
            world_size=1 + sum(self.member_ranks),
            members=list(self.members),
            member_ranks=list(self.member_ranks),
            buckets=buckets,
            group_epoch=self.epoch,
            restore=self.restore,
        )
        figures = {"members": float(len(self.members)), "bytes": 0.0, "self_check_s": 0.0}
        figures["snapshot_s"] = time.perf_counter() - start
        # Before the next step releases groups at this version: their actors generate them with these weights.
        self.plane.run.set_sending(version)
        self._in_flight = (version, self._pool.submit(self._transfer, unsealed, flats, figures, start))

    def _pack(self, buckets: list, params: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        """The buckets' flat copies. Each parameter is let go once packed: under ZeRO-3 ``params`` are rank 0's
        gathered CPU copies and nothing else holds them, so the model is never whole twice on the host (gathered
        and packed); under ZeRO 0–2 they are views of the live weights and letting go costs nothing."""
        device = "cuda" if self.backend == "nccl" else "cpu"
        flats = []
        for bucket in buckets:
            flats.append(pack_bucket(bucket, params, device))
            for name in bucket.names:
                del params[name]
        return flats

    def _announce(self, manifest: WeightManifest, flats: list[torch.Tensor]) -> float:
        """Seal the manifest's buckets (each member verifies every one before it loads any: ``common/weights/group.py``)
        and publish it; returns the seconds spent hashing."""
        hashing = time.perf_counter()
        if flats and self.config.weight_sync.digests:
            buckets, digest = seal_buckets(manifest.buckets, flats)
            manifest = dataclasses.replace(manifest, buckets=buckets, digest=digest)
        hashed = time.perf_counter() - hashing
        last = self.manifest
        if last is None or last.group_epoch != manifest.group_epoch:
            self._position = 0
        self.plane.run.publish_manifest(manifest, self._position)
        self._position += 1
        self.manifest = manifest
        if self.audit is not None and manifest.members:
            self.audit.record(
                "weights.published",
                version=manifest.version,
                digest=manifest.digest,
                epoch=manifest.group_epoch,
                members=manifest.members,
            )
        return hashed

    def close(self) -> None:
        """Wait for the transfer in flight, then stop the background thread (its version is not published)."""
        if self._in_flight is not None:
            self._in_flight[1].result()
        self._pool.shutdown(wait=True)

    def _transfer(
        self, manifest: WeightManifest, flats: list[torch.Tensor], figures: dict[str, float], start: float
    ) -> dict[str, float]:
        figures["digest_s"] = self._announce(manifest, flats)
        if self.members:
            try:
                figures.update(self._send(flats))
            except WeightSyncError as exc:
                evicted = self._evict_absent(exc)
                figures["failed"] = 1.0
                if self.audit is not None:  # the trail says what metrics.jsonl may never get to (a stop right after)
                    self.audit.record("weights.failed", version=manifest.version, epoch=manifest.group_epoch,
                                      evicted=evicted)  # fmt: skip
                # at once, not at the next step's publish: actors waiting for this version sample with what they hold
                self.plane.run.set_sending(self.plane.run.version())
        figures["seconds"] = time.perf_counter() - start
        return figures

    def _update_membership(self) -> None:
        self.evicted = {a: n - 1 for a, n in self.evicted.items() if n > 1}
        ranks = {a: n for a, n in sorted(self._live_ranks().items()) if a not in self.evicted}
        members = list(ranks)
        if members != self.members or list(ranks.values()) != self.member_ranks or self.group is None:
            self.epoch += 1
            self.members, self.member_ranks = members, list(ranks.values())
            self.group = None
            if members:
                log.info("weight group re-formed", epoch=self.epoch, members=",".join(members))

    def _send(self, flats: list[torch.Tensor]) -> dict[str, float]:
        figures = {}
        if self.group is None:
            address = GroupAddress(
                "",  # rank 0 uses self.store, the learner's own connection
                self.config.run.name,
                self.epoch,
                0,
                1 + sum(self.member_ranks),
                self.config.weight_sync.timeout_s,
                self.backend,
            )
            self.group = WeightGroup(address, self.store)
            figures["self_check_s"] = self.group.self_check()
            log.info("weight group self-check passed", epoch=self.epoch, seconds=round(figures["self_check_s"], 4))
        figures["bytes"] = float(self.group.send_packed(flats))
        return figures

    def _evict_absent(self, exc: WeightSyncError) -> list[str]:
        """Evict the members that did not come to the failed transfer (for the next ``EVICT_SYNCS`` syncs), abandon its
        formation, and return them."""
        formation = self.manifest  # the last published: the formation that failed
        assert formation is not None  # _transfer published it before it sent
        absent = sorted({formation.owner_of(r) for r in absent_ranks(self.store, self.epoch, formation.world_size)})
        suspects = absent or list(self.members)  # all came but one hung mid-broadcast: retry them all later
        for actor in absent:
            self.evicted[actor] = EVICT_SYNCS
        abandon_formation(self.store, self.epoch)  # members still in its rendezvous stop waiting for the others
        log.error(
            "weight sync failed; the run goes on without these actors",
            epoch=self.epoch,
            evicted=",".join(absent) or "none",
            suspects=",".join(suspects),
            error=str(exc),
            action="check the actors' logs; they rejoin at a later sync once healthy",
        )
        self.group = None
        self.members, self.member_ranks = [], []
        return absent


def _previous_manifest(plane: ControlPlane) -> WeightManifest | None:
    """The run's last published manifest, or None (none yet, or unreadable: then epochs start again at 1)."""
    try:
        current = plane.run.read_manifest()
    except WireError as exc:
        log.warning("ignored an unreadable weight manifest", field=exc.field, reason=exc.reason)
        return None
    return current[0] if current else None
