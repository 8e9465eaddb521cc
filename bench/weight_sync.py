"""Weight sync: a model's weights from the learner into two live vLLM actors, against raw baselines.

In one run, for each model size (float32 Llama checkpoints made locally), medians of ``--repeats`` versions:

- ``asyncrl``: the learner's side of a version as a run does it — flat dtype buckets (``--bucket-mb``) packed, sealed
  with their digests, the manifest published, and broadcast over gloo to two running ``rl-actor`` processes; it ends
  when the broadcast does, so it holds the actors' reaction to the manifest (notice, pause, RPC into the worker) but
  not their load. ``digest`` is the learner's share of it spent hashing the buckets;
- ``asyncrl_loaded``: from the start of packing until the second actor recorded ``weights.loaded`` in the audit trail
  (received every bucket, verified it, loaded it with ``reload_weights``, resumed generation); ``actor_receive``,
  ``actor_verify`` and ``actor_load`` are the slower actor's own figures for that version, from its log;
- ``raw_flat``: one ``broadcast`` of the same number of bytes to two plain processes (the transfer floor);
- ``per_parameter``: one ``broadcast`` per parameter to two plain processes (the per-parameter design);
- ``bare_reload``: ``model_runner.reload_weights`` of the same tensors in a vLLM engine of the same checkpoint, set
  up as an actor's and on one core, timed in its worker — no group, no manifest, no digests (``bench/bare_reload.py``);
  ``raw_flat_plus_reload`` = ``raw_flat`` + ``bare_reload``, the floor of a transfer that also loads into vLLM.

The ≤ 1.3× raw goal was read against ``raw_flat``, a transfer that loads nothing; both ratios are reported:
``asyncrl_vs_raw_flat`` (learner's side against the bare transfer, as before) and
``asyncrl_loaded_vs_raw_flat_plus_reload`` (loaded into both engines against transfer + bare load). The learner-side
``asyncrl`` is not divided by ``raw_flat_plus_reload``: it ends before the actors load.

Receive-all-then-load against double-buffered receive. An actor receives every bucket before it loads any, so a
failed transfer never leaves the served model half-loaded. Overlapping that receive with vLLM's load is not possible
in place: ``reload_weights`` takes the model's weights apart while it loads and repacks them on CPUs
(``actors/weight_receiver.py``), so it can be fed bucket by bucket as they arrive, but a transfer that fails half way
leaves a model that cannot run, and it has no second copy to load into and swap. What a double-buffered receive
would cost is therefore measured with two plain receiver processes (one torch thread each), the same buckets as
``asyncrl`` without digests, and a copy into a state dict standing in for the load:

- ``receive_then_copy``: ``receive_all`` (every bucket), then each parameter copied into the live state dict — the
  actor's order today;
- ``double_buffered``: a receive thread fills two bucket buffers in turn while the main thread copies the full one
  into a shadow state dict (bucket k+1 arrives while bucket k is copied); after the last bucket the shadow becomes the
  live state dict (a swap), so the new version never serves half-loaded. Memory: a shadow copy plus two buckets,
  against a copy of every bucket for the serial receive.

Each is the slower receiver's seconds from a barrier of the group (the root sends right after it) until its weights
are in; ``double_buffered_vs_receive_then_copy`` is their ratio. A plain copy is much cheaper than vLLM's load
(``bare_reload``): the overlap hides at most the shorter of receive and load, so this models what pipelining could
save, not vLLM itself.

    python bench/weight_sync.py [--sizes 50,200] [--repeats 3] [--bucket-mb 64]

Prints one JSON object last: seconds (``*_s``, medians of the repeats) and the ratios above, per size. No figure is
asserted. Measured here, 64 MB buckets, one run each of ``python bench/weight_sync.py --sizes 50 --repeats 3`` and
``--sizes 200 --repeats 3``, 2 CPU cores shared with other benchmarks (an earlier 50 M run under heavier
load gave asyncrl 0.94 s, asyncrl_loaded 1.23 s and ratios 3.0 and 2.6: read these as noisy):

    figure (seconds)                            50 M (203 MB)   200 M (810 MB)
    asyncrl (learner: pack + seal + send)           0.37            1.30
      of which digest                               0.045           0.18
    asyncrl_loaded (until both actors loaded)       0.62            1.90
      actor_receive / verify / load             0.24/0.05/0.20  0.81/0.17/0.40
    raw_flat                                        0.30            1.27
    bare_reload                                     0.25            0.46
    raw_flat_plus_reload                            0.55            1.74
    per_parameter                                   0.22            0.89
    asyncrl_vs_raw_flat                             1.23            1.02
    asyncrl_loaded_vs_raw_flat_plus_reload          1.12            1.09
    receive_then_copy                               0.39            1.75
    double_buffered                                 0.33            0.99
    double_buffered_vs_receive_then_copy            0.86            0.57
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import multiprocessing as mp
import os
import queue
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
from safetensors.torch import save_file

from asyncrl.common.config import load_config
from asyncrl.common.plane.audit_file import entry_line
from asyncrl.common.plane.control import ControlPlane
from asyncrl.common.plane.keys import RunKeys, connect
from asyncrl.common.plane.redis_server import EmbeddedRedis
from asyncrl.common.weights.group import (
    GroupAddress,
    WeightGroup,
    pack_bucket,
    pack_sealed,
    plan_buckets,
    seal_buckets,
    torch_dtype,
    unpack_bucket,
)
from asyncrl.common.weights.rendezvous import RedisStore
from asyncrl.common.wire.messages import WeightBucket, WeightManifest
from bench.bare_reload import engine_overrides

RUN = "bench-weights"
SHAPES = {50: (512, 16, 1376), 200: (1024, 16, 2752)}  # hidden, layers, intermediate -> ~50M / ~200M params


def make_model(folder: Path, millions: int) -> dict[str, torch.Tensor]:
    from transformers import LlamaConfig, LlamaForCausalLM

    from asyncrl.common.data.tasks import TASK_ALPHABET
    from asyncrl.common.tiny_models.character import init_model

    hidden, layers, intermediate = SHAPES[millions]
    init_model(folder, alphabet=TASK_ALPHABET, hidden=hidden, layers=layers, heads=8, intermediate=intermediate)
    model = LlamaForCausalLM(LlamaConfig.from_pretrained(folder))
    return {name: p.detach().add(0.001) for name, p in model.named_parameters()}


def start_actors(url: str, n: int, logs: Path) -> list[subprocess.Popen]:
    """``n`` rollout actors, actor ``i`` on core ``i``; their logs go to ``logs/a<i>.log`` (read by
    :func:`actor_figures`)."""
    actor = str(Path(sys.executable).parent / "rl-actor")
    procs = []
    for i in range(n):
        with open(logs / f"a{i}.log", "wb") as log:
            procs.append(
                subprocess.Popen(
                    [actor, "--run", RUN, "--id", f"a{i}"],  # the URL (with its password) in the environment
                    env={**os.environ, "VLLM_CPU_OMP_THREADS_BIND": str(i % os.cpu_count()), "ASYNCRL_REDIS_URL": url},
                    stdout=subprocess.DEVNULL,
                    stderr=log,
                )
            )
    return procs


def wait_ready(plane: ControlPlane, n: int, timeout_s: float = 600) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        live, _ = plane.registry.processes()
        if sum(h.kind == "actor" and h.state not in ("starting",) for h in live) >= n:
            return
        time.sleep(1)
    raise RuntimeError("actors did not start")


def wait_loaded(plane: ControlPlane, version: int, actors: set[str], timeout_s: float = 300) -> float:
    """Unix time at which the last of ``actors`` recorded ``weights.loaded`` for ``version`` in the audit trail
    (after its generation resumed; the same clock as the bench's, one machine)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        loaded = {}
        for entry_id, fields in plane.client.xrange(RunKeys(RUN).audit):
            line = entry_line(entry_id.decode(), fields)
            if line["event"] == "weights.loaded" and line.get("version") == version:
                loaded[line["who"]["process"]] = line["unix"]
        if actors <= loaded.keys():
            return max(loaded[a] for a in actors)
        time.sleep(0.05)
    raise RuntimeError(f"version {version} was not loaded by {sorted(actors)} within {timeout_s}s")


def asyncrl_sync(
    plane: ControlPlane, params: dict[str, torch.Tensor], repeats: int, bucket_mb: float
) -> dict[str, list[float]]:
    """Per version after the first: the learner's seconds to pack, seal (digest) and send it as a run does
    (``asyncrl``), of the digests alone (``digest``), and from the start of packing until both actors have loaded it
    (``asyncrl_loaded``)."""
    store = RedisStore(plane.client, RUN, 600)
    group = None
    times: dict[str, list[float]] = {"asyncrl": [], "digest": [], "asyncrl_loaded": []}
    for version in range(1, repeats + 2):
        started = time.time()
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
            ),
            version - 1,  # its place in the formation
        )
        if group is None:
            group = WeightGroup(GroupAddress("", RUN, 1, 0, 3, 600), store)
            group.self_check()
        group.send_packed(sealed.flats)
        sent = time.perf_counter() - start
        loaded = wait_loaded(plane, version, {"a0", "a1"}) - started
        if version > 1:  # the first one also pays for the group formation
            times["asyncrl"].append(sent)
            times["asyncrl_loaded"].append(loaded)
            hashed = time.perf_counter()
            seal_buckets(sealed.buckets, sealed.flats)
            times["digest"].append(time.perf_counter() - hashed)
        time.sleep(0.5)  # let the actors settle before the next version
    return times


