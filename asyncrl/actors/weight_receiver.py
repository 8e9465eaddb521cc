"""A vLLM worker extension that joins the learner's weight group and loads broadcast weights in place.

vLLM mixes this class into its worker (``worker_extension_cls``); the actor calls its methods
through ``AsyncLLM.collective_rpc``, so they run inside the worker process that owns the model.
Every bucket is received before ``reload_weights`` starts (see :meth:`WeightReceiverExtension.asyncrl_receive`
for why), so a failed transfer never leaves a half-loaded model. ``model.load_weights`` is not used:
on CPUs vLLM repacks weights after loading and only ``reload_weights`` handles that
(DESIGN.md, facts measured here).
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

import torch

from asyncrl.actors.engine import POLICY_ADAPTER_ID
from asyncrl.actors.lifeline import follow_actor
from asyncrl.common.weights.group import GroupAddress, WeightGroup, digest_mismatch, unpack_bucket
from asyncrl.common.wire.messages import Decoder, WeightManifest

if TYPE_CHECKING:
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding


class WeightReceiverExtension:
    """Methods added to each vLLM worker; state lives on the worker object itself."""

    _asyncrl_group: WeightGroup | None = None
    _asyncrl_received: tuple[WeightManifest, list] | None = None  # verified, not yet loaded
    model_runner: Any  # the vLLM worker's, which this class is mixed into

    def asyncrl_join(self, address: dict[str, Any]) -> float:
        """Form (or re-form) the weight group; returns the self-check seconds.

        ``address['rank']`` is the actor's first rank: with tensor parallelism every worker joins as its own rank,
        the actor's first plus the worker's rank in the engine, and receives every bucket itself (vLLM's loader then
        keeps this worker's shard of each tensor). Receiving once and handing on inside the engine would save the
        learner's uplink (one copy per actor, not per GPU) but needs a second collective inside vLLM's own group.
        """
        self.asyncrl_leave()
        worker = int(getattr(self, "rank", 0))  # vLLM's Worker: its rank in the engine (0 without parallelism)
        self._asyncrl_group = WeightGroup(GroupAddress(**{**address, "rank": address["rank"] + worker}))
        return self._asyncrl_group.self_check()

    def asyncrl_receive(self, manifest_frames: list[bytes], verify: bool = True) -> dict[str, Any]:
        """Receive every bucket of the manifest and verify it; returns timings and the bytes received. The actor
        then calls :meth:`asyncrl_load` on every worker — to load, only once every worker verified its copy.

        All buckets arrive before the first weight is loaded: vLLM's in-place reload takes the model's weights
        apart while it loads (on CPUs it repacks them), so a transfer that failed halfway — a learner killed
        mid-broadcast — would leave a model that cannot run and kill the engine. Received first, a failed
        transfer leaves the old weights serving. The cost is one copy of the weights in memory during a sync.

        Every bucket is checked against its digest in the manifest before any is loaded; on a mismatch the result
        says why under ``refused``, and the actor loads on no worker — with tensor parallelism, one worker's bad copy
        must not leave the others serving a different version — so the old weights keep serving (the transfer itself
        succeeded, so the worker stays in the group for the next version).
        """
        if self._asyncrl_group is None:
            raise RuntimeError("asyncrl_receive before asyncrl_join: this worker is not in a weight group")
        manifest: WeightManifest = Decoder(WeightManifest).decode(manifest_frames)
        start = time.perf_counter()
        flats = self._asyncrl_group.receive_all(manifest.buckets)
        received = time.perf_counter()
        figures: dict[str, Any] = {
            "receive_s": received - start,
            "bytes": float(sum(f.numel() * f.element_size() for f in flats)),
        }
        refused = digest_mismatch(manifest.buckets, flats) if verify else ""  # off: weight_sync.digests = false
        figures["verify_s"] = time.perf_counter() - received
        if refused:
            return figures | {"refused": refused}
        self._asyncrl_received = (manifest, flats)
        return figures

    def asyncrl_load(self, load: bool, adapter: dict[str, Any] | None = None) -> float:
        """Load the weights :meth:`asyncrl_receive` verified (``load``), or drop them; returns the seconds taken.
        ``adapter``: the weights are a LoRA run's adapters, with these PEFT settings (:func:`install_adapter`)."""
        start = time.perf_counter()
        received, self._asyncrl_received = self._asyncrl_received, None
        if load and received is not None:
            manifest, flats = received
            pairs = zip(manifest.buckets, flats, strict=True)
            weights = (pair for bucket, flat in pairs for pair in unpack_bucket(bucket, flat))
            if adapter is not None:
                install_adapter(self.model_runner.lora_manager, dict(weights), adapter)
            else:
                model = self.model_runner.model
                quiet_buffer_only_layers(model)
                self.model_runner.reload_weights(weights_iterator=weights, is_checkpoint_format=True)
                retie_output_head(model)
        return time.perf_counter() - start

    def asyncrl_zero_adapter(self) -> None:
        """Serve the policy's adapter slot with an adapter of zeros (exactly the base model) until the first
        version's adapters arrive: every request names the slot from the start, so a request in flight across an
        update switches adapters at the pause as one without adapters would switch weights."""
        manager = self.model_runner.lora_manager
        rank = manager.lora_config.max_lora_rank
        zero = manager._adapter_manager.create_dummy_lora(POLICY_ADAPTER_ID, rank, manager.embedding_modules)
        _replace_adapter(manager, zero)

    def asyncrl_leave(self) -> None:
        """Drop the current group and close its store connection."""
        if self._asyncrl_group is not None:
            self._asyncrl_group.close()
        self._asyncrl_group = None


def install_adapter(manager: Any, tensors: dict[str, torch.Tensor], settings: dict[str, Any]) -> None:
    """Put ``tensors`` (named as a saved PEFT adapter's) into vLLM's adapter cache as :data:`POLICY_ADAPTER_ID`,
    replacing the version it served, straight from memory: vLLM's own path (``LoRARequest.lora_path``) reads a
    folder, and none is written.

    ``manager`` is the model runner's ``LRUCacheWorkerLoRAManager``; it keeps one adapter (``max_cpu_loras = 1``), so
    the one in memory is never evicted and never read back from a path."""
    from vllm.lora.peft_helper import PEFTHelper

    helper = PEFTHelper.from_dict(settings)
    helper.validate_legal(manager.lora_config)
    model = manager._adapter_manager.model
    mapper = getattr(model, "hf_to_vllm_mapper", None)
    adapter = manager._lora_model_cls.from_lora_tensors(
        lora_model_id=POLICY_ADAPTER_ID,
        tensors=tensors,
        peft_helper=helper,
        device="cpu",
        dtype=manager.lora_config.lora_dtype,
        model_vocab_size=manager.vocab_size,
        weights_mapper=None if mapper is None else mapper.get_rename_mapper(),
        skip_prefixes=getattr(model, "lora_skip_prefixes", None),
    )
    _replace_adapter(manager, adapter)


def _replace_adapter(manager: Any, adapter: Any) -> None:
    cache = manager._adapter_manager
    cache.remove_adapter(adapter.id)
    cache.add_adapter(adapter)
    cache.activate_adapter(adapter.id)


RELOAD_LOGGER = "vllm.model_executor.model_loader.reload.layerwise"


class BufferOnlyLayers(logging.Filter):
    """Drops vLLM's ``<Layer>: Failed to load weights`` for layer classes that hold no parameters.

    vLLM's layer-wise reload says so for every layer that received none of its tensors. A rotary embedding's only
    tensor is its cos/sin cache, a buffer no checkpoint carries (HF's ``inv_freq`` is not persistent) and no
    broadcast sends; vLLM puts it back as it was. Said on every reload, once a step, the warning is noise; for a
    layer with parameters it still means a weight was not sent, and passes.
    """

    def __init__(self, classes: frozenset[str]) -> None:
        super().__init__()
        self.classes = classes

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if record.msg != "%s: Failed to load weights" or not isinstance(args, tuple) or not args:
            return True
        return args[0] not in self.classes


def quiet_buffer_only_layers(model: torch.nn.Module) -> None:
    """Install :class:`BufferOnlyLayers` on vLLM's reload logger for ``model``'s classes without parameters, and for
    an output head tied to the input embedding, which :func:`retie_output_head` loads (once)."""
    logger = logging.getLogger(RELOAD_LOGGER)
    if any(isinstance(f, BufferOnlyLayers) for f in logger.filters):
        return
    with_parameters = {type(m).__name__ for m in model.modules() if next(m.parameters(), None) is not None}
    without = {type(m).__name__ for m in model.modules()} - with_parameters
    if (tied := tied_output_head(model)) is not None:
        without.add(type(tied[0]).__name__)
    logger.addFilter(BufferOnlyLayers(frozenset(without)))


def tied_output_head(model: torch.nn.Module) -> tuple[VocabParallelEmbedding, torch.nn.Module] | None:
    """(output head, input embedding) of a model whose head shares the embedding's weight (``tie_word_embeddings``,
    as in Qwen2-0.5B or Llama-3.2-1B); None otherwise."""
    if not getattr(getattr(model, "config", None), "tie_word_embeddings", False):
        return None
    head, embedding = getattr(model, "lm_head", None), getattr(getattr(model, "model", None), "embed_tokens", None)
    if head is None or embedding is None or not hasattr(head, "quant_method"):
        return None
    return head, embedding


def retie_output_head(model: torch.nn.Module) -> None:
    """After a reload, make a tied output head compute with the embedding weight that was just loaded.

    A tied head's weight arrives once, as the embedding's (the model's loader skips ``lm_head.weight``). vLLM's
    layer-wise reload then finds no weight for the head, puts its pre-reload tensors back, and on CPUs the head keeps
    computing logits with the matrix it packed at the previous load: the actor samples from the new embedding and an
    old head. In a synchronous run of a tied Qwen2 that showed as a policy mismatch (KL between vLLM's and the
    learner's log-probs of the same tokens) growing with each version, 2e-4 to 1.1e-3 by the third; with the head
    re-tied it stays at rounding. The head is pointed at the embedding's weight again and processed as after a load
    (its CPU packing redone)."""
    if (tied := tied_output_head(model)) is None:
        return
    head, embedding = tied
    head.weight = embedding.weight
    head.quant_method.process_weights_after_loading(head)


# vLLM imports this module in every process that hosts one of its workers: from here on, that process ends when the
# rollout actor that started the engine does (actors/lifeline.py), even if the actor was killed with -9.
follow_actor()
