"""vLLM's "<Layer>: Failed to load weights" on every reload: dropped for layer classes without parameters (a rotary
embedding's cache) and for an output head tied to the embedding (re-tied after the reload), kept for a layer whose
weights did not arrive."""

from __future__ import annotations

import logging
import types

import pytest
import torch

from asyncrl.actors.weight_receiver import (
    RELOAD_LOGGER,
    BufferOnlyLayers,
    quiet_buffer_only_layers,
    retie_output_head,
)


class RotaryEmbedding(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("cos_sin_cache", torch.zeros(4, 2), persistent=False)


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.rotary = RotaryEmbedding()
        self.proj = torch.nn.Linear(2, 2)


@pytest.fixture
def reload_logger():
    logger = logging.getLogger(RELOAD_LOGGER)
    yield logger
    logger.filters = [f for f in logger.filters if not isinstance(f, BufferOnlyLayers)]


def test_only_parameterless_layers_are_quieted(reload_logger, caplog: pytest.LogCaptureFixture) -> None:
    model = torch.nn.Sequential(Block(), Block())
    quiet_buffer_only_layers(model)
    quiet_buffer_only_layers(model)  # once per process, not once per reload
    assert [f.classes for f in reload_logger.filters if isinstance(f, BufferOnlyLayers)] == [
        frozenset({"RotaryEmbedding"})
    ]
    with caplog.at_level(logging.WARNING, logger=RELOAD_LOGGER):
        for layer in ("RotaryEmbedding", "Linear", "Block"):
            reload_logger.warning("%s: Failed to load weights", layer)
        reload_logger.warning("%s: something else", "RotaryEmbedding")
    assert [r.getMessage() for r in caplog.records] == [
        "Linear: Failed to load weights",
        "Block: Failed to load weights",
        "RotaryEmbedding: something else",
    ]


class PackingMethod:
    """Stands in for vLLM's embedding method on CPUs: packs the head's weight when processed after a load."""

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        layer.packed = layer.weight.detach().clone()


class Head(torch.nn.Module):
    def __init__(self, weight: torch.nn.Parameter) -> None:
        super().__init__()
        self.weight, self.quant_method = weight, PackingMethod()
        self.quant_method.process_weights_after_loading(self)


class TinyCausalLM(torch.nn.Module):
    """vLLM's layout of a causal LM: ``model.embed_tokens``, ``lm_head``, ``config.tie_word_embeddings``."""

    def __init__(self, tied: bool) -> None:
        super().__init__()
        self.config = types.SimpleNamespace(tie_word_embeddings=tied)
        self.model = torch.nn.Module()
        self.model.embed_tokens = torch.nn.Embedding(5, 3)
        self.lm_head = Head(self.model.embed_tokens.weight if tied else torch.nn.Parameter(torch.zeros(5, 3)))

    def reload_embedding(self) -> None:
        """What vLLM's layer-wise reload leaves: a new embedding weight, the head's old tensors put back."""
        self.model.embed_tokens.weight = torch.nn.Parameter(torch.randn(5, 3))


@pytest.mark.parametrize("tied", [True, False])
def test_a_tied_head_computes_with_the_embedding_just_loaded_and_its_warning_is_quieted(
    tied: bool, reload_logger
) -> None:
    model = TinyCausalLM(tied)
    untied_head = model.lm_head.weight
    model.reload_embedding()
    retie_output_head(model)
    head, embedding = model.lm_head, model.model.embed_tokens
    if tied:
        assert head.weight is embedding.weight and torch.equal(head.packed, embedding.weight)
    else:
        assert head.weight is untied_head and not torch.equal(head.packed, embedding.weight)
    quiet_buffer_only_layers(model)
    [quieted] = [f.classes for f in reload_logger.filters if isinstance(f, BufferOnlyLayers)]
    assert ("Head" in quieted) == tied
