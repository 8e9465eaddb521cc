"""The run configuration: one validated schema for a whole run, loaded from TOML.

Every field's docstring is its help text (``rl-learner fields`` prints them).
A config file may name a ``preset`` (a TOML file in ``configs/``) that it overlays; then
``--set a.b=c`` overrides apply, then validation. The resolved config is written to
``runs/<name>/config.json`` and published to Redis, so that an actor started with only
``--redis URL --run NAME`` works from exactly the same settings as the learner.
"""

from __future__ import annotations

import json
import math
import os
import sys
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    Strict,
    ValidationError,
    field_validator,
    model_validator,
)

from asyncrl.common.observability.redact import redact

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"


class ConfigError(ValueError):
    """A config that cannot be used; the message names each bad field and what is allowed."""


Int = Annotated[int, Strict()]
"""An integer setting: ``true`` is not a count and ``1e9`` (a TOML float) is not an integer, so both are refused."""


def _not_a_bool(value: Any) -> Any:
    if isinstance(value, bool):
        raise ValueError("a number is needed, not true or false")
    return value


ZeroStage = Annotated[Literal[0, 1, 2, 3], BeforeValidator(_not_a_bool)]
"""A DeepSpeed ZeRO stage (``true`` would pass as stage 1)."""

WEEK_S = 7 * 24 * 3600
"""Upper bound of every time limit in seconds: a process never waits longer than this for anything."""
MAX_STEPS = 10_000_000
"""Upper bound of step counts and periods in steps."""
MAX_TOKENS = 2**24
"""Upper bound of token lengths (16M: beyond the longest context of any released model)."""
MAX_SEED = 2**32 - 1
"""Largest seed (NumPy's bound; actors add their process id to it)."""
MAX_DEPTH = 32
"""Deepest nesting of tables and arrays in a config (free-form option tables included)."""
MAX_CONFIG_BYTES = 16 * 2**20
"""Largest config file read."""
GROUP_BASELINE_ADVANTAGES = frozenset({"grpo", "dr_grpo", "rloo"})
"""Advantage estimators whose baseline is the response's own group: a group of one response has advantage 0."""


class Section(BaseModel):
    model_config = ConfigDict(
        extra="forbid", use_attribute_docstrings=True, validate_assignment=True, allow_inf_nan=False
    )