_LOADED = re.compile(r"loaded new weights version=(\d+) .*")
_FIGURE = re.compile(r"(receive_s|verify_s|load_s)=([0-9.e-]+)")


def actor_figures(logs: Path, versions: range) -> dict[str, list[float]]:
    """Per version, the slower actor's ``receive_s``, ``verify_s`` and ``load_s`` from its ``loaded new weights`` line
    (what ``asyncrl_load`` timed around ``reload_weights`` in the worker)."""
    per_version: dict[int, dict[str, float]] = {v: {} for v in versions}
    for log in sorted(logs.glob("a*.log")):
        for line in log.read_text(errors="replace").splitlines():
            if (match := _LOADED.search(line)) and int(match[1]) in per_version:
                figures = per_version[int(match[1])]
                for name, value in _FIGURE.findall(line):
                    figures[name] = max(figures.get(name, 0.0), float(value))
    return {
        f"actor_{name.removesuffix('_s')}": [figures[name] for figures in per_version.values() if name in figures]
        for name in ("receive_s", "verify_s", "load_s")
    }


@dataclass(frozen=True)
class PlainGroup:
    """The plain receivers of :func:`raw_baselines`: how many, the dtype they receive (that of the parameters, one
    dtype for all), whether the per-parameter broadcasts run too, and the cores they are pinned to (receiver ``r`` on
    ``cores[r - 1]``, one torch thread; empty = not pinned)."""

    receivers: int = 2
    dtype: torch.dtype = torch.float32
    per_parameter: bool = True
    cores: tuple[int, ...] = ()


