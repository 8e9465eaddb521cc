"""Multi-turn episodes of a thinking model, around a scripted engine: a chat template that drops past reasoning once a
later user turn follows (``common/tiny_models/chat.py: THINKING_TEMPLATE``, as Qwen3's does) is run as it is served.
Each model turn is generated on the context the template renders at that turn, the episode travels as rows (a context,
then the turns written on it), the replay checks every context and where each row starts, and the learner runs the
model on exactly those rows while the advantages stay one per episode. (The real engine and learner log-probs on such
rows: tests/integration/test_chat_models.py.)"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch

from asyncrl.actors.episode_scoring import EpisodeMismatch
from asyncrl.cli.model_check import episode_mode
from asyncrl.cli.preflight import check_config
from asyncrl.common.config import load_config
from asyncrl.common.environments.turns import EpisodeTools
from asyncrl.common.wire.codec import Limits, WireError
from asyncrl.common.wire.messages import ScoredGroup, segments
from asyncrl.learner.record.samples import _turns
from asyncrl.learner.update.batch import collate
from tests.helpers.scripted_episodes import CALL, QUESTION, episode, replay, tools_for

COUNTING = "environment.name=tests.unit.actors.test_episodes:Counting"
"""Never done, answers each turn as a user turn (``turn N``) with a reward of 0.25."""
NOT_SERVED = "differs from the environment's observation as the chat template renders it"
TURNS = ["<think>\nfirst\n</think>\n\na", "<think>\nsecond\n</think>\n\nb", "<think>\nthird\n</think>\n\nc"]


@pytest.fixture(scope="module")
def tools() -> EpisodeTools:
    tools = tools_for("qwen3")
    assert tools.per_turn  # the template drops past reasoning, and the run serves it as it is
    return tools


def served(tools: EpisodeTools, turns: list[str]) -> str:
    """The template's rendering of the question then ``turns`` answered by Counting, with the generation prompt: what
    a served model is given for its next turn."""
    conversation = list(QUESTION)
    for n, said in enumerate(turns, start=1):
        conversation += [{"role": "assistant", "content": said}, {"role": "user", "content": f"turn {n}"}]
    return tools.tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)


def test_each_turn_is_generated_on_the_context_the_template_serves_and_kept_as_its_own_row(tools) -> None:
    rollout, engine, turn = episode(tools, TURNS, COUNTING, "environment.max_turns=3")
    decode = tools.tokenizer.decode
    # What the engine was asked for at each turn is the template's rendering of the conversation so far: the earlier
    # turns without their reasoning.
    assert [decode(prompt) for prompt in engine.prompts] == [served(tools, TURNS[:k]) for k in range(3)]
    assert "first" not in decode(engine.prompts[2]) and "second" not in decode(engine.prompts[2])
    ids, logprobs, _ = rollout.response(0)
    rows = rollout.rows(0)
    assert len(rows) == 3 and rollout.finish_reasons == ["max_turns"]
    prompt = rollout.prompt_ids.tolist()
    for (start, end), asked, said in zip(rows, engine.prompts, TURNS, strict=True):
        row = ids[start:end].tolist()
        trained = rollout.trained(0)[start:end]
        assert prompt + row[: int(np.argmax(trained))] == asked  # the row: the context the turn was served ...
        assert decode(row[int(np.argmax(trained)) :]) == said + "<|im_end|>"  # ... then the turn, as sampled
    # Every model token is trained once, in the row it was sampled in; the contexts carry no log-probs.
    turns = [ids[s:e].tolist() for s, e, by_model in segments(rollout.trained(0)) if by_model]
    assert [decode(t) for t in turns] == [said + "<|im_end|>" for said in TURNS]
    assert int(rollout.trained(0).sum()) == sum(map(len, turns)) and np.all(logprobs[~rollout.trained(0)] == 0)
    assert replay(tools, rollout, turn) == 0.75  # three steps' rewards


def test_the_replay_refuses_a_context_or_a_row_that_is_not_what_the_template_serves(tools) -> None:
    rollout, _, turn = episode(tools, TURNS, COUNTING, "environment.max_turns=3")
    (_, _), (second, _), _ = rollout.rows(0)
    forged = rollout.token_ids.copy()
    forged[second + 1] += 1  # the served context changed on the way
    with pytest.raises(EpisodeMismatch, match=NOT_SERVED):
        replay(tools, dataclasses.replace(rollout, token_ids=forged), turn)
    appended = rollout.row_starts.copy()
    appended[second] = 0  # the second turn claimed to follow the first's reasoning: a context never served
    with pytest.raises(EpisodeMismatch, match=NOT_SERVED):
        replay(tools, dataclasses.replace(rollout, row_starts=appended), turn)
    # The wire refuses rows that cannot be what an actor made, before any replay
    on_a_turn = rollout.row_starts.copy()
    on_a_turn[second - 1] = 1  # a row that starts on a token the model sampled
    with pytest.raises(WireError, match="row that starts with a token the model sampled"):
        dataclasses.replace(rollout, row_starts=on_a_turn).validate(Limits())
    with pytest.raises(WireError, match="has 3 entries but lengths sum to"):
        dataclasses.replace(rollout, row_starts=rollout.row_starts[:3]).validate(Limits())


def test_a_tool_reply_is_not_a_user_turn_so_the_row_goes_on(tools) -> None:
    """Reasoning within one tool-calling exchange stays in the template's rendering: the served context extends the
    row, and the episode is one sequence as with any template that appends."""
    thinking_call = f"<think>\nuse the tool\n</think>\n\n{CALL}"
    rollout, engine, turn = episode(tools, [thinking_call, "It is 42."])
    assert rollout.rows(0) == [(0, int(rollout.lengths[0]))] and not len(rollout.row_starts)
    prompt, ids = rollout.prompt_ids.tolist(), rollout.response(0)[0].tolist()
    assert engine.prompts[1] == prompt + ids[: len(engine.prompts[1]) - len(prompt)]  # the episode so far, as sampled
    assert replay(tools, rollout, turn) == 1.0


def test_keeping_past_reasoning_keeps_one_sequence(tools) -> None:
    kept = EpisodeTools.for_tokenizer(tools.tokenizer, "keep")
    rollout, engine, turn = episode(kept, TURNS, COUNTING, "environment.max_turns=3", "environment.past_reasoning=keep")
    assert not len(rollout.row_starts) and len(rollout.rows(0)) == 1
    assert "first" in kept.tokenizer.decode(engine.prompts[2])  # the reasoning the served model would not see
    assert replay(kept, rollout, turn) == 0.75


def test_the_learner_runs_the_model_on_the_rows_and_keeps_one_advantage_per_episode(tools) -> None:
    rollout, _, _ = episode(tools, TURNS, COUNTING, "environment.max_turns=3")
    single, _, _ = episode(tools_for("qwen2"), ["42"])
    groups = [ScoredGroup(rollout=rollout, rewards=np.ones(1, np.float32))]
    groups.append(ScoredGroup(rollout=single, rewards=np.zeros(1, np.float32)))
    batch = collate(groups, pad_id=0)
    assert batch.rows == 2 and batch.served is not None
    rows = batch.served
    assert rows.input_ids.shape[0] == 3 + 1  # the episode's three rows, the single-turn response whole
    prompt, ids = rollout.prompt_ids.tolist(), rollout.response(0)[0].tolist()
    for r, (start, end) in enumerate(rollout.rows(0)):
        width = len(prompt) + end - start
        assert rows.input_ids[r, :width].tolist() == prompt + ids[start:end]
        assert int(rows.attention_mask[r].sum()) == width
        assert rows.response_mask[r, len(prompt) : width].tolist() == rollout.trained(0)[start:end].tolist()
    # Every trained token of the batch is trained in exactly one row, and takes its episode's values there.
    assert int(rows.response_mask.sum()) == int(batch.response_mask.sum())
    sources = rows.source[rows.source >= 0]
    assert len(sources) == len(set(sources.tolist())) == int(batch.response_mask.sum())
    advantages = torch.arange(batch.response_mask.numel(), dtype=torch.float32).view(batch.response_mask.shape)
    advantages = advantages * batch.response_mask
    taken = batch.on_model_rows(advantages)
    assert torch.equal(taken[rows.response_mask], advantages.reshape(-1)[sources])
    assert torch.all(taken[~rows.response_mask] == 0)
    assert torch.equal(rows.behaviour_logprobs[rows.response_mask], batch.behaviour_logprobs.reshape(-1)[sources])
    assert batch.model_tensors()["input_ids"] is rows.input_ids
    # samples.jsonl shows where each row starts: the whole served context
    shown = _turns(groups[0], 0, tools.tokenizer.decode)
    assert [t["by"] for t in shown["turns"]] == ["model", "context", "model", "context", "model"]
    assert shown["rows"] == 3


def test_resolve_says_an_episode_is_kept_per_turn_and_refuses_what_cannot_train_it(tools, tmp_path: Path) -> None:
    tools.tokenizer.save_pretrained(tmp_path)
    run = ["rollout.workflow=multi_turn", "environment.name=calculator", f"model.path={tmp_path}"]
    check_config(load_config(None, run))  # grpo: advantages per episode, a loss per token
    said = episode_mode(load_config(None, run)) or ""
    assert said.startswith("episodes: per turn, environment 'calculator' (replayed by the reward worker to score)")
    # the calculator answers as a tool, before which the template keeps reasoning: its episodes stay one row
    assert "keeps it before this environment's observations (tool turns), so each episode stays one row" in said
    counting = episode_mode(load_config(None, [*run, COUNTING])) or ""  # it answers in user turns
    assert "drops past reasoning once a later user turn follows, so each model turn is generated" in counting
    ppo = Path(__file__).resolve().parents[3] / "configs" / "ppo.toml"
    with pytest.raises(ValueError, match=r"^environment\.past_reasoning = 'as_served': .* needs token_kl, values"):
        check_config(load_config(ppo, run))
    check_config(load_config(ppo, [*run, "environment.past_reasoning=keep"]))  # one sequence: a critic runs on it
    kept = episode_mode(load_config(None, [*run, "environment.past_reasoning=keep"])) or ""
    assert "past reasoning kept as generated (environment.past_reasoning = 'keep')" in kept
