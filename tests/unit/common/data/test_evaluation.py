"""Evaluation: the figures of a round by hand, the [eval] config, eval groups on the wire and their
provenance."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from asyncrl.common.config import ConfigError, load_config
from asyncrl.common.data.evaluation import eval_examples, eval_groups, round_figures
from asyncrl.common.data.prompts import Prompter
from asyncrl.common.wire.messages import (
    Decoder,
    PromptGroup,
    RolloutGroup,
    ScoredGroup,
    WireError,
    decode_blob,
    encode_blob,
)
from asyncrl.common.wire.provenance import issue_mismatch


def scored(rewards: list[float], lengths: list[int] | None = None, versions: int = 2) -> ScoredGroup:
    lengths = lengths or [1] * len(rewards)
    total = sum(lengths)
    rollout = RolloutGroup(
        group_id="g",
        task="arithmetic",
        prompt="1+1=",
        prompt_ids=np.array([1], np.int32),
        token_ids=np.ones(total, np.int32),
        logprobs=np.zeros(total, np.float32),
        versions=np.full(total, versions, np.int32),
        lengths=np.array(lengths, np.int32),
        texts=[""] * len(rewards),
        finish_reasons=["length" if n == 3 else "stop" for n in lengths],
        purpose="eval",
    )
    return ScoredGroup(rollout=rollout, rewards=np.array(rewards, np.float32))


def test_round_figures_by_hand() -> None:
    # three prompts, k = 4, threshold 1.0:
    #   a: 1 0 0 0    mean 0.25   solved once     pass 1
    #   b: 0 0 0 0    mean 0      never           pass 0
    #   c: 1 1 0.5 1  mean 0.875  three of four   pass 1
    # mean@4 = (0.25 + 0 + 0.875) / 3 = 0.375; pass@4 = 2/3; accuracy = (1 + 0 + 3) / 12 = 1/3
    groups = [
        scored([1, 0, 0, 0], [1, 2, 3, 2]),
        scored([0, 0, 0, 0], [3, 3, 1, 1], versions=1),
        scored([1, 1, 0.5, 1], versions=3),
    ]
    figures = round_figures(groups, threshold=1.0)
    assert figures["eval/mean@k"] == pytest.approx(0.375)
    assert figures["eval/pass@k"] == pytest.approx(2 / 3)
    assert figures["eval/accuracy"] == pytest.approx(1 / 3)
    # lengths 1 2 3 2 | 3 3 1 1 | 1 1 1 1 -> 20 / 12 tokens; three of twelve hit the length limit (3 tokens)
    assert figures["eval/response_tokens"] == pytest.approx(20 / 12)
    assert figures["eval/truncated"] == pytest.approx(3 / 12)
    assert (figures["eval/policy_min"], figures["eval/policy_max"]) == (1.0, 3.0)


def test_threshold_decides_what_is_solved_and_greedy_pass_is_accuracy() -> None:
    groups = [scored([0.6]), scored([0.4]), scored([1.0]), scored([0.0])]  # k = 1 (greedy)
    loose, strict = round_figures(groups, 0.5), round_figures(groups, 1.0)
    assert loose["eval/pass@k"] == loose["eval/accuracy"] == 0.5  # 0.6 and 1.0
    assert strict["eval/pass@k"] == strict["eval/accuracy"] == 0.25  # only 1.0
    assert loose["eval/mean@k"] == pytest.approx(0.5)  # (0.6 + 0.4 + 1 + 0) / 4
    assert round_figures([], 1.0) == {}


def test_eval_config_defaults_and_validation() -> None:
    config = load_config(None)
    assert config.eval.every == 0 and config.eval.temperature == 0.0 and config.eval.num_samples == 1
    with pytest.raises(ConfigError, match="num_samples = 1"):
        load_config(None, ["eval.num_samples=4"])  # greedy gives one response
    assert load_config(None, ["eval.num_samples=4", "eval.temperature=1.0"]).eval.num_samples == 4
    with pytest.raises(ConfigError, match=r"eval\.path"):
        load_config(None, ["eval.every=5"])  # name = "file" without a file
    with pytest.raises(ConfigError, match="run's verifier"):
        load_config(None, ["eval.every=5", "eval.name=reverse"])  # scored by the arithmetic verifier: refused
    assert load_config(None, ["eval.every=5", "eval.name=arithmetic"]).eval.seed != config.run.seed
    with pytest.raises(ConfigError, match="eval"):
        load_config(None, ["eval.evry=5"])


def encode(text: str) -> list[int]:
    return [ord(c) % 50 for c in text]


def test_eval_groups_carry_their_purpose_and_sampling_settings(tmp_path) -> None:
    config = load_config(
        None,
        ["run.name=r", "eval.every=2", "eval.name=arithmetic", "eval.limit=5", "eval.max_new_tokens=9",
         "eval.temperature=0.7", "eval.num_samples=3"],
    )
    examples = eval_examples(config, Prompter(encode=encode))
    again = eval_examples(config, Prompter(encode=encode))
    assert len(examples) == 5 and examples == again  # seeded by eval.seed: the same set every round
    groups = eval_groups(config, examples, encode, step=4, version=4)
    assert [g.group_id for g in groups][:2] == ["r-eval000004-00000", "r-eval000004-00001"]
    assert {(g.purpose, g.temperature, g.max_new_tokens, g.num_samples, g.issued_version) for g in groups} == {
        ("eval", 0.7, 9, 3, 4)
    }
    # a file: its first eval.limit rows, in file order
    path = tmp_path / "held.jsonl"
    path.write_text("".join(f'{{"q": "{i}+{i}=", "a": "{2 * i}"}}\n' for i in range(6)))
    config = load_config(None, [f"eval.path={path}", "eval.prompt_key=q", "eval.answer_key=a", "eval.limit=4"])
    assert [e.answer for e in eval_examples(config, Prompter(encode=encode))] == ["0", "2", "4", "6"]
    # keys named only under [task]: the held-out file of the run's kind is read with them
    task = tmp_path / "train.jsonl"
    task.write_text('{"q": "1+1=", "a": "2"}\n')
    inherited = load_config(None, ["task.name=file", f"task.path={task}", "task.prompt_key=q", "task.answer_key=a",
                                   f"eval.path={path}", "eval.limit=2"])  # fmt: skip
    assert [e.answer for e in eval_examples(inherited, Prompter(encode=encode))] == ["0", "2"]


def test_purpose_on_the_wire_and_a_peer_that_predates_it() -> None:
    group = PromptGroup(group_id="e", task="t", prompt="p", prompt_ids=np.array([1], np.int32), purpose="eval",
                        temperature=0.0, max_new_tokens=12)
    decoded = decode_blob(Decoder(PromptGroup), encode_blob(group))
    assert (decoded.purpose, decoded.temperature, decoded.max_new_tokens) == ("eval", 0.0, 12)
    old = dataclasses.replace(group, purpose="train", temperature=-1.0, max_new_tokens=0)
    assert decode_blob(Decoder(PromptGroup), encode_blob(old)).purpose == "train"  # defaults: a training group
    with pytest.raises(WireError, match="purpose"):
        decode_blob(Decoder(PromptGroup), encode_blob(dataclasses.replace(group, purpose="both")))


def test_provenance_of_an_eval_group() -> None:
    issued = PromptGroup(group_id="e", task="t", prompt="p", prompt_ids=np.array([1], np.int32), purpose="eval",
                         max_new_tokens=40)
    answer = scored([1.0], [30]).rollout
    answer = dataclasses.replace(answer, group_id="e", task="t", prompt="p")
    assert issue_mismatch(issued, answer, max_new_tokens=6) is None  # its own max_new_tokens, not rollout's 6
    assert "purpose" in issue_mismatch(issued, dataclasses.replace(answer, purpose="train"), 6)
    assert "40" in issue_mismatch(issued, dataclasses.replace(
        answer, lengths=np.array([41], np.int32), token_ids=np.ones(41, np.int32),
        logprobs=np.zeros(41, np.float32), versions=np.zeros(41, np.int32)), 6)


def test_offline_samples_hold_every_response_with_its_prompt_answer_and_reward(tmp_path) -> None:
    """``rl-learner eval --samples``: one line per response, in order, with what a reader checks an answer by."""
    import json

    from asyncrl.actors.evaluate import write_samples
    from tests.helpers.rollouts import encode, make_group

    groups = [make_group(["19", "18"], group_id="g-1"), make_group(["7"], prompt="3+4=", answer="7", group_id="g-2")]
    rewards = [[1.0, 0.0], [1.0]]
    scored_groups = [
        ScoredGroup(rollout=g, rewards=np.asarray(r, np.float32)) for g, r in zip(groups, rewards, strict=True)
    ]
    path = tmp_path / "answers.jsonl"
    write_samples(path, scored_groups)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [(r["group_id"], r["index"], r["response"], r["reward"]) for r in rows] == [
        ("g-1", 0, "19", 1.0), ("g-1", 1, "18", 0.0), ("g-2", 0, "7", 1.0)
    ]
    assert rows[2]["prompt"] == "3+4=" and rows[2]["answer"] == "7" and rows[2]["finish_reason"] == "stop"
    assert rows[1]["response_ids"] == encode("18") and rows[1]["prompt_ids"] == [0, 0, 0, 0, 0]
