"""Multi-turn episodes around a scripted engine, on both tiny chat tokenizers: the episode's tokens are the chat
template's rendering of the conversation, the loss mask marks the model's tokens only, the reward worker's replay
scores what the environment says and refuses episodes the environment would not have produced, and environments that
fail, hang, return garbage or huge observations, or never finish end their episode without taking the actor down.
(The real engine under ``multi_turn`` is tests/integration/test_chat_models.py's.)"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from asyncrl.actors.episode_scoring import EpisodeMismatch, environment_reward, replay_time_limit
from asyncrl.cli.preflight import check_config
from asyncrl.common.config import ConfigError, EnvironmentSection, RewardFunction, load_config
from asyncrl.common.data.tasks import TaskExample
from asyncrl.common.environments.protocol import (
    ENVIRONMENTS,
    MAX_TIMED_OUT_VARIANTS,
    EnvironmentFailed,
    EpisodeRow,
    OutOfTime,
    Step,
    ToolEnvironment,
    calculate,
    checked_step,
    run_prompter,
    run_tools,
)
from asyncrl.common.environments.tool_calls import parse_tool_calls
from asyncrl.common.environments.turns import EpisodeTools, TemplateError, TurnEncoder
from asyncrl.common.rewards.functions import bind_functions, episode_options, time_limit
from asyncrl.common.tiny_models.chat import ARCHITECTURES, CHATML_TEMPLATE, build_bpe_tokenizer
from asyncrl.common.wire.messages import ScoredGroup, segments
from asyncrl.learner.algorithms import GlobalCounts, LossInput, build_aggregation, build_loss
from asyncrl.learner.update.batch import collate
from tests.helpers.scripted_episodes import CALL, QUESTION, context, episode, replay, tools_for


@pytest.fixture(scope="module", params=ARCHITECTURES)
def tools(request: pytest.FixtureRequest) -> EpisodeTools:
    return tools_for(request.param)


def test_an_episode_is_the_templates_rendering_with_only_the_models_tokens_trained(tools: EpisodeTools) -> None:
    rollout, engine, turn = episode(tools, [CALL, "It is 42."])
    ids, logprobs, versions = rollout.response(0)
    parts = segments(rollout.trained(0))
    assert [trained for _, _, trained in parts] == [True, False, True]
    _, (tool_start, tool_end, _), _ = parts
    observation = tools.encoder.ids([{"role": "tool", "content": "42"}])
    assert ids[tool_start:tool_end].tolist() == observation
    assert np.all(logprobs[tool_start:tool_end] == 0.0) and np.all(logprobs[rollout.trained(0)] == -0.5)
    assert versions.tolist() == [1] * tool_end + [2] * (len(ids) - tool_end)  # the tool's carry its turn's version
    # The whole conversation as the template renders it (it closes the last turn with a newline the episode ends
    # before), as text and as ids: the model's turns here are canonical encodings of their text.
    conversation = [*QUESTION, {"role": "assistant", "content": CALL}, {"role": "tool", "content": "42"}]
    conversation.append({"role": "assistant", "content": "It is 42."})
    rendered = tools.tokenizer.apply_chat_template(conversation, tokenize=False)
    whole = [*rollout.prompt_ids.tolist(), *ids.tolist()]
    assert tools.tokenizer.decode(whole) == rendered.removesuffix("\n")
    assert whole == tools.tokenizer(rendered, add_special_tokens=False)["input_ids"][: len(whole)]
    # Each turn is asked for on the whole episode so far.
    assert engine.prompts == [rollout.prompt_ids.tolist(), whole[: len(rollout.prompt_ids) + tool_end]]
    assert replay(tools, rollout, turn) == 1.0
    wrong, _, _ = episode(tools, [CALL, "It is 41."])
    assert replay(tools, wrong, turn) == 0.0


def test_the_replay_refuses_an_episode_the_environment_would_not_have_produced(tools: EpisodeTools) -> None:
    rollout, _, turn = episode(tools, [CALL, "It is 42."])
    (_, _, _), (tool_start, _, _), _ = segments(rollout.trained(0))
    forged = rollout.token_ids.copy()
    forged[tool_start + 3] += 1  # the tool's answer changed on the way
    with pytest.raises(EpisodeMismatch, match="differs from the environment's observation"):
        replay(tools, dataclasses.replace(rollout, token_ids=forged), turn)
    everything = np.ones(len(rollout.token_ids), np.int32)  # the tool's tokens marked as the model's: trained
    with pytest.raises(EpisodeMismatch, match="past its end of turn"):
        replay(tools, dataclasses.replace(rollout, loss_mask=everything), turn)
    first_is_tool = 1 - rollout.loss_mask
    with pytest.raises(EpisodeMismatch, match="starts with tokens the model did not sample"):
        replay(tools, dataclasses.replace(rollout, loss_mask=first_is_tool), turn)
    with pytest.raises(EpisodeMismatch, match=r"more model turns than environment\.max_turns"):
        replay(tools, rollout, context("environment.max_turns=1"))


def test_the_reward_worker_scores_episodes_through_the_environment_function(tools, tmp_path) -> None:
    """The ``environment`` reward function as a worker binds it: the run's [environment] and model folder."""
    tools.tokenizer.save_pretrained(tmp_path)
    settings = ["rollout.workflow=multi_turn", "environment.name=calculator", "environment.isolation=thread"]
    config = load_config(None, [*settings, f"model.path={tmp_path}"])
    [function] = bind_functions([RewardFunction(name="environment")], "file", episode_options(config))
    right, _, _ = episode(tools, [CALL, "42"])
    wrong, _, _ = episode(tools, ["41"])
    assert environment_reward(right, function.options) == [(0.0, 1.0)]  # per model turn: the call, then the answer
    assert environment_reward(wrong, function.options) == [(0.0,)]


