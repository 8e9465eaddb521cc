"""TRL's side of the multi-turn race in ``bench/peer.py``: asyncrl's ``calculator`` environment as a TRL environment,
the chat template and response template TRL needs to write and read the tiny agent model's tool calls, the reward,
and a greedy held-out evaluation that runs asyncrl's own episode loop on HF ``generate``.

What is the same on both sides: the prompts (TRL renders the same bytes as asyncrl's ``run_prompter``: a system
turn naming the tools, then ChatML), the tool's observations (the environment's own ``Calculator`` answers each
call, and TRL appends the tool turn's tokens as asyncrl's ``TurnEncoder`` does), the reward (``Calculator.score``
after the final answer), the turn limit (``environment.max_turns`` model turns: TRL's ``max_tool_calling_iterations``
is one less) and the per-turn cap (``rollout.max_new_tokens``). What differs: a malformed call gets an error
observation in asyncrl and ends a TRL episode (TRL reads it as plain text, so it scores 0); TRL caps a whole episode
at one ``max_completion_length`` (``model.max_model_len`` less the longest prompt), asyncrl each episode at the context
its prompt leaves.
"""

from __future__ import annotations

import asyncio
from typing import Any

from asyncrl.actors.episode_scoring import replay_episode
from asyncrl.actors.episodes import multi_turn
from asyncrl.actors.generation import Response, WorkflowContext
from asyncrl.common.environments.protocol import Calculator, EpisodeRow
from asyncrl.common.environments.turns import EpisodeTools
from asyncrl.common.tiny_models.agent import TOOLS_TURN, calculator_call

TOOL_CHAT_TEMPLATE = TOOLS_TURN + (
    "{%- for message in messages %}"
    "{%- if message['role'] == 'tool' %}"
    "{%- if loop.first or loop.previtem['role'] != 'tool' %}{{- '<|im_start|>tool\\n' }}"
    "{%- else %}{{- '\\n' }}{%- endif %}"
    "{{- message['content'] }}"
    "{%- if loop.last or loop.nextitem['role'] != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + (message['content'] or '') }}"
    "{%- for call in message.get('tool_calls') or [] %}"
    "{{- '<tool_call>' + {'name': call['function']['name'], 'arguments': call['function']['arguments']} | tojson"
    " + '</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
"""The tiny agent model's template (``common/tiny_models/agent.py``: the same tools turn, then ChatML) extended so
it renders an assistant message's ``tool_calls`` and runs of tool messages as one tool turn, which TRL checks before
it trains with tools. It renders asyncrl's prompts, tool turns and episodes byte for byte as the model's own template
does (``tests/unit/test_peer_multi_turn.py``)."""

RESPONSE_TEMPLATE = {
    "defaults": {"role": "assistant"},
    "start_anchor": "<|im_start|>assistant\n",
    "fields": {
        "tool_calls": {
            "open": "<tool_call>",
            "close": "</tool_call>",
            "repeats": True,
            "content": "json",
            "transform": {"type": "function", "function": "{content}"},
        },
        "content": {"close_pattern": r"<\|im_end\|>\s*", "content": "text"},
    },
}
"""How transformers' ``parse_response`` reads an assistant turn of the tiny model into content and tool calls
(``tokenizer.response_template``); TRL sets one only for the chat templates it knows."""


def prepare_tokenizer(tokenizer: Any) -> None:
    tokenizer.chat_template = TOOL_CHAT_TEMPLATE
    tokenizer.response_template = RESPONSE_TEMPLATE


def environment_class(options: dict[str, Any]) -> type:
    """The TRL environment: one asyncrl ``Calculator`` per episode, its ``calc`` tool TRL's tool of that name."""

    class CalculatorEnvironment:
        def reset(self, answer: str, **_: Any) -> None:
            self.calculator = Calculator(EpisodeRow(prompt="", answer=answer), options)

        def calc(self, expression: str = "") -> str:
            """The value of an arithmetic expression.

            Args:
                expression: numbers, + - * / and parentheses, e.g. 37*48
            """
            return self.calculator.step(calculator_call(expression)).observation[0]["content"]

    return CalculatorEnvironment


def episode_rewards(completions, completion_ids, environments, eos_id: int) -> list[float]:
    """The ``Calculator``'s score of each episode: its last turn is the answer when it ended the turn (EOS) without
    calling a tool, as asyncrl's episode loop hands a finished turn to the environment."""
    rewards = []
    for messages, ids, environment in zip(completions, completion_ids, environments, strict=True):
        last = messages[-1]
        if last["role"] == "assistant" and not last.get("tool_calls") and len(ids) and ids[-1] == eos_id:
            environment.calculator.step(last["content"] or "")
        rewards.append(environment.calculator.score())
    return rewards


class GreedyGenerate:
    """asyncrl's ``Generator`` over HF ``generate``, greedy: TRL's model run through asyncrl's episode loop."""

    def __init__(self, model: Any, tokenizer: Any, stop_ids: tuple[int, ...]) -> None:
        self.model, self.tokenizer, self.stop_ids = model, tokenizer, stop_ids
        self.ends = {tokenizer.eos_token_id, *stop_ids}

    async def generate(self, prompt_ids, sampling, request_id: str) -> list[Response]:
        import torch

        ids = torch.tensor([list(prompt_ids)])
        out = self.model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=sampling.max_tokens,
            eos_token_id=sorted(self.ends),
            pad_token_id=self.tokenizer.pad_token_id,
        )
        new = out[0, ids.shape[1] :].tolist()
        finish = "stop" if new and new[-1] in self.ends else "length"
        return [Response(token_ids=new, logprobs=[0.0] * len(new), versions=[0] * len(new), finish_reason=finish)]


def solved_share(config, model: Any, tokenizer: Any, groups, stop_ids: tuple[int, ...]) -> float:
    """Greedy episodes of the held-out ``groups`` (one each) run as an asyncrl actor runs them, scored by replaying
    them as a reward worker does; the share that reaches ``eval.success_threshold``."""
    engine, tools = GreedyGenerate(model, tokenizer, stop_ids), EpisodeTools.for_tokenizer(tokenizer)

    async def score(group) -> float:
        rollout = await multi_turn(engine, group, WorkflowContext.of(config, "trl", group.group_id))
        return await replay_episode(tools, config.environment, rollout, 0)

    scores = [asyncio.run(score(group)) for group in groups]
    return sum(s >= config.eval.success_threshold for s in scores) / len(scores)
