"""Peer benchmark: asyncrl against TRL's ``GRPOTrainer``, side by side, time-to-accuracy.

One invocation trains the same warm model three times, one after the other, on the same task, prompt order and
hyper-parameters: TRL ``GRPOTrainer`` (HF ``generate``), asyncrl synchronous (``staleness.max_staleness = 0``) and
asyncrl asynchronous (``max_staleness = 1``). Install TRL with ``pip install -e .[bench]``.

    python bench/peer.py [--steps 100] [--threshold 0.7] [--eval-every 5]
                         [--tasks arithmetic,reverse,long-tail,multi-turn] [--trl-threads 2] [--lr LR]
                         [--split learner=0,actor=1,frontend=0,reward=0] [--set SECTION.FIELD=VALUE ...]
                         [--size task|21m] [--no-sync]

``--size 21m`` gives every task's character model 21.0 M parameters (hidden 512, 8 layers) instead of its own (the
demo's 0.34 M, the long-tail task's 3.97 M), warm-started with the task's own steps and learning rate: the race at a
size where generation costs what it does at users' sizes. ``--no-sync`` leaves out the synchronous asyncrl run.

Four tasks (``TASKS``): two short-answer ones (``arithmetic``, ``reverse``), ``long-tail`` (counting, answers of 5 to
95 characters with a heavy tail, on an 11.6x larger model) and ``multi-turn`` (the agent preset: episodes with a
calculator tool; TRL through its ``environment_factory``, ``bench/peer_multi_turn.py``). About 30 minutes on 2 cores
for all four; ``--tasks arithmetic`` about 4.

What is the same in all three runs:

- the model: ``rl-learner init-model configs/demo.toml --warm-steps 120`` (tiny Llama, character tokenizer, float32),
  or ``--model PATH`` for the first task; every other task gets its own warm start on that task (the multi-turn task:
  ``rl-learner init-model configs/agent.toml --kind agent``);
- the prompts: the demo task (one-digit sums), drawn from ``random.Random(run.seed)`` in the order asyncrl's
  dispatcher draws them; TRL reads them in that order (``shuffle_dataset = False``); 16 prompts × 8 samples a step;
- the hyper-parameters, read from the resolved asyncrl config: lr (constant, no warm-up), AdamW betas and eps,
  no weight decay, gradient clip, KL 0 (``beta = 0``), clip ε low/high, temperature 1, top-p 1, max new tokens,
  one optimizer step per batch, token-mean loss over the batch (TRL ``loss_type = "dapo"``), advantages
  ``(r − mean) / std`` per group;
- the reward: asyncrl's verifier as the run binds it (``common.rewards.functions.run_verifier``), called by TRL's
  reward function;
- the evaluation: the run's ``[eval]`` set (``common.data.evaluation.eval_examples``: 64 held-out prompts drawn with
  ``eval.seed``), greedy, one response each, solved when the reward reaches ``eval.success_threshold``; at step 0,
  every ``--eval-every`` steps and the last. asyncrl evaluates with its own ``[eval]`` rounds (vLLM, greedy, rows
  ``eval/accuracy`` in metrics.jsonl); TRL evaluates with HF ``generate(do_sample=False)`` in a callback.

The clock: seconds since the end of step 1 (start-up excluded: vLLM, DeepSpeed and model loading; reported
apart as ``startup_s``). Time-to-accuracy is the clock at the first evaluated step whose greedy accuracy reaches
``--threshold``. The comparison leans towards TRL on purpose: TRL's evaluation time is taken off its clock (it
pauses training), asyncrl's eval rounds stay on ours (they share the actor with training). s/step and tokens/s
(response tokens sampled per second) are over steps 2..N.

Cores (DESIGN.md, "Measuring on a 2-core machine"; ``--split``): asyncrl's learner and reward worker on core 0
(1 torch thread), its one rollout actor's vLLM engine (bound to core 1) alone on core 1, pinned by this script with
``taskset``, and the actor's own process moved to core 0 once its engine is up (``rollout.frontend_cpus = "0"``;
the same split as ``rl-launch run --pin learner=0 --pin rewards=0 --pin actors=1 --set rollout.frontend_cpus=0``);
the actor keeps a whole step's 16 groups in flight (``rollout.max_groups_in_flight = 16``). TRL, one process, on
the same two cores (``--trl-threads`` torch threads, 2 by default). ``--set`` passes a config override to the asyncrl
runs.

Not like-for-like: asyncrl (async) trains one version stale with the token-truncated correction and the mismatch
guard; TRL's group std has ε = 1e-4, asyncrl's 1e-6; generation engines differ (vLLM vs HF ``generate``),
which is part of what is measured; TRL's sampling RNG is its own, so the two sample different responses to the
same prompts. Accuracy is on 64 prompts (one prompt = 0.016) and read every 5 steps, so time-to-accuracy moves
by a step or two between runs: read it together with s/step and the accuracy rows.

Measured (2026-12, 2 cores, defaults; TRL 2 threads, 0.100 s/step against 0.121 at 1 thread in a 30-step pilot):

    task        TRL s/step  sync s/step  async s/step  seconds to 0.7: TRL / sync / async  ratio sync / async
    arithmetic  0.074       0.370        0.256         1.9 / 10.8 / 9.6                     5.8 / 5.2
    reverse     0.197       0.621        0.412         15.9 / 36.1 / 31.4                   2.3 / 2.0

With OpenMP's passive waits and the one-process engine (the defaults since; one run, arithmetic): TRL 0.055,
sync 0.209, async 0.153 s/step; 0.9 accuracy in 4.6 / 10.4 / 9.0 s (the warm model started at 0.72).

The long-tail and multi-turn races, and the long-tail task's earlier form (copying letters), are in
docs/benchmarks.md.

Before the overhead work (π_old's own pass, two Redis commands per arriving group, the reward worker on the
actor's core, 8 groups in flight): arithmetic 0.096 / 0.471 / 0.427 s/step, reverse 0.204 / 0.745 / 0.560.

The last line of stdout is one JSON object: every figure, and ``ratio_sync`` / ``ratio_async`` = asyncrl's
time-to-accuracy over TRL's (null when either run did not reach the threshold). The table goes to stderr. A
benchmark: nothing here asserts a time.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
CONFIG = ROOT / "configs/demo.toml"


def cores_used(threads: int) -> str:
    """The process split of this invocation, in words (the summary's ``cores``)."""
    return (
        f"asyncrl: learner on cores {SPLIT['learner']} ({LEARNER_THREADS[0]} torch threads), 1 rollout actor (vLLM) "
        f"on core {SPLIT['actor']} with its frontend on core {SPLIT['frontend']}, 1 reward worker on core "
        f"{SPLIT['reward']}, pinned with taskset by bench/peer.py; "
        f"TRL: one process on cores 0-1 ({threads} torch threads)"
    )


@dataclass(frozen=True)
class PeerTask:
    overrides: tuple[str, ...]
    """``--set`` overrides of configs/demo.toml for this task (training and eval prompts, response length)."""
    warm_steps: int
    """Supervised warm-start steps that leave the tiny model at partial skill on it."""
    threshold: float
    """Held-out greedy accuracy that time-to-accuracy is measured to (``--threshold`` sets the first task's)."""
    shape: tuple[str, ...] = ()
    """``rl-learner init-model`` options for the model's size (the demo's 0.34 M parameters when empty)."""
    config: Path = CONFIG
    """The asyncrl config the task's overrides apply to."""
    kind: str = "task"
    """``rl-learner init-model --kind``: ``task`` (the character model) or ``agent`` (the tool-chat model)."""


LONG_TAIL_WARM_STEPS = 300
"""Supervised warm-start steps of the long-tail model (batch 32, lr 1e-3, about 2.5 minutes on 2 threads). At 500
steps it is at greedy 0.70, at 600 (with counts from 1) it no longer explores: its samples agree with each other."""
TASKS: dict[str, PeerTask] = {
    # the demo's task: one-digit sums, responses of 1-2 characters and EOS; ~0.5 greedy accuracy after the warm start
    "arithmetic": PeerTask((), 120, 0.7),
    # reversing 5-8 letters: responses of 6-9 tokens, so generation takes a larger share of a step; ~0.3 after it
    "reverse": PeerTask(
        (
            "task.name=reverse",
            "task.options={ min_length = 5, max_length = 8 }",
            "eval.name=reverse",
            "eval.options={ min_length = 5, max_length = 8 }",
            "rollout.max_new_tokens=10",
        ),
        350,
        0.7,
    ),
    # long-tail: counting 2-32 two-digit numbers (``ct:17,21=`` → ``17 18 19 20 21``), counts Pareto(1): half the
    # answers are 2-3 numbers, one in six 12 or more, one in sixteen all 32 (95 characters), and a model that misses
    # the end runs on to max_new_tokens. Prompts are 9 characters, so a long answer costs sampling, not reading. A
    # 3.97 M-parameter model (hidden 256, 6 layers: 11.6x the demo's); after the warm start (300 steps, ~2.5 min):
    # greedy 0.40 on 256 held-out prompts (0.52 of counts 2-4, 0.17 of 5-12, 0.17 of 13 or more); it counts right
    # and runs past the end. Sampled, 89% of the groups of counts 2-4 hold both right and wrong answers. Rewarded
    # only for exact answers, every policy learns to stop early (right for a third of the prompts) and stays there;
    # with partial credit (``prefix``: the numbers right from the start, over the longer of the two) TRL and asyncrl
    # synchronous reach 0.5 held-out from 0.33 in 30-40 steps and stay near it, so 0.5 is the threshold.
    "long-tail": PeerTask(
        (
            "task.name=count",
            "task.options={ min_length = 2, max_length = 32, tail = 1.0 }",
            "eval.name=count",
            "eval.options={ min_length = 2, max_length = 32, tail = 1.0 }",
            "rollout.max_new_tokens=100",
            "model.max_model_len=128",
            "learner.micro_batch_size=16",  # asyncrl's learner: 8 passes, each cut to its own longest row
            # partial credit for the numbers right from the start (held-out accuracy stays exact answers)
            'reward.functions=[{ name = "task", options = { verifier = "prefix" } }]',
        ),
        LONG_TAIL_WARM_STEPS,
        0.5,
        ("--hidden", "256", "--layers", "6", "--lr", "1e-3", "--threads", "2"),
    ),
    # multi-turn: the agent preset (configs/agent.toml): two-digit products with the calculator tool, up to 3 model
    # turns of 64 tokens; the tiny tool-chat model warm-started on episodes of which 4 in 10 call the tool. TRL trains
    # through its environment_factory on the same environment (bench/peer_multi_turn.py).
    "multi-turn": PeerTask((), 600, 0.9, config=ROOT / "configs/agent.toml", kind="agent"),
}
SIZES: dict[str, tuple[str, ...]] = {
    "task": (),  # each task's own model: the demo's 0.34 M parameters, the long-tail task's 3.97 M
    "21m": ("--hidden", "512", "--layers", "8"),  # 21.0 M parameters: 10 h² a layer (4 h² attention, 6 h² MLP)
}
"""``--size``: the character model's widths for every task of the invocation (``rl-learner init-model --hidden
--layers``; an MLP twice the hidden size, 4 heads), the task's own warm-start options kept."""
THRESHOLDS = (0.5, 0.6, 0.7, 0.8, 0.9)
"""Also reported: time-to-accuracy at each of these."""


# --------------------------------------------------------------------------- shared set-up


def resolved(overrides: list[str], config: Path = CONFIG):
    from asyncrl.common.config import load_config

    return load_config(config, overrides)


def sized(spec: PeerTask, size: str) -> PeerTask:
    """``spec`` with the model widths of ``size`` (:data:`SIZES`): its own ``--hidden`` and ``--layers`` replaced, its
    other warm-start options (learning rate, threads) kept; two warm-start threads where it named none."""
    if not SIZES[size]:
        return spec
    pairs = zip(spec.shape[::2], spec.shape[1::2], strict=True)  # (flag, value)
    kept = [part for flag, value in pairs if flag not in ("--hidden", "--layers") for part in (flag, value)]
    threads = [] if "--threads" in kept else ["--threads", "2"]
    return dataclasses.replace(spec, shape=(*SIZES[size], *kept, *threads))


def init_model(folder: Path, task_overrides: list[str], warm_steps: int, spec: PeerTask = TASKS["arithmetic"]) -> None:
    sets = [a for o in [*task_overrides, f"model.path={folder}"] for a in ("--set", o)]
    cmd = [str(BIN / "rl-learner"), "init-model", str(spec.config), *sets, "--warm-steps", str(warm_steps)]
    cmd += ["--kind", spec.kind, *spec.shape]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def clock_figures(times: dict[int, float], tokens: dict[int, float], accuracy: dict[int, float], threshold: float):
    """s/step, tokens/s, steps and seconds to ``threshold`` from per-step end times (seconds since any origin)."""
    last = max(times)
    start = times[1]
    span = times[last] - start
    clock = {step: (times[step] - start if step >= 1 else 0.0) for step in times} | {0: 0.0}

    def first(level: float) -> int | None:
        return next((s for s in sorted(accuracy) if accuracy[s] >= level), None)

    reached = first(threshold)
    return {
        "steps": last,
        "s_per_step": span / max(last - 1, 1),
        "tokens_per_s": sum(tokens[s] for s in tokens if s >= 2) / max(span, 1e-9),
        "steps_to_accuracy": reached,
        "time_to_accuracy_s": None if reached is None else clock[reached],
        "accuracy": {str(s): round(a, 4) for s, a in sorted(accuracy.items())},
        "final_accuracy": accuracy[max(accuracy)] if accuracy else None,
        "time_to": {str(t): (None if first(t) is None else clock[first(t)]) for t in THRESHOLDS},
    }


# --------------------------------------------------------------------------- TRL (a child process)


def trl_child(spec_file: Path, out_file: Path) -> None:
    """Train with TRL's GRPOTrainer as ``spec_file`` says; write per-step times, tokens and eval accuracies."""
    spec = json.loads(spec_file.read_text())
    import torch

    torch.set_num_threads(spec["threads"])
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOTrainer

    config = resolved(spec["overrides"], Path(spec["config"]))
    tokenizer = AutoTokenizer.from_pretrained(config.model.path)
    model = AutoModelForCausalLM.from_pretrained(config.model.path, dtype=torch.float32)
    tools: dict[str, Any] = {}
    if config.rollout.workflow == "multi_turn":
        import peer_multi_turn

        os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
        peer_multi_turn.prepare_tokenizer(tokenizer)
        tools["environment_factory"] = peer_multi_turn.environment_class(config.environment.options)
    record = TrlRecord(config, tokenizer)
    model.generate = record.timed(model.generate)
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=record.episode_reward if tools else record.reward,
        args=trl_args(config, spec["out"], record.longest_prompt()),
        train_dataset=Dataset.from_list(training_prompts(config, chat=bool(tools))),
        processing_class=tokenizer,
        callbacks=[record.callback()],
        **tools,
    )
    trainer.train()
    out_file.write_text(json.dumps(record.figures()))


