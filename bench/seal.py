"""What membership and scoring-what-is-trained cost per rollout group.

Figures for each group size (8 responses × ``--tokens`` tokens, int32 ids, float32 log-probs, int32 versions):

- ``seal_us``: sealing one encoded group (HMAC-SHA-256 over every frame) — the sender's added work in Python;
- ``push_pull_us``: one group PUSHed and PULLed (decoded and validated) over loopback ZeroMQ in one process, with
  neither seal nor CURVE (the bare channel, the baseline);
- ``push_pull_member_us``: the same on a channel as the run uses it: sealed, and CURVE with the keys every member
  derives from the run secret (encryption and authentication in libzmq's I/O threads, off the Python thread);
  ``member_overhead`` is its ratio to the baseline, ``member_added_us`` the difference: the whole per-message cost of
  admitting only the run's processes;
- ``decode_us``: the decode of a group's token ids with the tiny models' character tokenizer (what the reward worker
  scores and the learner checks).

Each figure is the median of ``--rounds`` rounds; both sides of each ratio run in the same process, alternating, on
the same core.

    python bench/seal.py [--tokens 64 1024 16384] [--groups 2000] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from asyncrl.common.tiny_models import synthetic
from asyncrl.common.transport.channel import PullChannel, PushChannel
from asyncrl.common.wire.messages import RolloutGroup, encode
from asyncrl.common.wire.seal import Seal


def per_group_us(fn, groups: int) -> float:
    started = time.perf_counter()
    for _ in range(groups):
        fn()
    return (time.perf_counter() - started) / groups * 1e6


def push_pull_us(frames: list, seal: Seal | None, groups: int) -> float:
    """Microseconds per group through PUSH → PULL (decode and validate included), in batches of 32."""
    pull = PullChannel("bench", RolloutGroup, hwm=64, seal=seal)
    push = PushChannel("bench", hwm=64, seal=seal)
    push.connect(pull.bind("tcp://127.0.0.1:0"))
    try:
        push.send_frames(frames)
        assert pull.recv(timeout_s=10) is not None  # connected
        started = time.perf_counter()
        for _ in range(groups // 32):
            for _ in range(32):
                push.send_frames(frames)
            for _ in range(32):
                assert pull.recv(timeout_s=10) is not None
        return (time.perf_counter() - started) / (groups // 32 * 32) * 1e6
    finally:
        push.close()
        pull.close()


def measure(tokens: int, groups: int, rounds: int) -> dict[str, float]:
    from asyncrl.common.data.tasks import TASK_ALPHABET
    from asyncrl.common.rewards.response_text import ResponseTexts
    from asyncrl.common.tiny_models.character import build_char_tokenizer

    tokenizer = build_char_tokenizer(TASK_ALPHABET)
    group = synthetic.rollout_group(8, tokens, seed=0, vocab_size=len(tokenizer))
    frames, seal = encode(group), Seal(bytes(32), "bench")
    plain, member = [], []
    for _ in range(rounds):
        plain.append(push_pull_us(frames, None, groups))
        member.append(push_pull_us(frames, seal, groups))
    texts = ResponseTexts(tokenizer)
    return {
        "bytes": sum(memoryview(f).nbytes for f in frames),
        "seal_us": round(per_group_us(lambda: seal.seal(frames), groups), 2),
        "push_pull_us": round(statistics.median(plain), 2),
        "push_pull_member_us": round(statistics.median(member), 2),
        "member_added_us": round(statistics.median(member) - statistics.median(plain), 2),
        "member_overhead": round(statistics.median(member) / statistics.median(plain), 3),
        "decode_us": round(per_group_us(lambda: texts.decode(group), max(groups // 10, 10)), 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[64, 1024, 16384])
    parser.add_argument("--groups", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    # Fewer groups of the largest sizes, so that each size takes about as long.
    figures = {f"{t}_tokens": measure(t, max(64, args.groups * 1024 // max(t, 1024)), args.rounds) for t in args.tokens}
    for name, row in figures.items():
        print(name, row)
    print(json.dumps({"responses_per_group": 8, "cores": "one process, one core", **figures}))


if __name__ == "__main__":
    main()
