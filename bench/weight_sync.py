"""Weight sync: a model's weights from the learner into two live vLLM actors, against two raw baselines.

In one run, for each model size (float32 Llama checkpoints made locally):

- ``asyncrl``: what the learner does each step — flat dtype buckets (``--bucket-mb``) packed, sealed with their
  digests and broadcast over gloo to two running ``rl-actor`` processes, which verify and load them with vLLM's
  ``reload_weights``; ``digest`` is the learner's share of that spent hashing the buckets;
- ``raw_flat``: one ``broadcast`` of the same number of bytes to two plain processes (the floor);
- ``per_parameter``: one ``broadcast`` per parameter to two plain processes (the per-parameter design).

    python bench/weight_sync.py [--sizes 50,200] [--repeats 3]

Prints one JSON object last: seconds (median of the repeats) and the ratios asyncrl/raw_flat and
per_parameter/asyncrl.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from common.config import load_config
from common.control import ControlPlane
from common.keys import connect
from common.redis_server import EmbeddedRedis
from common.rendezvous import RedisStore
from common.weights import GroupAddress, WeightGroup, pack_sealed, seal_buckets
from common.wire import WeightManifest

RUN = "bench-weights"
SHAPES = {50: (512, 16, 1376), 200: (1024, 16, 2752)}  # hidden, layers, intermediate -> ~50M / ~200M params


def make_model(folder: Path, millions: int) -> dict[str, torch.Tensor]:
    from transformers import LlamaConfig, LlamaForCausalLM

    from common.tasks import TASK_ALPHABET
    from common.tiny_model import init_model

    hidden, layers, intermediate = SHAPES[millions]
    init_model(folder, alphabet=TASK_ALPHABET, hidden=hidden, layers=layers, heads=8, intermediate=intermediate)
    model = LlamaForCausalLM(LlamaConfig.from_pretrained(folder))
    return {name: p.detach().add(0.001) for name, p in model.named_parameters()}


def start_actors(url: str, n: int) -> list[subprocess.Popen]:
    actor = str(Path(sys.executable).parent / "rl-actor")
    return [
        subprocess.Popen(
            [actor, "--redis", url, "--run", RUN, "--id", f"a{i}"],
            env={**os.environ, "VLLM_CPU_OMP_THREADS_BIND": str(i % os.cpu_count())},
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for i in range(n)
    ]


def wait_ready(plane: ControlPlane, n: int, timeout_s: float = 600) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        live, _ = plane.registry.processes()
        if sum(h.kind == "actor" and h.state not in ("starting",) for h in live) >= n:
            return
        time.sleep(1)
    raise RuntimeError("actors did not start")


def asyncrl_sync(
    plane: ControlPlane, params: dict[str, torch.Tensor], repeats: int, bucket_mb: float
) -> tuple[list[float], list[float]]:
    """Seconds to pack, seal (digest) and send each version as the learner does, and of the digests alone."""
    store = RedisStore(plane.client, RUN, 600)
    group = None
    times, digest_times = [], []
    for version in range(1, repeats + 2):
        start = time.perf_counter()
        sealed = pack_sealed(params, int(bucket_mb * 2**20))
        plane.run.publish_manifest(
            WeightManifest(
                version=version,
                world_size=3,
                members=["a0", "a1"],
                buckets=sealed.buckets,
                group_epoch=1,
                digest=sealed.digest,
            )
        )
        if group is None:
            group = WeightGroup(GroupAddress("", RUN, 1, 0, 3, 600), store)
            group.self_check()
        group.send_packed(sealed.flats)
        if version > 1:  # the first one also pays for the group formation
            times.append(time.perf_counter() - start)
            hashed = time.perf_counter()
            seal_buckets(sealed.buckets, sealed.flats)
            digest_times.append(time.perf_counter() - hashed)
        time.sleep(1.5)  # let the actors resume before the next version
    return times, digest_times


def _plain_member(url: str, rank: int, shapes: list[list[int]], repeats: int) -> None:
    group = WeightGroup(GroupAddress(url, RUN, epoch=99, rank=rank, world_size=3, timeout_s=600))
    total = sum(torch.Size(s).numel() for s in shapes)
    for _ in range(repeats):
        group.broadcast(torch.empty(total))
        for shape in shapes:
            group.broadcast(torch.empty(shape))


def raw_baselines(url: str, params: dict[str, torch.Tensor], repeats: int) -> tuple[list[float], list[float]]:
    store = RedisStore(connect(url), RUN, 600)
    shapes = [list(p.shape) for p in params.values()]
    ctx = mp.get_context("spawn")
    members = [ctx.Process(target=_plain_member, args=(url, r, shapes, repeats)) for r in (1, 2)]
    for proc in members:
        proc.start()
    group = WeightGroup(GroupAddress("", RUN, epoch=99, rank=0, world_size=3, timeout_s=600), store)
    flat = torch.cat([p.reshape(-1) for p in params.values()])
    flat_times, per_param_times = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        group.broadcast(flat)
        flat_times.append(time.perf_counter() - start)
        start = time.perf_counter()
        for p in params.values():
            group.broadcast(p.contiguous())
        per_param_times.append(time.perf_counter() - start)
    for proc in members:
        proc.join(60)
    return flat_times, per_param_times


def measure(millions: int, repeats: int, tmp: Path, bucket_mb: float) -> dict[str, float]:
    folder = tmp / f"model-{millions}m"
    params = make_model(folder, millions)
    with EmbeddedRedis(tmp / f"redis-{millions}") as redis:
        plane = ControlPlane(connect(redis.url), RUN)
        plane.run.publish_config(
            load_config(
                None,
                [
                    f"run.name={RUN}",
                    f"model.path={folder}",
                    "model.max_model_len=64",
                    "rollout.kv_cache_bytes=33554432",
                    "weight_sync.timeout_s=600",
                ],
            )
        )
        actors = start_actors(redis.url, 2)
        try:
            wait_ready(plane, 2)
            ours, digests = asyncrl_sync(plane, params, repeats, bucket_mb)
        finally:
            for proc in actors:
                proc.send_signal(signal.SIGTERM)
            for proc in actors:
                proc.wait(120)
        flat, per_param = raw_baselines(redis.url, params, repeats)
    seconds = {
        k: statistics.median(v)
        for k, v in (("asyncrl", ours), ("digest", digests), ("raw_flat", flat), ("per_parameter", per_param))
    }
    return {
        "parameters": sum(p.numel() for p in params.values()),
        "tensors": len(params),
        "bytes": sum(p.numel() * 4 for p in params.values()),
        **{f"{k}_s": round(v, 4) for k, v in seconds.items()},
        "asyncrl_vs_raw_flat": round(seconds["asyncrl"] / seconds["raw_flat"], 3),
        "per_parameter_vs_asyncrl": round(seconds["per_parameter"] / seconds["asyncrl"], 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="50,200", help="model sizes in millions of parameters (50, 200)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--bucket-mb", type=float, default=64.0, help="asyncrl's bucket size (weight_sync.bucket_mb)")
    args = parser.parse_args()
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for size in (int(s) for s in args.sizes.split(",")):
            results[f"{size}M"] = measure(size, args.repeats, Path(tmp), args.bucket_mb)
            print(f"{size}M: {results[f'{size}M']}", file=sys.stderr)
    results["setup"] = (
        f"float32, gloo over loopback, two receivers, buckets of {args.bucket_mb:g} MB, "
        "2 CPU cores shared by all processes"
    )
    print(json.dumps(results))


if __name__ == "__main__":
    main()