def training_prompts(config, chat: bool = False) -> list[dict[str, Any]]:
    """The run's prompt stream as asyncrl's dispatcher draws it (``random.Random(run.seed)``), one step's worth more;
    ``chat``: each prompt a user message, for TRL to render with the chat template and the environment's tools."""
    import random

    from asyncrl.learner.intake.dispatcher import prompt_source

    task, _ = prompt_source(config.task)
    rng = random.Random(config.run.seed)
    count = (config.learner.steps + 1) * config.learner.groups_per_step
    examples = [task.sample(rng) for _ in range(count)]
    if chat:
        return [{"prompt": [{"role": "user", "content": e.prompt}], "answer": e.answer} for e in examples]
    return [{"prompt": e.prompt, "answer": e.answer} for e in examples]


def trl_args(config, out: str, longest_prompt: int = 0):
    """GRPOConfig with the asyncrl run's hyper-parameters (see the module docstring); a multi-turn run's episode
    fits the context its longest prompt leaves (``longest_prompt`` tokens)."""
    from trl import GRPOConfig

    from asyncrl.learner.update.engine import ADAM_BETAS, ADAM_EPS

    clip = config.algorithm.loss_options
    learner, rollout = config.learner, config.rollout
    episodes: dict[str, Any] = {}
    if rollout.workflow == "multi_turn":
        episodes = {
            "max_tool_calling_iterations": config.environment.max_turns - 1,
            "max_completion_length": config.model.max_model_len - longest_prompt,
            "generation_kwargs": {"max_new_tokens": rollout.max_new_tokens},
        }
    return GRPOConfig(
        output_dir=out,
        max_steps=learner.steps,
        per_device_train_batch_size=learner.groups_per_step * rollout.num_samples,
        gradient_accumulation_steps=1,
        num_generations=rollout.num_samples,
        num_iterations=1,
        max_completion_length=episodes.pop("max_completion_length", rollout.max_new_tokens),
        temperature=rollout.temperature,
        top_p=rollout.top_p,
        top_k=0,
        learning_rate=learner.lr,
        lr_scheduler_type="constant",
        warmup_steps=learner.warmup_steps,
        weight_decay=learner.weight_decay,
        max_grad_norm=learner.grad_clip,
        adam_beta1=ADAM_BETAS[0],
        adam_beta2=ADAM_BETAS[1],
        adam_epsilon=ADAM_EPS,
        beta=clip.get("kl_coef", 0.0),
        epsilon=clip.get("clip_low", 0.2),
        epsilon_high=clip.get("clip_high", 0.2),
        loss_type="dapo",  # token-mean over the whole batch, as asyncrl's token_mean aggregation
        scale_rewards="group",
        shuffle_dataset=False,
        seed=config.run.seed,
        bf16=False,
        use_cpu=True,
        disable_dropout=True,
        report_to="none",
        save_strategy="no",
        logging_steps=1,
        dataloader_num_workers=0,
        **episodes,
    )