class RunSection(Section):
    name: str = Field("demo", pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
    """Run name: the Redis namespace and the folder under ``root``."""
    root: str = "runs"
    """Folder that holds one sub-folder per run."""
    seed: Int = Field(0, ge=0, le=MAX_SEED)
    """Seed for prompt order, sampling and initialisation."""


class ModelSection(Section):
    path: str = "runs/models/tiny-arith"
    """Hugging Face checkpoint folder (local; nothing is fetched from a hub)."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Precision of the policy weights on actors and learner."""
    max_model_len: Int = Field(512, ge=16, le=MAX_TOKENS)
    """Longest prompt + response in tokens; at most the model's context (its ``config.json``, checked before a run
    starts)."""


ENGINE_ARGS_OWNED = {
    "model": "set model.path",
    "tokenizer": "the model folder's tokenizer is used (model.path)",
    "dtype": "set model.dtype",
    "max_model_len": "set model.max_model_len",
    "seed": "set run.seed (each actor derives its own)",
    "enforce_eager": "set rollout.enforce_eager",
    "kv_cache_memory_bytes": "set rollout.kv_cache_bytes",
    "gpu_memory_utilization": "set rollout.gpu_memory_utilization",
    "tensor_parallel_size": "set rollout.tensor_parallel_size",
    "max_num_seqs": "set rollout.max_num_seqs",
    "enable_prefix_caching": "set rollout.enable_prefix_caching",
    "logprobs_mode": "asyncrl needs processed_logprobs (the behaviour log-probs μ)",
    "worker_extension_cls": "asyncrl's weight receiver must be the worker extension",
    "skip_tokenizer_init": "the actor needs the tokenizer to return response texts",
    "trust_remote_code": "refused: it runs code from the model folder (no asyncrl process does)",
    "pipeline_parallel_size": "not supported: one actor is one engine; start more actors to scale out",
    "data_parallel_size": "not supported: one actor is one engine; start more actors to scale out",
}
"""``AsyncEngineArgs`` fields that ``rollout.engine_args`` may not set, and why."""


class RolloutSection(Section):
    workflow: str = "single_turn"
    """How an actor turns a prompt group into a rollout (``actors/workflows.py``): ``single_turn`` samples the group's
    K responses to its prompt in one request; ``multi_turn`` runs K episodes with ``[environment]``; an import path
    ``package.module:function`` names your own."""
    num_samples: Int = Field(8, ge=1, le=4096)
    """Responses sampled per prompt (the group size K)."""
    max_new_tokens: Int = Field(64, ge=1, le=MAX_TOKENS)
    """Longest response in tokens."""
    temperature: float = Field(1.0, ge=0.0, le=100.0)
    """Sampling temperature; 1.0 keeps the behaviour log-probs those of the policy itself."""
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    """Nucleus sampling mass."""
    stop: list[str] = Field(default_factory=list)
    """Strings that end a response."""
    max_groups_in_flight: Int = Field(16, ge=1, le=65536)
    """Prompt groups one actor generates at once."""
    kv_cache_bytes: Literal["auto"] | Annotated[int, Field(ge=0, le=2**50)] = "auto"
    """KV-cache size per vLLM engine in bytes; ``auto`` = sized by vLLM from ``gpu_memory_utilization`` on a GPU, and 256 MiB on CPUs (where vLLM misjudges free memory); 0 = from ``gpu_memory_utilization`` (GPUs only)."""  # noqa: E501
    gpu_memory_utilization: float = Field(0.9, gt=0.0, le=1.0)
    """Share of each GPU's memory vLLM may take (weights, activations, KV cache) when ``kv_cache_bytes`` is ``auto``
    or 0; lower it when the learner shares the GPUs."""
    tensor_parallel_size: Int = Field(1, ge=1, le=64)
    """GPUs one actor's engine spans (vLLM tensor parallelism); each of its workers joins the weight group as its own
    rank."""
    max_num_seqs: Int = Field(0, ge=0, le=65536)
    """Most sequences the engine runs at once (vLLM's ``max_num_seqs``); 0 = vLLM's default."""
    enable_prefix_caching: bool | None = None
    """Reuse the KV cache of shared prompt prefixes (the K samples of a group share their prompt); unset = vLLM's
    default."""
    engine_args: dict[str, Any] = Field(default_factory=dict)
    """Other ``vllm.AsyncEngineArgs`` fields, passed through as given (checked against vLLM's when the actor starts);
    fields asyncrl sets itself are refused here, naming the setting to use."""
    cpu_threads: str = ""
    """vLLM CPU cores to bind, e.g. ``0`` or ``0-3`` (``VLLM_CPU_OMP_THREADS_BIND``; with ``cpu_single_process`` the
    engine's process is pinned to them); empty = vLLM's choice."""
    cpu_single_process: bool = False
    """On CPUs with ``tensor_parallel_size`` 1, run vLLM's model worker inside its engine-core process (vLLM's
    ``uni`` executor) instead of a process of its own: one process fewer, and no engine core polling its worker
    while the model runs. vLLM's own per-thread binding needs the separate worker, so ``cpu_threads`` then pins
    the engine's process instead. No effect on GPUs (vLLM runs one GPU's worker in the engine core already). Off by
    default: a step's generation alone was 10–20% faster, a whole peer run was not (bench/peer.py: 0.392 / 0.277
    s/step sync / async against 0.377 / 0.244 with the separate worker)."""
    frontend_cpus: str = ""
    """CPUs for the actor's own process once its engine has started, e.g. ``0`` (every thread of it; vLLM's engine
    processes keep the CPUs they started on); empty = where it was started. On CPUs the actor's frontend (vLLM's
    ``AsyncLLM``, streaming every token) shares a core with the engine it waits for unless moved: 16 × 8 short
    responses on one core took 0.13–0.17 s with it there and 0.086–0.117 s with it on another core
    (bench/peer.py: the learner's core, which idles most of a step)."""
    enforce_eager: bool = True
    """Disable CUDA graphs / compilation (required on CPUs, faster start everywhere)."""

    @field_validator("cpu_threads", "frontend_cpus")
    @classmethod
    def _cpu_list(cls, text: str) -> str:
        from asyncrl.common.observability.procs import cpu_list

        if text and not cpu_list(text):
            raise ValueError(f"{text!r} is not a CPU list such as 1, 0-3 or 0,2-3")
        return text

    @field_validator("kv_cache_bytes")
    @classmethod
    def _kv_cache_size(cls, size: int | str) -> int | str:
        if isinstance(size, int) and 0 < size < 2**20:
            raise ValueError("must be 0 (sized by gpu_memory_utilization) or at least 1 MiB (1048576)")
        return size

    @field_validator("engine_args")
    @classmethod
    def _not_ours(cls, args: dict[str, Any]) -> dict[str, Any]:
        taken = {name: ENGINE_ARGS_OWNED[name] for name in args if name in ENGINE_ARGS_OWNED}
        if taken:
            raise ValueError("; ".join(f"{name!r}: {why}" for name, why in sorted(taken.items())))
        return args


class RewardFunction(Section):
    name: str
    """Registered reward function, e.g. ``task``, ``format``, ``overlong``, ``code_tests``, ``reward_model``."""
    weight: float = Field(1.0, ge=-1e6, le=1e6)
    """Weight of this function in the summed reward."""
    options: dict[str, Any] = Field(default_factory=dict)
    """Settings passed to the function."""


class RewardSection(Section):
    functions: list[RewardFunction] = Field(default_factory=lambda: [RewardFunction(name="task")])
    """Reward functions summed with their weights."""
    timeout_s: float = Field(10.0, gt=0, le=WEEK_S)
    """Per-call time limit of a reward function (the ``environment`` function gets at least ``(environment.max_turns + 1) × environment.step_timeout_s``: its replay's steps have their own limits)."""  # noqa: E501
    retries: Int = Field(2, ge=0, le=100)
    """Retries of a call that timed out or failed before the group is dead-lettered."""


class TaskSection(Section):
    name: str = "arithmetic"
    """Prompt source: a built-in task (``arithmetic``, ``reverse``, ``countdown``) or ``file``."""
    path: str = ""
    """Data file when ``name = "file"``: JSONL, Parquet, or a folder written by ``datasets``' ``save_to_disk``."""
    options: dict[str, Any] = Field(default_factory=dict)
    """Task settings, e.g. digit counts."""
    prompt_key: str = Field("prompt", min_length=1)
    """Field of a data row holding the prompt: a string, or chat messages (``role``, ``content``); a dotted path reads a nested field. A row without that field may hold ``messages``."""  # noqa: E501
    answer_key: str = Field("answer", min_length=1)
    """Field of a data row holding the reference answer the verifier checks; a dotted path reads a nested field (``reward_model.ground_truth``). The row's other fields reach reward functions as ``extra``."""  # noqa: E501
    split: str = ""
    """Split of a ``DatasetDict`` folder (``train``); empty = its only split."""
    limit: Int = Field(0, ge=0, le=10**12)
    """Use only the first this many rows of the data file (0 = all)."""
    shuffle: bool = True
    """Serve a data file's rows in a seeded shuffled order, reshuffled every pass; false = in file order."""
    overlong: Literal["skip", "refuse"] = "skip"
    """A data row whose prompt is longer than ``model.max_model_len - rollout.max_new_tokens`` tokens: ``skip`` leaves it out at load (each named in one log line, and counted), ``refuse`` refuses the whole file naming it."""  # noqa: E501
    chat: Literal["auto"] | bool = "auto"
    """Build prompts with the tokenizer's chat template (``add_generation_prompt``): ``auto`` = when the model's tokenizer has one."""  # noqa: E501
    system_prompt: str = ""
    """System message put before each chat prompt that has none (needs a chat template)."""

    @model_validator(mode="after")
    def _file_settings_need_a_file(self) -> TaskSection:
        defaults = TaskSection.model_fields
        for field in ("prompt_key", "answer_key", "split", "limit", "shuffle", "overlong"):
            if self.name != "file" and getattr(self, field) != defaults[field].default:
                raise ValueError(f'{field} is a setting of data files: it needs name = "file" (not {self.name!r})')
        return self


class EvalSection(Section):
    """Evaluation during the run on held-out prompts (``common/data/evaluation.py``): never trained on, scored by the
    run's reward functions, written as ``eval/*`` rows of metrics.jsonl."""

    every: Int = Field(0, ge=0, le=MAX_STEPS)
    """Evaluate the policy of every this many steps (at step 0, every N-th step and the last); 0 = no evaluation."""
    name: str = "file"
    """Held-out prompts: ``file`` (a data file, read as ``[task]`` reads one) or a built-in task drawn with ``seed``."""
    path: str = ""
    """Held-out data file when ``name = "file"``: JSONL, Parquet, or a ``save_to_disk`` folder."""
    options: dict[str, Any] = Field(default_factory=dict)
    """A built-in task's settings (e.g. digit counts); the run's verifier scores every eval prompt."""
    prompt_key: str = ""
    """Field of a data row holding the prompt (a dotted path reads a nested field); empty = ``task.prompt_key``."""
    answer_key: str = ""
    """Field of a data row holding the reference answer; empty = ``task.answer_key``."""
    split: str = ""
    """Split of a ``DatasetDict`` folder; empty = its only split."""
    limit: Int = Field(64, ge=1, le=10_000_000)
    """Eval prompts per round: the first this many rows of the file (or draws of a built-in task)."""
    seed: Int = Field(1_000_003, ge=0, le=MAX_SEED)
    """Seed of a built-in task's draws (differs from ``run.seed``, so the eval set is not the training stream)."""
    num_samples: Int = Field(1, ge=1, le=4096)
    """Responses per eval prompt (k of pass@k and mean@k)."""
    temperature: float = Field(0.0, ge=0.0, le=100.0)
    """Sampling temperature of eval prompts; 0 = greedy (then ``num_samples`` must be 1)."""
    max_new_tokens: Int = Field(0, ge=0, le=MAX_TOKENS)
    """Longest eval response in tokens; 0 = ``rollout.max_new_tokens``."""
    success_threshold: float = Field(1.0, ge=-1e9, le=1e9)
    """A response with reward at least this counts as solved (for pass@k and ``eval/accuracy``)."""
    deadline_s: float = Field(600.0, gt=0, le=WEEK_S)
    """A round not back this long after its issue is recorded with what came back (``eval/missing`` counts the rest)."""

    @model_validator(mode="after")
    def _greedy_is_one_sample(self) -> EvalSection:
        if self.temperature == 0.0 and self.num_samples != 1:
            raise ValueError("greedy evaluation (temperature = 0) has one response: set num_samples = 1 or temperature")
        if self.every and self.name == "file" and not self.path:
            raise ValueError('eval name = "file" needs a held-out data file: set eval.path (or name a built-in task)')
        return self


class AlgorithmSection(Section):
    preset: str = "grpo"
    """Name of the algorithm this config was built from (informational once resolved)."""
    advantage: str = "grpo"
    """Registered advantage estimator (or ``package.module:function``)."""
    advantage_options: dict[str, Any] = Field(default_factory=dict)
    """Settings of the advantage estimator, validated by its own settings type."""
    loss: str = "ppo_clip"
    """Registered policy loss (or ``package.module:function``)."""
    loss_options: dict[str, Any] = Field(default_factory=dict)
    """Settings of the loss, e.g. ``clip_high``, ``kl_coef`` (the off-policy correction comes from [staleness])."""
    aggregation: str = "token_mean"
    """Registered loss aggregation."""
    aggregation_options: dict[str, Any] = Field(default_factory=dict)
    """Settings of the aggregation, e.g. ``norm`` for ``seq_mean_token_sum_norm``."""
    kl_reward: dict[str, Any] = Field(default_factory=dict)
    """KL penalty in the token rewards (for ``gae``, ``reinforce_pp``): ``mode`` (off, fixed, adaptive), ``coef``,
    ``target``, ``horizon``; the per-token KL is k1 = log π_old − log π_ref."""
    dynamic_sampling: bool = False
    """Drop groups whose rewards are all equal (no learning signal) and take replacements so the batch stays full
    (DAPO); the count is ``groups/zero_variance`` in metrics.jsonl."""


class LearnerSection(Section):
    steps: Int = Field(50, ge=1, le=MAX_STEPS)
    """Optimizer steps in the run."""
    groups_per_step: Int = Field(8, ge=1, le=65536)
    """Prompt groups in one training batch."""
    micro_batch_size: Int = Field(8, ge=1, le=65536)
    """Sequences per forward/backward pass."""
    lr: float = Field(1e-5, gt=0.0, le=1.0)
    """Peak learning rate."""
    weight_decay: float = Field(0.0, ge=0.0, le=10.0)
    """AdamW weight decay."""
    grad_clip: float = Field(1.0, ge=0.0, le=1e6)
    """Gradient norm clip (0 disables)."""
    warmup_steps: Int = Field(0, ge=0, le=MAX_STEPS)
    """Linear learning-rate warm-up."""
    zero_stage: ZeroStage = 0
    """DeepSpeed ZeRO stage."""
    precision: Literal["float32", "bfloat16", "float16"] = "float32"
    """Training precision."""
    reference_precision: Literal["float32", "bfloat16", "float16"] | None = None
    """Precision of the frozen reference model (KL terms, DPO); unset = ``precision``. bfloat16 halves its memory."""
    offload: bool = False
    """Offload optimizer state to CPU memory (ZeRO 1-3; no effect on CPU-only machines)."""
    group_deadline_s: float = Field(300.0, gt=0, le=WEEK_S)
    """A prompt group not back in the replay stream this long after issue is re-issued once, then counted lost."""
    wait_for_batch_s: float = Field(600.0, gt=0, le=WEEK_S)
    """Longest wait for one training batch before the learner stops with an error (actors or reward workers gone)."""
    no_actors_s: float = Field(300.0, ge=0, le=WEEK_S)
    """How long the learner waits with no rollout actor alive (all gone, or none started; one whose engine is still
    starting counts) before it saves a checkpoint and exits 3; 0 = no such limit (``wait_for_batch_s`` applies)."""
    max_minutes: float | None = Field(None, gt=0, le=366 * 24 * 60)
    """Wall-clock budget: this many minutes after it started, the learner stops after the step in progress (a wait
    for a batch ends at once), saves a checkpoint (reason ``max_minutes``) and exits 0; unset = no budget."""


class CriticSection(Section):
    """The value model V(s) that the ``gae`` advantage estimator needs (unused by critic-free algorithms).

    A separate model with its own optimizer; unset training settings follow ``[learner]``.
    """

    path: str = ""
    """Value-model folder written by ``ValueModel.save`` (backbone + ``value_head.safetensors``), or a causal-LM checkpoint that gets a fresh zero head; empty = ``model.path`` with a fresh zero head."""  # noqa: E501
    lr: float = Field(1e-5, gt=0.0, le=1.0)
    """Peak learning rate of the critic (warm-up, weight decay and gradient clip follow ``[learner]``)."""
    value_clip: float = Field(0.2, ge=0.0, le=1e6)
    """ε of the clipped value loss: V is kept within ±ε of the values at the start of the step (PPO2); 0 = no clipping."""  # noqa: E501
    precision: Literal["float32", "bfloat16", "float16"] | None = None
    """Training precision of the critic; unset = ``learner.precision``."""
    zero_stage: ZeroStage | None = None
    """DeepSpeed ZeRO stage of the critic; unset = ``learner.zero_stage``."""
    offload: bool | None = None
    """Offload the critic's optimizer state to CPU memory; unset = ``learner.offload``."""
    micro_batch_size: Int | None = Field(None, ge=1, le=65536)
    """Sequences per critic forward/backward pass; unset = ``learner.micro_batch_size``."""


class DataSection(Section):
    source: Literal["rollouts", "preferences"] = "rollouts"
    """Training data: ``rollouts`` (actors sample and reward workers score, through Redis) or ``preferences`` (offline DPO on ``path``: no Redis, no actors)."""  # noqa: E501
    path: str = ""
    """JSONL or Parquet file of preference pairs with text fields ``prompt``, ``chosen``, ``rejected`` (``source = "preferences"``)."""  # noqa: E501
    epochs: Int = Field(1, ge=1, le=1_000_000)
    """Passes over the preference pairs; the run ends after these or after ``learner.steps``, whichever comes first."""
    batch_pairs: Int = Field(8, ge=1, le=65536)
    """Preference pairs per optimizer step (two sequences each; micro-batches hold whole pairs)."""

    @model_validator(mode="after")
    def _preferences_need_a_file(self) -> DataSection:
        if self.source == "preferences" and not self.path:
            raise ValueError('source = "preferences" needs path (a JSONL or Parquet file of preference pairs)')
        return self


class StalenessSection(Section):
    max_staleness: Int = Field(1, ge=0, le=1000)
    """Versions a token may lag the policy being trained; 0 = synchronous on-policy training."""
    correction: Literal["none", "truncate", "mask"] = "truncate"
    """Off-policy correction by π_old/μ: ``none`` uses μ as π_old; ``truncate`` caps the weight; ``mask`` drops tokens outside the band."""  # noqa: E501
    level: Literal["token", "sequence"] = "token"
    """Level at which the importance weight is computed."""
    cap: float = Field(2.0, gt=1.0, le=1e6)
    """Upper cap (truncate) or upper band edge (mask) of the importance weight."""
    max_sequence_kl: float = Field(0.5, ge=0.0, le=1e6)
    """Mismatch guard: drop from the loss each sequence whose mean per-token KL(μ ‖ π_old) is above this (counted in
    ``train/offpolicy/dropped_frac``); 0 = off. Normal runs stay below 0.5 (bench/stability.py: ≤ 0.01% of a run's
    sequences dropped; at most 3% of one step's, the first update from a warm start); a bad weight load does not
    (tests/e2e/test_mismatch_guard.py)."""
    veto: float = Field(1e-4, ge=0.0, lt=1.0)
    """Token veto: drop each sequence with a token whose π_old/μ is below this; 0 = off."""


class TransportSection(Section):
    redis_url: str = ""
    """Redis URL without a password (the config is written to config.json and published to every process; give a
    password through ``--redis-url-file`` or ``$ASYNCRL_REDIS_URL``); empty = an embedded redis-server in the run
    folder."""
    zmq_endpoint: str = "tcp://127.0.0.1:0"
    """Where reward workers bind their PULL socket for rollouts (port 0 = pick a free one)."""
    zmq_hwm: Int = Field(64, ge=1, le=1_000_000)
    """ZeroMQ high-water mark in messages: senders block beyond it (back-pressure)."""
    curve_server_key: str = ""
    """Path of the CURVE server secret key file (required when binding beyond loopback)."""
    curve_client_keys: str = ""
    """Folder of authorised CURVE client public keys."""
    curve_client_key: str = ""
    """Path of a rollout actor's CURVE client secret key file (``name.key_secret``); needed to send to reward workers
    that bind with CURVE (their public key comes from their heartbeat)."""
    max_message_mb: float = Field(64.0, gt=0, le=4096)
    """Largest accepted message; a bigger one is refused and counted, except one single frame over it, which ZeroMQ
    itself drops with the sender's connection (``ZMQ_MAXMSGSIZE``): the process never sees it."""
    replay_maxlen: Int = Field(10_000, ge=10, le=100_000_000)
    """Approximate cap of the replay stream (``XADD MAXLEN ~``)."""
    redis_maxmemory_mb: Int = Field(2048, ge=0, le=2**24)
    """Memory limit of the embedded redis-server (``maxmemory``, with ``noeviction``: past it a write fails loudly, nothing of the run is evicted); 0 = none. Size it above ``replay_maxlen`` × a scored group's bytes, plus about 30 MB for the dead-letter stream."""  # noqa: E501
    heartbeat_s: float = Field(2.0, gt=0, le=3600)
    """Seconds between heartbeats."""
    heartbeat_ttl_s: float = Field(10.0, gt=0, le=86_400)
    """A process whose heartbeat is older than this is considered dead."""
    redis_outage_s: float = Field(60.0, gt=0, le=86_400)
    """How long every process waits for Redis when it stops answering (killed, restarting on its AOF), retrying with back-off; past this it exits with status 75 and says what to do (restart Redis, then resume with ``--resume latest``)."""  # noqa: E501

    @field_validator("redis_url")
    @classmethod
    def _no_password(cls, url: str) -> str:
        from urllib.parse import urlsplit

        if url and urlsplit(url).password:
            raise ValueError(
                "holds a password, and the config is written to config.json and published to every process: "
                "give the URL through --redis-url-file FILE (mode 0600) or $ASYNCRL_REDIS_URL instead"
            )
        return url

    @model_validator(mode="after")
    def _ttl_exceeds_period(self) -> TransportSection:
        if self.heartbeat_ttl_s <= self.heartbeat_s:
            raise ValueError("heartbeat_ttl_s must exceed heartbeat_s, or live processes would expire")
        return self


class WeightSyncSection(Section):
    sync_every: Int = Field(1, ge=1, le=1000)
    """Broadcast new weights every this many optimizer steps (actors reload that much less often); needs
    ``staleness.max_staleness`` ≥ sync_every − 1, or ≥ sync_every with ``overlap``: the versions the actors' weights
    may trail."""
    bucket_mb: float = Field(256.0, gt=0, le=65536)
    """Size of one flat broadcast bucket."""
    timeout_s: float = Field(60.0, gt=0, le=WEEK_S)
    """Time limit of one collective; an actor that misses it is evicted."""
    overlap: bool = True
    """Send a copy of the new weights while the next step trains (needs ``staleness.max_staleness`` ≥ 1; with 0
    the learner waits for every broadcast, since the next batch must come from the new weights)."""
    digests: bool = True
    """Seal every version with a BLAKE3 digest per bucket, which each actor verifies before it loads any (a mismatch
    is refused); off saves the hashing on both sides (about 1 s per 4 GB on one CPU core)."""


class CheckpointSection(Section):
    every: Int = Field(0, ge=0, le=MAX_STEPS)
    """Save every this many steps (0 = only at the end and on SIGTERM); a resume re-trains the steps after it."""
    keep: Int = Field(2, ge=1, le=10_000)
    """Most recent checkpoints kept (plus the best by reward)."""
    keep_best: bool = True
    """Also keep the checkpoint with the highest mean reward over its steps (those since the one before)."""
    export_hf: bool = True
    """Write the policy into each checkpoint as a Hugging Face folder (``hf/``) that transformers and vLLM load."""


class MonitoringSection(Section):
    metrics_port: Int = Field(0, ge=0, le=65535)
    """Prometheus /metrics port; 0 = pick a free one and register it in Redis."""
    metrics_host: str = "127.0.0.1"
    """Address the /metrics servers bind: loopback by default; ``0.0.0.0`` (every interface) where Prometheus scrapes from another host or pod (the Kubernetes manifests set it)."""  # noqa: E501
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"
    """Log level of every process."""
    samples_every: Int = Field(5, ge=0, le=MAX_STEPS)
    """Every this many steps, append responses the learner trained on to samples.jsonl (0 = never)."""
    samples_per_step: Int = Field(4, ge=0, le=1000)
    """Responses drawn at random for samples.jsonl each time, besides the step's worst and best."""


class HealthSection(Section):
    """Run health (``learner/health.py``): non-finite steps are skipped, repeated ones roll the run back, and alert
    rules watch each step's metrics. An alert's threshold of 0 turns it off."""

    max_skipped_steps: Int = Field(3, ge=1, le=10_000)
    """Consecutive optimizer steps skipped for a non-finite loss or gradient (their update is never applied) after which the learner rolls back to the last healthy checkpoint."""  # noqa: E501
    rollback_lr_factor: float = Field(0.5, gt=0.0, le=1.0)
    """Each rollback multiplies the learning rate by this (cumulative: after two rollbacks at 0.5 the run trains at 0.25 × the schedule)."""  # noqa: E501
    max_rollbacks: Int = Field(3, ge=0, le=1000)
    """Rollbacks allowed in one run; when one more is due the learner stops with an error instead."""
    kl_ref_max: float = Field(0.5, ge=0.0, le=1e6)
    """Alert ``kl_ref_high`` while the per-token KL to the reference policy (``train/loss/kl_ref``, or ``train/kl_reward/kl`` with the KL in the reward) is above this."""  # noqa: E501
    mismatch_kl_max: float = Field(0.1, ge=0.0, le=1e6)
    """Alert ``mismatch_kl_high`` while KL(μ ‖ π_old) between the actors' sampling policy and the learner's (``train/offpolicy/mismatch_kl``) is above this."""  # noqa: E501
    entropy_floor: float = Field(0.01, ge=0.0, le=1e6)
    """Alert ``entropy_collapse`` while the mean token entropy (``train/loss/entropy``, nats) is below this."""
    entropy_drop_factor: float = Field(10.0, ge=0.0, le=1e6)
    """Alert ``entropy_collapse`` also while the entropy is below 1/this of its highest value in the last ``entropy_window`` steps (0 = off; else above 1)."""  # noqa: E501
    entropy_window: Int = Field(20, ge=2, le=1_000_000)
    """Steps over which ``entropy_drop_factor`` compares."""
    reward_flat_window: Int = Field(20, ge=2, le=1_000_000)
    """Alert ``reward_flat`` while the standard deviation of the last this many steps' mean rewards (``rollout/reward_mean``) is below ``reward_flat_epsilon``."""  # noqa: E501
    reward_flat_epsilon: float = Field(1e-3, ge=0.0, le=1e6)
    """See ``reward_flat_window``."""
    reward_error_rate: float = Field(0.05, ge=0.0, le=1.0)
    """Alert ``reward_errors`` while the reward service's failures (dead-lettered groups, failed calls) since the last step exceed this fraction of them plus the step's groups."""  # noqa: E501
    stale_drop_fraction: float = Field(0.1, ge=0.0, le=1.0)
    """Alert ``stale_drops`` while the groups a step dropped as too stale (``groups/dropped_stale``) exceed this fraction of them plus the groups it trained."""  # noqa: E501
    starving_idle_fraction: float = Field(0.5, ge=0.0, le=1.0)
    """Alert ``learner_starving`` while the learner's mean idle fraction (``step/idle_fraction``, time spent waiting for a batch) over the last ``starving_window`` steps is above this (not in a synchronous run, ``staleness.max_staleness = 0``, which waits by design)."""  # noqa: E501
    starving_window: Int = Field(10, ge=1, le=1_000_000)
    """Steps averaged by ``starving_idle_fraction``."""
    webhook_url: str = Field("", pattern=r"^(https?://\S+)?$")
    """POST each alert transition as JSON (``alert``, ``state``, ``step``, ``value``, ``message``) to this URL from a background thread; empty = none. Failures are logged, never raised."""  # noqa: E501
    webhook_timeout_s: float = Field(2.0, gt=0.0, le=30.0)
    """Time limit of one webhook POST."""

    @model_validator(mode="after")
    def _drop_factor_off_or_above_one(self) -> HealthSection:
        if 0.0 < self.entropy_drop_factor <= 1.0:
            raise ValueError("entropy_drop_factor must be 0 (off) or above 1 (entropy fell to 1/factor of its peak)")
        return self


class EnvironmentSection(Section):
    name: str = ""
    """Environment of a ``multi_turn`` workflow (``common/environments/protocol.py``): a registered name (``calculator``) or an import path ``package.module:Class``."""  # noqa: E501
    options: dict[str, Any] = Field(default_factory=dict)
    """Settings passed to the environment."""
    max_turns: Int = Field(4, ge=1, le=1000)
    """Model turns per episode at most; an episode not done by then ends there (truncated)."""
    max_episode_tokens: Int = Field(0, ge=0, le=MAX_TOKENS)
    """Tokens after the prompt (model and environment turns together) per episode at most; 0 = up to ``model.max_model_len``."""  # noqa: E501
    step_timeout_s: float = Field(10.0, gt=0, le=WEEK_S)
    """Time limit of one environment step; a step past it ends its episode as an error."""
    episode_timeout_s: float = Field(0.0, ge=0, le=WEEK_S)
    """Time limit of one episode, checked before each model turn (0 = none); an episode past it ends there."""
    isolation: Literal["process", "workers", "thread"] = "process"
    """Where environments run: ``process`` = a child process of the actor (and of the reward worker that replays them), so one that crashes, hangs or eats memory never takes an engine down; ``workers`` = on the run's reward workers, which serve them to every actor (an episode whose worker is lost moves to another, its steps replayed); ``thread`` = in the process itself (a synchronous step in a thread)."""  # noqa: E501
    max_memory_mb: Int = Field(4096, ge=64, le=2**24)
    """Address space of the environments' process (``isolation = "process"``); past it a step fails with MemoryError and ends its episode."""  # noqa: E501


class RunConfig(Section):
    """A whole run. Sections group the settings of each part of the system."""

    run: RunSection = Field(default_factory=RunSection)
    model: ModelSection = Field(default_factory=ModelSection)
    task: TaskSection = Field(default_factory=TaskSection)
    rollout: RolloutSection = Field(default_factory=RolloutSection)
    reward: RewardSection = Field(default_factory=RewardSection)
    algorithm: AlgorithmSection = Field(default_factory=AlgorithmSection)
    learner: LearnerSection = Field(default_factory=LearnerSection)
    critic: CriticSection = Field(default_factory=CriticSection)
    data: DataSection = Field(default_factory=DataSection)
    staleness: StalenessSection = Field(default_factory=StalenessSection)
    transport: TransportSection = Field(default_factory=TransportSection)
    weight_sync: WeightSyncSection = Field(default_factory=WeightSyncSection)
    checkpoint: CheckpointSection = Field(default_factory=CheckpointSection)
    monitoring: MonitoringSection = Field(default_factory=MonitoringSection)
    health: HealthSection = Field(default_factory=HealthSection)
    eval: EvalSection = Field(default_factory=EvalSection)
    environment: EnvironmentSection = Field(default_factory=EnvironmentSection)

    @model_validator(mode="after")
    def _episodes_need_an_environment(self) -> RunConfig:
        if self.rollout.workflow == "multi_turn":
            if not self.environment.name:
                raise ValueError(
                    "rollout.workflow = 'multi_turn' runs episodes in an environment: set environment.name "
                    "(e.g. 'calculator')"
                )
            if self.rollout.stop:
                raise ValueError(
                    "rollout.stop with rollout.workflow = 'multi_turn': a turn ends at the chat template's end of "
                    "turn, which the episode keeps as a token; remove rollout.stop"
                )
        return self

    @model_validator(mode="after")
    def _eval_is_scored_as_the_task(self) -> RunConfig:
        # Eval groups carry the run's task label: the reward workers score them with the run's verifier.
        if self.eval.every and self.eval.name not in ("file", self.task.name):
            raise ValueError(
                f"eval.name {self.eval.name!r}: eval prompts are scored by the run's verifier, so eval takes a "
                f'held-out file (name = "file", eval.path) or the run\'s own task {self.task.name!r} with another '
                "eval.seed; eval.every = 0 turns evaluation off"
            )
        return self

    @model_validator(mode="after")
    def _sync_every_fits_the_staleness_bound(self) -> RunConfig:
        lag = weights_lag(self)
        if lag > self.staleness.max_staleness:
            raise ValueError(
                f"weight_sync.sync_every = {self.weight_sync.sync_every}: the actors' weights would lag the learner "
                f"by up to {lag} versions, beyond staleness.max_staleness = {self.staleness.max_staleness}, so their "
                f"groups would be dropped as stale; set staleness.max_staleness >= {lag} or lower sync_every"
            )
        return self

    @model_validator(mode="after")
    def _responses_leave_room_for_the_prompt(self) -> RunConfig:
        limit = self.model.max_model_len
        for name, tokens in (("rollout", self.rollout.max_new_tokens), ("eval", self.eval.max_new_tokens)):
            if tokens >= limit:
                raise ValueError(
                    f"{name}.max_new_tokens = {tokens} leaves no token for the prompt in model.max_model_len = "
                    f"{limit}; set {name}.max_new_tokens below {limit} or raise model.max_model_len"
                )
        return self

    @model_validator(mode="after")
    def _group_signals_need_a_group(self) -> RunConfig:
        # A group of one response is its own baseline (advantage 0) and has equal rewards (dropped as no signal).
        samples, algorithm = self.rollout.num_samples, self.algorithm
        if self.data.source != "rollouts" or samples >= 2:
            return self
        if algorithm.advantage in GROUP_BASELINE_ADVANTAGES:
            raise ValueError(
                f"rollout.num_samples = {samples} with algorithm.advantage = {algorithm.advantage!r}: a group "
                "baseline compares each response with the others of its prompt, so every advantage would be 0; "
                "set rollout.num_samples >= 2 or an estimator without a group baseline (batch_mean, reinforce_pp, gae)"
            )
        if algorithm.dynamic_sampling:
            raise ValueError(
                f"rollout.num_samples = {samples} with algorithm.dynamic_sampling: a group of one response has "
                "equal rewards and would always be dropped; set rollout.num_samples >= 2 or dynamic_sampling = false"
            )
        return self

    @property
    def run_dir(self) -> Path:
        return Path(self.run.root) / self.run.name

    def to_json(self) -> str:
        return self.model_dump_json(indent=2)

    @classmethod
    def from_json(cls, text: str | bytes) -> RunConfig:
        try:
            data = json.loads(text)
        except RecursionError:
            raise ConfigError(f"config JSON: nested more than {MAX_DEPTH} levels deep") from None
        except json.JSONDecodeError as exc:
            raise ConfigError(f"config JSON: {exc}") from None
        except ValueError:  # a number beyond Python's int-string conversion limit
            raise ConfigError(f"config JSON: a number of over {sys.get_int_max_str_digits()} digits") from None
        if not isinstance(data, dict):
            raise ConfigError(f"config JSON: a JSON object is needed, not {type(data).__name__}")
        return _validated(data)


# --------------------------------------------------------------------------- loading


def broadcast_overlaps(config: RunConfig) -> bool:
    """Whether a version's broadcast runs while the next step trains: ``weight_sync.overlap`` with ``max_staleness``
    ≥ 1 (synchronous training needs the new weights before its next batch)."""
    return config.weight_sync.overlap and config.staleness.max_staleness >= 1


def weights_lag(config: RunConfig) -> int:
    """Most versions the actors' weights trail the learner's: (sync_every − 1) versions are never sent, and with
    overlap the newest one is still on the wire while the next step trains."""
    return config.weight_sync.sync_every - 1 + int(broadcast_overlaps(config))


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> RunConfig:
    """The config in ``path`` (over its ``preset``, if any) with ``key.path=value`` overrides applied."""
    data: dict[str, Any] = _read_toml_with_preset(Path(path)) if path else {}
    for item in overrides:
        key, value = _parse_override(item)
        _check_values(value, key.split("."))
        _set_dotted(data, key, value)
    return _validated(data)


def _read_toml_with_preset(path: Path, seen: tuple[Path, ...] = ()) -> dict[str, Any]:
    if path in seen:
        raise ConfigError(f"{path}: preset cycle through {' -> '.join(map(str, seen))}")
    data = _parse_toml(path, _read_config_file(path))
    _check_values(data, [], f"{path}: ")
    base_name = data.pop("preset", None)
    if base_name is None:
        return data
    base_path = _preset_path(str(base_name), path.parent)
    return _deep_merge(_read_toml_with_preset(base_path, (*seen, path)), data)


def _read_config_file(path: Path) -> str:
    """The text of a config file, at most :data:`MAX_CONFIG_BYTES` of it (``/dev/zero`` never ends)."""
    try:
        with path.open("rb") as f:
            raw = f.read(MAX_CONFIG_BYTES + 1)
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such config file") from None
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read the config file: {exc.strerror or exc}") from None
    if len(raw) > MAX_CONFIG_BYTES:
        raise ConfigError(f"{path}: a config file of over {MAX_CONFIG_BYTES // 2**20} MiB; give a TOML file")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML: not UTF-8 text at byte {exc.start}") from None


def _parse_toml(path: Path, text: str) -> dict[str, Any]:
    try:
        return tomllib.loads(text)
    except RecursionError:
        raise ConfigError(f"{path}: not valid TOML: nested more than {MAX_DEPTH} levels deep") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from None
    except ValueError:  # a number beyond Python's int-string conversion limit
        raise ConfigError(
            f"{path}: a number of over {sys.get_int_max_str_digits()} digits; no setting takes one"
        ) from None


def _check_values(value: Any, where: list[str], prefix: str = "invalid config: ") -> None:
    """Refuse tables and arrays nested deeper than :data:`MAX_DEPTH` and non-finite numbers anywhere in ``value``
    (free-form option tables included: JSON has no infinity, so one would reach other processes as null). Iterative,
    so that no nesting depth can exhaust the stack; the error names the setting (the first levels of its path)."""
    stack: list[tuple[Any, list[str]]] = [(value, where)]
    while stack:
        node, path = stack.pop()
        if isinstance(node, float) and not math.isfinite(node):
            raise ConfigError(f"{prefix}{_dotted(path)}: {node} is not a finite number; give a finite value")
        if not isinstance(node, (dict, list)):
            continue
        if len(path) >= MAX_DEPTH:  # the whole config is the first level
            raise ConfigError(
                f"{prefix}{_dotted(path[: max(2, len(where))])}: nested more than {MAX_DEPTH} levels deep (tables "
                "and arrays); flatten it"
            )
        items = node.items() if isinstance(node, dict) else enumerate(node)
        stack.extend((child, [*path, str(key)]) for key, child in items)


def _dotted(path: list[str]) -> str:
    return ".".join(path) or "(top level)"


def _preset_path(name: str, relative_to: Path) -> Path:
    for candidate in (relative_to / name, relative_to / f"{name}.toml", CONFIG_DIR / f"{name}.toml"):
        if candidate.is_file():
            return candidate
    known = sorted(p.stem for p in CONFIG_DIR.glob("*.toml"))
    raise ConfigError(f"preset {name!r} not found; known presets: {', '.join(known) or 'none'}")


def _deep_merge(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    """``top`` over ``base``, tables merged key by key — except ``*_options`` tables, which belong to the variant
    named beside them and are replaced whole (a preset that switches ``loss`` must not inherit the old loss's
    options)."""
    merged = dict(base)
    for key, value in top.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict) and not key.endswith("_options"):
            merged[key] = _deep_merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def _parse_override(item: str) -> tuple[str, Any]:
    """``a.b=c`` → (``a.b``, value); the value is read as TOML (``3``, ``true``, ``[1,2]``) or else a string.

    A field whose type is a string takes the text as it is (``rollout.cpu_threads=1`` is the string ``"1"``, not
    the integer 1); a quoted TOML string is unquoted first.
    """
    key, sep, raw = item.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ConfigError(f"override {item!r} is not of the form section.field=value")
    if raw.strip().lstrip("+-") in ("nan", "inf"):
        return key, raw.strip()  # a name such as run.name=nan, not a float: no field takes NaN or infinity
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except RecursionError:
        raise ConfigError(f"invalid config: {key}: nested more than {MAX_DEPTH} levels deep; flatten it") from None
    except ValueError:  # not TOML (or a number beyond Python's int-string limit): the text itself
        value = raw.strip()
    if not isinstance(value, str) and _field_type(key) is str:
        value = raw.strip()
    return key, value


def _field_type(key: str) -> Any:
    """The annotation of the config field at dotted ``key`` (``rollout.cpu_threads`` → ``str``), None if unknown."""
    model: Any = RunConfig
    annotation: Any = None
    for part in key.split("."):
        fields = getattr(model, "model_fields", None)
        if not fields or part not in fields:
            return None
        annotation = fields[part].annotation
        model = annotation
    return annotation


def _set_dotted(data: dict[str, Any], key: str, value: Any) -> None:
    node = data
    parts = key.split(".")
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"override {key!r}: {part!r} is a value, not a section")
        node = child
    node[parts[-1]] = value


