"""The learner's owners built alone, with a real Redis and (for the update and the run state) a DeepSpeed engine on
the tiny model: BatchSource, the broadcaster's overlap, PolicyUpdate and RunState."""

from __future__ import annotations

import hashlib
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoTokenizer

from asyncrl.common.config import RunConfig
from asyncrl.common.plane.audit import Audit
from asyncrl.common.plane.audit import flush as flush_audit
from asyncrl.common.plane.audit_file import entry_line
from asyncrl.common.plane.control import ControlPlane
from asyncrl.common.plane.dead_letters import dead_letter
from asyncrl.common.plane.replay import ReplayWriter
from asyncrl.common.wire.messages import Heartbeat
from asyncrl.learner.algorithms.assembly import assemble
from asyncrl.learner.checkpoint.format import open_checkpoint
from asyncrl.learner.checkpoint.history import complete_checkpoints
from asyncrl.learner.intake.batch_source import BatchSource, EveryGroupRefused, StepInterrupted
from asyncrl.learner.run_state import RunState
from asyncrl.learner.update.policy import PolicyUpdate
from asyncrl.learner.weights.broadcaster import Broadcaster
from tests.helpers.rollouts import answer
from tests.helpers.waits import wait_for


def run_config(tmp_path: Path, model_dir: Path | str = "unused", **sections: dict) -> RunConfig:
    base = {
        "run": {"name": "owners", "root": str(tmp_path / "runs")},
        "model": {"path": str(model_dir)},
        "rollout": {"num_samples": 2, "max_new_tokens": 4},
        "learner": {"groups_per_step": 2, "micro_batch_size": 4, "lr": 1e-3},
        "staleness": {"max_staleness": 0},
    }
    for name, values in sections.items():
        base[name] = {**base.get(name, {}), **values}
    return RunConfig.model_validate(base)


@pytest.fixture
def tokenizer(tiny_model_dir: Path):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


# --------------------------------------------------------------------------- BatchSource


def test_batch_source_admits_answers_and_judges_the_rest(redis_client, tmp_path, tiny_model_dir, tokenizer) -> None:
    config = run_config(tmp_path, tiny_model_dir)
    plane = ControlPlane(redis_client, "owners")
    source = BatchSource(config, plane, tokenizer, newest_version=0)
    assert source.dispatcher.release(0) == 2  # capacity (0 + 0 + 1) × 2
    first, second = (plane.prompts.load_group(g) for g in sorted(plane.prompts.ledger()))
    ReplayWriter(redis_client, plane.keys).add(
        [
            answer(first, prompt_ids=first.prompt_ids[::-1].copy()),  # a forgery under a live id
            answer(first),
            answer(first),  # its re-issued twin, in the same batch
            answer(second),
        ]
    )
    taken = source.take(0, threading.Event(), on_wait=lambda: None)
    assert [e.group.rollout.group_id for e in taken.entries] == [first.group_id, second.group_id]
    assert taken.verdicts == {"duplicate": 1, "refused": 1, "stale": 0, "zero_variance": 0}
    assert taken.figures()["groups/refused"] == 1.0 and taken.figures()["groups/duplicates"] == 1.0
    assert taken.rewards().tolist() == [1.0, 0.0, 1.0, 0.0]
    [(_, dead)] = redis_client.xrange(plane.keys.dead)
    assert dead[b"source"] == b"learner:refused" and b"prompt_ids differ" in dead[b"reason"]
    source.settle(1, taken)
    assert source.trained.trained_steps() == {first.group_id: 1, second.group_id: 1}
    assert plane.prompts.ledger() == {} and source.reader.depth()["pending"] == 0  # no periodic checkpoints: acked now


def test_a_run_whose_every_group_is_dead_lettered_stops_naming_the_newest_reason(
    redis_client, tmp_path, tiny_model_dir, tokenizer
) -> None:
    """Reward workers that dead-letter every group (an environment that cannot be replayed): each group's slot is
    freed at the next look and a replacement released, and after four batches' worth in a row, none trained, the
    learner stops with the reason instead of waiting for a batch that never comes."""
    config = run_config(tmp_path, tiny_model_dir)
    plane = ControlPlane(redis_client, "owners")
    source = BatchSource(config, plane, tokenizer, newest_version=0)
    seen: set[str] = set()

    def reward_workers_refuse_every_group() -> None:
        for group_id in set(plane.prompts.ledger()) - seen:
            seen.add(group_id)
            dead_letter(redis_client, plane.keys, "reward", "refused: an environment turn differs from its replay", b"")
            plane.prompts.note_refused(group_id)

    with pytest.raises(EveryGroupRefused, match=r"dead-lettered the last 8 groups .*environment turn differs"):
        source.take(0, threading.Event(), on_wait=reward_workers_refuse_every_group)
    assert len(seen) == 8 and plane.prompts.dispatch_counts()["refused"] == 8  # 4 batches of 2, each one replaced


