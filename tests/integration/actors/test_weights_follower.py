"""The actor's weights follower against the learner's real broadcaster, over real gloo with the run's Redis: a member
that is slow to receive still pairs every broadcast with its own manifest, however far the learner got meanwhile.

The engine here is vLLM's part only: the follower calls ``update_weights`` on it, and it runs the real worker
extension's join, receive and digest check (``actors/weight_receiver.py``) without a model to load into."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import torch

from asyncrl.actors.weight_receiver import WeightReceiverExtension
from asyncrl.actors.weights_follower import WeightsFollower
from asyncrl.common.config import RunConfig
from asyncrl.common.plane.audit import Audit
from asyncrl.common.plane.control import ControlPlane
from asyncrl.common.weights.group import unpack_bucket
from asyncrl.common.wire.messages import Decoder, Heartbeat, WeightManifest
from asyncrl.learner.weights.broadcaster import Broadcaster
from tests.helpers.waits import wait_for


class ReceivingWorker(WeightReceiverExtension):
    """One vLLM worker's weight receiver; what it loads goes into ``served``."""

    def __init__(self) -> None:
        self.served: dict[str, torch.Tensor] = {}

    def asyncrl_load(self, load: bool) -> float:
        received, self._asyncrl_received = self._asyncrl_received, None
        if load and received is not None:
            manifest, flats = received
            for bucket, flat in zip(manifest.buckets, flats, strict=True):
                self.served.update((name, t.clone()) for name, t in unpack_bucket(bucket, flat))
        return 0.0


class HeldEngine:
    """The follower's engine: receives through :class:`ReceivingWorker`, then loads once ``go`` is set (a member slow
    to load, as an engine busy with a long decode step is)."""

    def __init__(self) -> None:
        self.worker = ReceivingWorker()
        self.go = threading.Event()
        self.refused: list[int] = []

    async def update_weights(self, frames, join, version, buckets, on_loaded) -> dict:
        if join is not None:
            await asyncio.to_thread(self.worker.asyncrl_join, join)
        figures = await asyncio.to_thread(self.worker.asyncrl_receive, frames)
        await asyncio.to_thread(self.go.wait, 60)
        self.worker.asyncrl_load("refused" not in figures)
        if "refused" in figures:
            self.refused.append(Decoder(WeightManifest).decode(frames).version)
        else:
            on_loaded()
        return figures


def test_a_slow_member_pairs_each_broadcast_with_its_own_manifest(redis_server, redis_client, tmp_path: Path):
    """Gloo broadcasts down a binomial tree: with three members, rank 3 receives from rank 1, so the learner's sends
    of a version can end before rank 3 has it. The receipt after each transfer (``WeightGroup.receipt``) holds the
    learner until every member has the version: while rank 3 is slow to load version 1 (and so to take version 2),
    manifest 2 is out but the version key stays at 1 — no actor is judged against weights it has not got — and each
    member still pairs each broadcast with its own manifest."""
    config = RunConfig.model_validate(
        {
            "run": {"name": "follow", "root": str(tmp_path / "runs")},
            "model": {"path": "unused"},
            "staleness": {"max_staleness": 2},  # overlapped broadcasts: the learner runs ahead of a slow member
            "weight_sync": {"timeout_s": 60},
        }
    )
    plane = ControlPlane(redis_client, "follow")
    members = {}
    for actor in "abc":  # weight-group ranks 1, 2, 3 (members are sorted)
        plane.registry.beat(Heartbeat(process_id=actor, kind="actor", state="idle", weight_ranks=1), ttl_s=120)
        audit = Audit(redis_client, "follow", actor, "actor")
        members[actor] = (WeightsFollower(config, plane, redis_server.url, actor, audit), HeldEngine())
    broadcaster = Broadcaster(config, plane)
    done = threading.Event()
    threads = [
        threading.Thread(target=asyncio.run, args=(follower.follow(engine, done.is_set, print),))
        for follower, engine in members.values()
    ]
    for thread in threads:
        thread.start()
    slow = members["c"][1]
    try:
        for actor in "ab":
            members[actor][1].go.set()
        for version in (1, 2):  # overlapped: each goes out in the background once the one before is done
            broadcaster.publish(version, lambda v=version: {"w": torch.full((3,), float(v))})
        wait_for(lambda: plane.run.read_manifest()[0].version == 2, "manifest 2 while rank 3 loads 1", timeout_s=60)
        assert members["c"][0].version == 0  # received version 1, not done loading it
        assert plane.run.version() == 1  # version 2 is not announced: rank 3 has not taken it
        slow.go.set()
        broadcaster.publish(3, lambda: {"w": torch.full((3,), 3.0)})
        broadcaster.finish()
        wait_for(lambda: all(f.version == 3 for f, _ in members.values()), "version 3 loaded", timeout_s=60)
        for follower, engine in members.values():
            assert engine.refused == [] and follower.epoch == broadcaster.epoch
            assert torch.equal(engine.worker.served["w"], torch.full((3,), 3.0))  # version 3's weights, under 3
    finally:
        done.set()
        for _, engine in members.values():
            engine.go.set()
        for thread in threads:
            thread.join(30)
        broadcaster.close()
        for _, engine in members.values():
            engine.worker.asyncrl_leave()
