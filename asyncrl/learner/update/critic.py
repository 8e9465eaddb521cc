"""The critic: a value model V(s) trained by DeepSpeed beside the policy, for the ``gae`` advantage estimator.

:class:`ValueModel` is the transformer of a causal-LM checkpoint (``AutoModel``: the backbone without its LM head)
with a scalar head ``nn.Linear(hidden, 1)`` on every position — the usual PPO critic for LLMs (Ouyang et al. 2022;
verl and OpenRLHF build theirs the same way). Started from the policy's checkpoint, its head is zero, so every value
starts at 0 (a neutral baseline) and the backbone starts from the policy's features.

:class:`ValueEngine` wraps it with ``deepspeed.initialize`` exactly like
:class:`asyncrl.learner.update.engine.PolicyEngine` (same DeepSpeed config builder, warm-up schedule and loss
convention: a micro-batch's loss is its share of the full-batch loss, normalised with global counts; ``backward``
without accumulation scaling, × the data-parallel size). Its optimizer settings come from ``[critic]``, falling back to
``[learner]`` (:func:`critic_learner_section`).

**Alignment.** ``values[b, t] = V(x[b, :t]) = head(h[b, t−1])``: the value of the state in which token ``t`` is chosen,
read from the hidden state that has seen the tokens before it. It sits at the same index as that token's log-prob in
:func:`asyncrl.learner.update.engine.sequence_logprobs`, so one ``response_mask`` selects both; ``values[:, 0] = 0`` and
``values[b, t] = 0`` where token ``t`` or ``t−1`` is padding.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor, nn
from transformers import AutoModel, PreTrainedModel

from asyncrl.common.config import LearnerSection, RunConfig
from asyncrl.common.observability.logs import get_logger
from asyncrl.learner.algorithms.aggregations import TokenMeanSettings, token_mean
from asyncrl.learner.algorithms.types import GlobalCounts
from asyncrl.learner.algorithms.value import clipped_value_loss
from asyncrl.learner.update import lora
from asyncrl.learner.update.engine import DTYPES, Batch, PolicyEngine, StepStats
from asyncrl.learner.update.step_metrics import MicroBatchMetrics

log = get_logger("critic")

VALUE_HEAD_FILE = "value_head.safetensors"
"""The head's weights beside the backbone's checkpoint files in a saved value-model folder."""

ValueLossFn = Callable[["ValueEngine", Batch], Tensor]
"""``loss_fn(engine, micro_batch) -> scalar``: the micro-batch's share of the batch loss (global counts)."""


# --------------------------------------------------------------------------- the model


class ValueModel(nn.Module):
    """Backbone (``AutoModel`` of a causal-LM checkpoint) + scalar head; ``forward`` gives one score per position."""

    def __init__(self, backbone: PreTrainedModel, head: nn.Linear) -> None:
        super().__init__()
        self.backbone: nn.Module = backbone  # or PEFT's wrapper of it ([lora]: _DeepSpeedValueModel)
        self.head = head

    @classmethod
    def from_pretrained(cls, path: str | Path, dtype: torch.dtype = torch.float32) -> ValueModel:
        """Load ``path``: a folder written by :meth:`save` (head included), or a causal-LM checkpoint (zero head)."""
        path = Path(path)
        backbone = AutoModel.from_pretrained(path, dtype=dtype)
        head = nn.Linear(backbone.config.get_text_config().hidden_size, 1, dtype=dtype)
        head_file = path / VALUE_HEAD_FILE
        if head_file.is_file():
            head.load_state_dict(load_file(head_file))
        else:
            # Zero, not random: V ≡ 0 at the start, a neutral baseline, instead of noise of the hidden states' scale.
            nn.init.zeros_(head.weight)
            nn.init.zeros_(head.bias)
            log.info("value head initialised to zero", backbone=str(path))
        return cls(backbone, head)

    def forward(self, input_ids: Tensor, attention_mask: Tensor, position_ids: Tensor | None = None) -> Tensor:
        """``[B, T]`` float32 score of every position: ``head(h[b, t])`` (unshifted; see :func:`token_values`)."""
        hidden = self.backbone(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False
        ).last_hidden_state
        return self.head(hidden).squeeze(-1).float()

    def save(self, folder: str | Path) -> Path:
        """Write the backbone (``save_pretrained``; a LoRA critic's with its adapters merged in) and
        :data:`VALUE_HEAD_FILE`; :meth:`from_pretrained` reads it."""
        out = Path(folder)
        lora.save_pretrained_merged(self.backbone, out)
        head = {name: p.detach().cpu().contiguous() for name, p in self.head.state_dict().items()}
        save_file(head, out / VALUE_HEAD_FILE)
        return out


def token_values(model: Callable[..., Tensor], input_ids: Tensor, attention_mask: Tensor) -> Tensor:
    """``values[b, t] = head(h[b, t−1])``, aligned with :func:`asyncrl.learner.update.engine.sequence_logprobs` (module
    docstring).

    Position ids count valid tokens (``cumsum(mask) − 1``), as in ``sequence_logprobs``, so left and right padding
    give the same values. Shapes: ``[B, T]`` ids and mask → ``[B, T]`` float32; differentiable unless under no_grad.
    """
    mask = attention_mask.bool()
    positions = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
    scores = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=positions)[:, :-1]
    valid = mask[:, 1:] & mask[:, :-1]
    # where(), not a product: a padded row's hidden states may be NaN, and NaN * 0 is NaN.
    scores = torch.where(valid, scores, torch.zeros_like(scores))
    return torch.cat([scores.new_zeros(scores.shape[0], 1), scores], dim=1)


