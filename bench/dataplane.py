"""Data-plane throughput: rollout groups through ZeroMQ into the replay stream and out to the learner.

Three measurements in one run, on the same payload (groups of 8 responses x 1,024 tokens:
int32 ids, float32 log-probs, int32 versions — about 98 KB a group):

- ``pipeline``: producer (encode, PUSH) -> bridge (PULL, decode and validate, score stand-in,
  XADD in pipelined batches) -> consumer (XREADGROUP, decode and validate, XACK); three processes.
- ``raw_xadd``: one client XADDs blobs of the same size, pipelined in the same batches
  (what ``redis-benchmark`` would do with a custom XADD command).
- ``raw_zmq``: PUSH -> PULL of the same frames, no encoding or validation.

Cores: redis-server runs on the last core; every Python process of the measurement on core 0, so
"the pipeline" is measured on one core as the goal states (>= 50% of raw XADD throughput).
Redis keeps its AOF (appendfsync everysec) on tmpfs when /dev/shm exists: every figure here
writes ~100 MB/s of AOF, and a shared disk's write-back bursts would otherwise decide the
ratios. The three measurements alternate for ``--rounds`` rounds; each figure is the median.
The last line printed is one JSON object with the figures and the ratios.

    python bench/dataplane.py [--seconds 4] [--rounds 3] [--samples 8] [--tokens 1024]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from asyncrl.common.tiny_models import synthetic
from asyncrl.common.wire.messages import encode, pack_frames

BATCH = 16
MAXLEN = 2000
HWM = 64


def pin(core: int) -> None:
    """Run this process on one core (if the machine allows it)."""
    if core in os.sched_getaffinity(0):
        os.sched_setaffinity(0, {core})


def run_producer(endpoint: str, samples: int, tokens: int) -> None:
    from asyncrl.common.transport.channel import PushChannel

    pin(0)
    push = PushChannel("bench", hwm=HWM)
    push.connect(endpoint)
    groups = [encode(synthetic.rollout_group(samples, tokens, seed=i)) for i in range(8)]
    i = 0
    while True:
        push.send_frames(groups[i % len(groups)])
        i += 1


def run_bridge(redis_url: str, endpoint_queue: mp.Queue) -> None:
    """The reward worker's data path with a constant score: PULL, decode, wrap, XADD."""
    import numpy as np

    from asyncrl.common.plane.keys import RunKeys, connect
    from asyncrl.common.plane.replay import ReplayWriter
    from asyncrl.common.transport.channel import PullChannel
    from asyncrl.common.wire.messages import RolloutGroup, ScoredGroup

    pin(0)
    pull = PullChannel("bench", RolloutGroup, hwm=HWM)
    endpoint_queue.put(pull.bind("tcp://127.0.0.1:0"))
    writer = ReplayWriter(connect(redis_url), RunKeys("bench"), maxlen=MAXLEN)
    while True:
        batch = [pull.recv(timeout_s=1.0)]
        while len(batch) < BATCH and (group := pull.recv(timeout_s=0)) is not None:
            batch.append(group)
        scored = [ScoredGroup(rollout=g, rewards=np.ones(g.num_samples, np.float32)) for g in batch if g]
        writer.add(scored)


def consume(redis_url: str, seconds: float) -> dict[str, float]:
    """Read, decode and acknowledge for ``seconds`` after the first entry arrives."""
    from asyncrl.common.plane.keys import RunKeys, connect
    from asyncrl.common.plane.replay import ReplayReader

    reader = ReplayReader(connect(redis_url), RunKeys("bench"))
    while not reader.read(count=1, block_ms=30_000):
        pass
    groups = nbytes = 0
    start = time.perf_counter()
    while (elapsed := time.perf_counter() - start) < seconds:
        entries = reader.read(count=BATCH, block_ms=200)
        reader.ack(e.entry_id for e in entries)
        groups += len(entries)
        nbytes += sum(_payload_bytes(e.group.rollout) for e in entries)
    return {"groups_per_s": groups / elapsed, "mb_per_s": nbytes / elapsed / 1e6}


def _payload_bytes(group) -> int:
    return group.token_ids.nbytes + group.logprobs.nbytes + group.versions.nbytes


def measure_pipeline(redis_url: str, seconds: float, samples: int, tokens: int) -> dict[str, float]:
    ctx = mp.get_context("spawn")
    endpoints: mp.Queue = ctx.Queue()
    bridge = ctx.Process(target=run_bridge, args=(redis_url, endpoints), daemon=True)
    bridge.start()
    producer = ctx.Process(target=run_producer, args=(endpoints.get(timeout=60), samples, tokens), daemon=True)
    producer.start()
    try:
        return consume(redis_url, seconds)
    finally:
        for proc in (producer, bridge):
            proc.terminate()
            proc.join(10)


def measure_raw_xadd(redis_url: str, seconds: float, blob: bytes, payload: int) -> dict[str, float]:
    from asyncrl.common.plane.keys import connect

    client = connect(redis_url)
    key = "asyncrl:bench:raw"
    count = 0
    start = time.perf_counter()
    while (elapsed := time.perf_counter() - start) < seconds:
        pipe = client.pipeline(transaction=False)
        for _ in range(BATCH):
            pipe.xadd(key, {b"m": blob}, maxlen=MAXLEN, approximate=True)
        pipe.execute()
        count += BATCH
    client.delete(key)
    return {"groups_per_s": count / elapsed, "mb_per_s": count * payload / elapsed / 1e6}


