"""The TRL side of the multi-turn race (``bench/peer_multi_turn.py``) renders what asyncrl renders: the prompt, a
tool turn and a whole episode are the same bytes under TRL's chat template (tool calls as ``tool_calls``) as under the
tiny agent model's own (tool calls in the assistant's text). A race where the two saw different text would compare
two tasks."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from asyncrl.common.config import load_config
from asyncrl.common.environments.protocol import run_tools
from asyncrl.common.environments.turns import TurnEncoder
from asyncrl.common.tiny_models.agent import calculator_call, init_agent_model

ROOT = Path(__file__).resolve().parents[2]
USER = [{"role": "user", "content": "10*41="}]
TOOL = [{"role": "tool", "content": "410"}]


def bench_module():
    spec = importlib.util.spec_from_file_location("peer_multi_turn", ROOT / "bench" / "peer_multi_turn.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    """The agent model's tokenizer as asyncrl uses it, and the same tokenizer as the race hands it to TRL."""
    folder = init_agent_model(tmp_path_factory.mktemp("agent"), hidden=16, layers=1, heads=2, intermediate=32)
    ours, theirs = AutoTokenizer.from_pretrained(folder), AutoTokenizer.from_pretrained(folder)
    bench_module().prepare_tokenizer(theirs)
    return ours, theirs


@pytest.fixture(scope="module")
def tools():
    """The tools the agent preset offers the model."""
    offered = run_tools(load_config(ROOT / "configs" / "agent.toml"))
    assert offered
    return offered


def test_the_prompt_and_a_tool_turn_are_the_same_bytes(tokenizers, tools) -> None:
    ours, theirs = tokenizers
    prompt = {
        t: t.apply_chat_template(USER, tools=tools, tokenize=False, add_generation_prompt=True) for t in tokenizers
    }
    assert prompt[ours] == prompt[theirs]
    assert prompt[ours].startswith("<|im_start|>system\ntools: calc<|im_end|>\n")
    assert TurnEncoder.for_tokenizer(ours).text(TOOL) == TurnEncoder.for_tokenizer(theirs).text(TOOL)


def test_an_episode_with_a_tool_call_is_the_same_bytes(tokenizers, tools) -> None:
    ours, theirs = tokenizers
    call = {"type": "function", "function": {"name": "calc", "arguments": {"expression": "10*41"}}}
    trl = [
        *USER,
        {"role": "assistant", "content": "", "tool_calls": [call]},
        *TOOL,
        {"role": "assistant", "content": "410"},
    ]
    asyncrl = [
        *USER,
        {"role": "assistant", "content": calculator_call("10*41")},
        *TOOL,
        {"role": "assistant", "content": "410"},
    ]
    assert theirs.apply_chat_template(trl, tools=tools, tokenize=False) == ours.apply_chat_template(
        asyncrl, tools=tools, tokenize=False
    )