HERE = "tests.unit.actors.test_episodes"


class Counting:
    """Never done: says how many turns it has seen (named by import path, as a user's own environment is)."""

    def __init__(self, row, options) -> None:
        self.turns = 0

    def step(self, action: str) -> Step:
        self.turns += 1
        return Step(observation=[{"role": "user", "content": f"turn {self.turns}"}], reward=0.25)

    def score(self) -> float:
        return 0.0


class Failing(Counting):
    """Fails as options["how"] says, at its first step."""

    def __init__(self, row, options) -> None:
        self.how = options["how"]

    async def step(self, action: str) -> Step:
        if self.how == "raises":
            raise RuntimeError("the environment broke")
        if self.how == "hangs":
            time.sleep(2)  # a synchronous hang: only its thread waits
        if self.how == "hangs_async":
            await asyncio.sleep(60)
        if self.how == "garbage":
            return {"observation": "not a Step"}
        return Step(observation=[{"role": "user", "content": "x" * 2**20}])  # huge


def test_an_environment_that_never_finishes_ends_at_max_turns_with_its_turn_rewards(tools: EpisodeTools) -> None:
    rollout, engine, turn = episode(tools, ["a", "b", "c", "d"], f"environment.name={HERE}:Counting")
    assert len(engine.prompts) == 4 and rollout.finish_reasons == ["max_turns"]
    assert [t for _, _, t in segments(rollout.trained(0))] == [True, False] * 3 + [True]
    assert replay(tools, rollout, turn) == 1.0  # four turns' rewards of 0.25 (the last one stepped, not appended)


def test_an_episode_ends_at_its_token_budget(tools: EpisodeTools) -> None:
    settings = (f"environment.name={HERE}:Counting", "environment.max_episode_tokens=40")
    rollout, engine, turn = episode(tools, ["a longer turn than the others"], *settings)
    assert int(rollout.lengths[0]) <= 40 and len(engine.prompts) < 4
    assert replay(tools, rollout, turn) > 0


@pytest.mark.parametrize("how", ["raises", "hangs", "hangs_async", "garbage", "huge"])
def test_an_environment_that_fails_ends_its_episode_and_the_replay_scores_it_zero(tools, how) -> None:
    settings = (f"environment.name={HERE}:Failing", f"environment.options={{how='{how}'}}")
    settings += ("environment.step_timeout_s=0.3",)
    rollout, engine, turn = episode(tools, [CALL, "42"], *settings)
    assert len(engine.prompts) == 1 and rollout.trained(0).all()  # the first turn kept, nothing after it
    assert rollout.finish_reasons == ["environment_error"]
    assert replay(tools, rollout, turn) == 0.0


def test_a_replay_whose_environment_fails_where_the_actors_did_not_is_tried_again(tools: EpisodeTools) -> None:
    """A failure of the replay's own (a timeout, a replaced process) is an error the reward worker retries, on any
    turn: never a reward of 0 for an episode the actor's environment ran to its end."""
    rollout, _, _ = episode(tools, [CALL, "It is 42."])
    failing = context(f"environment.name={HERE}:Failing", "environment.options={how='raises'}")
    with pytest.raises(EnvironmentFailed, match="the environment broke"):
        replay(tools, rollout, failing)
    last_turn_only, _, _ = episode(tools, ["41"])
    with pytest.raises(EnvironmentFailed):
        replay(tools, last_turn_only, failing)


