"""The learner's models: the DeepSpeed-wrapped policy that trains, and a frozen reference for the KL term.

:class:`PolicyEngine` owns what DeepSpeed does well — ZeRO stages, optimizer offload, mixed precision, gradient
clipping, data-parallel gradient reduction — and exposes the three things the loop needs: per-token log-probs
(:meth:`PolicyEngine.token_logprobs`), one optimizer step over a list of micro-batches
(:meth:`PolicyEngine.train_step`), and the full weights for the broadcast to actors
(:meth:`PolicyEngine.state_dict_for_broadcast`).

**Loss convention.** A loss function returns its micro-batch's *share* of the full-batch loss, normalised with
global counts (all tokens or sequences of the optimizer step, over every micro-batch and every rank), so the shares
sum to the full-batch loss. Then accumulation is a plain sum: :meth:`train_step` calls ``backward`` without
DeepSpeed's division by the accumulation steps, and multiplies by the data-parallel size because DeepSpeed averages
(not sums) gradients over ranks. One rank with one micro-batch, one rank with many, and many ranks all give the same
gradient — ``tests/integration/learner/update/test_learner_engine.py`` checks it.

DeepSpeed is imported through :mod:`asyncrl.learner.dist` (its accelerator is fixed at first import). Before DeepSpeed
builds or loads a JIT-compiled op, a build lock that a killed process left in torch's extension cache is cleared
(:mod:`asyncrl.learner.jit_lock`): otherwise the build waits for it forever.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch
from torch import Tensor
from transformers import AutoModelForCausalLM

from asyncrl.common.config import LearnerSection, RunConfig
from asyncrl.learner import dist
from asyncrl.learner.health.monitor import step_is_finite
from asyncrl.learner.jit_lock import clear_stale_locks, prefer_environment_ninja
from asyncrl.learner.update import lora
from asyncrl.learner.update.batch import PolicyRows

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
ADAM_BETAS = (0.9, 0.999)
ADAM_EPS = 1e-8
ZERO3_GATHER_NUMEL = 64 * 2**20  # parameters gathered per all-gather when collecting ZeRO-3 weights

Batch = dict[str, Tensor]
MicroBatch = TypeVar("MicroBatch", Batch, PolicyRows)
"""What one backward pass runs on: a typed bundle of the policy's rows, or named tensors (the critic's, DPO's)."""
LossFn = Callable[["PolicyEngine", Batch], Tensor]
"""A loss over named tensors (:meth:`PolicyEngine.train_step`'s other form)."""


def _on_device(micro_batch: MicroBatch, device: torch.device) -> MicroBatch:
    if isinstance(micro_batch, PolicyRows):
        return micro_batch.to(device)
    return {key: value.to(device) for key, value in micro_batch.items()}


# --------------------------------------------------------------------------- log-probs


def sequence_logprobs(
    model: Callable[..., Any], input_ids: Tensor, attention_mask: Tensor, temperature: float = 1.0
) -> Tensor:
    """Log-probability of every token given the tokens before it, under a causal LM.

    ``out[b, t] = log_softmax(z[b, t-1] / τ)[x[b, t]]``, where ``z[b, t-1]`` are the logits the model emits at
    position ``t-1`` (after reading ``x[b, :t]``). So ``out[:, t]`` is the log-prob OF token ``t``, aligned with
    ``input_ids``; ``out[:, 0] = 0`` (nothing predicts the first token), and ``out[b, t] = 0`` where token ``t`` or
    token ``t-1`` is padding. Computed as ``z[x] - logsumexp(z)`` in float32 (bf16 log-sum-exp over a vocabulary is
    off by ~1e-2), which avoids materialising a second ``[B, T, V]`` tensor. Position ids count valid tokens
    (``cumsum(mask) - 1``), so left- and right-padded rows both see each token at its true position, as vLLM does.

    Shapes: ``input_ids``, ``attention_mask`` ``[B, T]`` → ``[B, T]`` float32. Differentiable unless called under
    ``torch.no_grad``.
    """
    logits, valid = _next_token_logits(model, input_ids, attention_mask, temperature)
    return _pick(logits, input_ids, valid)


