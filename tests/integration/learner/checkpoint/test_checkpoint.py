"""Checkpoints on CPU (DeepSpeed over gloo, a real Redis): a save and a load give back the same training, a changed or
missing file is refused by name, old checkpoints are pruned to the last K plus the best, the Hugging Face export
loads in transformers with the engine's logits, and the Redis record of trained groups rewinds to a checkpoint."""

from __future__ import annotations

import json
import random
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from asyncrl.common.config import RunConfig
from asyncrl.common.plane.control import ControlPlane
from asyncrl.common.plane.replay import ReplayReader
from asyncrl.learner.checkpoint.checkpointer import Checkpointer
from asyncrl.learner.checkpoint.format import CheckpointError, SavedState, capture_rng, open_checkpoint, restore_rng
from asyncrl.learner.checkpoint.history import find_checkpoint, truncate_metrics
from asyncrl.learner.intake.trained import TrainedLog
from asyncrl.learner.update.batch import split_micro_batches
from asyncrl.learner.update.engine import PolicyEngine
from tests.helpers.engine_ranks import LENGTHS, fixed_batch, nll_loss, predicted_tokens

pytestmark = pytest.mark.usefixtures("one_rank_world")
BIN = Path(sys.executable).parent
ROOT = Path(__file__).resolve().parents[4]


def run_config(
    tmp_path: Path, model_dir: Path, zero_stage: int = 0, lora_rank: int = 0, **checkpoint: object
) -> RunConfig:
    return RunConfig.model_validate(
        {
            "run": {"name": "ckpt", "root": str(tmp_path / "runs")},
            "model": {"path": str(model_dir)},
            # warm-up: a fresh scheduler would give the third step another lr than a restored one
            "learner": {"zero_stage": zero_stage, "micro_batch_size": 4, "lr": 1e-3, "warmup_steps": 4},
            "lora": {"rank": lora_rank},
            "checkpoint": checkpoint,
        }
    )


def new_engine(config: RunConfig) -> PolicyEngine:
    return PolicyEngine(config, global_batch=len(LENGTHS))


def train_step(engine: PolicyEngine):
    batch = fixed_batch()
    return engine.train_step(split_micro_batches(batch, 4), nll_loss(predicted_tokens(batch["attention_mask"])))


def weights(engine: PolicyEngine) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in engine.state_dict_for_broadcast(torch.float32).items()}


def draws() -> tuple[float, float, list[float]]:
    return random.random(), float(np.random.rand()), torch.rand(3).tolist()


def save(engine: PolicyEngine, config: RunConfig, step: int, reward: float | None = None) -> Path:
    tokenizer = AutoTokenizer.from_pretrained(config.model.path)
    state = SavedState(step=step, version=step, kl_coef=0.25, rng=capture_rng(), reward_mean=reward)
    return Checkpointer(config, engine, tokenizer=tokenizer).save(state)


@pytest.mark.parametrize(
    ("zero_stage", "lora_rank"), [(0, 0), (2, 0), (0, 4), (3, 4)], ids=["zero0", "zero2", "lora-zero0", "lora-zero3"]
)
def test_a_loaded_checkpoint_trains_on_exactly_like_the_saved_engine(
    tmp_path: Path, tiny_model_dir: Path, zero_stage: int, lora_rank: int
) -> None:
    """Weights, Adam moments, the warm-up schedule and the RNGs all come back: the step after a load is identical.
    A LoRA run's checkpoint holds its adapters and their optimizer state, not the frozen base (a fraction of the
    bytes), and its ``adapter/`` folder."""
    config = run_config(tmp_path, tiny_model_dir, zero_stage, lora_rank)
    saved = new_engine(config)
    for _ in range(2):
        train_step(saved)
    path = save(saved, config, step=2)
    at_save = weights(saved)
    expected_draws = draws()
    expected = train_step(saved)
    expected_weights = weights(saved)

    loaded = new_engine(config)
    state = Checkpointer(config, loaded).load(open_checkpoint(path))
    restore_rng(state.rng)
    assert (state.step, state.version, state.kl_coef) == (2, 2, 0.25)
    assert draws() == expected_draws
    for name, tensor in weights(loaded).items():
        torch.testing.assert_close(tensor, at_save[name], rtol=0, atol=0)
    got = train_step(loaded)
    assert got.lr == pytest.approx(expected.lr) and got.lr == pytest.approx(3 / 4 * 1e-3)  # third warm-up step
    for name, tensor in weights(loaded).items():
        torch.testing.assert_close(tensor, expected_weights[name], rtol=0, atol=1e-7)  # Adam state included
    if lora_rank:
        saved_bytes = sum(f.stat().st_size for f in (path / "policy").rglob("*") if f.is_file())
        model_bytes = sum(f.stat().st_size for f in tiny_model_dir.glob("*.safetensors"))
        assert saved_bytes < model_bytes, (saved_bytes, model_bytes)  # adapters + Adam moments, not the base
        assert (path / "adapter" / "adapter_model.safetensors").is_file()