def test_a_turn_cut_by_its_budget_ends_the_episode_without_a_step(tools: EpisodeTools) -> None:
    rollout, engine, turn = episode(tools, [CALL], "rollout.max_new_tokens=5", cut=True)
    assert len(engine.prompts) == 1 and int(rollout.lengths[0]) == 5 and rollout.finish_reasons == ["length"]
    assert replay(tools, rollout, turn) == 0.0


def test_a_multi_turn_run_needs_an_environment_that_exists() -> None:
    with pytest.raises(ConfigError, match=r"set environment\.name"):
        load_config(None, ["rollout.workflow=multi_turn"])
    with pytest.raises(ValueError, match=r"environment\.name = 'nowhere': unknown environment 'nowhere'; registered: "):
        check_config(load_config(None, ["rollout.workflow=multi_turn", "environment.name=nowhere"]))
    assert "calculator" in ENVIRONMENTS
    assert EnvironmentSection().max_turns == 4
    # the reward worker's limit for a replay: opening the environment and every step, each at its own limit
    assert replay_time_limit(EnvironmentSection(max_turns=3, step_timeout_s=2.5)) == 10.0
    # which the environment function declares: a call of it may take that long whatever reward.timeout_s says
    replay = RewardFunction(name="environment", options={"environment": {"max_turns": 3, "step_timeout_s": 2.5}})
    assert (time_limit(replay, 5.0), time_limit(replay, 30.0)) == (10.0, 30.0)
    assert time_limit(RewardFunction(name="task"), 5.0) == 5.0