def sequence_logprobs_and_entropy(
    model: Callable[..., Any],
    input_ids: Tensor,
    attention_mask: Tensor,
    temperature: float = 1.0,
    entropy_grad: bool = True,
) -> tuple[Tensor, Tensor]:
    """:func:`sequence_logprobs` and, at the same positions, the entropy −Σ_v p_v log p_v of the distribution each token
    was drawn from (:func:`asyncrl.learner.algorithms.entropy.token_entropy`; 0 where the log-prob is 0). One forward.
    ``entropy_grad=False``: the entropy without a graph, a chunk of positions at a time (a figure, not a loss term)."""
    from asyncrl.learner.algorithms.entropy import token_entropy, token_entropy_no_grad

    logits, valid = _next_token_logits(model, input_ids, attention_mask, temperature)
    per_token = token_entropy(logits) if entropy_grad else token_entropy_no_grad(logits)
    entropy = torch.where(valid, per_token, torch.zeros_like(valid, dtype=torch.float32))
    return _pick(logits, input_ids, valid), torch.cat([entropy.new_zeros(entropy.shape[0], 1), entropy], dim=1)


def _next_token_logits(
    model: Callable[..., Any], input_ids: Tensor, attention_mask: Tensor, temperature: float
) -> tuple[Tensor, Tensor]:
    """float32 logits ``[B, T-1, V]`` at positions ``0..T-2`` (each predicts the next token), divided by τ, and the
    ``[B, T-1]`` mask of positions where both the token and the one it predicts are real."""
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    mask = attention_mask.bool()
    positions = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
    out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=positions, use_cache=False)
    logits = out.logits[:, :-1].float()
    if temperature != 1.0:
        logits = logits / temperature
    return logits, mask[:, 1:] & mask[:, :-1]


def _pick(logits: Tensor, input_ids: Tensor, valid: Tensor) -> Tensor:
    """``[B, T]`` log-prob of each token (index 0 and invalid positions 0) from :func:`_next_token_logits`."""
    picked = logits.gather(-1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, dim=-1)
    # where(), not a product: a padded row's logits may be NaN, and NaN * 0 is NaN.
    picked = torch.where(valid, picked, torch.zeros_like(picked))
    return torch.cat([picked.new_zeros(picked.shape[0], 1), picked], dim=1)


# --------------------------------------------------------------------------- DeepSpeed config


def deepspeed_config(
    learner: LearnerSection, *, micro_batch_size: int, accumulation_steps: int, cpu: bool
) -> dict[str, Any]:
    """The DeepSpeed config of a :class:`LearnerSection`.

    The optimizer is DeepSpeed's ``AdamW`` with ``torch_adam`` (``torch.optim.AdamW``): it needs no compiled op,
    so it works on CPUs and on GPU machines without a CUDA toolkit. Only optimizer offload on a GPU machine uses
    DeepSpeedCPUAdam (JIT-built), because torch's AdamW on CPU is several times slower there. Offload has no
    meaning for stage 0 and is dropped. The batch fields are bookkeeping only: :meth:`PolicyEngine.train_step`
    sets the accumulation boundary itself and never lets DeepSpeed divide by the accumulation steps.
    """
    zero: dict[str, Any] = {"stage": learner.zero_stage}
    if learner.offload and learner.zero_stage >= 1:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": not cpu}
    torch_adam = cpu or not (learner.offload and learner.zero_stage >= 1)
    adamw = {"lr": learner.lr, "betas": list(ADAM_BETAS), "eps": ADAM_EPS, "weight_decay": learner.weight_decay}
    return {
        "train_micro_batch_size_per_gpu": micro_batch_size,
        "gradient_accumulation_steps": accumulation_steps,
        "gradient_clipping": learner.grad_clip,
        "zero_optimization": zero,
        "bf16": {"enabled": learner.precision == "bfloat16"},
        "fp16": {"enabled": learner.precision == "float16"},
        "optimizer": {"type": "AdamW", "params": {**adamw, "torch_adam": torch_adam}},
        "steps_per_print": 2**31 - 1,  # the learner logs its own metrics
        "wall_clock_breakdown": False,
    }


def warmup_schedule(warmup_steps: int) -> Callable[[torch.optim.Optimizer], torch.optim.lr_scheduler.LRScheduler]:
    """Linear warm-up to the peak lr, then constant: step ``k`` (1-based) uses ``lr · min(1, k / warmup_steps)``.

    Not DeepSpeed's ``WarmupLR``: its first step uses ``warmup_min_lr`` (a wasted step at lr 0) and it warms up over
    at least 2 steps. ``warmup_steps = 0`` is a constant lr.
    """

    def factor(index: int) -> float:  # index = optimizer steps taken so far
        return 1.0 if warmup_steps == 0 else min(1.0, (index + 1) / warmup_steps)

    return lambda optimizer: torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


