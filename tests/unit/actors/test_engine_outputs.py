"""How the rollout engine assembles a response from vLLM's streamed outputs: ids and log-probs as they come, versions
from the spans of weight versions vLLM's engine core reports when the response finishes."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from vllm.logprobs import Logprob
from vllm.outputs import WeightVersionSpan

from asyncrl.actors.engine import _append
from asyncrl.actors.generation import Response


@dataclass
class Part:
    """What vLLM's ``CompletionOutput`` gives ``_append``."""

    token_ids: list[int]
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    weight_versions: list[WeightVersionSpan] | None = None

    def __post_init__(self) -> None:
        self.logprobs = [{t: Logprob(-0.5 - t)} for t in self.token_ids]


def version_of(label: str) -> int:
    return 3 if label == "default" else int(label)


def test_a_response_across_an_update_takes_each_spans_version_once_it_finishes() -> None:
    response = Response()
    _append(response, Part([5, 6]), version_of)
    assert response.versions == [] and response.token_ids == [5, 6]  # not stamped while it runs
    spans = [WeightVersionSpan("default", 0, 3), WeightVersionSpan("4", 3, 5)]
    _append(response, Part([7, 8, 9], finish_reason="stop", weight_versions=spans), version_of)
    assert response.token_ids == [5, 6, 7, 8, 9]
    assert response.logprobs == [-5.5, -6.5, -7.5, -8.5, -9.5]
    assert response.versions == [3, 3, 3, 4, 4]
    assert response.finish_reason == "stop"


def test_a_vllm_that_reports_no_weight_versions_is_named_instead_of_stamping_a_guess() -> None:
    response = Response()
    with pytest.raises(RuntimeError, match="does not report weight versions"):
        _append(response, Part([1, 2], finish_reason="length", weight_versions=None), version_of)