class TrlRecord:
    """The TRL run's reward function and callback: scores with asyncrl's verifier, counts response tokens per step,
    stamps the end of every step and evaluates greedily (its time taken off the clock)."""

    def __init__(self, config, tokenizer) -> None:
        from asyncrl.common.data.evaluation import eval_examples, eval_groups, eval_max_new_tokens
        from asyncrl.common.environments.protocol import run_prompter
        from asyncrl.common.rewards.functions import run_verifier

        self.config, self.tokenizer = config, tokenizer
        self.multi_turn = config.rollout.workflow == "multi_turn"
        # a multi-turn run is scored by its environment (episode_reward); the others by the run's bound verifier
        self.verify = None if self.multi_turn else run_verifier(config)
        self.prompter = run_prompter(tokenizer, config)
        self.examples = eval_examples(config, self.prompter)
        self.groups = eval_groups(config, self.examples, self.prompter.encode, step=0, version=0)
        self.max_new = eval_max_new_tokens(config)
        self.tokens: list[int] = []
        self.lengths: list[int] = []
        self.generate_s = 0.0
        self.evaluating = False
        self.times: dict[int, float] = {}
        self.accuracy: dict[int, float] = {}
        self.eval_s = 0.0
        self.born = time.perf_counter()
        self.start = self.born

    def callback(self):
        """A TrainerCallback calling this record's hooks (transformers is imported only in the TRL child)."""
        from transformers import TrainerCallback

        hooks = {"on_train_begin": self.on_train_begin, "on_step_end": self.on_step_end}
        return type("TrlRecordCallback", (TrainerCallback,), hooks)()

    def timed(self, generate):
        """``model.generate`` with its training-time seconds added to ``generate_s`` (evaluation's are not)."""

        def timed_generate(*args: Any, **kwargs: Any):
            started = time.perf_counter()
            try:
                return generate(*args, **kwargs)
            finally:
                if not self.evaluating:
                    self.generate_s += time.perf_counter() - started

        return timed_generate

    def longest_prompt(self) -> int:
        """Tokens of the longest training prompt as asyncrl renders it."""
        return max(len(self.prompter.encode(row["prompt"])) for row in training_prompts(self.config))

    def episode_reward(self, completions, completion_ids, environments, **_: Any) -> list[float]:
        """A multi-turn run's reward: each episode's score by its environment (``bench/peer_multi_turn.py``)."""
        from peer_multi_turn import episode_rewards

        self.tokens.append(sum(len(ids) for ids in completion_ids))
        self.lengths += [len(ids) for ids in completion_ids]
        return episode_rewards(completions, completion_ids, environments, self.tokenizer.eos_token_id)

    def reward(self, prompts, completions, answer, completion_ids, **_: Any) -> list[float]:
        self.tokens.append(sum(len(ids) for ids in completion_ids))
        self.lengths += [len(ids) for ids in completion_ids]
        return [float(self.verify(c, a)) for c, a in zip(completions, answer, strict=True)]

    def on_train_begin(self, args, state, control, model=None, **_: Any) -> None:
        self.evaluate(model, 0)
        self.start = time.perf_counter()
        self.eval_s = 0.0
        self.generate_s = 0.0

    def on_step_end(self, args, state, control, model=None, **_: Any) -> None:
        step = state.global_step
        self.times[step] = time.perf_counter() - self.start - self.eval_s
        if step % self.config.eval.every == 0 or step == state.max_steps:
            self.evaluate(model, step)

    def evaluate(self, model, step: int) -> None:
        started, self.evaluating = time.perf_counter(), True
        was_training = model.training
        model.eval()
        if self.multi_turn:
            from peer_multi_turn import solved_share

            stop_ids = tuple(self.prompter.stop_ids)
            self.accuracy[step] = solved_share(self.config, model, self.tokenizer, self.groups, stop_ids)
        else:
            self.accuracy[step] = self.greedy_accuracy(model)
        model.train(was_training)
        self.eval_s += time.perf_counter() - started
        self.evaluating = False

    def greedy_accuracy(self, model) -> float:
        import torch

        self.tokenizer.padding_side = "left"
        batch = self.tokenizer([e.prompt for e in self.examples], return_tensors="pt", padding=True)
        with torch.no_grad():
            out = model.generate(
                **batch, do_sample=False, max_new_tokens=self.max_new, pad_token_id=self.tokenizer.pad_token_id
            )
        texts = self.tokenizer.batch_decode(out[:, batch["input_ids"].shape[1] :], skip_special_tokens=True)
        solved = [
            self.verify(t, e.answer) >= self.config.eval.success_threshold
            for t, e in zip(texts, self.examples, strict=True)
        ]
        return sum(solved) / len(solved)

    def figures(self) -> dict[str, Any]:
        return {
            "times": self.times,
            "tokens": dict(enumerate(self.tokens, start=1)),
            "accuracy": self.accuracy,
            "startup_s": self.times[1] + self.start - self.born,
            "eval_s": self.eval_s,
            "generate_s": self.generate_s,
            "lengths": self.lengths,
        }