# --------------------------------------------------------------------------- the policy


@dataclass(frozen=True)
class StepStats:
    """One optimizer step. Every rank gets the same values."""

    loss: float
    """Full-batch loss: Σ of the loss function over micro-batches and ranks."""
    grad_norm: float
    """Global L2 norm of the gradient before clipping (NaN if DeepSpeed did not compute one)."""
    lr: float
    """Learning rate this step applied."""
    seconds: float
    """Wall time of the step (forward, backward, reduction, update)."""
    micro_batches: int
    """Micro-batches on this rank."""
    applied: bool
    """False when fp16 loss scaling overflowed and DeepSpeed skipped the update."""


class PolicyEngine:
    """The trained policy: a Hugging Face causal LM wrapped by ``deepspeed.initialize``.

    ``global_batch`` is the number of sequences in one optimizer step over all ranks (default: groups per step ×
    samples per prompt); it only sizes DeepSpeed's bookkeeping. Every method that touches the model is collective
    under data parallelism: all ranks call it in the same order.
    """

    def __init__(self, config: RunConfig, model_path: str | None = None, *, global_batch: int | None = None) -> None:
        self.config = config
        self.model_path = Path(model_path or config.model.path)
        dist.init_distributed()
        self.deepspeed = dist.import_deepspeed()
        learner = config.learner
        self.world_size = dist.world_size()
        per_rank = math.ceil((global_batch or learner.groups_per_step * config.rollout.num_samples) / self.world_size)
        self.micro_batch_size = min(learner.micro_batch_size, per_rank)
        self.ds_config = deepspeed_config(
            learner,
            micro_batch_size=self.micro_batch_size,
            accumulation_steps=math.ceil(per_rank / self.micro_batch_size),
            cpu=dist.configure_accelerator() == "cpu",
        )
        model = self._load_model()
        prefer_environment_ninja()
        clear_stale_locks()  # an op this config needs (cpu_adam for offload) is built on the next line
        self.engine, *_ = self.deepspeed.initialize(
            model=model,
            model_parameters=[p for p in model.parameters() if p.requires_grad],
            config=self.ds_config,
            lr_scheduler=warmup_schedule(learner.warmup_steps),
        )
        # No dropout: π_old recomputed at the start of a step must equal π_θ before its update, and vLLM samples
        # without dropout. Backward works the same in eval mode.
        self.engine.eval()

    def _load_model(self) -> torch.nn.Module:
        """The HF model, whole, in the training precision.

        Under ZeRO-3 ``deepspeed.initialize`` partitions it afterwards, so each rank briefly holds the whole model in
        host memory. Loading straight into partitions needs transformers' ``HfDeepSpeedConfig``, which requires the
        ``accelerate`` package (not a dependency of this project).
        """
        model = AutoModelForCausalLM.from_pretrained(self.model_path, dtype=DTYPES[self.config.learner.precision])
        return lora.add_adapters(model, self.config.lora) if self.config.lora.enabled else model

    @property
    def module(self) -> torch.nn.Module:
        """The Hugging Face model inside the engine (ZeRO-3: its parameters are partitioned)."""
        return self.engine.module

    @property
    def device(self) -> torch.device:
        return self.engine.device

    @property
    def rank(self) -> int:
        return dist.rank()

    def token_logprobs(self, input_ids: Tensor, attention_mask: Tensor, temperature: float = 1.0) -> Tensor:
        """``[B, T]`` log π_θ(x_t | x_<t), differentiable; see :func:`sequence_logprobs` for the alignment."""
        return sequence_logprobs(self.engine, input_ids.to(self.device), attention_mask.to(self.device), temperature)

    def token_logprobs_and_entropy(
        self, input_ids: Tensor, attention_mask: Tensor, temperature: float = 1.0, entropy_grad: bool = True
    ) -> tuple[Tensor, Tensor]:
        """``[B, T]`` log π_θ (differentiable) and the policy's entropy at each token: differentiable for an entropy
        bonus, else without a graph (the figure every step reports)."""
        ids, mask = input_ids.to(self.device), attention_mask.to(self.device)
        return sequence_logprobs_and_entropy(self.engine, ids, mask, temperature, entropy_grad)

    @torch.no_grad()
    def token_logprobs_no_grad(self, input_ids: Tensor, attention_mask: Tensor, temperature: float = 1.0) -> Tensor:
        """The same without a graph: proximal log-probs π_old at the start of a step."""
        return self.token_logprobs(input_ids, attention_mask, temperature)

    def train_step(
        self, micro_batches: Sequence[MicroBatch], loss_fn: Callable[[PolicyEngine, MicroBatch], Tensor]
    ) -> StepStats:
        """One optimizer step: ``backward`` of each micro-batch's loss share, then one DeepSpeed ``step``.

        ``loss_fn(engine, micro_batch)`` returns a scalar normalised with global counts (see the module docstring).
        The accumulation boundary is set by hand (``set_gradient_accumulation_boundary``), so any number of
        micro-batches makes one update, whatever ``gradient_accumulation_steps`` says. Collective.
        """
        if not micro_batches:
            raise ValueError("train_step needs at least one micro-batch")
        started = time.perf_counter()
        lr = float(self.engine.get_lr()[0])  # before step(): the scheduler moves it on afterwards
        local_loss = torch.zeros((), dtype=torch.float64, device=self.device)
        last = len(micro_batches) - 1
        for index, micro_batch in enumerate(micro_batches):
            self.engine.set_gradient_accumulation_boundary(index == last)
            loss = loss_fn(self, _on_device(micro_batch, self.device))
            # DeepSpeed averages gradients over data-parallel ranks; the shares are already globally normalised.
            self.engine.backward(loss * self.engine.dp_world_size, scale_wrt_gas=False)
            local_loss += loss.detach()  # a tensor: no device sync per micro-batch
        own_norm = self._grad_norm() if not hasattr(self.engine.optimizer, "_global_grad_norm") else None
        total_loss = dist.all_reduce_sum(local_loss)
        # A non-finite loss or gradient must not reach the weights (learner/health/monitor.py). DeepSpeed's ZeRO and
        # bf16/fp16 optimizers skip such a step themselves; the bare optimizer of ZeRO 0 float32 (the one without a norm
        # of its own) would not, so skip it here: drop the gradients and leave weights, Adam state and lr schedule as
        # they are. Loss and norm are global, so every rank decides the same.
        if own_norm is not None and not step_is_finite(total_loss, own_norm):
            self.engine.zero_grad()
            applied = False
        else:
            self.engine.step()
            applied = bool(self.engine.was_step_applied())
        grad_norm = own_norm if own_norm is not None else self.engine.get_global_grad_norm()
        return StepStats(
            loss=total_loss,
            grad_norm=math.nan if grad_norm is None else float(grad_norm),
            lr=lr,
            seconds=time.perf_counter() - started,
            micro_batches=len(micro_batches),
            applied=applied,
        )

    def _grad_norm(self) -> float:
        """L2 norm of the module's gradients, for the one set-up where DeepSpeed keeps none (ZeRO 0, float32).

        Called after the boundary backward, when ZeRO 0 has already all-reduced the gradients, so it is global.
        """
        norms = [p.grad.detach().float().norm() for p in self.module.parameters() if p.grad is not None]
        return float(torch.stack(norms).norm()) if norms else 0.0

    # ----------------------------------------------------------------------- weights out

    def state_dict_for_broadcast(self, dtype: torch.dtype | None = None) -> dict[str, Tensor]:
        r"""What the actors load, on rank 0 (``{}`` on other ranks): the policy's full parameters, named as in the HF
        checkpoint — or with ``[lora]`` only the adapters' tensors, named as in a saved PEFT adapter.

        Full names are ``named_parameters()`` of the HF model (``model.layers.0.self_attn.q_proj.weight``,
        ``lm_head.weight``; a tied weight appears once, as in ``save_pretrained``); adapter names are as
        :func:`asyncrl.learner.update.lora.saved_name` gives them. ``dtype`` defaults to ``config.model.dtype``, the
        actors'. ZeRO 0–2 keep whole parameters on every rank: the tensors are detached views of the live weights on the
        engine's device (no copy; copy before the next ``train_step`` when sending in the background —
        ``common.weights.group.pack_bucket`` does). ZeRO-3: collective; parameters are all-gathered
        ``ZERO3_GATHER_NUMEL`` elements at a time with ``deepspeed.zero.GatheredParameters`` and rank 0 keeps CPU
        copies, so no rank ever holds the whole model on its device at once.
        """
        named = list(self.module.named_parameters())
        if self.config.lora.enabled:
            named = [(lora.saved_name(name), p) for name, p in named if lora.is_adapter(name)]
        return self._collect(named, dtype or DTYPES[self.config.model.dtype])

    def full_state_dict(self, dtype: torch.dtype | None = None) -> dict[str, Tensor]:
        """Every weight of the policy under its HF name, on rank 0 (``{}`` on others; collective under ZeRO-3): with
        ``[lora]`` each targeted layer merged, ``W + (alpha / rank) · B A``
        (:func:`asyncrl.learner.update.lora.merged_weights`), otherwise :meth:`state_dict_for_broadcast`."""
        if not self.config.lora.enabled:
            return self.state_dict_for_broadcast(dtype)
        params = self._collect(list(self.module.named_parameters()), dtype or DTYPES[self.config.model.dtype])
        return lora.merged_weights(params, self.config.lora.alpha / self.config.lora.rank) if params else {}

    def _collect(self, named: list[tuple[str, Any]], dtype: torch.dtype) -> dict[str, Tensor]:
        if self.config.learner.zero_stage == 3:
            return self._gather_zero3(named, dtype)
        if self.rank != 0:
            return {}
        return {name: p.detach().to(dtype) for name, p in named}

    def _gather_zero3(self, named: list[tuple[str, Any]], dtype: torch.dtype) -> dict[str, Tensor]:
        gathered: dict[str, Tensor] = {}
        for chunk in _chunks_by_numel(named, ZERO3_GATHER_NUMEL):
            with self.deepspeed.zero.GatheredParameters([p for _, p in chunk], modifier_rank=None):
                if self.rank == 0:
                    gathered.update((name, p.detach().to("cpu", dtype, copy=True)) for name, p in chunk)
        return gathered


