"""The weight broadcaster: after a step, new weights to every live rollout actor.

Membership is the set of actors whose heartbeat says they are up (not ``starting`` or
``draining``). When it changes, the group is re-formed under a new epoch at the next sync. A
formation or broadcast that misses ``weight_sync.timeout_s`` raises inside :class:`WeightGroup`;
the actors that never announced themselves for the epoch are evicted (left out of the next
``EVICT_SYNCS`` formations) and the run goes on — nobody waits on a hung actor for longer than
the timeout, and a failed sync is never announced as done: the version is only bumped after a
broadcast that every member completed.

Overlap: :meth:`Broadcaster.start` copies the weights into flat buckets and publishes the manifest on
the caller's thread (a memcpy of the model), then hands the transfer to a background thread and
returns a future, so the learner computes its next step while the copy is on the wire. One transfer
at a time: ``start`` waits for the previous one before it touches the group.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from common.config import RunConfig
from common.control import ControlPlane
from common.logs import get_logger
from common.rendezvous import RedisStore
from common.weights import (
    GroupAddress,
    WeightGroup,
    WeightSyncError,
    absent_ranks,
    pack_bucket,
    plan_buckets,
)
from common.wire import WeightManifest, WireError

log = get_logger("broadcaster")
EVICT_SYNCS = 5
_JOINABLE = ("starting", "draining")


class Broadcaster:
    def __init__(self, config: RunConfig, plane: ControlPlane) -> None:
        self.config = config
        self.plane = plane
        # The rendezvous lives in the run's Redis: nothing listens for it, and only the run's processes can join.
        self.store = RedisStore(plane.client, config.run.name, config.weight_sync.timeout_s)
        self.backend = "nccl" if torch.cuda.is_available() else "gloo"
        # A restarted learner goes on from the last published manifest: a reused epoch would look to the actors
        # like the formation they already joined (of the dead learner), so they would not join this one.
        previous = _previous_manifest(plane)
        self.epoch = previous.group_epoch if previous else 0
        self.restore = previous.restore if previous else 0
        self.newest_version = previous.version if previous else 0
        """The version of the last manifest a previous learner of this run published (actors may hold it)."""
        """Restore generation stamped on every manifest (the learner bumps it when it resumes from a checkpoint)."""
        self.members: list[str] = []
        self.group: WeightGroup | None = None
        self.evicted: dict[str, int] = {}  # actor id -> syncs left out
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="weight-sync")
        self._pending: Future[dict[str, float]] | None = None

    def live_actors(self) -> list[str]:
        live, _ = self.plane.processes()
        return sorted(h.process_id for h in live if h.kind == "actor" and h.state not in _JOINABLE)

    def has_newcomers(self) -> bool:
        """A live actor that is neither in the current group nor evicted: it holds no recent weights yet."""
        return any(a not in self.members and a not in self.evicted for a in self.live_actors())

    def start(self, version: int, params: Mapping[str, torch.Tensor]) -> Future[dict[str, float]]:
        """Snapshot ``params``, publish ``version``'s manifest, and send in the background.

        When this returns, ``params`` may change (the next optimizer step): the buckets are copies. The
        future's result is the figures of the transfer; it never raises — a failed transfer evicts the
        actors that did not come and reports ``failed = 1``.
        """
        if self._pending is not None:
            self._pending.result()
        start = time.perf_counter()
        self._update_membership()
        buckets = plan_buckets(params, int(self.config.weight_sync.bucket_mb * 2**20))
        device = "cuda" if self.backend == "nccl" else "cpu"
        flats = [pack_bucket(bucket, params, device) for bucket in buckets] if self.members else []
        manifest = WeightManifest(
            version=version,
            world_size=len(self.members) + 1,
            members=list(self.members),
            buckets=buckets,
            group_epoch=self.epoch,
            restore=self.restore,
        )
        self.plane.publish_manifest(manifest)
        figures = {"members": float(len(self.members)), "bytes": 0.0, "self_check_s": 0.0}
        figures["snapshot_s"] = time.perf_counter() - start
        self._pending = self._pool.submit(self._transfer, flats, figures, start)
        return self._pending

    def close(self) -> None:
        """Wait for the transfer in flight, then stop the background thread."""
        if self._pending is not None:
            self._pending.result()
        self._pool.shutdown(wait=True)

    def _transfer(self, flats: list[torch.Tensor], figures: dict[str, float], start: float) -> dict[str, float]:
        if self.members:
            try:
                figures.update(self._send(flats))
            except WeightSyncError as exc:
                self._evict_absent(exc)
                figures["failed"] = 1.0
        figures["seconds"] = time.perf_counter() - start
        return figures

    def _update_membership(self) -> None:
        self.evicted = {a: n - 1 for a, n in self.evicted.items() if n > 1}
        members = [a for a in self.live_actors() if a not in self.evicted]
        if members != self.members or self.group is None:
            self.epoch += 1
            self.members = members
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
                len(self.members) + 1,
                self.config.weight_sync.timeout_s,
                self.backend,
            )
            self.group = WeightGroup(address, self.store)
            figures["self_check_s"] = self.group.self_check()
            log.info("weight group self-check passed", epoch=self.epoch, seconds=round(figures["self_check_s"], 4))
        figures["bytes"] = float(self.group.send_packed(flats))
        return figures

    def _evict_absent(self, exc: WeightSyncError) -> None:
        absent = [self.members[r - 1] for r in absent_ranks(self.store, self.epoch, len(self.members) + 1)]
        suspects = absent or list(self.members)  # all came but one hung mid-broadcast: retry them all later
        for actor in absent:
            self.evicted[actor] = EVICT_SYNCS
        log.error(
            "weight sync failed; the run goes on without these actors",
            epoch=self.epoch,
            evicted=",".join(absent) or "none",
            suspects=",".join(suspects),
            error=str(exc),
            action="check the actors' logs; they rejoin at a later sync once healthy",
        )
        self.group = None
        self.members = []


def _previous_manifest(plane: ControlPlane) -> WeightManifest | None:
    """The run's last published manifest, or None (none yet, or unreadable: then epochs start again at 1)."""
    try:
        current = plane.read_manifest()
    except WireError as exc:
        log.warning("ignored an unreadable weight manifest", field=exc.field, reason=exc.reason)
        return None
    return current[0] if current else None