def run_trl(tmp: Path, overrides: list[str], threshold: float, threads: int, config: Path = CONFIG) -> dict[str, Any]:
    spec, out = tmp / "trl-spec.json", tmp / "trl-figures.json"
    settings = {"overrides": overrides, "threads": threads, "out": str(tmp / "trl"), "config": str(config)}
    spec.write_text(json.dumps(settings))
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false", "CUDA_VISIBLE_DEVICES": ""}
    cmd = ["taskset", "-c", "0,1", sys.executable, __file__, "--trl-child", str(spec), str(out)]
    started = time.time()
    log = tmp / "trl.log"
    with log.open("w") as sink:
        code = subprocess.run(cmd, env=env, stdout=sink, stderr=subprocess.STDOUT, timeout=3600).returncode
    if code:
        raise RuntimeError(f"TRL run exited with {code}:\n{log.read_text()[-3000:]}")
    raw = json.loads(out.read_text())
    as_int = {k: {int(s): v for s, v in raw[k].items()} for k in ("times", "tokens", "accuracy")}
    figures = clock_figures(as_int["times"], as_int["tokens"], as_int["accuracy"], threshold)
    return figures | {
        "startup_s": raw["startup_s"],
        "eval_s_off_clock": raw["eval_s"],
        "wall_s": time.time() - started,
        "generation_share": raw["generate_s"] / max(as_int["times"][max(as_int["times"])], 1e-9),
        "response_tokens": length_figures(raw["lengths"]),
    }


