"""One rank of a two-rank weight group that times broadcasts: the multi-host test runs it across hosts and on loopback.

    python -m tests.helpers.broadcast_probe URL_FILE RUN EPOCH RANK SIZES REPEATS

Both ranks form :class:`common.weights.WeightGroup` (through the run's Redis, with the advertised address
``$ASYNCRL_ADVERTISE_HOST`` when set, as the learner and the actors do); for each size in ``SIZES`` (bytes, comma
separated) rank 0 broadcasts a float32 tensor of that size ``REPEATS`` times. Each rank prints one JSON object: the
self-check seconds and, per size, the median seconds of a broadcast (rank 1's end when every byte has arrived: the
figures to quote).
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

import torch

from common.weights import GroupAddress, WeightGroup


def main(url_file: str, run: str, epoch: str, rank: str, sizes: str, repeats: str) -> None:
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
    print(json.dumps(figures))


if __name__ == "__main__":
    main(*sys.argv[1:])
