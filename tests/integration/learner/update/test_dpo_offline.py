"""Offline DPO as a user runs it: ``rl-learner init-model``, ``make-preferences``, ``train configs/dpo.toml``.

Separate processes, real DeepSpeed on CPU, a tiny random model; the assertions read what a person reads
(``metrics.jsonl``, the exit code, stderr). No Redis: the run folder must not get one.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[4]
BIN = Path(sys.executable).parent
DPO = str(REPO / "configs" / "dpo.toml")
ONE_DIGIT_SUMS = 'task.options={ops="+", max_digits=1}'
STEPS = 20
WINDOW = 5  # steps averaged at each end of the run


def run(*args: str, cwd: Path, check: bool = True, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "DS_ACCELERATOR": "cpu"}
    result = subprocess.run(args, capture_output=True, text=True, timeout=timeout, cwd=cwd, env=env)
    if check:
        assert result.returncode == 0, result.stderr[-6000:]
    return result


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("tiny") / "model"
    run(str(BIN / "rl-learner"), "init-model", "--set", f"model.path={folder}", cwd=REPO)
    return folder


def test_offline_dpo_widens_the_reward_margin(model_dir: Path, tmp_path: Path) -> None:
    prefs = tmp_path / "prefs.jsonl"
    run(
        str(BIN / "rl-learner"),
        "make-preferences",
        DPO,
        "--out",
        str(prefs),
        "--pairs",
        "32",
        "--set",
        ONE_DIGIT_SUMS,
        cwd=tmp_path,
    )
    assert len(prefs.read_text().splitlines()) == 32

    overrides = [
        f"data.path={prefs}",
        f"model.path={model_dir}",
        f"run.root={tmp_path / 'runs'}",
        "run.name=dpo",
        f"learner.steps={STEPS}",
        "data.epochs=10",  # 32 pairs / 8 per step = 4 steps an epoch: learner.steps ends the run after 5 epochs
        "learner.lr=1e-3",
        "learner.micro_batch_size=8",  # two micro-batches of 4 pairs per step
    ]
    result = run(str(BIN / "rl-learner"), "train", DPO, *(arg for o in overrides for arg in ("--set", o)), cwd=tmp_path)

    run_dir = tmp_path / "runs" / "dpo"
    assert not (run_dir / "redis").exists()  # offline: no Redis started
    assert json.loads((run_dir / "config.json").read_text())["data"]["source"] == "preferences"
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert [r["epoch"] for r in rows] == [step // 4 for step in range(STEPS)]
    for key in ("train/loss", "train/grad_norm", "train/dpo/reward_margin", "train/dpo/accuracy"):
        assert all(abs(r[key]) < float("inf") for r in rows), key

    margin = [r["train/dpo/reward_margin"] for r in rows]
    loss = [r["train/loss"] for r in rows]
    accuracy = [r["train/dpo/accuracy"] for r in rows]
    assert margin[0] == pytest.approx(0.0, abs=1e-6)  # before the first update the policy is the reference
    assert loss[0] == pytest.approx(0.693147, abs=1e-4)  # so the loss is −log σ(0) = log 2
    print(
        f"DPO margin {statistics.mean(margin[:WINDOW]):.3f} -> {statistics.mean(margin[-WINDOW:]):.3f}, "
        f"loss {statistics.mean(loss[:WINDOW]):.3f} -> {statistics.mean(loss[-WINDOW:]):.3f}, "
        f"accuracy {statistics.mean(accuracy[:WINDOW]):.2f} -> {statistics.mean(accuracy[-WINDOW:]):.2f}"
    )
    assert statistics.mean(margin[-WINDOW:]) > statistics.mean(margin[:WINDOW]) + 0.1
    assert statistics.mean(loss[-WINDOW:]) < statistics.mean(loss[:WINDOW])
    assert statistics.mean(accuracy[-WINDOW:]) > 0.7
    assert f"offline dpo finished run=dpo steps={STEPS}" in result.stderr


def test_a_malformed_preference_file_stops_training_naming_the_line(model_dir: Path, tmp_path: Path) -> None:
    prefs = tmp_path / "bad.jsonl"
    prefs.write_text('{"prompt": "1+2=", "chosen": "3", "rejected": "4"}\n{"prompt": "1+3=", "chosen": 4}\n')
    result = run(
        str(BIN / "rl-learner"), "train", DPO, "--set", f"data.path={prefs}", "--set", f"model.path={model_dir}",
        "--set", f"run.root={tmp_path / 'runs'}", cwd=tmp_path, check=False,
    )  # fmt: skip
    assert result.returncode == 2, result.stderr[-3000:]
    assert f"error: {prefs}:line 2: field 'chosen' must be a string, got int" in result.stderr
    assert "Traceback" not in result.stderr


def test_the_dpo_preset_without_a_file_names_the_missing_field(tmp_path: Path) -> None:
    result = run(str(BIN / "rl-learner"), "resolve", DPO, "--dry-run", cwd=tmp_path, check=False)
    assert result.returncode == 2
    assert 'data: Value error, source = "preferences" needs path' in result.stderr


def test_preference_data_with_a_loss_that_is_not_pairwise_is_refused(model_dir: Path, tmp_path: Path) -> None:
    prefs = tmp_path / "ok.jsonl"
    prefs.write_text('{"prompt": "1+2=", "chosen": "3", "rejected": "4"}\n')
    result = run(
        str(BIN / "rl-learner"), "train", DPO, "--set", f"data.path={prefs}", "--set", f"model.path={model_dir}",
        "--set", "algorithm.loss=ppo_clip", "--set", "algorithm.loss_options={}",
        "--set", f"run.root={tmp_path / 'runs'}", cwd=tmp_path, check=False,
    )  # fmt: skip
    assert result.returncode == 2, result.stderr[-3000:]
    assert "'ppo_clip' is not a pairwise loss" in result.stderr
