"""The generation and reload baselines of ``bench/scale.py``: one vLLM engine set up as a rollout actor sets up its
own, with nothing of asyncrl around it.

``SPEC`` (JSON) names the run's config file and ``--set`` overrides; the engine is built from them with the actor's own
``engine_keywords`` and in the actor's layout (``rollout.cpu_single_process``: vLLM's worker inside this process, on
the cores this process was started on), with :class:`bench.bare_reload.BareReloadExtension` as its worker extension.
Then, timed in this process:

- ``generate``: vLLM's offline ``LLM.generate`` of the spec's prompts (token ids, templated as the learner makes them)
  with the actor's sampling settings (``n``, temperature, top-p, max tokens, the stop ids, one log-prob per token, no
  detokenizing) in one call, after an untimed warm-up call of one prompt; per repeat its wall seconds, this process's
  CPU seconds (its core's busy time) and the response tokens;
- ``reload``: ``model_runner.reload_weights`` of the tensors of the spec's ``weights`` file (when it names one),
  ``repeats`` times after an untimed first (``BareReloadExtension.bench_reload``).

With ``lora_adapter`` (a PEFT adapter folder) every request names that adapter, as a LoRA run's actor does. It runs as
its own process so that the engine's processes end with it.

    python bench/bare_engine.py SPEC OUT

Writes ``{"tokens", "wall_s", "cpu_s", "maxrss_bytes", "reload_s"}`` as JSON to ``OUT`` (vLLM logs to stdout).
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.bare_reload import EXTENSION

ROOT = Path(__file__).resolve().parent.parent


def start_engine(spec: dict[str, Any]) -> Any:
    """vLLM's offline ``LLM`` with the keywords a rollout actor gives its engine (``actors/engine.py``)."""
    from asyncrl.actors.engine import engine_keywords
    from asyncrl.actors.engine_processes import single_process, use_single_process
    from asyncrl.common.config import load_config

    config = load_config(spec["config"], spec["overrides"])
    if single_process(config.rollout, has_gpu=False):
        use_single_process(config.rollout.cpu_threads)
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    from vllm import LLM, EngineArgs

    return LLM(**engine_keywords(config, EngineArgs, has_gpu=False, extension=EXTENSION))


def generate(llm: Any, spec: dict[str, Any]) -> dict[str, list[float]]:
    """Per repeat: wall and CPU seconds of one ``generate`` of every prompt, and the response tokens it made."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    sampling = spec["sampling"]
    params = SamplingParams(
        n=sampling["n"],
        temperature=sampling["temperature"],
        top_p=sampling["top_p"],
        max_tokens=sampling["max_tokens"],
        stop_token_ids=sampling["stop_token_ids"] or None,
        logprobs=0,
        detokenize=False,
    )
    prompts = [TokensPrompt(prompt_token_ids=ids) for ids in spec["prompts"]]
    adapter = _adapter(spec.get("lora_adapter"))
    llm.generate(prompts[:1], params, use_tqdm=False, lora_request=adapter)  # warm-up
    figures: dict[str, list[float]] = {"tokens": [], "wall_s": [], "cpu_s": []}
    for _ in range(spec["repeats"]):
        wall, cpu = time.perf_counter(), time.process_time()
        outputs = llm.generate(prompts, params, use_tqdm=False, lora_request=adapter)
        figures["wall_s"].append(time.perf_counter() - wall)
        figures["cpu_s"].append(time.process_time() - cpu)
        figures["tokens"].append(sum(len(c.token_ids) for out in outputs for c in out.outputs))
    return figures


def _adapter(folder: str | None) -> Any:
    if not folder:
        return None
    from vllm.lora.request import LoRARequest

    return LoRARequest("bare", 1, folder)


def main() -> None:
    spec, out = json.loads(Path(sys.argv[1]).read_text()), Path(sys.argv[2])
    llm = start_engine(spec)
    figures: dict[str, Any] = generate(llm, spec)
    figures["maxrss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # before the reload's copy
    figures["reload_s"] = []
    if spec.get("weights"):
        figures["reload_s"] = llm.collective_rpc("bench_reload", args=(spec["weights"], spec["repeats"]))[0]
    out.write_text(json.dumps(figures))


if __name__ == "__main__":
    main()