def _validated(data: dict[str, Any]) -> RunConfig:
    _check_values(data, [])
    try:
        return RunConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(_explain(exc)) from None


def _explain(exc: ValidationError) -> str:
    """One line per problem, naming the field, what is allowed and what was given (one line in all for one)."""
    lines = []
    for err in exc.errors():
        where = ".".join(str(p) for p in err["loc"])
        msg = err["msg"]
        given = err.get("input")
        if err["type"] == "extra_forbidden":
            msg = f"unknown field; allowed here: {', '.join(_allowed_fields(err['loc'][:-1]))}"
        elif err["type"] == "int_type" and isinstance(given, bool):
            msg = "a whole number is needed, not true or false"
        elif err["type"] == "int_type" and isinstance(given, float):
            msg = "a whole number is needed: write it without a decimal point or exponent (TOML reads 1e9 as a float)"
        # A section's own rule was given the whole section: its message names the fields instead.
        got = "" if err["type"] == "missing" or isinstance(given, (dict, BaseModel)) else f" (got {_shown(given)})"
        if not where and msg.startswith("Value error, "):
            lines.append(f"{msg.removeprefix('Value error, ')}{got}")
        else:
            lines.append(f"{where or '(top level)'}: {msg}{got}")
    if len(lines) == 1:
        return f"invalid config: {lines[0]}"
    return "\n  ".join([f"invalid config ({len(lines)} problems):", *lines])


