"""The reload baseline of ``bench/weight_sync.py``: a bare vLLM ``reload_weights`` of a saved state dict.

One vLLM engine of the checkpoint in ``FOLDER``, set up as a rollout actor sets up its own (same engine arguments,
one core), with :class:`BareReloadExtension` mixed into its worker. Inside the worker the tensors of ``WEIGHTS`` (a
safetensors file) are read into memory untimed, then handed to ``model_runner.reload_weights`` ``REPEATS + 1`` times,
each timed; the first is dropped (the actor's first load is too). No group, no manifest, no digests: what loading
costs by itself. It runs as its own process so the engine's processes end with it.

    python bench/bare_reload.py FOLDER WEIGHTS REPEATS OUT

Writes a JSON list of seconds, one per timed reload, to ``OUT`` (vLLM logs to stdout, even at exit).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

EXTENSION = "bench.bare_reload.BareReloadExtension"


def engine_overrides(folder: Path) -> list[str]:
    """The config both the bench's actors and this engine start from (``--set`` overrides)."""
    return [
        f"model.path={folder}",
        "model.max_model_len=64",
        "rollout.max_new_tokens=16",
        "rollout.kv_cache_bytes=33554432",
        "weight_sync.timeout_s=600",
    ]


class BareReloadExtension:
    """Mixed into the vLLM worker (``worker_extension_cls``); called through ``collective_rpc``."""

    def bench_reload(self, weights_path: str, repeats: int) -> list[float]:
        """Seconds of ``repeats + 1`` reloads of the tensors in ``weights_path``, the first dropped."""
        from safetensors.torch import load_file

        weights = load_file(weights_path)
        seconds = []
        for _ in range(repeats + 1):
            start = time.perf_counter()
            self.model_runner.reload_weights(weights_iterator=iter(weights.items()), is_checkpoint_format=True)
            seconds.append(time.perf_counter() - start)
        return seconds[1:]


def reload_seconds(folder: Path, weights_path: Path, repeats: int) -> list[float]:
    """Start the engine as ``actors/engine.py`` does (synchronous ``LLM`` instead of ``AsyncLLM``) and time reloads."""
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "0"  # one core, as each bench actor has
    root = str(Path(__file__).resolve().parent.parent)  # the worker imports EXTENSION from it
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))
    from vllm import LLM, EngineArgs

    from asyncrl.actors.engine import engine_keywords
    from asyncrl.common.config import load_config

    config = load_config(None, engine_overrides(folder))
    llm = LLM(**engine_keywords(config, EngineArgs, has_gpu=False, extension=EXTENSION))
    return llm.collective_rpc("bench_reload", args=(str(weights_path), repeats))[0]


def main() -> None:
    folder, weights_path, repeats, out = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4])
    out.write_text(json.dumps(reload_seconds(folder, weights_path, repeats)))


if __name__ == "__main__":
    main()
