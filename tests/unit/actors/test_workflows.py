"""Rollout workflows around a stand-in engine: the built-in ``single_turn`` asks for the group's K responses in one
request with the sampling the group or ``[rollout]`` gives, and packs what comes back as the wire carries it; a
workflow is chosen by name, and an unknown name is refused at ``resolve``, naming the known ones. (The real engine
under ``single_turn`` is tests/integration/actors/test_rollout_actor.py's.)"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import numpy as np
import pytest

from asyncrl.actors.workflows import (
    WORKFLOWS,
    Response,
    Sampling,
    WorkflowContext,
    check_workflow,
    register_workflow,
    rollout_group,
    sampling_for,
)
from asyncrl.cli.preflight import check_config
from asyncrl.common.config import ConfigError, load_config
from asyncrl.common.wire.messages import PromptGroup


class ScriptedEngine:
    """Answers every request with the responses it was given, and records what was asked."""

    stop_ids = (7,)

    def __init__(self, responses: list[Response]) -> None:
        self.responses = responses
        self.requests: list[tuple[list[int], Sampling, str]] = []

    async def generate(self, prompt_ids: Sequence[int], sampling: Sampling, request_id: str) -> list[Response]:
        self.requests.append((list(prompt_ids), sampling, request_id))
        return self.responses[: sampling.n]


def group(**fields) -> PromptGroup:
    return PromptGroup(
        group_id="g-1", task="arithmetic", prompt="1+2=", prompt_ids=np.array([4, 5, 6], np.int32), answer="3",
        num_samples=2, issued_version=3, **fields,
    )  # fmt: skip


def turn(*overrides: str) -> WorkflowContext:
    return WorkflowContext(load_config(None, list(overrides)).rollout, "actor-0", "g-1-abc")


RESPONSES = [
    Response(token_ids=[9, 7], logprobs=[-0.5, -float("inf")], versions=[3, 4], text="3", finish_reason="stop"),
    Response(token_ids=[8], logprobs=[-1.0], versions=[4], text="2", finish_reason=""),
]


def test_single_turn_asks_once_for_k_responses_and_packs_them() -> None:
    engine = ScriptedEngine(RESPONSES)
    rollout = asyncio.run(check_workflow("single_turn")(engine, group(), turn("rollout.max_new_tokens=5")))
    [(prompt_ids, sampling, request_id)] = engine.requests
    assert prompt_ids == [4, 5, 6] and request_id == "g-1-abc"
    assert sampling == Sampling(n=2, temperature=1.0, top_p=1.0, max_tokens=5, stop=(), stop_token_ids=(7,))
    assert rollout.token_ids.tolist() == [9, 7, 8] and rollout.lengths.tolist() == [2, 1]
    assert rollout.versions.tolist() == [3, 4, 4] and rollout.texts == ["3", "2"]
    assert rollout.logprobs.tolist() == [-0.5, -1e4, -1.0]  # an underflow to -inf is clamped for the wire
    assert rollout.finish_reasons == ["stop", "abort"]  # a response that never finished was cut
    assert (rollout.group_id, rollout.actor_id, rollout.issued_version) == ("g-1", "actor-0", 3)
    assert rollout.timings["generate"] >= 0


def test_an_eval_group_samples_with_its_own_settings_and_a_training_group_as_the_run_says() -> None:
    run = turn("rollout.temperature=0.7", "rollout.top_p=0.9", "rollout.max_new_tokens=6", "rollout.stop=['END']")
    training = sampling_for(group(), run)
    assert (training.temperature, training.top_p, training.max_tokens, training.stop) == (0.7, 0.9, 6, ("END",))
    held_out = sampling_for(group(purpose="eval", temperature=0.0, max_new_tokens=3), run)
    assert (held_out.temperature, held_out.top_p, held_out.max_tokens) == (0.0, 1.0, 3)


async def two_requests(engine, prompt_group: PromptGroup, context: WorkflowContext):
    """A workflow of two requests, each answered once: what a user's own workflow may do."""
    first = await engine.generate([1], sampling_for(prompt_group, context), context.request_id + "-a")
    second = await engine.generate([2], sampling_for(prompt_group, context), context.request_id + "-b")
    return rollout_group(prompt_group, first[:1] + second[:1], context)


@pytest.mark.parametrize("name", ["two_requests", "tests.unit.actors.test_workflows:two_requests"])
def test_a_workflow_is_chosen_by_its_registered_name_or_its_import_path(name: str) -> None:
    with WORKFLOWS.snapshot():
        register_workflow("two_requests")(two_requests)
        engine = ScriptedEngine(RESPONSES)
        rollout = asyncio.run(check_workflow(load_config(None, [f"rollout.workflow={name!r}"]).rollout.workflow)(
            engine, group(), turn()
        ))  # fmt: skip
        assert [r[2] for r in engine.requests] == ["g-1-abc-a", "g-1-abc-b"]
        assert rollout.lengths.tolist() == [2, 2]
        with pytest.raises(ValueError, match="already registered"):
            register_workflow("single_turn")(two_requests)
    assert "two_requests" not in WORKFLOWS


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("two_turns", "rollout.workflow: unknown rollout workflow 'two_turns'; registered: multi_turn, single_turn"),
        ("tests.unit.actors.test_workflows:nowhere", "rollout.workflow: rollout workflow import path"),
    ],
)
def test_an_unknown_workflow_is_refused_when_the_config_is_checked(name: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        check_config(load_config(None, [f"rollout.workflow={name!r}"]))


def test_responses_that_say_which_tokens_were_sampled_give_the_rollout_its_loss_mask() -> None:
    episode = Response(token_ids=[9, 3, 3, 8], logprobs=[-0.1, 0.0, 0.0, -0.2], versions=[1] * 4, trained=[1, 0, 0, 1])
    plain = Response(token_ids=[5, 6], logprobs=[-0.3, -0.4], versions=[1, 1])
    rollout = rollout_group(group(), [episode, plain], turn())
    assert rollout.loss_mask.tolist() == [1, 0, 0, 1, 1, 1]  # a response without a mask: every token sampled
    assert rollout_group(group(), [plain, plain], turn()).loss_mask.size == 0  # nothing left out: no mask sent
