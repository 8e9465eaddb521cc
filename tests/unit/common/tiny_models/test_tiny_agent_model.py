"""The tiny tool-chat model of the agent preset: its tokenizer and template carry an episode as the actor builds it,
and its warm-start rows train the model's turns only."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import AutoTokenizer

from asyncrl.common.environments.protocol import Calculator, EpisodeRow
from asyncrl.common.environments.tool_calls import parse_tool_calls
from asyncrl.common.environments.turns import TurnEncoder, turn_text
from asyncrl.common.tiny_models.agent import (
    TOOL_CALL_OPEN,
    calculator_call,
    calculator_conversation,
    encode_conversation,
    init_agent_model,
)
from asyncrl.common.tiny_models.character import IGNORE_INDEX


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory):
    folder = init_agent_model(tmp_path_factory.mktemp("agent") / "model", hidden=32, layers=1, heads=2, intermediate=64)
    return AutoTokenizer.from_pretrained(folder)


def test_the_tool_call_tags_are_single_tokens_kept_when_a_turn_is_decoded(tokenizer) -> None:
    call = calculator_call("37*48")
    ids = tokenizer(call + "<|im_end|>", add_special_tokens=False)["input_ids"]
    assert tokenizer.convert_ids_to_tokens(ids[:1]) == [TOOL_CALL_OPEN]
    assert ids[-1] == tokenizer.eos_token_id  # <|im_end|> ends a turn and the generation
    assert turn_text(tokenizer, ids) == call
    assert parse_tool_calls(call).calls[0].arguments == {"expression": "37*48"}


def test_the_template_names_the_tools_and_extends_an_episode_by_appending(tokenizer) -> None:
    tools = Calculator.tool_specs({})
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "37*48="}], tokenize=False, add_generation_prompt=True, tools=tools
    )
    assert (
        prompt
        == "<|im_start|>system\ntools: calc<|im_end|>\n<|im_start|>user\n37*48=<|im_end|>\n<|im_start|>assistant\n"
    )
    encoder = TurnEncoder.for_tokenizer(tokenizer)
    assert (
        encoder.text([{"role": "tool", "content": "1776"}])
        == "\n<|im_start|>tool\n1776<|im_end|>\n<|im_start|>assistant\n"
    )


def test_warm_start_rows_train_the_assistant_turns_and_their_end_only(tokenizer) -> None:
    tools = Calculator.tool_specs({})
    conversation = calculator_conversation("37*48=", "1776", use_tool=True)
    ids, labels = encode_conversation(tokenizer, conversation, tools)
    assert tokenizer.decode(ids) == tokenizer.apply_chat_template(conversation, tokenize=False, tools=tools).rstrip(
        "\n"
    )
    trained = [i for i, label in zip(ids, labels, strict=True) if label != IGNORE_INDEX]
    assert tokenizer.decode(trained) == f"{calculator_call('37*48')}<|im_end|>1776<|im_end|>"
    assert all(label in (IGNORE_INDEX, i) for i, label in zip(ids, labels, strict=True))
    direct = encode_conversation(tokenizer, calculator_conversation("37*48=", "1776", use_tool=False), tools)
    assert tokenizer.decode([i for i, label in zip(*direct, strict=True) if label != IGNORE_INDEX]) == "1776<|im_end|>"


def test_the_calculator_scores_the_conversation_the_warm_start_teaches() -> None:
    environment = Calculator(EpisodeRow(prompt="37*48=", answer="1776"), {})
    call, _, answer = calculator_conversation("37*48=", "1776", use_tool=True)[1:]
    assert environment.step(call["content"]).observation == [{"role": "tool", "content": "1776"}]
    assert environment.step(answer["content"]).done and environment.score() == 1.0


def test_init_model_refuses_an_unknown_kind(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from asyncrl.cli.learner import app

    result = CliRunner().invoke(app, ["init-model", "--kind", "huge", "--set", f"model.path={tmp_path / 'm'}"])
    assert result.exit_code != 0 and "--kind must be one of task, agent" in result.output


def test_the_same_seed_makes_the_same_model_whatever_ran_before(tmp_path: Path) -> None:
    """The embeddings of the added tokens are drawn from the seed too: a build does not depend on the process's RNG."""
    import torch

    shape = {"hidden": 32, "layers": 1, "heads": 2, "intermediate": 64}
    first = init_agent_model(tmp_path / "first", seed=3, **shape)
    torch.rand(1000)  # whatever else the process drew meanwhile
    second = init_agent_model(tmp_path / "second", seed=3, **shape)
    assert (first / "model.safetensors").read_bytes() == (second / "model.safetensors").read_bytes()
    other = init_agent_model(tmp_path / "other", seed=4, **shape)
    assert (first / "model.safetensors").read_bytes() != (other / "model.safetensors").read_bytes()


def test_init_model_takes_a_shape_and_refuses_one_the_heads_cannot_split(tmp_path: Path) -> None:
    from transformers import AutoConfig
    from typer.testing import CliRunner

    from asyncrl.cli.learner import app

    folder = tmp_path / "m"
    result = CliRunner().invoke(app, ["init-model", "--hidden", "64", "--layers", "3", "--set", f"model.path={folder}"])
    assert result.exit_code == 0, result.output
    shape = AutoConfig.from_pretrained(folder)
    assert (shape.hidden_size, shape.num_hidden_layers, shape.intermediate_size) == (64, 3, 128)
    result = CliRunner().invoke(app, ["init-model", "--hidden", "68", "--set", f"model.path={tmp_path / 'n'}"])
    assert result.exit_code != 0 and "--hidden must be a multiple of 8" in result.output