def _plain_member(url: str, rank: int, shapes: list[list[int]], repeats: int, plain: PlainGroup) -> None:
    if plain.cores:
        os.sched_setaffinity(0, {plain.cores[(rank - 1) % len(plain.cores)]})
        torch.set_num_threads(1)
    group = WeightGroup(GroupAddress(url, RUN, epoch=99, rank=rank, world_size=plain.receivers + 1, timeout_s=600))
    total = sum(torch.Size(s).numel() for s in shapes)
    for _ in range(repeats):
        group.broadcast(torch.empty(total, dtype=plain.dtype))
        for shape in shapes if plain.per_parameter else []:
            group.broadcast(torch.empty(shape, dtype=plain.dtype))


def raw_baselines(
    url: str, params: dict[str, torch.Tensor], repeats: int, plain: PlainGroup | None = None
) -> tuple[list[float], list[float]]:
    """Seconds of one ``broadcast`` of all of ``params`` as one flat tensor, and of one ``broadcast`` per parameter
    (empty when ``plain.per_parameter`` is off), from this process to plain receivers (:class:`PlainGroup`; by default
    two, float32, unpinned), ``repeats`` times each."""
    dtype = next(iter(params.values())).dtype
    plain = dataclasses.replace(plain or PlainGroup(), dtype=dtype)
    store = RedisStore(connect(url), RUN, 600)
    shapes = [list(p.shape) for p in params.values()]
    ctx = mp.get_context("spawn")
    members = [
        ctx.Process(target=_plain_member, args=(url, r, shapes, repeats, plain)) for r in range(1, plain.receivers + 1)
    ]
    for proc in members:
        proc.start()
    group = WeightGroup(GroupAddress("", RUN, epoch=99, rank=0, world_size=plain.receivers + 1, timeout_s=600), store)
    flat = torch.cat([p.reshape(-1) for p in params.values()])
    flat_times, per_param_times = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        group.broadcast(flat)
        flat_times.append(time.perf_counter() - start)
        if not plain.per_parameter:
            continue
        start = time.perf_counter()
        for p in params.values():
            group.broadcast(p.contiguous())
        per_param_times.append(time.perf_counter() - start)
    for proc in members:
        proc.join(60)
    return flat_times, per_param_times


