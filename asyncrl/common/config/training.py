"""The sections of what a run trains and how: the run and its model, rollouts and rewards, the task and its
evaluation, the algorithm, the learner and its critic, preference data, and the environment of multi-turn episodes."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    Field,
    field_validator,
    model_validator,
)

from asyncrl.common.config.base import MAX_SEED, MAX_STEPS, MAX_TOKENS, WEEK_S, Int, Section, ZeroStage


def cpu_list(text: str) -> set[int]:
    """The CPUs of a list like ``0,2-3`` (empty for a malformed one)."""
    cpus: set[int] = set()
    for part in text.split(","):
        low, _, high = part.partition("-")
        if not low.isdigit() or (high and not high.isdigit()) or int(high or low) < int(low):
            return set()
        cpus |= set(range(int(low), int(high or low) + 1))
    return cpus

class RunSection(Section):
    name: str = Field(default="demo", pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
    """Run name: the Redis namespace and the folder under ``root``."""
    root: str = "runs"
    """Folder that holds one sub-folder per run."""
    seed: Int = Field(default=0, ge=0, le=MAX_SEED)
    """Seed for prompt order, sampling and initialisation."""


class ModelSection(Section):
    path: str = "runs/models/tiny-arith"
    """Hugging Face checkpoint folder (local; nothing is fetched from a hub). A relative path is from the working
    directory of each process that reads it (the learner's, each actor's), not from the config file's folder."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Precision of the policy weights on actors and learner."""
    max_model_len: Int = Field(default=512, ge=16, le=MAX_TOKENS)
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
    num_samples: Int = Field(default=8, ge=1, le=4096)
    """Responses sampled per prompt (the group size K)."""
    max_new_tokens: Int = Field(default=64, ge=1, le=MAX_TOKENS)
    """Longest response in tokens."""
    temperature: float = Field(default=1.0, ge=0.0, le=100.0)
    """Sampling temperature; 1.0 keeps the behaviour log-probs those of the policy itself."""
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    """Nucleus sampling mass."""
    stop: list[str] = Field(default_factory=list)
    """Strings that end a response."""
    max_groups_in_flight: Int = Field(default=16, ge=1, le=65536)
    """Prompt groups one actor generates at once."""
    kv_cache_bytes: Literal["auto"] | Annotated[int, Field(ge=0, le=2**50)] = "auto"
    """KV-cache size per vLLM engine in bytes; ``auto`` = sized by vLLM from ``gpu_memory_utilization`` on a GPU, and 256 MiB on CPUs (where vLLM misjudges free memory); 0 = from ``gpu_memory_utilization`` (GPUs only)."""  # noqa: E501
    gpu_memory_utilization: float = Field(default=0.9, gt=0.0, le=1.0)
    """Share of each GPU's memory vLLM may take (weights, activations, KV cache) when ``kv_cache_bytes`` is ``auto``
    or 0; lower it when the learner shares the GPUs."""
    tensor_parallel_size: Int = Field(default=1, ge=1, le=64)
    """GPUs one actor's engine spans (vLLM tensor parallelism); each of its workers joins the weight group as its own
    rank."""
    max_num_seqs: Int = Field(default=0, ge=0, le=65536)
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
    cpu_single_process: bool = True
    """On CPUs with ``tensor_parallel_size`` 1, run vLLM's model worker inside its engine-core process (vLLM's
    ``uni`` executor) instead of a process of its own: one process fewer to start, and no engine core polling its
    worker while the model runs. vLLM's own per-thread binding needs the separate worker, so ``cpu_threads`` then pins
    the engine's process instead. No effect on GPUs (vLLM runs one GPU's worker in the engine core already). On by
    default: the demo (2 cores, two actors, the learner) took 0.13 s a step against 0.30 s with the separate worker."""
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
    weight: float = Field(default=1.0, ge=-1e6, le=1e6)
    """Weight of this function in the summed reward."""
    options: dict[str, Any] = Field(default_factory=dict)
    """Settings passed to the function."""