def _shown(value: Any, limit: int = 80) -> str:
    """``value`` as given, secrets redacted, cut to about ``limit`` characters."""
    if isinstance(value, str) and len(value) > 4 * limit:
        value = value[: 4 * limit]
    try:
        text = redact(repr(value))
    except ValueError:  # an integer beyond Python's int-string conversion limit
        return "a number of over 4300 digits"
    return text if len(text) <= limit else f"{text[: limit - 5]}...{text[-1:]}"


def _allowed_fields(loc: tuple[Any, ...]) -> list[str]:
    model: Any = RunConfig
    for part in loc:
        field = model.model_fields.get(part) if isinstance(part, str) else None
        if field is None or not isinstance(field.annotation, type) or not issubclass(field.annotation, BaseModel):
            return ["(see the config reference)"]
        model = field.annotation
    return sorted(model.model_fields)


def field_help(model: type[BaseModel] = RunConfig, prefix: str = "") -> list[tuple[str, str, str]]:
    """(dotted name, default, docstring) of every field: the config reference."""
    rows = []
    for name, info in model.model_fields.items():
        ann = info.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            rows += field_help(ann, f"{prefix}{name}.")
            continue
        default = info.get_default(call_default_factory=True)
        rows.append((f"{prefix}{name}", json.dumps(default, default=str), info.description or ""))
    return rows


def write_resolved(config: RunConfig) -> Path:
    """Write ``runs/<name>/config.json`` (creating the run folder) and return its path."""
    config.run_dir.mkdir(parents=True, exist_ok=True)
    out = config.run_dir / "config.json"
    tmp = out.with_suffix(".json.tmp")
    tmp.write_text(config.to_json())
    tmp.replace(out)
    return out


HOST_KEY_ENV = {
    "ASYNCRL_CURVE_SERVER_KEY": "curve_server_key",
    "ASYNCRL_CURVE_CLIENT_KEYS": "curve_client_keys",
    "ASYNCRL_CURVE_CLIENT_KEY": "curve_client_key",
}
"""Environment variables that set this process's CURVE key paths over the run's config (each host mounts its own)."""


def with_host_keys(config: RunConfig, environ: Mapping[str, str] | None = None) -> RunConfig:
    """``config`` with the CURVE key paths of this host, where :data:`HOST_KEY_ENV` variables are set."""
    environ = os.environ if environ is None else environ
    changes = {field: environ[var] for var, field in HOST_KEY_ENV.items() if environ.get(var)}
    if not changes:
        return config
    return config.model_copy(update={"transport": config.transport.model_copy(update=changes)})