THINKING_TEMPLATE = (
    "{%- for m in messages %}{%- set c = m['content'] %}"
    "{%- if m['role'] == 'assistant' and not loop.last %}{%- set c = c.split('</think>')[-1] %}{%- endif %}"
    "{{- '<|im_start|>' + m['role'] + '\\n' + c + '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
"""As thinking models' templates do: an earlier assistant turn loses its reasoning once another turn follows."""


def test_a_template_that_drops_past_reasoning_is_run_per_turn_and_one_that_rewrites_every_turn_is_refused() -> None:
    tokenizer = build_bpe_tokenizer("qwen2")
    with pytest.raises(TemplateError, match="has none"):
        TurnEncoder.for_tokenizer(type("Plain", (), {"chat_template": None})())
    tokenizer.chat_template = THINKING_TEMPLATE
    encoder = TurnEncoder.for_tokenizer(tokenizer)  # the plain probe, without reasoning, is appended
    assert encoder.text([{"role": "tool", "content": "1"}]).startswith("\n<|im_start|>tool")
    with pytest.raises(TemplateError, match=r"drops the model's past reasoning \(<think>…</think>\) once a later"):
        encoder.check_past_reasoning_kept()  # the probe with reasoning finds it
    assert EpisodeTools.for_tokenizer(tokenizer).per_turn  # and the run serves each turn as the template renders it
    assert not EpisodeTools.for_tokenizer(tokenizer, "keep").per_turn  # asked for: one sequence, reasoning as written
    with pytest.raises(TemplateError, match="rewrites earlier turns"):
        TurnEncoder.for_tokenizer(_with_probe_reasoning(tokenizer))
    for name in ("qwen2", "llama"):  # templates that keep each turn as written pass both probes: appended
        assert not EpisodeTools.for_tokenizer(build_bpe_tokenizer(name)).per_turn


def _with_probe_reasoning(tokenizer):
    """The tokenizer with a template that always drops what comes before the last ``e`` of an earlier assistant turn
    (the probe's content has one): a template that rewrites earlier turns whatever they hold."""
    tokenizer.chat_template = tokenizer.chat_template.replace("'</think>'", "'e'")
    return tokenizer


def test_calculator_and_tool_calls_refuse_what_they_cannot_do_safely() -> None:
    assert calculate("(12+3)*4 - 10/4") == "57.5" and calculate("7//2") == "3"
    for expression, why in [
        ("2**10", "unsupported BinOp"),
        ("__import__('os')", "unsupported Call"),
        ("1/0", "division by zero"),
        ("9" * 30, "beyond"),
        ("1+" * 150, "longer than"),
        ("1 +", "invalid syntax"),
    ]:
        assert calculate(expression).startswith("error:") and why in calculate(expression), expression
    parsed = parse_tool_calls(
        CALL + '<tool_call>{"name": 3}</tool_call><tool_call>{oops</tool_call>'
        '<tool_call>{"name": "calc", "arguments": [1]}</tool_call><tool_call>{"name": "calc"'
    )
    assert [c.arguments for c in parsed.calls] == [{"expression": "6*7"}]
    assert [e.split(" ")[0] for e in parsed.errors] == ["not", "not", '"arguments"', "a"]
    assert not parse_tool_calls("just 42").any


def test_the_learner_trains_the_models_tokens_of_an_episode_and_nothing_the_environment_wrote(tools) -> None:
    """The batch's response mask is the episode's loss mask; whatever the environment's positions hold (log-probs of
    any policy, advantages), the loss and its gradient are the same."""
    rollout, _, _ = episode(tools, [CALL, "It is 42."])
    scored = ScoredGroup(rollout=rollout, rewards=np.ones(1, np.float32))
    batch = collate([scored], pad_id=0)
    prompt = len(rollout.prompt_ids)
    assert batch.response_mask[0, :prompt].sum() == 0
    assert batch.response_mask[0, prompt:].tolist() == rollout.trained(0).tolist()
    mask = batch.response_mask
    gen = torch.Generator().manual_seed(0)
    behaviour = batch.behaviour_logprobs.double()
    old = behaviour + 0.1 * torch.randn(mask.shape, generator=gen, dtype=torch.float64)
    current = old + 0.1 * torch.randn(mask.shape, generator=gen, dtype=torch.float64)
    advantages = torch.randn(mask.shape, generator=gen, dtype=torch.float64)
    environment = ~mask & batch.attention_mask.bool()
    environment[:, :prompt] = False
    assert environment.sum() > 0

    def loss_and_grad(spoil: float) -> tuple[torch.Tensor, torch.Tensor]:
        theta = torch.where(environment, current + spoil, current).requires_grad_()
        inp = LossInput(
            theta,
            torch.where(environment, old - spoil, old),
            torch.where(environment, behaviour + 3 * spoil, behaviour),
            torch.where(environment, advantages * (1 + spoil), advantages),
            mask,
        )
        out = build_loss("ppo_clip", {"off_policy": {"level": "sequence"}})(inp)
        loss = build_aggregation("token_mean")(out.per_token_loss, mask, GlobalCounts.of(mask))
        loss.backward()
        return loss.detach(), theta.grad

    (loss, grad), (spoiled_loss, spoiled_grad) = loss_and_grad(0.0), loss_and_grad(5.0)
    assert loss != 0 and torch.equal(loss, spoiled_loss) and torch.equal(grad, spoiled_grad)
    assert torch.all(grad[environment] == 0)


def test_the_environment_in_the_docs_runs_as_written() -> None:
    """docs/environments.md's example, executed: under 30 lines, and it does what its docstring says."""
    text = (Path(__file__).resolve().parents[3] / "docs" / "environments.md").read_text()
    source = text.split("```python\n", 1)[1].split("```", 1)[0]
    assert len(source.strip().splitlines()) <= 30
    namespace: dict = {}
    exec(compile(source, "docs/environments.md", "exec"), namespace)
    guess = namespace["Guess"](EpisodeRow(prompt="", answer="7"), {})
    assert guess.step("I say 3").observation == [{"role": "user", "content": "3 is too low."}]
    assert guess.step("no idea").observation[0]["content"] == "Answer with a number."
    assert guess.step("7").done and guess.score() == 1.0
    assert ENVIRONMENTS.contract is not None and ENVIRONMENTS.contract.problem(namespace["Guess"]) is None


TOOL_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\n# Tools\\n<tools>' }}{%- for t in tools %}{{- '\\n' + (t | tojson) }}"
    "{%- endfor %}{{- '\\n</tools><|im_end|>\\n' }}{%- endif %}" + CHATML_TEMPLATE
)
"""ChatML with the tools block Qwen2.5's template writes into the system turn (its layout, shortened)."""