class RewardSection(Section):
    functions: list[RewardFunction] = Field(default_factory=lambda: [RewardFunction(name="task")])
    """Reward functions summed with their weights."""
    timeout_s: float = Field(default=10.0, gt=0, le=WEEK_S)
    """Per-call time limit of a reward function (the ``environment`` function gets at least ``(environment.max_turns + 1) × environment.step_timeout_s``: its replay's steps have their own limits)."""  # noqa: E501
    retries: Int = Field(default=2, ge=0, le=100)
    """Retries of a call that timed out or failed before the group is dead-lettered."""


class TaskSection(Section):
    name: str = "arithmetic"
    """Prompt source: a built-in task (``arithmetic``, ``reverse``, ``copy``, ``count``, ``countdown``) or ``file``."""
    path: str = ""
    """Data file when ``name = "file"``: JSONL, Parquet, or a folder written by ``datasets``' ``save_to_disk``. A
    relative path is from the learner's working directory, not from the config file's folder."""
    options: dict[str, Any] = Field(default_factory=dict)
    """Task settings, e.g. digit counts."""
    prompt_key: str = Field(default="prompt", min_length=1)
    """Field of a data row holding the prompt: a string, or chat messages (``role``, ``content``); a dotted path reads a nested field. A row without that field may hold ``messages``."""  # noqa: E501
    answer_key: str = Field(default="answer", min_length=1)
    """Field of a data row holding the reference answer the verifier checks; a dotted path reads a nested field (``reward_model.ground_truth``). The row's other fields reach reward functions as ``extra``."""  # noqa: E501
    split: str = ""
    """Split of a ``DatasetDict`` folder (``train``); empty = its only split."""
    limit: Int = Field(default=0, ge=0, le=10**12)
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

    every: Int = Field(default=0, ge=0, le=MAX_STEPS)
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
    limit: Int = Field(default=64, ge=1, le=10_000_000)
    """Eval prompts per round: the first this many rows of the file (or draws of a built-in task)."""
    seed: Int = Field(default=1_000_003, ge=0, le=MAX_SEED)
    """Seed of a built-in task's draws (differs from ``run.seed``, so the eval set is not the training stream)."""
    num_samples: Int = Field(default=1, ge=1, le=4096)
    """Responses per eval prompt (k of pass@k and mean@k)."""
    temperature: float = Field(default=0.0, ge=0.0, le=100.0)
    """Sampling temperature of eval prompts; 0 = greedy (then ``num_samples`` must be 1)."""
    max_new_tokens: Int = Field(default=0, ge=0, le=MAX_TOKENS)
    """Longest eval response in tokens; 0 = ``rollout.max_new_tokens``."""
    success_threshold: float = Field(default=1.0, ge=-1e9, le=1e9)
    """A response with reward at least this counts as solved (for pass@k and ``eval/accuracy``)."""
    deadline_s: float = Field(default=600.0, gt=0, le=WEEK_S)
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
    steps: Int = Field(default=50, ge=1, le=MAX_STEPS)
    """Optimizer steps in the run."""
    groups_per_step: Int = Field(default=8, ge=1, le=65536)
    """Prompt groups in one training batch."""
    micro_batch_size: Int = Field(default=8, ge=1, le=65536)
    """Sequences per forward/backward pass, longest first, each pass cut to its longest sequence: with lengths
    that differ widely, smaller passes pad less."""
    lr: float = Field(default=1e-5, gt=0.0, le=1.0)
    """Peak learning rate."""
    weight_decay: float = Field(default=0.0, ge=0.0, le=10.0)
    """AdamW weight decay."""
    grad_clip: float = Field(default=1.0, ge=0.0, le=1e6)
    """Gradient norm clip (0 disables)."""
    warmup_steps: Int = Field(default=0, ge=0, le=MAX_STEPS)
    """Linear learning-rate warm-up."""
    zero_stage: ZeroStage = 0
    """DeepSpeed ZeRO stage."""
    precision: Literal["float32", "bfloat16", "float16"] = "float32"
    """Training precision."""
    reference_precision: Literal["float32", "bfloat16", "float16"] | None = None
    """Precision of the frozen reference model (KL terms, DPO); unset = ``precision``. bfloat16 halves its memory."""
    offload: bool = False
    """Offload optimizer state to CPU memory (ZeRO 1-3; no effect on CPU-only machines)."""
    group_deadline_s: float = Field(default=300.0, gt=0, le=WEEK_S)
    """A prompt group not back in the replay stream this long after issue is re-issued once, then counted lost."""
    wait_for_batch_s: float = Field(default=600.0, gt=0, le=WEEK_S)
    """Longest wait for one training batch before the learner stops with an error (actors or reward workers gone)."""
    no_actors_s: float = Field(default=300.0, ge=0, le=WEEK_S)
    """How long the learner waits with no rollout actor alive, or no reward worker (all gone, or none started; an
    actor whose engine is still starting counts; before the first actor, at least 120 s), before it saves a
    checkpoint and exits 3; 0 = no such limit (``wait_for_batch_s`` applies)."""
    max_minutes: float | None = Field(default=None, gt=0, le=366 * 24 * 60)
    """Wall-clock budget: this many minutes after it started, the learner stops after the step in progress (a wait
    for a batch ends at once), saves a checkpoint (reason ``max_minutes``) and exits 0; unset = no budget."""