def bare_reload(folder: Path, params: dict[str, torch.Tensor], repeats: int) -> list[float]:
    """Seconds of a bare ``reload_weights`` of ``params`` in a vLLM engine of ``folder`` (``bench/bare_reload.py``)."""
    weights = folder.parent / f"{folder.name}-params.safetensors"
    save_file({name: p.contiguous() for name, p in params.items()}, weights)
    out, log = folder.parent / f"{folder.name}-reload.json", folder.parent / f"{folder.name}-reload.log"
    script = Path(__file__).with_name("bare_reload.py")
    with open(log, "wb") as output:
        done = subprocess.run(
            [sys.executable, str(script), str(folder), str(weights), str(repeats), str(out)],
            stdout=output,
            stderr=subprocess.STDOUT,
            timeout=900,
        )
    if done.returncode != 0:
        tail = log.read_text(errors="replace")[-3000:]
        raise RuntimeError(f"bench/bare_reload.py exited with {done.returncode}:\n{tail}")
    return json.loads(out.read_text())


# --------------------------------------------------------------------------- receive, then load vs double-buffered


def _start_line(group: WeightGroup) -> float:
    """A barrier of the group: every rank is ready before the root sends, so a receiver's clock starts with it."""
    group.group.barrier().wait()
    return time.perf_counter()


def _receive_then_copy(group: WeightGroup, buckets: list[WeightBucket], live: dict[str, torch.Tensor]) -> None:
    """What an actor does today: every bucket received (``receive_all``), then loaded (here: copied into ``live``)."""
    flats = group.receive_all(buckets)
    for bucket, flat in zip(buckets, flats, strict=True):
        for name, view in unpack_bucket(bucket, flat):
            live[name].copy_(view)


def _nbytes(bucket: WeightBucket) -> int:
    return bucket.numel * torch_dtype(bucket.dtype).itemsize


def _double_buffered(group: WeightGroup, buckets: list[WeightBucket], shadow: dict[str, torch.Tensor]) -> None:
    """A receive thread fills two bucket buffers in turn while this thread copies the full one into ``shadow``:
    bucket k+1 arrives while bucket k is copied; bucket k+2 is received into k's buffer once k is copied."""
    free: queue.Queue[torch.Tensor] = queue.Queue()
    for _ in range(2):
        free.put(torch.empty(max(_nbytes(b) for b in buckets), dtype=torch.uint8))
    full: queue.Queue[tuple[torch.Tensor, torch.Tensor] | BaseException] = queue.Queue()

    def receive() -> None:
        try:
            for bucket in buckets:
                buffer = free.get()
                full.put((buffer, group.broadcast(buffer[: _nbytes(bucket)].view(torch_dtype(bucket.dtype)))))
        except BaseException as exc:  # reaches the copying thread, which raises it
            full.put(exc)

    receiver = threading.Thread(target=receive, daemon=True)
    receiver.start()
    for bucket in buckets:
        item = full.get()
        if isinstance(item, BaseException):
            raise item
        buffer, flat = item
        for name, view in unpack_bucket(bucket, flat):
            shadow[name].copy_(view)
        free.put(buffer)
    receiver.join()


