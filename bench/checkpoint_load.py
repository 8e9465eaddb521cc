"""The learner's checkpoint load, timed, for ``bench/scale.py``.

``SPEC`` (JSON) names the run's config file and ``--set`` overrides. A one-rank ``PolicyEngine`` of that config is
started (untimed: DeepSpeed and the model), then the run's ``latest`` checkpoint is opened and checked against its
manifest as ``--resume`` does (``verify_s``: every file hashed) and loaded into the engine by the learner's own
``Checkpointer.load`` (``load_s``: weights, optimizer and scheduler state). Run by ``bench/scale.py`` pinned to the
learner's core, with the learner's thread count.

    python bench/checkpoint_load.py SPEC OUT

Writes ``{"verify_s", "load_s"}`` as JSON to ``OUT``.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> None:
    spec, out = json.loads(Path(sys.argv[1]).read_text()), Path(sys.argv[2])
    from asyncrl.common.config import load_config
    from asyncrl.learner.checkpoint.checkpointer import Checkpointer
    from asyncrl.learner.checkpoint.format import open_checkpoint
    from asyncrl.learner.checkpoint.history import find_checkpoint
    from asyncrl.learner.update.engine import PolicyEngine

    config = load_config(spec["config"], spec["overrides"])
    policy = PolicyEngine(config)
    start = time.perf_counter()
    checkpoint = open_checkpoint(find_checkpoint("latest", config.run_dir / "checkpoints"))
    verified = time.perf_counter() - start
    start = time.perf_counter()
    Checkpointer(config, policy).load(checkpoint)
    out.write_text(json.dumps({"verify_s": verified, "load_s": time.perf_counter() - start}))


if __name__ == "__main__":
    main()
