"""A weight group's broadcast across two hosts against the same on loopback, on one machine.

Two hosts are two Linux network namespaces joined by a veth pair, with addresses (10.78.0.1, 10.78.0.2) that exist only
inside them; a Redis on the first holds the groups' rendezvous. Two two-rank
:class:`asyncrl.common.weights.group.WeightGroup` s are formed through it, as the learner and the actors form theirs:

- ``across_hosts``: rank 0 on the first host, rank 1 on the second, each advertising its address
  (``$ASYNCRL_ADVERTISE_HOST``);
- ``loopback``: both ranks on the first host, neither advertising (gloo's default device, 127.0.0.1 here).

For each of ``--sizes`` (bytes) rank 0 broadcasts a float32 tensor ``--repeats`` times; the figure is rank 1's median
seconds until every byte has arrived. The multi-host e2e test (``tests/e2e/test_multi_host.py``) prints its run's own
``sync/seconds`` beside the model's bytes; these are the bare transfers to read them against.

    python bench/broadcast_hosts.py [--sizes 1234567 67108864] [--repeats 20]

Needs root and ``ip netns`` (iproute2). Prints one JSON object last: per size, ``across_hosts_<bytes>_s`` and
``loopback_<bytes>_s``, and each group's self-check seconds. No figure is asserted. Measured here (2 CPU cores shared
with other tests, two runs of 20 repeats; the same probes inside the multi-host test's finished run, under heavier
load, in brackets):

    bytes                   across hosts               loopback
    1,372,672 (the model)   0.70-0.94 ms (1.66 ms)     0.85-0.89 ms (1.11 ms)
    64 MiB                  29.2-40.6 ms (57.3 ms)     28.0-29.1 ms (35.4 ms)

The run itself took a median 0.11-0.12 s per version sent to two actor hosts (``sync/seconds``: packing, digests,
the manifest and the transfer), so the transfer is a small part of a sync at this size.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from asyncrl.cli.deploy import ADVERTISE_ENV  # noqa: E402
from asyncrl.common.plane.redis_server import find_redis_server  # noqa: E402

HOSTS = ("10.78.0.1", "10.78.0.2")
RUN = "bench-broadcast"
DEMO_MODEL_BYTES = 1_372_672
"""Default first size: the bytes a version of the demo's tiny model sends (``model_bytes`` in the e2e test's print)."""


def main() -> None:
    args = _parse()
    if args.probe:
        print(json.dumps(probe(*args.probe)))
        return
    names = {host: f"bch{os.getpid()}-{n}" for n, host in enumerate(HOSTS)}
    with tempfile.TemporaryDirectory() as folder:
        redis = None
        try:
            _make_hosts(names)
            redis, url_file = _start_redis(names[HOSTS[0]], Path(folder))
            figures = _measure(names, url_file, args.sizes, args.repeats)
        finally:
            if redis is not None:
                redis.terminate()
                redis.wait(30)
            for name in names.values():
                subprocess.run(["ip", "netns", "del", name], capture_output=True)
    print(json.dumps({"repeats": args.repeats, **figures}))


def _measure(names: dict[str, str], url_file: str, sizes: list[int], repeats: int) -> dict[str, float]:
    """Rank 1's figures of a group across the two hosts, then of one with both ranks on the first host."""
    figures: dict[str, float] = {}
    joined = ",".join(str(size) for size in sizes)
    for epoch, (label, pair) in enumerate((("across_hosts", HOSTS), ("loopback", (HOSTS[0],) * 2)), 1):
        received = _pair(names, pair, url_file, epoch, joined, repeats)
        figures[f"{label}_self_check_s"] = received["self_check_s"]
        figures |= {f"{label}_{size}_s": received["median_s"][str(size)] for size in sizes}
    return figures