# --------------------------------------------------------------------------- the engine


def critic_learner_section(config: RunConfig) -> LearnerSection:
    """``[learner]`` with the critic's own settings in place: what
    :func:`asyncrl.learner.update.engine.deepspeed_config` reads.

    ``lr`` is the critic's; ``precision``, ``zero_stage``, ``offload`` and ``micro_batch_size`` are the critic's when
    set, else the learner's; warm-up, weight decay and gradient clip are always the learner's.
    """
    critic, learner = config.critic, config.learner
    chosen = {"precision": critic.precision, "zero_stage": critic.zero_stage, "offload": critic.offload}
    chosen["micro_batch_size"] = critic.micro_batch_size
    update = {name: value for name, value in chosen.items() if value is not None}
    return learner.model_copy(update={**update, "lr": critic.lr})


class _DeepSpeedValueModel(PolicyEngine):
    """PolicyEngine's DeepSpeed wrapping and ``train_step``, around a :class:`ValueModel` instead of a causal LM.

    Private: its log-prob and broadcast methods are meaningless for a critic; :class:`ValueEngine` exposes the rest.
    """

    def _load_model(self) -> nn.Module:
        model = ValueModel.from_pretrained(self.model_path, DTYPES[self.config.learner.precision])
        if self.config.lora.enabled:  # adapters on the backbone, as on the policy; the value head trains whole
            model.backbone = lora.add_adapters(model.backbone, self.config.lora, task_type=None)
        return model


class ValueEngine:
    """The trained critic. ``global_batch`` (sequences per optimizer step over all ranks) defaults to the policy's.

    Every method that touches the model is collective under data parallelism: all ranks call it in the same order.
    """

    def __init__(self, config: RunConfig, *, global_batch: int | None = None) -> None:
        self.config = config
        self.settings = critic_learner_section(config)
        """The optimizer and DeepSpeed settings in effect (``[critic]`` over ``[learner]``)."""
        path = config.critic.path or config.model.path
        critic_config = config.model_copy(update={"learner": self.settings})
        self._wrapped = _DeepSpeedValueModel(critic_config, path, global_batch=global_batch)

    @property
    def micro_batch_size(self) -> int:
        return self._wrapped.micro_batch_size

    @property
    def engine(self) -> Any:
        """The DeepSpeed engine (``save_checkpoint``/``load_checkpoint``: weights, optimizer and scheduler state)."""
        return self._wrapped.engine

    @property
    def module(self) -> ValueModel:
        """The :class:`ValueModel` inside the DeepSpeed engine (ZeRO-3: its parameters are partitioned)."""
        return self._wrapped.module  # type: ignore[return-value]

    @property
    def device(self) -> torch.device:
        return self._wrapped.device

    def values(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        """``[B, T]`` V(state before token t), differentiable; see :func:`token_values` for the alignment."""
        return token_values(self._wrapped.engine, input_ids.to(self.device), attention_mask.to(self.device))

    @torch.no_grad()
    def values_no_grad(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        """The same without a graph: V_old at the start of a step (the bootstrap values of GAE, the clip centre)."""
        return self.values(input_ids, attention_mask)

    def train_step(self, micro_batches: Sequence[Batch], loss_fn: ValueLossFn) -> StepStats:
        """One optimizer step of the critic; ``loss_fn(self, micro_batch)`` follows the engine's loss convention."""
        return self._wrapped.train_step(micro_batches, lambda _, micro_batch: loss_fn(self, micro_batch))

    def save(self, folder: str | Path) -> Path | None:
        """Write the critic as a value-model folder (:meth:`ValueModel.save`) on rank 0; returns it there, else None.

        Collective. ZeRO-3 gathers every parameter on every rank for the save (fine for models that fit one device;
        sharded saving belongs with the checkpoint code).
        """
        if self.settings.zero_stage != 3:
            return self.module.save(folder) if self._wrapped.rank == 0 else None
        params = list(self.module.parameters())
        with self._wrapped.deepspeed.zero.GatheredParameters(params, modifier_rank=None):
            return self.module.save(folder) if self._wrapped.rank == 0 else None


def value_loss_fn(clip: float, counts: GlobalCounts, metrics: MicroBatchMetrics | None = None) -> ValueLossFn:
    """The critic's loss for :meth:`ValueEngine.train_step`: clipped value loss, ``token_mean`` over ``counts``.

    Each micro-batch holds ``input_ids``, ``attention_mask``, ``response_mask``, ``old_values`` (V_old from
    :meth:`ValueEngine.values_no_grad`) and ``returns``, all ``[B, T]`` in the alignment of :func:`token_values`.
    ``counts`` are the whole step's :class:`GlobalCounts` (all micro-batches, all ranks). Metrics of every
    micro-batch are added to ``metrics`` when given.
    """
    settings = TokenMeanSettings()

    def loss(engine: ValueEngine, micro_batch: Batch) -> Tensor:
        values = engine.values(micro_batch["input_ids"], micro_batch["attention_mask"])
        mask = micro_batch["response_mask"]
        out = clipped_value_loss(values, micro_batch["old_values"], micro_batch["returns"], mask, clip)
        if metrics is not None:
            metrics.add(out.metrics, mask)
        return token_mean(out.per_token_loss, mask, counts, settings)

    return loss
