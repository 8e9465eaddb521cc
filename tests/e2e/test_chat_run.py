"""A user's model and data, end to end: `rl-launch run` on a chat model (byte-level BPE, ChatML
template, Qwen2 with a padded embedding) and a chat-formatted JSONL file with one prompt too long to serve.

The run trains every step with finite losses; the over-long row is skipped at load with one log line naming it,
and the run goes on; the metrics show which groups were trained and that none was refused."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from asyncrl.common.tiny_models.chat import chat_examples, init_chat_model, warm_start_chat
from tests.helpers.stack import ONE_PROCESS_ENGINE, finish, launch, metrics

pytestmark = pytest.mark.e2e
STEPS = 4


def test_a_chat_model_trains_on_a_chat_file_and_skips_the_overlong_row(tmp_path: Path) -> None:
    """One architecture here, Qwen2 with its padded embedding: tests/integration/test_chat_models.py serves and
    trains each of them (the ids the actor generated are exactly those the learner trains)."""
    arch = "qwen2"
    model = init_chat_model(tmp_path / "model", arch, seed=0)
    warm_start_chat(model, chat_examples(2000, seed=1), steps=60)
    rows = chat_examples(40, seed=2)
    rows.insert(5, {"messages": [{"role": "user", "content": "What is " + "1+" * 80 + "1?"}], "answer": "81"})
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows))
    proc = launch(
        tmp_path,
        model,
        arch,
        "task.name=file",
        f"task.path={json.dumps(str(data))}",
        'task.options={verifier="arithmetic"}',
        'task.system_prompt="Answer with the number only."',
        'reward.functions=[{name = "task"}, {name = "format", weight = 0.5}]',  # format varies: a real gradient
        "model.max_model_len=96",
        "rollout.max_new_tokens=8",  # 88 prompt tokens at most: the long row has about 200
        "rollout.num_samples=4",
        ONE_PROCESS_ENGINE,
        f"learner.steps={STEPS}",
        "eval.every=0",  # the demo config's eval draws its built-in task; evaluation has its own e2e test
        "learner.groups_per_step=4",
        "learner.micro_batch_size=16",
        actors=1,
    )
    assert finish(proc, 900) == 0
    steps = metrics(tmp_path, arch)
    assert [int(r["step"]) for r in steps] == list(range(1, STEPS + 1))
    assert all(math.isfinite(r["train/loss"]) and math.isfinite(r["train/grad_norm"]) for r in steps), steps
    assert all(r["train/applied"] == 1.0 and r["groups/refused"] == 0 for r in steps)
    assert any(r["train/grad_norm"] > 0 for r in steps), "no step had a learning signal"
    log = (tmp_path / arch / "logs" / "learner.log").read_text()
    named = [line for line in log.splitlines() if "skipped a row whose prompt is too long to serve" in line]
    assert len(named) == 1 and f"{data}:line 6" in named[0], named
    figures = {
        key: [round(r[key], 4) for r in steps] for key in ("train/loss", "train/grad_norm", "rollout/reward_mean")
    }
    print(f"{arch}: {figures}, mismatch KL max {max(abs(r['train/offpolicy/mismatch_kl']) for r in steps):.1e}")