def _parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[DEMO_MODEL_BYTES, 64 * 2**20], help="bytes")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--probe", nargs=6, metavar=("URL_FILE", "RUN", "EPOCH", "RANK", "SIZES", "REPEATS"),
                        help="internal: run one rank of a group")  # fmt: skip
    return parser.parse_args()


def probe(url_file: str, run: str, epoch: str, rank: str, sizes: str, repeats: str) -> dict:
    """One rank of a two-rank weight group: its self-check seconds and, per size, the median seconds of a broadcast."""
    import torch

    from asyncrl.common.weights.group import GroupAddress, WeightGroup

    url = Path(url_file).read_text().strip()
    group = WeightGroup(GroupAddress(url, run, epoch=int(epoch), rank=int(rank), world_size=2, timeout_s=60))
    figures = {"rank": int(rank), "self_check_s": group.self_check(), "median_s": {}}
    for size in sizes.split(","):
        tensor = torch.ones(int(size) // 4, dtype=torch.float32)
        seconds = []
        for _ in range(int(repeats)):
            start = time.perf_counter()
            group.broadcast(tensor)
            seconds.append(time.perf_counter() - start)
        figures["median_s"][size] = statistics.median(seconds)
    group.close()
    return figures


def _make_hosts(names: dict[str, str]) -> None:
    """Two namespaces, each with ``lo`` and an ``eth0`` holding its address; the two ``eth0`` are one veth pair."""
    name_a, name_b = names.values()
    for name in (name_a, name_b):
        _ip("netns", "add", name)
    _ip("link", "add", "eth0", "netns", name_a, "type", "veth", "peer", "name", "eth0", "netns", name_b)
    for address, name in names.items():
        _ip("-n", name, "addr", "add", f"{address}/24", "dev", "eth0")
        _ip("-n", name, "link", "set", "dev", "eth0", "up")
        _ip("-n", name, "link", "set", "dev", "lo", "up")


def _ip(*args: str) -> None:
    done = subprocess.run(["ip", *args], capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"ip {' '.join(args)}: {done.stderr.strip()} (this bench needs root and `ip netns`)")


def _start_redis(namespace: str, folder: Path) -> tuple[subprocess.Popen, str]:
    """A throwaway Redis bound to the first host's address; the file holding its URL."""
    folder.mkdir(parents=True, exist_ok=True)
    log = folder / "redis.log"
    cmd = ["ip", "netns", "exec", namespace, find_redis_server(), "--bind", HOSTS[0], "--port", "6379",
           "--save", "", "--appendonly", "no", "--dir", str(folder), "--logfile", str(log)]  # fmt: skip
    redis = subprocess.Popen(cmd)
    deadline = time.monotonic() + 30
    while "Ready to accept connections" not in (log.read_text() if log.exists() else ""):
        if redis.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"redis-server did not start: {log.read_text() if log.exists() else ''}")
        time.sleep(0.1)
    url_file = folder / "redis-url"
    url_file.write_text(f"redis://{HOSTS[0]}:6379/0\n")
    return redis, str(url_file)


def _pair(names: dict[str, str], pair: tuple[str, str], url_file: str, epoch: int, sizes: str, repeats: int) -> dict:
    """Both ranks of one group, each in its host's namespace; rank 1's figures."""
    ranks = []
    for rank, host in enumerate(pair):
        env = {k: v for k, v in os.environ.items() if k != ADVERTISE_ENV}
        if pair[0] != pair[1]:
            env[ADVERTISE_ENV] = host
        cmd = ["ip", "netns", "exec", names[host], sys.executable, str(Path(__file__).resolve()), "--probe",
               url_file, RUN, str(epoch), str(rank), sizes, str(repeats)]  # fmt: skip
        ranks.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True))
    outs = [proc.communicate(timeout=300)[0] for proc in ranks]
    if any(proc.returncode for proc in ranks):
        raise SystemExit(f"a probe failed: {outs}")
    return json.loads(outs[1].strip().splitlines()[-1])


if __name__ == "__main__":
    main()