def _chunks_by_numel(items: list[tuple[str, Any]], limit: int) -> Iterator[list[tuple[str, Any]]]:
    """Consecutive runs of (name, parameter) whose ZeRO-3 full sizes (``ds_numel``) sum to at most ``limit``."""
    chunk: list[tuple[str, Any]] = []
    size = 0
    for name, param in items:
        numel = getattr(param, "ds_numel", param.numel())
        if chunk and size + numel > limit:
            yield chunk
            chunk, size = [], 0
        chunk.append((name, param))
        size += numel
    if chunk:
        yield chunk


# --------------------------------------------------------------------------- the reference


class ReferenceModel:
    """A frozen copy of the initial policy for the KL term: eval mode, no gradients, not wrapped by DeepSpeed.

    Whole on every rank (a reference too large for one device would need DeepSpeed's inference engine).
    """

    def __init__(self, path: str | Path, dtype: str | torch.dtype = "float32", device: str | None = None) -> None:
        torch_dtype = DTYPES[dtype] if isinstance(dtype, str) else dtype
        self.device = torch.device(device or _default_device())
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype)
        # transformers wraps Module.to with functools.wraps, whose type does not bind self: the device reads as self.
        self.model = model.to(self.device).eval()  # pyright: ignore[reportArgumentType]
        self.model.requires_grad_(False)

    @torch.no_grad()
    def token_logprobs(self, input_ids: Tensor, attention_mask: Tensor, temperature: float = 1.0) -> Tensor:
        """``[B, T]`` log π_ref(x_t | x_<t); see :func:`sequence_logprobs` for the alignment."""
        return sequence_logprobs(self.model, input_ids.to(self.device), attention_mask.to(self.device), temperature)


def reference_for(policy: PolicyEngine) -> ReferenceModel | lora.AdapterOffReference:
    """The frozen reference policy of the KL terms and DPO: the policy's own module with its adapters off in a
    ``[lora]`` run (no second copy), else a :class:`ReferenceModel` loaded from ``model.path``."""
    config = policy.config
    if config.lora.enabled:
        return lora.AdapterOffReference(policy)
    return ReferenceModel(config.model.path, reference_precision(config), str(policy.device))


def reference_precision(config: RunConfig) -> str:
    """The reference model's dtype name: ``learner.reference_precision``, else the training precision."""
    return config.learner.reference_precision or config.learner.precision


def _default_device() -> str:
    if dist.configure_accelerator() == "cpu":
        return "cpu"
    return f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}"