def test_batch_source_drops_stale_groups_and_stops_when_asked(redis_client, tmp_path, tiny_model_dir, tokenizer):
    config = run_config(tmp_path, tiny_model_dir)
    plane = ControlPlane(redis_client, "owners")
    source = BatchSource(config, plane, tokenizer, newest_version=1)
    source.dispatcher.release(0)
    first = plane.prompts.load_group(min(plane.prompts.ledger()))
    ReplayWriter(redis_client, plane.keys).add([answer(first, version=0)])
    stop = threading.Event()
    waits = []

    def on_wait() -> None:  # the learner's chance to welcome actors; here: stop after the first read
        waits.append(1)
        if len(waits) == 2:
            stop.set()

    with pytest.raises(StepInterrupted):
        source.take(1, stop, on_wait)  # at version 1 with max_staleness 0 the floor is 1: version 0 is stale
    assert plane.prompts.dispatch_counts()["discarded"] == 1  # admission releases a replacement
    assert source.reader.depth()["pending"] == 0  # the decided entry was acknowledged on the way out


# --------------------------------------------------------------------------- the broadcaster's overlap


def manifest_version(plane: ControlPlane, timeout_s: float = 10) -> int:
    """The published manifest's version, once there is one (the broadcaster publishes it from its thread)."""
    current = wait_for(plane.run.read_manifest, "published manifest", timeout_s=timeout_s, poll_s=0.01)
    return current[0].version


def test_overlap_publishes_a_version_at_the_next_broadcast(redis_client, tmp_path) -> None:
    params = {"w": torch.ones(3)}
    plane = ControlPlane(redis_client, "owners")
    overlapped = Broadcaster(run_config(tmp_path, staleness={"max_staleness": 1}), plane)
    try:
        assert overlapped.overlap and overlapped.publish(1, lambda: params) == {}  # on the wire, not yet announced
        assert manifest_version(plane) == 1 and plane.run.version() == 0  # the manifest goes out from the background
        figures = overlapped.publish(2, lambda: params)  # finishes version 1 first
        assert figures["version"] == 1.0 and plane.run.version() == 1
        assert overlapped.finish()["version"] == 2.0 and plane.run.version() == 2
        assert overlapped.finish() == {}  # nothing in flight
    finally:
        overlapped.close()


def test_synchronous_and_skipped_broadcasts(redis_client, tmp_path) -> None:
    params = {"w": torch.ones(3)}
    plane = ControlPlane(redis_client, "owners")
    config = run_config(tmp_path, weight_sync={"sync_every": 2, "overlap": False}, staleness={"max_staleness": 1})
    synchronous = Broadcaster(config, plane)  # every second version skipped: the actors may trail by one
    try:
        assert not synchronous.overlap
        assert synchronous.publish(1, lambda: params) == {"skipped": 1.0}
        assert synchronous.publish(2, lambda: params)["version"] == 2.0 and plane.run.version() == 2
    finally:
        synchronous.close()


