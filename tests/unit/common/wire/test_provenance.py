"""The learner's check that a scored group answers what was issued under its id: forged groups."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from asyncrl.common.config import load_config
from asyncrl.common.wire.messages import PromptGroup, RolloutGroup
from asyncrl.common.wire.provenance import episode_tokens, issue_mismatch

ISSUED = PromptGroup(
    group_id="run-00000007",
    task="arithmetic",
    prompt="12+7=",
    prompt_ids=np.array([1, 5, 6, 9, 11, 12], np.int32),
    answer="19",
    num_samples=2,
    issued_version=3,
)


def answer(**changes) -> RolloutGroup:
    """What an honest actor sends back for ISSUED: two responses of 2 and 3 tokens, sampled by versions 3 and 4."""
    group = RolloutGroup(
        group_id=ISSUED.group_id,
        task=ISSUED.task,
        prompt=ISSUED.prompt,
        prompt_ids=ISSUED.prompt_ids.copy(),
        answer=ISSUED.answer,
        token_ids=np.array([7, 8, 7, 8, 2], np.int32),
        logprobs=np.zeros(5, np.float32),
        versions=np.array([3, 3, 3, 4, 4], np.int32),
        lengths=np.array([2, 3], np.int32),
        texts=["19", "20\n"],
        finish_reasons=["stop", "length"],
        issued_version=3,
    )
    return dataclasses.replace(group, **changes)


def test_an_honest_answer_passes() -> None:
    assert issue_mismatch(ISSUED, answer(), max_new_tokens=3, newest_version=4) is None


@pytest.mark.parametrize(
    ("changes", "reason"),
    [
        ({"task": "os:system"}, "its task differs"),
        ({"prompt": "99+1="}, "its prompt differs"),
        ({"answer": "20"}, "its answer differs"),  # a forger's own ground truth would score wrong responses 1
        ({"prompt_ids": np.array([1, 5, 6, 9, 11, 13], np.int32)}, "its prompt_ids differ"),
        ({"prompt_ids": np.array([1, 5, 6], np.int32)}, "its prompt_ids differ"),
        (
            {
                "lengths": np.array([5], np.int32),
                "texts": ["19"],
                "finish_reasons": ["stop"],
            },
            "it has 1 responses; 2 were asked for",
        ),
        ({"issued_version": 0}, "its issued_version 0 is not the issued 3"),
        ({"versions": np.array([3, 3, 3, 4, 9], np.int32)}, "stamped version 9; the newest published is 4"),
    ],
)
def test_every_field_that_differs_from_the_issue_record_is_named(changes: dict, reason: str) -> None:
    assert reason in issue_mismatch(ISSUED, answer(**changes), max_new_tokens=3, newest_version=4)


def test_a_response_longer_than_max_new_tokens_is_refused() -> None:
    # 12.7 KB of tokens in one group made a step 8-9x slower; vLLM never samples past max_new_tokens
    long = answer(
        token_ids=np.zeros(3200, np.int32),
        logprobs=np.zeros(3200, np.float32),
        versions=np.full(3200, 3, np.int32),
        lengths=np.array([3199, 1], np.int32),
    )
    assert issue_mismatch(ISSUED, long, max_new_tokens=64, newest_version=4) == (
        "a response has 3199 tokens; rollout.max_new_tokens is 64"
    )
    assert issue_mismatch(ISSUED, answer(), max_new_tokens=2, newest_version=4) is not None  # 3 > 2: the bound is exact
    # A multi-turn episode holds several turns of up to max_new_tokens each: its budget bounds it instead.
    assert issue_mismatch(ISSUED, long, 64, 4, episode_tokens=3199) is None
    assert issue_mismatch(ISSUED, long, 64, 4, episode_tokens=3198) == (
        "a response has 3199 tokens; an episode's token budget is 3198"
    )
    # An episode kept per turn holds several rows, each a context and turns of at most the budget: rows are bounded.
    rows = np.zeros(3200, np.int32)
    rows[1600] = 1  # a row starts on a context token (loss mask 0)
    mask = np.ones(3200, np.int32)
    mask[1600:1700] = 0
    per_turn = dataclasses.replace(long, row_starts=rows, loss_mask=mask)
    assert issue_mismatch(ISSUED, per_turn, 64, 4, episode_tokens=1600) is None
    assert issue_mismatch(ISSUED, per_turn, 64, 4, episode_tokens=1599) == (
        "a row of a response has 1600 tokens; an episode's token budget is 1599"
    )
    episodes = ["rollout.workflow=multi_turn", "environment.name=calculator", "model.max_model_len=300"]
    assert episode_tokens(load_config(None, episodes)) == 300
    assert episode_tokens(load_config(None, [*episodes, "environment.max_episode_tokens=99"])) == 99
    assert episode_tokens(load_config(None, [])) == 0


def test_an_id_without_an_issue_record_is_refused() -> None:
    assert "not in flight: never issued" in issue_mismatch(None, answer(), max_new_tokens=3, newest_version=4)


def test_without_a_newest_version_the_version_bound_is_skipped() -> None:
    """The reward worker's check: it does not follow versions, the learner bounds them."""
    future = answer(versions=np.full(5, 10**6, np.int32))
    assert issue_mismatch(ISSUED, future, max_new_tokens=3) is None
    assert issue_mismatch(ISSUED, answer(task="x"), max_new_tokens=3) == "its task differs from the one issued"