LORA_ALL_LINEAR = "all-linear"


class LoraSection(Section):
    """Low-rank adapters (LoRA, Hu et al. 2021): ``W x + (alpha / rank) · B A x`` with ``A`` of shape
    ``rank × in`` and ``B`` of shape ``out × rank``, ``B = 0`` at the start. Only ``A`` and ``B`` train; the reference
    policy is the same model with its adapters switched off, and each weight version sends only the adapters to the
    actors. ``rank = 0`` trains every parameter."""

    rank: Int = Field(default=0, ge=0, le=512)
    """Adapter rank r; 0 = no adapters (full-parameter training). At most 512, the largest vLLM serves."""
    alpha: float = Field(default=16.0, gt=0.0, le=1e6)
    """Scale numerator: the adapter's output is multiplied by ``alpha / rank``."""
    dropout: float = Field(default=0.0, ge=0.0, lt=1.0)
    """Dropout on the adapter's input. Must stay 0: the learner computes π_old and π_θ without dropout, so that the
    importance ratio is exactly 1 before an update, as the actors' engine samples."""
    target_modules: list[Annotated[str, Field(min_length=1, max_length=128)]] | Literal["all-linear"] = LORA_ALL_LINEAR
    """Linear layers that get adapters, by module name (``["q_proj", "v_proj"]``) or ``"all-linear"`` (every linear
    layer of the transformer blocks; never the output head)."""

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    @field_validator("dropout")
    @classmethod
    def _no_dropout(cls, value: float) -> float:
        if value:
            raise ValueError(
                "the learner computes π_old and π_θ without dropout (the importance ratio must be 1 before an update, "
                "and the actors sample without it); set lora.dropout = 0"
            )
        return value


class CriticSection(Section):
    """The value model V(s) that the ``gae`` advantage estimator needs (unused by critic-free algorithms).

    A separate model with its own optimizer; unset training settings follow ``[learner]``.
    """

    path: str = ""
    """Value-model folder written by ``ValueModel.save`` (backbone + ``value_head.safetensors``), or a causal-LM checkpoint that gets a fresh zero head; empty = ``model.path`` with a fresh zero head."""  # noqa: E501
    lr: float = Field(default=1e-5, gt=0.0, le=1.0)
    """Peak learning rate of the critic (warm-up, weight decay and gradient clip follow ``[learner]``)."""
    value_clip: float = Field(default=0.2, ge=0.0, le=1e6)
    """ε of the clipped value loss: V is kept within ±ε of the values at the start of the step (PPO2); 0 = no clipping."""  # noqa: E501
    precision: Literal["float32", "bfloat16", "float16"] | None = None
    """Training precision of the critic; unset = ``learner.precision``."""
    zero_stage: ZeroStage | None = None
    """DeepSpeed ZeRO stage of the critic; unset = ``learner.zero_stage``."""
    offload: bool | None = None
    """Offload the critic's optimizer state to CPU memory; unset = ``learner.offload``."""
    micro_batch_size: Int | None = Field(default=None, ge=1, le=65536)
    """Sequences per critic forward/backward pass; unset = ``learner.micro_batch_size``."""