def test_each_actor_takes_the_ranks_its_heartbeat_asks_and_absent_ranks_name_their_actor(redis_client, tmp_path):
    """An actor with a tensor-parallel engine heartbeats one rank per worker; the manifest lays the ranks out
    back to back, and when nobody joins, the ranks that never announced themselves evict the actors that own them."""
    plane = ControlPlane(redis_client, "owners")
    for actor, ranks in (("a", 2), ("b", 1)):
        plane.registry.beat(Heartbeat(process_id=actor, kind="actor", state="idle", weight_ranks=ranks), ttl_s=60)
    broadcaster = Broadcaster(run_config(tmp_path, weight_sync={"timeout_s": 1}), plane)
    try:
        figures = broadcaster.publish(1, lambda: {"w": torch.ones(3)})
        manifest = plane.run.read_manifest()[0]
        assert (manifest.members, manifest.member_ranks, manifest.world_size) == (["a", "b"], [2, 1], 4)
        assert [list(manifest.ranks_of(a)) for a in "ab"] == [[1, 2], [3]] and manifest.owner_of(2) == "a"
        assert figures["failed"] == 1.0 and set(broadcaster.evicted) == {"a", "b"}  # nobody came
        assert len(manifest.digest) == 16 and all(len(b.digest) == 16 for b in manifest.buckets)  # sealed
        assert plane.run.version() == 0  # a failed sync is never announced: the actors are judged by what they hold
        assert "failed" not in broadcaster.publish(2, lambda: {"w": torch.ones(3)})  # both evicted: nobody to wait on
        assert plane.run.version() == 2
    finally:
        broadcaster.close()
    unsealed = Broadcaster(run_config(tmp_path, weight_sync={"timeout_s": 1, "digests": False}), plane)
    try:
        unsealed.publish(3, lambda: {"w": torch.ones(3)})
        manifest = plane.run.read_manifest()[0]
        assert manifest.members and manifest.digest == "" and manifest.buckets[0].digest == ""  # digests off
    finally:
        unsealed.close()


# --------------------------------------------------------------------------- PolicyUpdate and RunState


@pytest.mark.usefixtures("one_rank_world")
def test_update_trains_and_run_state_saves_restores_and_rolls_back(
    redis_client, tmp_path, tiny_model_dir, tokenizer
) -> None:
    config = run_config(tmp_path, tiny_model_dir, checkpoint={"every": 1, "keep": 5, "export_hf": False})
    plane = ControlPlane(redis_client, "owners")
    update = PolicyUpdate(config, assemble(config), tokenizer.pad_token_id)
    broadcaster = Broadcaster(config, plane)
    source = BatchSource(config, plane, tokenizer, newest_version=0)
    metrics = config.run_dir / "metrics.jsonl"
    audit = Audit(redis_client, "owners", "learner", "learner")
    state = RunState(config, 0, update, source, broadcaster, metrics, tokenizer, audit=audit)
    source.dispatcher.release(0)
    groups = [answer(plane.prompts.load_group(g)) for g in sorted(plane.prompts.ledger())]
    try:
        for step in (1, 2, 3):
            figures = update.train(update.collate(groups))
            assert np.isfinite(figures["loss"]) and figures["applied"] == 1.0
            assert state.advance(reward_mean=0.5) == step
            metrics.parent.mkdir(parents=True, exist_ok=True)
            with metrics.open("a") as f:
                f.write(f'{{"step": {step}}}\n')
            assert state.save("every").name == f"step-{step}"
            assert state.save("every") is None  # nothing new since
        assert state.save("every", healthy=False) is None
        state.restore(open_checkpoint(config.run_dir / "checkpoints" / "step-2"))
        assert state.version == 2 and broadcaster.restore == 1
        assert state.take_resumed()["from_step"] == 2.0 and state.take_resumed() == {}  # once
        assert [s for s, _ in complete_checkpoints(config.run_dir / "checkpoints")] == [1, 2]  # step 3 set aside
        assert metrics.read_text().count("step") == 2
        assert state.restore_latest_healthy(before_step=2) == 1  # health's rollback: the newest before the streak
        assert state.version == 1 and state.resumed
        state.set_lr_factor(0.5)
        assert update.engine.engine.optimizer.param_groups[0]["lr"] == pytest.approx(0.5e-3)
        assert flush_audit(30, redis_client)  # the audit trail: each checkpoint written, both restores, the rollback
        lines = [entry_line(i.decode(), f) for i, f in redis_client.xrange(plane.keys.audit)]
        events = [f"{line['event'].split('.')[1]} {line['step']}" for line in lines if "checkpoint." in line["event"]]
        saved, restored = ["written 1", "written 2", "written 3"], ["verified 2", "restored 2"]
        assert events == [*saved, *restored, "verified 1", "restored 1", "rolled_back 1"]  # the last three: rollback
        manifest = (config.run_dir / "checkpoints" / "step-1" / "manifest.json").read_bytes()
        assert lines[0]["manifest_sha256"] == hashlib.sha256(manifest).hexdigest() and lines[0]["files"] >= 2
    finally:
        broadcaster.close()
