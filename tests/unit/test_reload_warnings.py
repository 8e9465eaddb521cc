"""vLLM's "<Layer>: Failed to load weights" on every reload: dropped for layer classes without parameters (a rotary
embedding's cache), kept for a layer whose weights did not arrive."""

from __future__ import annotations

import logging

import pytest
import torch

from asyncrl.actors.weight_receiver import RELOAD_LOGGER, BufferOnlyLayers, quiet_buffer_only_layers


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
