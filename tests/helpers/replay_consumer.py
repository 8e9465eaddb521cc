"""The learner's replay consumer alone: ``python -m tests.helpers.replay_consumer URL RUN MAX_BYTES VOCAB``.

It reads the run's replay stream with :class:`asyncrl.common.plane.replay.ReplayReader` under the limits a learner uses
(``transport.max_message_mb``, the tokenizer's size), acknowledges every group it decodes (as a learner does once
the step that trained it is applied), and serves ``/metrics``; its first line on stdout is ``ready <port>``. It runs
until SIGTERM, then exits 0. A whole learner would add DeepSpeed to what the flood test measures, not another reader.
"""

from __future__ import annotations

import signal
import sys
import threading

from asyncrl.common.observability.logs import configure
from asyncrl.common.observability.metrics import serve
from asyncrl.common.plane.keys import RunKeys, connect
from asyncrl.common.plane.replay import ReplayReader
from asyncrl.common.wire.messages import Limits


def main(url: str, run: str, max_bytes: int, vocab_size: int) -> int:
    configure()
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    client = connect(url)
    reader = ReplayReader(client, RunKeys(run), limits=Limits(max_bytes, vocab_size))
    print(f"ready {serve(0, '127.0.0.1')}", flush=True)
    while not stop.is_set():
        entries = reader.read(count=256, block_ms=200)
        reader.ack(e.entry_id for e in entries)
    client.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])))