class DataSection(Section):
    source: Literal["rollouts", "preferences"] = "rollouts"
    """Training data: ``rollouts`` (actors sample and reward workers score, through Redis) or ``preferences`` (offline DPO on ``path``: no Redis, no actors)."""  # noqa: E501
    path: str = ""
    """JSONL or Parquet file of preference pairs with text fields ``prompt``, ``chosen``, ``rejected`` (``source = "preferences"``)."""  # noqa: E501
    epochs: Int = Field(default=1, ge=1, le=1_000_000)
    """Passes over the preference pairs; the run ends after these or after ``learner.steps``, whichever comes first."""
    batch_pairs: Int = Field(default=8, ge=1, le=65536)
    """Preference pairs per optimizer step (two sequences each; micro-batches hold whole pairs)."""

    @model_validator(mode="after")
    def _preferences_need_a_file(self) -> DataSection:
        if self.source == "preferences" and not self.path:
            raise ValueError('source = "preferences" needs path (a JSONL or Parquet file of preference pairs)')
        return self


class EnvironmentSection(Section):
    name: str = ""
    """Environment of a ``multi_turn`` workflow (``common/environments/protocol.py``): a registered name (``calculator``) or an import path ``package.module:Class``."""  # noqa: E501
    options: dict[str, Any] = Field(default_factory=dict)
    """Settings passed to the environment."""
    max_turns: Int = Field(default=4, ge=1, le=1000)
    """Model turns per episode at most; an episode not done by then ends there (truncated)."""
    max_episode_tokens: Int = Field(default=0, ge=0, le=MAX_TOKENS)
    """Tokens after the prompt (model and environment turns together) per episode at most; 0 = up to ``model.max_model_len``."""  # noqa: E501
    step_timeout_s: float = Field(default=10.0, gt=0, le=WEEK_S)
    """Time limit of one environment step; a step past it ends its episode as an error."""
    fault_attempts: Int = Field(default=3, ge=1, le=100)
    """Times a group is generated when an environment fault (a step that raised, hung past ``step_timeout_s`` or returned nothing usable; the environment's process died) ends one of its episodes: such a group is never trained, it is generated again from the start; after this many it is dead-lettered."""  # noqa: E501
    episode_timeout_s: float = Field(default=0.0, ge=0, le=WEEK_S)
    """Time limit of one episode, checked before each model turn (0 = none); an episode past it ends there."""
    past_reasoning: Literal["as_served", "keep"] = "as_served"
    """A chat template that drops the model's past reasoning (``<think>…</think>``) from earlier assistant turns once a later user turn follows, as thinking models' templates do (Qwen3's): ``as_served`` = each model turn is generated on the context the template renders at that turn and trained on exactly that context, an episode kept as several training rows (one per context the template rewrote); ``keep`` = each episode is one sequence with every past reasoning block as generated (the learner trains exactly the tokens the actor sampled, in a context the model is not served with at inference). Templates that keep past turns as written are not affected: one sequence per episode either way."""  # noqa: E501
    isolation: Literal["process", "workers", "thread"] = "process"
    """Where environments run: ``process`` = a child process of the actor (and of the reward worker that replays them), so one that crashes, hangs or eats memory never takes an engine down; ``workers`` = on the run's reward workers, which serve them to every actor (an episode whose worker is lost moves to another, its steps replayed) and sign what they say: the only place for an environment that cannot be replayed (``replayable = False``); ``thread`` = in the process itself (a synchronous step in a thread)."""  # noqa: E501
    max_memory_mb: Int = Field(default=4096, ge=64, le=2**24)
    """Address space of the environments' process (``isolation = "process"``); past it a step fails with MemoryError and ends its episode."""  # noqa: E501
    fence: Literal["auto", "offline", "none"] = "auto"
    """How the environments' process is fenced off from the process it serves (``actors/environments/fence.py``): ``auto`` = the strongest fence this machine allows (its own PID, mount and IPC namespaces, a read-only filesystem but its scratch, and a uid of its own when the actor is root), logged once; a hostile environment can end only its own process; ``offline`` = the same without network, not even loopback (refused where namespaces are not allowed); ``none`` = no fence (environment code can signal, trace and write into the actor)."""  # noqa: E501
