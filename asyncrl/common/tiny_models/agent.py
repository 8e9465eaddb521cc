"""A tiny tool-using chat model: character-level, a ChatML template that offers tools, warm-started on episodes.

The agent preset (``configs/agent.toml``) needs a policy that can start reinforcement learning on a multi-turn task
from partial skill: one that sometimes calls the calculator on a two-digit product and copies the tool's result
into its answer, and more often answers from memory (and is mostly wrong). Reinforcement then raises the reward by
raising the share of episodes that call the tool — the thing a multi-turn run must be able to learn.

The tokenizer is :func:`asyncrl.common.tiny_models.character.build_char_tokenizer` over :data:`AGENT_ALPHABET` plus
ChatML's ``<|im_start|>``/``<|im_end|>`` (special; ``<|im_end|>`` is the EOS, as in Qwen2.5-Instruct) and
``<tool_call>`` / ``</tool_call>`` (added, not special: a decoded turn keeps them, as Qwen2.5's tokenizer does). The
template (:data:`TOOL_CHAT_TEMPLATE`) names the offered tools in a system turn, Hermes-style calls go in the assistant's
text (``common/environments/tool_calls.py``), and a ``tool`` message is a turn of its own. It is a thinking model's
template, as Qwen3's: an assistant turn's ``<think>…</think>`` is dropped once a later user turn follows, so a run
serves each of the model's turns the context that template renders (``common/environments/turns.py``); a tool's reply
is not a user turn, so within a calculator episode nothing is dropped.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from asyncrl.common.data.tasks import TASK_ALPHABET
from asyncrl.common.environments.tool_calls import CLOSE as TOOL_CALL_CLOSE
from asyncrl.common.environments.tool_calls import OPEN as TOOL_CALL_OPEN
from asyncrl.common.tiny_models.character import IGNORE_INDEX, Row, init_model, warm_start_rows
from asyncrl.common.tiny_models.chat import IM_END, IM_START, THINKING_TEMPLATE, _save_chat_tokenizer

AGENT_ALPHABET = TASK_ALPHABET + "ABCDEFGHIJKLMNOPQRSTUVWXYZ.?!'_;|#%&"

TOOLS_TURN = (
    "{%- if tools %}{{- '<|im_start|>system\\ntools: ' }}"
    "{%- for tool in tools %}{{- tool['function']['name'] }}{%- if not loop.last %}{{- ', ' }}{%- endif %}"
    "{%- endfor %}{{- '<|im_end|>\\n' }}{%- endif %}"
)
"""A short system turn naming the offered tools: a character-level model reads every character, so the template names
the tools rather than printing their JSON schemas as Qwen2.5's does."""

TOOL_CHAT_TEMPLATE = TOOLS_TURN + THINKING_TEMPLATE
"""A thinking model's ChatML (``common/tiny_models/chat.py: THINKING_TEMPLATE``) after :data:`TOOLS_TURN`."""


def init_agent_model(out_dir: str | Path, *, seed: int = 0, **shape) -> Path:
    """Write the tiny Llama folder (:func:`asyncrl.common.tiny_models.character.init_model`, ``shape`` as there) with
    the tool-chat tokenizer and template. Returns the folder's path."""
    from tokenizers import AddedToken
    from transformers import PreTrainedTokenizerFast

    out = init_model(out_dir, alphabet=AGENT_ALPHABET, seed=seed, **shape)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(out)
    tokenizer.add_special_tokens({"additional_special_tokens": [IM_START, IM_END]})
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in (TOOL_CALL_OPEN, TOOL_CALL_CLOSE)])
    tokenizer.eos_token = IM_END
    tokenizer.chat_template = TOOL_CHAT_TEMPLATE
    _resize(out, tokenizer, seed)
    return out


def _resize(out: Path, tokenizer, seed: int) -> None:
    """Grow the saved model's embeddings to the tokenizer and make ``<|im_end|>`` its EOS; save both. The new rows are
    drawn from ``seed`` too: unseeded, every build would start its warm start from other special-token embeddings, and
    the warm-started agent's skill would differ from build to build."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model.resize_token_embeddings(len(tokenizer), mean_resizing=False)
    model.config.eos_token_id = tokenizer.eos_token_id
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=[tokenizer.eos_token_id], pad_token_id=tokenizer.pad_token_id
    )
    model.save_pretrained(out, safe_serialization=True)
    _save_chat_tokenizer(tokenizer, out)


AGENT_WARM_START = {"tool_share": 0.4, "lr": 1e-3}
"""The agent model's warm start: 4 in 10 episodes call the tool. After 600 steps (``rl-learner init-model --kind agent
--warm-steps 600``, under 3 minutes on one core) the model, sampled at temperature 1, calls the tool on about one
prompt in five, writes the prompt's expression in the call and copies the tool's result about 19 times in 20 each,
and answers from memory almost never right: calling the tool is what pays."""


def calculator_call(expression: str) -> str:
    """A model turn that calls the ``calculator`` environment's ``calc`` tool on ``expression``."""
    body = json.dumps({"name": "calc", "arguments": {"expression": expression}})
    return f"{TOOL_CALL_OPEN}{body}{TOOL_CALL_CLOSE}"


def calculator_conversation(prompt: str, answer: str, *, use_tool: bool) -> list[dict[str, str]]:
    """One episode of the calculator task as messages: with the tool, a call on the prompt's expression (the text
    before ``=``), the tool's result and the answer; without it, the answer at once."""
    user = {"role": "user", "content": prompt}
    if not use_tool:
        return [user, {"role": "assistant", "content": answer}]
    return [
        user,
        {"role": "assistant", "content": calculator_call(prompt.rstrip("="))},
        {"role": "tool", "content": answer},
        {"role": "assistant", "content": answer},
    ]


def encode_conversation(tokenizer, messages: list[dict[str, str]], tools: list[dict]) -> Row:
    """(input ids, labels) of a conversation as the template renders it, labels on each assistant turn's text and
    its ``<|im_end|>`` only: the model learns to act and to end its turns, never to write the environment's."""
    ids: list[int] = []
    labels: list[int] = []
    written = ""

    def add(text: str, trained: bool) -> None:
        new = tokenizer(text, add_special_tokens=False)["input_ids"]
        ids.extend(new)
        labels.extend(new if trained else [IGNORE_INDEX] * len(new))

    for index, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        head = tokenizer.apply_chat_template(messages[:index], tokenize=False, tools=tools, add_generation_prompt=True)
        add(head[len(written) :], trained=False)
        add(message["content"] + IM_END, trained=True)
        written = head + message["content"] + IM_END
    return ids, labels


def warm_start_calculator(
    model_dir: str | Path, examples: list[tuple[str, str]], *, steps: int, tool_share: float, seed: int = 0, **options
) -> dict[str, float]:
    """Fine-tune the agent model on calculator episodes: a ``tool_share`` of them call the tool and copy its result,
    the rest answer at once. Options and figures as :func:`asyncrl.common.tiny_models.character.warm_start_rows`."""
    from transformers import AutoTokenizer

    from asyncrl.common.environments.protocol import calculator_specs

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tools = calculator_specs()
    rng = random.Random(seed)
    rows = [
        encode_conversation(tokenizer, calculator_conversation(p, a, use_tool=rng.random() < tool_share), tools)
        for p, a in examples
    ]
    return warm_start_rows(model_dir, rows, steps=steps, seed=seed, **options)