def test_the_environments_tools_are_offered_through_the_chat_templates_tool_format(caplog) -> None:
    tokenizer = build_bpe_tokenizer("qwen2")
    tokenizer.chat_template = TOOL_TEMPLATE
    settings = ["rollout.workflow=multi_turn", "environment.name=calculator"]
    prompter = run_prompter(tokenizer, load_config(None, settings))
    text = prompter.text(TaskExample("What is 6*7?", "42"))
    [line] = [line for line in text.splitlines() if line.startswith("{")]
    assert json.loads(line)["function"]["name"] == "calc"
    assert json.loads(line)["function"]["parameters"]["required"] == ["expression"]
    assert text.endswith("<|im_start|>user\nWhat is 6*7?<|im_end|>\n<|im_start|>assistant\n")
    single = run_prompter(tokenizer, load_config(None, []))  # no environment: no tools
    assert "<tools>" not in single.text(TaskExample("What is 6*7?", "42"))
    python = load_config(None, ["rollout.workflow=multi_turn", "environment.name=python"])
    assert [t["function"]["name"] for t in run_tools(python)] == ["python"]
    plain = build_bpe_tokenizer("qwen2")  # a template without tools: the prompt as before, and the log says so
    run_prompter(plain, load_config(None, settings))
    assert "does not render tools" in caplog.text and "task.system_prompt" in caplog.text


def test_an_episode_past_its_time_limit_ends_before_its_next_turn(tools: EpisodeTools) -> None:
    settings = (f"environment.name={HERE}:Counting", "environment.episode_timeout_s=0.000001")
    rollout, engine, turn = episode(tools, ["a", "b", "c"], *settings)
    assert len(engine.prompts) == 1 and rollout.finish_reasons == ["deadline"]
    assert [t for _, _, t in segments(rollout.trained(0))] == [True, False]  # its first turn and the answer to it
    assert replay(tools, rollout, turn) == 0.25


WAIT = '<tool_call>{"name": "wait", "arguments": {}}</tool_call>'
OUT_OF_TIME = "error: timeout: ran out of time"


class Timed(ToolEnvironment):
    """A ``wait`` tool with a time limit that finishes (``waited``) or runs out of time as ``options["late"]`` says:
    one machine loaded, another not."""

    def make_tools(self, options):
        results = {"yes": OutOfTime(OUT_OF_TIME), "no": "waited", "other": "error: something else", "says": OUT_OF_TIME}
        return {"wait": lambda arguments: results[options["late"]]}

    def time_limited(self, options):
        return {"wait": OUT_OF_TIME}


def test_a_tool_that_ran_out_of_time_in_the_episode_but_not_in_the_replay_is_accepted(tools: EpisodeTools) -> None:
    """Which limit a tool meets first depends on load: the replay accepts an episode whose call ran out of time where
    its own did not (the model was told only that), retries one whose own call ran out of time, and refuses any other
    text in the tool's place."""
    timed = lambda late: (f"environment.name={HERE}:Timed", f"environment.options={{late='{late}'}}")  # noqa: E731
    late, _, _ = episode(tools, [WAIT, "It is 42."], *timed("yes"))
    assert replay(tools, late, context(*timed("no"))) == 1.0
    in_time, _, _ = episode(tools, [WAIT, "It is 42."], *timed("no"))
    with pytest.raises(EnvironmentFailed, match="ran out of time in the replay, not in the episode"):
        replay(tools, in_time, context(*timed("yes")))
    other, _, _ = episode(tools, [WAIT, "It is 42."], *timed("other"))
    with pytest.raises(EpisodeMismatch, match="differs from the environment's observation"):
        replay(tools, other, context(*timed("no")))


def test_a_turn_with_several_time_limited_calls_offers_each_subset_of_them_out_of_time() -> None:
    env = Timed(EpisodeRow(prompt="", answer="42"), {"late": "no", "max_calls": 8})
    step = env.step(WAIT * 2 + '<tool_call>{"name": "nope", "arguments": {}}</tool_call>')
    assert (
        not step.timed_out
        and step.observation[0]["content"] == "waited\nwaited\nerror: unknown tool 'nope'; the tools are wait"
    )
    assert sorted(v[0]["content"].split("\n")[:2] for v in step.if_timed_out) == sorted(
        [[OUT_OF_TIME, "waited"], ["waited", OUT_OF_TIME], [OUT_OF_TIME, OUT_OF_TIME]]
    )
    many = env.step(WAIT * 6)
    assert len(many.if_timed_out) == MAX_TIMED_OUT_VARIANTS  # the first four calls' subsets; checked_step allows them
    assert checked_step(many) is many
    late = Timed(EpisodeRow(prompt="", answer="42"), {"late": "yes"}).step(WAIT)
    assert late.timed_out and late.if_timed_out == []
    says = Timed(EpisodeRow(prompt="", answer="42"), {"late": "says"}).step(WAIT)  # a program printing the text
    assert not says.timed_out  # is not a timeout: a forged episode beside it is refused, never retried