def _raw_zmq_sender(endpoint: str, frames: list[bytes]) -> None:
    import zmq

    pin(0)
    sock = zmq.Context.instance().socket(zmq.PUSH)
    sock.sndhwm = HWM
    sock.connect(endpoint)
    while True:
        sock.send_multipart(frames, copy=False)


def measure_raw_zmq(seconds: float, frames: list[bytes], payload: int) -> dict[str, float]:
    import zmq

    sock = zmq.Context.instance().socket(zmq.PULL)
    sock.rcvhwm = HWM
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    sender = mp.get_context("spawn").Process(
        target=_raw_zmq_sender, args=(f"tcp://127.0.0.1:{port}", frames), daemon=True
    )
    sender.start()
    try:
        sock.recv_multipart(copy=False)
        count = 0
        start = time.perf_counter()
        while (elapsed := time.perf_counter() - start) < seconds:
            sock.recv_multipart(copy=False)
            count += 1
        return {"groups_per_s": count / elapsed, "mb_per_s": count * payload / elapsed / 1e6}
    finally:
        sender.terminate()
        sender.join(10)
        sock.close(linger=0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=4.0, help="length of each measurement in each round")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of the three measurements (median kept)")
    parser.add_argument("--samples", type=int, default=8, help="responses per group")
    parser.add_argument("--tokens", type=int, default=1024, help="tokens per response")
    args = parser.parse_args()

    from asyncrl.common.plane.redis_server import EmbeddedRedis

    cores = sorted(os.sched_getaffinity(0))
    pin(0)
    group = synthetic.rollout_group(args.samples, args.tokens)
    frames = [bytes(memoryview(f)) for f in encode(group)]
    payload = _payload_bytes(group)
    scratch = "/dev/shm" if Path("/dev/shm").is_dir() else None
    rounds: dict[str, list[dict[str, float]]] = {"raw_xadd": [], "raw_zmq": [], "pipeline": []}
    sync = "everysec"  # the figures are of Redis, not of a disk (on tmpfs either way)
    with tempfile.TemporaryDirectory(dir=scratch) as tmp, EmbeddedRedis(Path(tmp) / "redis", appendfsync=sync) as redis:
        if len(cores) > 1:
            os.sched_setaffinity(redis.process.pid, {cores[-1]})
        for _ in range(args.rounds):
            blob = pack_frames(frames)
            rounds["raw_xadd"].append(measured(measure_raw_xadd, redis.url, args.seconds, blob, payload))
            rounds["raw_zmq"].append(measured(measure_raw_zmq, args.seconds, frames, payload))
            rounds["pipeline"].append(measured(measure_pipeline, redis.url, args.seconds, args.samples, args.tokens))
    raw_xadd, raw_zmq, pipeline = (_median(rounds[k]) for k in ("raw_xadd", "raw_zmq", "pipeline"))
    result = {
        "payload": {"samples": args.samples, "tokens": args.tokens, "bytes_per_group": payload},
        "cores": f"python processes on core 0; redis-server on core {cores[-1]} of {len(cores)}",
        "seconds_each": args.seconds,
        "rounds": args.rounds,
        "aof": "tmpfs" if scratch else "disk",
        "pipeline": _rounded(pipeline),
        "raw_xadd": _rounded(raw_xadd),
        "raw_zmq": _rounded(raw_zmq),
        "pipeline_vs_raw_xadd": round(pipeline["groups_per_s"] / raw_xadd["groups_per_s"], 3),
        "pipeline_vs_raw_zmq": round(pipeline["groups_per_s"] / raw_zmq["groups_per_s"], 3),
    }
    print(
        f"pipeline {pipeline['groups_per_s']:.0f} groups/s ({pipeline['mb_per_s']:.0f} MB/s); "
        f"raw XADD {raw_xadd['groups_per_s']:.0f}; raw ZeroMQ {raw_zmq['groups_per_s']:.0f}",
        file=sys.stderr,
    )
    print(json.dumps(result))


def _cpu_busy() -> dict[str, tuple[float, float]]:
    """Per-core (busy, total) jiffies from /proc/stat."""
    out = {}
    for line in Path("/proc/stat").read_text().splitlines():
        name, *fields = line.split()
        if name.startswith("cpu") and name != "cpu":
            values = [float(v) for v in fields]
            idle = values[3] + values[4]
            out[name] = (sum(values) - idle, sum(values))
    return out


def measured(fn, *args) -> dict[str, float]:
    """``fn(*args)``'s figures plus how busy each core was meanwhile (1.0 = saturated)."""
    before = _cpu_busy()
    figures = fn(*args)
    after = _cpu_busy()
    for core, (busy, total) in after.items():
        figures[f"{core}_busy"] = (busy - before[core][0]) / max(total - before[core][1], 1.0)
    return figures


def _median(figures: list[dict[str, float]]) -> dict[str, float]:
    return {k: statistics.median(f[k] for f in figures) for k in figures[0]}


def _rounded(figures: dict[str, float]) -> dict[str, float]:
    return {k: round(v, 2 if k.endswith("_busy") else 1) for k, v in figures.items()}


if __name__ == "__main__":
    main()