LENGTH_BINS = (4, 8, 16, 32, 64, 128)
"""Upper ends of the response-length histogram's bins (tokens, the end of sequence included)."""


def length_figures(lengths: list[int]) -> dict[str, Any]:
    """Mean, p50, p95, max and a histogram (share of responses per :data:`LENGTH_BINS` bin) of response lengths."""
    ordered = sorted(lengths)
    if not ordered:
        return {}
    low, histogram = 0, {}
    for high in LENGTH_BINS:
        histogram[f"{low + 1}-{high}"] = sum(low < n <= high for n in ordered) / len(ordered)
        low = high
    histogram[f">{low}"] = sum(n > low for n in ordered) / len(ordered)
    return {
        "mean": sum(ordered) / len(ordered),
        "p50": ordered[len(ordered) // 2],
        "p95": ordered[int(0.95 * (len(ordered) - 1))],
        "max": ordered[-1],
        "histogram": histogram,
    }


# --------------------------------------------------------------------------- asyncrl (hand-pinned processes)


def pinned(cores: str, cmd: list[str]) -> list[str]:
    return ["taskset", "-c", cores, *cmd]


SPLIT = {"learner": "0", "actor": "1", "frontend": "0", "reward": "0"}
"""The cores each asyncrl process is pinned to (``--split``). The actor's vLLM engine gets a core of its own: the
learner idles most of a step (70% with the reward worker on the actor's core), and generation is what a step waits
for. Once the engine is up, the actor's own process (vLLM's frontend, streaming every token) moves to the learner's
core (``rollout.frontend_cpus``): 15–25% off async s/step and 8–21% off sync in two A/B pairs of 60 steps."""


LEARNER_THREADS = [1]
"""The asyncrl learner's torch threads (``--learner-threads``); give it as many cores in ``--split``."""


def parse_split(text: str) -> dict[str, str]:
    """``learner=0,actor=1,frontend=0,reward=0`` → the cores of each role (every role named once)."""
    split = dict(part.split("=", 1) for part in text.split(","))
    if set(split) != set(SPLIT):
        raise SystemExit(f"--split names each of {', '.join(SPLIT)} once, e.g. learner=0,actor=1,frontend=0,reward=0")
    return split


def run_asyncrl(
    tmp: Path, overrides: list[str], staleness: int, threshold: float, name: str = "", config_file: Path = CONFIG
) -> dict[str, Any]:
    """One asyncrl run (each process pinned to its cores of :data:`SPLIT`) and its figures; ``name``: the run's
    folder under ``tmp`` (default ``asyncrl-staleness-<staleness>``)."""
    from asyncrl.common.plane.control import ControlPlane
    from asyncrl.common.plane.keys import connect
    from asyncrl.common.plane.redis_server import EmbeddedRedis

    name = name or f"asyncrl-staleness-{staleness}"
    overrides = [*overrides, f"run.root={tmp}", f"run.name={name}", f"staleness.max_staleness={staleness}"]
    overrides.insert(0, f"rollout.frontend_cpus={SPLIT['frontend']}")  # first: --set may say otherwise
    config = resolved(overrides, config_file)
    env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": SPLIT["actor"], "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"}
    logs = tmp / name / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    started = time.time()
    with EmbeddedRedis(tmp / name / "redis") as redis:
        ControlPlane(connect(redis.url), name).run.publish_config(config)
        env["ASYNCRL_REDIS_URL"] = redis.url  # not in argv: the URL carries the password
        common = ["--run", name]
        helpers = [
            start(logs / "reward.log", pinned(SPLIT["reward"], [str(BIN / "rl-actor"), "reward", *common]), env),
            start(logs / "actor.log", pinned(SPLIT["actor"], [str(BIN / "rl-actor"), *common, "--id", "a0"]), env),
        ]
        learner_cmd = [str(BIN / "rl-learner"), "train", str(config_file)]
        learner_cmd += [a for o in overrides for a in ("--set", o)]
        try:
            learner_env = env | {"OMP_NUM_THREADS": str(LEARNER_THREADS[0])}
            learner = start(logs / "learner.log", pinned(SPLIT["learner"], learner_cmd), learner_env)
            code = learner.wait(3600)
        finally:
            for proc in helpers:
                proc.send_signal(signal.SIGTERM)
            for proc in helpers:
                proc.wait(120)
    if code:
        raise RuntimeError(f"learner of {name} exited with {code}; see {logs / 'learner.log'}")
    return asyncrl_figures(tmp / name / "metrics.jsonl", started, threshold) | {"wall_s": time.time() - started}


def start(log: Path, cmd: list[str], env: dict[str, str]) -> subprocess.Popen:
    with log.open("w") as sink:
        return subprocess.Popen(cmd, stdout=sink, stderr=subprocess.STDOUT, env=env)


def asyncrl_figures(metrics: Path, started: float, threshold: float) -> dict[str, Any]:
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    train = [r for r in rows if "eval/step" not in r]
    times = {int(r["step"]): r["time"] for r in train}
    tokens = {int(r["step"]): r["rollout/tokens"] for r in train}
    accuracy = {int(r["eval/step"]): r["eval/accuracy"] for r in rows if "eval/step" in r}
    figures = clock_figures(times, tokens, accuracy, threshold)
    return figures | {
        "startup_s": times[1] - started,
        "idle_fraction": sum(r["step/idle_fraction"] for r in train[1:]) / max(len(train) - 1, 1),
        "staleness_max": max(r["rollout/staleness_max"] for r in train),
        "eval_missing": sum(r.get("eval/missing", 0) for r in rows if "eval/step" in r),
        "response_tokens": {
            statistic: sum(r.get(f"rollout/response_tokens_{statistic}", 0.0) for r in train) / len(train)
            for statistic in ("mean", "p50", "p95", "max")
        },
        **offpolicy_figures(train),
    }


def offpolicy_figures(train: list[dict[str, Any]]) -> dict[str, float]:
    """The mismatch between μ and π_old over a run's steps, and what the guard dropped."""
    kl = [r.get("train/offpolicy/mismatch_kl", 0.0) for r in train]
    dropped = [r.get("train/offpolicy/dropped_frac", 0.0) for r in train]
    return {
        "mismatch_kl_mean": sum(kl) / len(kl),
        "mismatch_kl_max": max(kl),
        "dropped_frac_mean": sum(dropped) / len(dropped),
        "steps_with_drops": float(sum(d > 0 for d in dropped)),
    }


# --------------------------------------------------------------------------- report


def compare(tmp: Path, task: str, args: argparse.Namespace, first: bool) -> dict[str, Any]:
    """The three runs of ``task`` on one warm model (two with ``--no-sync``)."""
    spec = sized(TASKS[task], args.size)
    task_overrides = list(spec.overrides)
    threshold = args.threshold if first and args.threshold is not None else spec.threshold
    (tmp / task).mkdir(parents=True, exist_ok=True)
    model = args.model if first else None
    if model is None:
        model = tmp / f"model-{task}"
        warm_steps = args.warm_steps if first and args.warm_steps is not None else spec.warm_steps
        init_model(model, task_overrides, warm_steps, spec)
    overrides = [
        *task_overrides,
        f"model.path={model.resolve()}",
        f"learner.steps={args.steps}",
        f"run.seed={args.seed}",
        *([f"learner.lr={args.lr}"] if args.lr is not None else []),
        f"eval.every={args.eval_every}",
        f"eval.limit={args.eval_limit}",
        "eval.temperature=0",
        "eval.num_samples=1",
        "rollout.max_groups_in_flight=16",  # a whole step's groups in one engine batch (the demo keeps 8)
    ]
    runs: dict[str, Any] = {"trl": None, "asyncrl_sync": None, "asyncrl_async": None}
    for key in [k for k in runs if not (args.no_sync and k == "asyncrl_sync")]:
        say(f"[peer] {task}: {key} ...")
        if key == "trl":
            runs[key] = run_trl(tmp / task, overrides, threshold, args.trl_threads, spec.config)
        else:
            staleness = 0 if key == "asyncrl_sync" else 1
            runs[key] = run_asyncrl(tmp / task, [*overrides, *args.set], staleness, threshold, config_file=spec.config)
    trl = runs["trl"]
    modes = [m for m in ("sync", "async") if runs[f"asyncrl_{m}"] is not None]
    ratios: dict[str, Any] = {f"ratio_{m}": None for m in ("sync", "async")}
    ratios |= {f"s_per_step_ratio_{m}": None for m in ("sync", "async")}
    ratios["ratio_at"] = {}
    for mode in modes:
        ours = runs[f"asyncrl_{mode}"]
        ratios[f"ratio_{mode}"] = _ratio(ours["time_to_accuracy_s"], trl["time_to_accuracy_s"])
        ratios[f"s_per_step_ratio_{mode}"] = ours["s_per_step"] / trl["s_per_step"]
        ratios["ratio_at"][mode] = {t: _ratio(ours["time_to"][t], trl["time_to"][t]) for t in trl["time_to"]}
    run = resolved(overrides, spec.config)
    shape = f"{run.learner.groups_per_step} prompts x {run.rollout.num_samples} samples"
    return {"task": task, "threshold": threshold, "batch": shape, "model_shape": list(spec.shape), **runs, **ratios}


def _ratio(ours: float | None, theirs: float | None) -> float | None:
    """ours / theirs; None when either did not reach the accuracy or TRL had it at the end of step 1 already."""
    return None if ours is None or not theirs else ours / theirs


def say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def table(result: dict[str, Any], args: argparse.Namespace) -> str:
    names = {"trl": "TRL GRPOTrainer", "asyncrl_sync": "asyncrl sync", "asyncrl_async": "asyncrl async"}
    runs = [(name, result[key]) for key, name in names.items() if result[key] is not None]

    def fmt(value: Any, spec: str = ".3f") -> str:
        return "-" if value is None else format(value, spec)

    lines = [
        f"{result['task']}: {result['batch']}, {args.steps} steps, greedy eval of {args.eval_limit} held-out "
        f"prompts every {args.eval_every} steps, threshold {result['threshold']:g}",
        f"{'':28}" + "".join(f"{name:>18}" for name, _ in runs),
    ]
    rows = [
        ("s/step", lambda r: fmt(r["s_per_step"])),
        ("tokens/s", lambda r: fmt(r["tokens_per_s"], ".0f")),
        ("response tokens, mean", lambda r: fmt(r["response_tokens"].get("mean"), ".1f")),
        ("response tokens, p95", lambda r: fmt(r["response_tokens"].get("p95"), ".1f")),
        ("response tokens, max", lambda r: fmt(r["response_tokens"].get("max"), ".0f")),
        ("generation share of a step", lambda r: fmt(r.get("generation_share"), ".2f")),
        (f"steps to {result['threshold']:g}", lambda r: fmt(r["steps_to_accuracy"], "d")),
        (f"seconds to {result['threshold']:g}", lambda r: fmt(r["time_to_accuracy_s"], ".1f")),
        ("final accuracy", lambda r: fmt(r["final_accuracy"])),
        ("start-up s (off the clock)", lambda r: fmt(r["startup_s"], ".1f")),
        ("wall s", lambda r: fmt(r["wall_s"], ".1f")),
    ]
    rows += [
        (f"seconds to {t}", lambda r, t=t: fmt(r["time_to"][t], ".1f"))
        for t in result["trl"]["time_to"]
        if float(t) != result["threshold"]
    ]
    steps = sorted({int(s) for _, r in runs for s in r["accuracy"]})
    rows += [(f"accuracy @ step {s}", lambda r, s=s: fmt(r["accuracy"].get(str(s)))) for s in steps]
    lines += [f"{label:28}" + "".join(f"{cell(r):>18}" for _, r in runs) for label, cell in rows]
    histogram = result["trl"]["response_tokens"].get("histogram", {})
    lines.append("TRL's responses by length (tokens): " + ", ".join(f"{b} {v:.1%}" for b, v in histogram.items()))
    lines.append(
        f"time-to-accuracy, asyncrl / TRL: sync {fmt(result['ratio_sync'], '.2f')}, "
        f"async {fmt(result['ratio_async'], '.2f')}; s/step, asyncrl / TRL: sync "
        f"{fmt(result['s_per_step_ratio_sync'], '.2f')}, async {fmt(result['s_per_step_ratio_async'], '.2f')}"
    )
    return "\n".join(lines)


def rounded(value: Any) -> Any:
    if isinstance(value, float):
        return round(value, 4)
    if isinstance(value, dict):
        return {k: rounded(v) for k, v in value.items()}
    return value


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100, help="optimizer steps of each run")
    parser.add_argument("--threshold", type=float, help="held-out greedy accuracy to reach (first task; default 0.7)")
    parser.add_argument("--eval-every", type=int, default=5, help="evaluate every this many steps")
    parser.add_argument("--lr", type=float, help="learning rate of all three runs (default: the config's, 3e-4)")
    parser.add_argument("--eval-limit", type=int, default=64, help="held-out prompts")
    parser.add_argument("--seed", type=int, default=0, help="run.seed of all three runs: prompt order and sampling")
    parser.add_argument("--warm-steps", type=int, help="supervised warm start of the first task's model")
    parser.add_argument("--trl-threads", type=int, default=2, help="torch threads of the TRL run (cores 0-1)")
    parser.add_argument("--tasks", default=",".join(TASKS), help=f"comma-separated, of {', '.join(TASKS)}")
    parser.add_argument("--model", type=Path, help="a warm model folder to use (first task only)")
    parser.add_argument("--size", choices=list(SIZES), default="task", help="model widths of every task (SIZES)")
    parser.add_argument("--no-sync", action="store_true", help="skip the synchronous asyncrl run")
    parser.add_argument("--keep", type=Path, help="keep the runs' folders (logs, metrics) here")
    parser.add_argument(
        "--split", default="learner=0,actor=1,frontend=0,reward=0", help="cores of each asyncrl process"
    )
    parser.add_argument("--learner-threads", type=int, default=1, help="torch threads of the asyncrl learner")
    parser.add_argument("--set", action="append", default=[], help="a config override of the asyncrl runs only")
    parser.add_argument("--trl-child", nargs=2, type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.trl_child:
        trl_child(*args.trl_child)
        return
    SPLIT.update(parse_split(args.split))
    LEARNER_THREADS[0] = args.learner_threads
    tasks = args.tasks.split(",")
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = args.keep or Path(tmp_name)
        results = [compare(tmp, task, args, i == 0) for i, task in enumerate(tasks)]
    cores = cores_used(args.trl_threads)
    for result in results:
        say(table(result, args))
    say(f"cores: {cores}")
    first = results[0]
    summary = {
        "bench": "peer",
        "cores": cores,
        "asyncrl_overrides": args.set,
        "steps": args.steps,
        "size": args.size,
        "seed": args.seed,
        "threshold": first["threshold"],
        "eval_every": args.eval_every,
        "eval_prompts": args.eval_limit,
        "ratio_sync": first["ratio_sync"],
        "ratio_async": first["ratio_async"],
        "tasks": {r["task"]: r for r in results},
        "missing": [t for t in TASKS if t not in tasks],
    }
    print(json.dumps(rounded(summary)))


if __name__ == "__main__":
    main()
