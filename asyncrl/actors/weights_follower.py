"""The actor's weights follower: it takes part in the learner's weight broadcasts and loads what they carry.

The learner announces each broadcast with a manifest (``common/wire/messages.py: WeightManifest``): its version, the
members of the weight-group formation it goes to, and its buckets' digests. The follower reads the manifests of its
formation in broadcast order (``RunRecord.formation_manifest``), joins a new formation when one lists this actor, and
for each broadcast pauses generation (mode ``keep``), receives the buckets, checks them against the manifest's digests
and loads them; later tokens carry the new version. Weights that do not match the digests are refused and the old ones
go on serving. A formation it could not join is given up: the learner re-forms the group at its next sync.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable

from asyncrl.common.config import RunConfig
from asyncrl.common.observability.logs import get_logger
from asyncrl.common.observability.metrics import ACTOR_WEIGHT_DIGEST_MISMATCHES
from asyncrl.common.plane.audit import Audit
from asyncrl.common.plane.control import ControlPlane
from asyncrl.common.weights.group import group_backend
from asyncrl.common.wire.messages import WeightManifest

log = get_logger("actor")


class WeightsFollower:
    """The weights one actor serves, and the broadcasts that change them.

    ``version`` is the policy version of the weights loaded (0: the model folder), ``digest`` their version digest
    ("" for the model folder's), ``restore`` the learner's restore generation they came from; ``epoch`` is the
    formation this actor is a member of (None: none). ``syncing`` is true while a broadcast is being loaded;
    ``refused`` the newest version it refused since it last loaded one (0: none), which no broadcast brings again.
    """

    def __init__(self, config: RunConfig, plane: ControlPlane, redis_url: str, actor_id: str, audit: Audit) -> None:
        self.config, self.plane, self.redis_url, self.actor_id, self.audit = config, plane, redis_url, actor_id, audit
        self.version = 0
        self.digest = ""
        self.restore = 0
        self.epoch: int | None = None
        self.syncing = False
        self.refused = 0
        self._received = 0  # broadcasts received in the formation ``epoch`` (refused ones too)
        self._failed_epoch: int | None = None  # a formation this actor could not join: wait for the next one
        self._announced = threading.Event()

    def listen(self, stopped: Callable[[], bool]) -> None:
        """Thread: wake :meth:`follow` on every announcement (and every second, in case one was missed)."""
        pubsub = self.plane.client.pubsub(ignore_subscribe_messages=True)
        pubsub.subscribe(self.plane.keys.manifest_channel)
        while not stopped():
            try:
                pubsub.get_message(timeout=1.0)
            except Exception as exc:
                log.warning("manifest subscription failed; polling", error=exc)
                time.sleep(1.0)
            self._announced.set()
        pubsub.close()

    async def follow(self, engine, stopped: Callable[[], bool], failed: Callable[[BaseException], None]) -> None:
        """Take part in every broadcast to this actor until ``stopped``; ``failed`` hears of a load that raised."""
        while not stopped():
            await asyncio.to_thread(self._announced.wait, 1.0)
            self._announced.clear()
            following = await asyncio.to_thread(self.next_broadcast)
            if following is not None:
                await self._load(engine, *following, failed)
                self._announced.set()  # the learner may have published the one after already

    def next_broadcast(self) -> tuple[WeightManifest, list] | None:
        """The manifest (and its frames) of the next broadcast this actor takes part in, or None.

        In its formation it is the one after those it received, never simply the newest: a broadcast's root is done
        once its bytes are on the wire, so the learner may publish the next manifest before a slow member has read
        the last, and pairing a broadcast with a later manifest loads weights under the wrong version. Otherwise it
        is the first broadcast of the newest formation that lists this actor: every member joins a formation before
        its first broadcast can finish, so none can have gone by.
        """
        if self.epoch is not None:
            following = self.plane.run.formation_manifest(self.epoch, self._received)
            if following is not None:
                return following
        current = self.plane.run.read_manifest()
        if current is None:
            return None
        manifest = current[0]
        if self.actor_id not in manifest.members or manifest.group_epoch in (self.epoch, self._failed_epoch):
            return None  # not in it (the learner adds us at its next sync), in it and up to date, or it failed
        return self.plane.run.formation_manifest(manifest.group_epoch, 0)

    def _join(self, manifest: WeightManifest) -> dict | None:
        """How this actor's workers join ``manifest``'s formation, or None when they are members already."""
        if manifest.group_epoch == self.epoch:
            return None
        return {
            "redis_url": self.redis_url,
            "run": self.config.run.name,
            "epoch": manifest.group_epoch,
            "rank": manifest.ranks_of(self.actor_id).start,  # of its first worker; the others take the next
            "world_size": manifest.world_size,
            "timeout_s": self.config.weight_sync.timeout_s,
            "backend": group_backend(),
        }

    async def _load(
        self, engine, manifest: WeightManifest, frames: list, failed: Callable[[BaseException], None]
    ) -> None:
        join = self._join(manifest)
        self.syncing = True
        previous = self.version  # higher than version once, after the learner resumed from a checkpoint

        def loaded() -> None:  # called before generation resumes, so no new token carries the old version
            self.version = manifest.version

        try:
            figures = await engine.update_weights(frames, join, manifest.version, len(manifest.buckets), loaded)
        except Exception as exc:  # WeightSyncError from the worker, or an RPC timeout
            log.error("weight update failed; waiting for the next formation", version=manifest.version, error=repr(exc))
            self.epoch, self._received = None, 0
            self._failed_epoch = manifest.group_epoch
            failed(exc)
            return
        finally:
            self.syncing = False
        self._received = 1 if join is not None else self._received + 1
        self.epoch = manifest.group_epoch  # the transfer completed: this actor is a member of the formation
        if "refused" in figures:
            self._refuse(manifest, figures["refused"])
            return
        self.restore = manifest.restore
        self.digest = manifest.digest
        self.refused = 0  # older refusals are moot; a newer one means the learner restored and sends them anew
        self.audit.record("weights.loaded", version=self.version, digest=self.digest, epoch=self.epoch)
        log.info(
            "loaded new weights",
            version=self.version,
            previous=previous,
            epoch=self.epoch,
            restore=self.restore,
            **{k: round(v, 4) for k, v in figures.items()},
        )

    def coming(self, version: int) -> bool:
        """Whether weights ``version`` may still reach this actor: not once it refused that version or a newer one —
        the learner sends each version once, and the next comes only after a step that may need this actor's groups."""
        return version > self.refused

    def _refuse(self, manifest: WeightManifest, reason: str) -> None:
        """Weights that arrived whole but not as the manifest describes them: the old ones go on serving."""
        self.refused = max(self.refused, manifest.version)
        ACTOR_WEIGHT_DIGEST_MISMATCHES.inc()
        self.audit.record("weights.refused", version=manifest.version, digest=manifest.digest, reason=reason)
        log.error(
            "refused new weights: they do not match the manifest's digests; the old weights go on serving",
            version=manifest.version,
            serving=self.version,
            digest=manifest.digest,
            reason=reason,
            action="the transfer was altered or the manifest does not describe it: check the learner's log and the "
            "network between them; the actor takes the next version",
        )