@pytest.mark.parametrize("lora_rank", [0, 4], ids=["full", "lora"])
def test_the_critic_is_saved_and_loaded_beside_the_policy(tmp_path: Path, tiny_model_dir: Path, lora_rank: int) -> None:
    from asyncrl.learner.update.critic import ValueEngine

    config = run_config(tmp_path, tiny_model_dir, lora_rank=lora_rank, export_hf=False)
    policy, critic = new_engine(config), ValueEngine(config, global_batch=len(LENGTHS))
    torch.nn.init.normal_(critic.module.head.weight)  # not the fresh zero head, so a load is visible
    state = SavedState(step=1, version=1, rng=capture_rng())
    path = Checkpointer(config, policy, critic).save(state)
    assert any(name.startswith("critic/ds/") for name in open_checkpoint(path).files)

    fresh = ValueEngine(config, global_batch=len(LENGTHS))
    Checkpointer(config, new_engine(config), fresh).load(open_checkpoint(path))
    torch.testing.assert_close(fresh.module.head.weight, critic.module.head.weight, rtol=0, atol=0)
    with pytest.raises(CheckpointError, match="with a critic"):
        Checkpointer(config, new_engine(config)).load(open_checkpoint(path))


@pytest.fixture(scope="module")
def saved_checkpoint(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> tuple[RunConfig, Path]:
    tmp_path = tmp_path_factory.mktemp("saved")
    config = run_config(tmp_path, tiny_model_dir)
    engine = new_engine(config)
    train_step(engine)
    return config, save(engine, config, step=1)


def test_a_changed_byte_in_any_file_is_refused_naming_the_file(saved_checkpoint, tmp_path: Path) -> None:
    _, path = saved_checkpoint
    manifest = json.loads((path / "manifest.json").read_text())["files"]
    assert {"state.json", "hf/model.safetensors", "hf/config.json", "hf/tokenizer.json"} <= set(manifest)
    assert any(name.startswith("policy/ds/") for name in manifest)
    for name in manifest:
        copy = tmp_path / name.replace("/", "_") / "step-1"
        shutil.copytree(path, copy)
        target = copy / name
        data = bytearray(target.read_bytes())
        data[len(data) // 2] ^= 0x01
        target.write_bytes(bytes(data))
        with pytest.raises(CheckpointError, match="does not match its manifest") as caught:
            open_checkpoint(copy)
        assert str(target) in str(caught.value)


def test_a_missing_file_is_refused_by_rl_learner_with_exit_2(saved_checkpoint, tmp_path: Path) -> None:
    config, path = saved_checkpoint
    copy = tmp_path / "step-1"
    shutil.copytree(path, copy)
    missing = copy / "hf" / "model.safetensors"
    missing.unlink()
    with pytest.raises(CheckpointError, match="is missing"):
        open_checkpoint(copy)
    result = subprocess.run(
        [BIN / "rl-learner", "train", "--set", f"model.path={json.dumps(config.model.path)}", "--resume", str(copy)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert result.returncode == 2, result.stderr
    assert str(missing) in result.stderr and "cannot resume" in result.stderr


@pytest.mark.parametrize("command", [["rl-learner", "train"], ["rl-launch", "run"]])
def test_resume_latest_without_a_checkpoint_exits_2_with_the_reason(tmp_path: Path, command: list[str]) -> None:
    result = subprocess.run(
        [BIN / command[0], *command[1:], "--set", f'run.root="{tmp_path}"', "--resume", "latest"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2 and "no complete checkpoint" in result.stderr, result.stderr


def test_pruning_keeps_the_last_k_and_the_best_by_reward(tmp_path: Path, tiny_model_dir: Path) -> None:
    config = run_config(tmp_path, tiny_model_dir, keep=2, export_hf=False)
    engine = new_engine(config)
    rewards = [0.2, 0.9, 0.1, 0.3, 0.4, 0.5]
    for step, reward in enumerate(rewards, start=1):
        save(engine, config, step, reward)
    root = config.run_dir / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["step-2", "step-5", "step-6"]  # 2 is the best
    (root / ".tmp-step-7").mkdir()  # a save that died half-way is never "latest"
    assert find_checkpoint("latest", root).name == "step-6"
    assert not (root / "step-6" / "hf").exists()  # export_hf = false

    config.checkpoint.keep_best = False
    save(engine, config, 7, 0.0)
    assert sorted(p.name for p in root.iterdir() if not p.name.startswith(".")) == ["step-6", "step-7"]


def test_the_hugging_face_export_gives_the_engine_s_logits(saved_checkpoint, tiny_model_dir: Path) -> None:
    config, path = saved_checkpoint
    engine = new_engine(config)
    Checkpointer(config, engine).load(open_checkpoint(path))
    exported = AutoModelForCausalLM.from_pretrained(path / "hf").eval()
    tokenizer = AutoTokenizer.from_pretrained(path / "hf")
    assert tokenizer("1+2=")["input_ids"] == AutoTokenizer.from_pretrained(tiny_model_dir)("1+2=")["input_ids"]
    batch = fixed_batch()
    with torch.no_grad():
        expected = engine.module(**batch).logits
        got = exported(**batch).logits
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)
    original = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    with torch.no_grad():
        assert not torch.allclose(original(**batch).logits, got)  # the trained weights, not the initial ones


def test_metrics_are_cut_back_to_the_checkpoint_step(tmp_path: Path) -> None:
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(json.dumps({"step": s}) + "\n" for s in range(1, 9)) + '{"step": 9, "rew')
    assert truncate_metrics(metrics, 6) == (6, 3)
    assert [json.loads(line)["step"] for line in metrics.read_text().splitlines()] == [1, 2, 3, 4, 5, 6]
    assert len((tmp_path / "metrics.discarded.jsonl").read_text().splitlines()) == 3


# --------------------------------------------------------------------------- the trained-groups record in Redis


class _Entry:
    """The two fields TrainedLog reads from a replay entry."""

    def __init__(self, entry_id: str, group_id: str) -> None:
        self.entry_id = entry_id
        self.group = type("G", (), {"rollout": type("R", (), {"group_id": group_id})()})()


def _trained_run(redis_client, steps: int, per_step: int = 2) -> tuple[TrainedLog, ControlPlane]:
    """``steps`` steps of ``per_step`` groups each, read from the stream (pending) and recorded as trained."""
    plane = ControlPlane(redis_client, "rewind")
    reader = ReplayReader(redis_client, plane.keys)
    log = TrainedLog(plane, reader, defer_acks=True)
    for step in range(1, steps + 1):
        for _ in range(per_step):
            redis_client.xadd(plane.keys.replay, {"m": b"x"})
        read = redis_client.xreadgroup(reader.group, reader.consumer, {plane.keys.replay: ">"}, count=per_step)
        entries = [_Entry(eid.decode(), f"g{step}-{i}") for i, (eid, _) in enumerate(read[0][1])]
        log.record(step, entries, [])
        redis_client.sadd(plane.keys.done, *[e.group.rollout.group_id for e in entries])
    return log, plane


def _pending(redis_client, plane: ControlPlane) -> int:
    return int(redis_client.xpending(plane.keys.replay, "learner")["pending"])


def test_a_resume_trains_again_what_the_checkpoint_does_not_hold(redis_client) -> None:
    log, plane = _trained_run(redis_client, steps=5)
    assert log.commit(3) == 6 and _pending(redis_client, plane) == 4  # acknowledged once a checkpoint holds them
    rewind = log.rewind(3)
    assert sorted(rewind.retrain) == ["g4-0", "g4-1", "g5-0", "g5-1"] and rewind.lost == []
    assert _pending(redis_client, plane) == 4  # still pending: the next learner reads them again
    assert not any(plane.prompts.was_completed(g) for g in rewind.retrain)  # so they are not taken for duplicates
    assert sorted(set(log.trained_steps().values())) == [1, 2, 3]


def test_a_crash_between_save_and_commit_acknowledges_what_the_checkpoint_holds(redis_client) -> None:
    log, plane = _trained_run(redis_client, steps=3)
    rewind = log.rewind(3)  # the checkpoint of step 3 was renamed into place, its commit never ran
    assert (rewind.committed, rewind.retrain, rewind.lost) == (6, {}, [])
    assert _pending(redis_client, plane) == 0


def test_resuming_an_older_checkpoint_counts_the_later_groups_lost_and_replaces_them(redis_client) -> None:
    log, plane = _trained_run(redis_client, steps=5)
    plane.prompts.add_dispatch_counts({"released": 10})
    log.commit(5)
    rewind = log.rewind(3)
    assert rewind.retrain == {} and sorted(rewind.lost) == ["g4-0", "g4-1", "g5-0", "g5-1"]
    counts = plane.prompts.dispatch_counts()
    assert (counts["restore_lost"], counts["released"]) == (4, 6)  # admission releases 4 replacements