def _buffering_member(url: str, rank: int, buckets: list[WeightBucket], repeats: int, results: mp.Queue) -> None:
    """A plain receiver: each version once received then copied into the live weights, once double-buffered into a
    shadow copy that then becomes the live one (the swap); puts both lists of seconds on ``results``."""
    torch.set_num_threads(1)  # one core per receiver, as each bench actor's engine has (two threads: 3× slower copies)
    group = WeightGroup(GroupAddress(url, RUN, epoch=98, rank=rank, world_size=3, timeout_s=600))
    live = {n: torch.zeros(s) for b in buckets for n, s in zip(b.names, b.shapes, strict=True)}
    shadow = {n: torch.zeros_like(t) for n, t in live.items()}
    serial, double = [], []
    for _ in range(repeats):
        start = _start_line(group)
        _receive_then_copy(group, buckets, live)
        serial.append(time.perf_counter() - start)
        start = _start_line(group)
        _double_buffered(group, buckets, shadow)
        live, shadow = shadow, live  # only now does the new version serve: never half-loaded
        double.append(time.perf_counter() - start)
    results.put((serial, double))


def buffering(url: str, params: dict[str, torch.Tensor], repeats: int, bucket_mb: float) -> dict[str, list[float]]:
    """Receive-all-then-load against double-buffered receive, to two plain processes, same buckets as ``asyncrl``
    (without digests); per version, the slower receiver's seconds from the start line until its weights are in."""
    buckets = plan_buckets(params, int(bucket_mb * 2**20))
    flats = [pack_bucket(bucket, params) for bucket in buckets]
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    members = [ctx.Process(target=_buffering_member, args=(url, r, buckets, repeats, results)) for r in (1, 2)]
    for proc in members:
        proc.start()
    group = WeightGroup(
        GroupAddress("", RUN, epoch=98, rank=0, world_size=3, timeout_s=600), RedisStore(connect(url), RUN, 600)
    )
    for _ in range(2 * repeats):
        _start_line(group)
        group.send_packed(flats)
    reports = [results.get(timeout=600) for _ in members]
    for proc in members:
        proc.join(60)
    return {
        "receive_then_copy": [max(times) for times in zip(*(r[0] for r in reports), strict=True)],
        "double_buffered": [max(times) for times in zip(*(r[1] for r in reports), strict=True)],
    }


def measure(millions: int, repeats: int, tmp: Path, bucket_mb: float) -> dict[str, float]:
    folder = tmp / f"model-{millions}m"
    params = make_model(folder, millions)
    logs = tmp / f"logs-{millions}m"
    logs.mkdir()
    with EmbeddedRedis(tmp / f"redis-{millions}") as redis:
        plane = ControlPlane(connect(redis.url), RUN)
        plane.run.publish_config(load_config(None, [f"run.name={RUN}", *engine_overrides(folder)]))
        actors = start_actors(redis.url, 2, logs)
        try:
            wait_ready(plane, 2)
            times = asyncrl_sync(plane, params, repeats, bucket_mb)
        finally:
            for proc in actors:
                proc.send_signal(signal.SIGTERM)
            for proc in actors:
                proc.wait(120)
        times |= actor_figures(logs, range(2, repeats + 2))
        times["raw_flat"], times["per_parameter"] = raw_baselines(redis.url, params, repeats)
        times |= buffering(redis.url, params, repeats, bucket_mb)
    times["bare_reload"] = bare_reload(folder, params, repeats)
    s = {name: statistics.median(values) for name, values in times.items()}
    s["raw_flat_plus_reload"] = s["raw_flat"] + s["bare_reload"]
    return {
        "parameters": sum(p.numel() for p in params.values()),
        "tensors": len(params),
        "bytes": sum(p.numel() * 4 for p in params.values()),
        **{f"{name}_s": round(value, 4) for name, value in s.items()},
        "asyncrl_vs_raw_flat": round(s["asyncrl"] / s["raw_flat"], 3),
        "asyncrl_loaded_vs_raw_flat_plus_reload": round(s["asyncrl_loaded"] / s["raw_flat_plus_reload"], 3),
        "per_parameter_vs_asyncrl": round(s["per_parameter"] / s["asyncrl"], 3),
        "double_buffered_vs_receive_then_copy": round(s["double_buffered"] / s["receive_then_copy"], 3),
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
        "2 CPU cores shared by all processes; bare reload in one vLLM engine on one core"
    )
    print(json.dumps(results))


if __name__ == "__main__":
    main()
