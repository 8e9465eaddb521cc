"""A tiny chat model that has seen the calculator tool: the model of the multi-turn demo (``configs/agent.toml``).

Multiplying two two-digit numbers is beyond a model this size; copying numbers is not. The warm start shows it
two ways to answer ``What is 37*48?`` — half the time the whole episode with the tool (a ``calc`` call, the tool's
answer, the tool's number as the answer), half the time a number guessed straight away — so that it starts calling
the tool about as often as not. Reinforcement learning on the ``calculator`` environment (where only a right answer
scores) then raises the share of episodes that call the tool, and the reward with it.

Only the model's turns are trained in the warm start (the prompt and the tool's answer are masked), as in RL.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from common.tiny_chat_model import init_chat_model
from common.tiny_model import IGNORE_INDEX, Row, warm_start_rows

SYSTEM_PROMPT = (
    'To multiply, call the calc tool: <tool_call>{"name": "calc", "arguments": {"expression": "A*B"}}</tool_call> '
    "then answer with its result only."
)
"""``task.system_prompt`` of the demo: the tool and its call format."""


def tool_call(expression: str) -> str:
    return '<tool_call>{"name": "calc", "arguments": {"expression": "' + expression + '"}}</tool_call>'


def multiplication_rows(n: int, seed: int = 0, low: int = 10, high: int = 99) -> list[dict]:
    """``n`` chat rows ``What is A*B?`` with the product as the answer (two-digit factors by default)."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        a, b = rng.randint(low, high), rng.randint(low, high)
        rows.append({"messages": [{"role": "user", "content": f"What is {a}*{b}?"}], "answer": str(a * b), "id": i})
    return rows


def episode_rows(model_dir: str | Path, rows: list[dict], tool_share: float = 0.5, seed: int = 0) -> list[Row]:
    """The warm start's (ids, labels): each row as a tool episode (share ``tool_share``) or a straight guess."""
    from transformers import AutoTokenizer

    from common.prompts import turn_end_ids
    from common.turns import TurnEncoder

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    stop = turn_end_ids(tokenizer)
    end = stop[0] if stop else tokenizer.eos_token_id
    encoder = TurnEncoder.for_tokenizer(tokenizer, stop)
    rng = random.Random(seed)

    def said(text: str) -> list[int]:
        return [*tokenizer(text, add_special_tokens=False)["input_ids"], end]

    encoded: list[Row] = []
    for row in rows:
        messages = [{"role": "system", "content": SYSTEM_PROMPT}, *row["messages"]]
        prompt = tokenizer(
            tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
            add_special_tokens=False,
        )["input_ids"]
        ids, labels = list(prompt), [IGNORE_INDEX] * len(prompt)
        if rng.random() < tool_share:
            expression = row["messages"][-1]["content"].removeprefix("What is ").removesuffix("?")
            call, answer = said(tool_call(expression)), said(row["answer"])
            tool = encoder.ids([{"role": "tool", "content": row["answer"]}])
            ids += call + tool + answer
            labels += call + [IGNORE_INDEX] * len(tool) + answer
        else:
            guess = said(str(rng.randint(100, 9801)))
            ids += guess
            labels += guess
        encoded.append((ids, labels))
    return encoded


def init_agent_model(
    out_dir: str | Path, *, steps: int = 300, examples: int = 4000, seed: int = 0, low: int = 10, high: int = 99
) -> dict:
    """Write the demo's tiny Qwen2-style chat model and warm-start it on calculator episodes; returns the figures
    of :func:`common.tiny_model.warm_start_rows`, with the folder."""
    folder = init_chat_model(out_dir, "qwen2", seed=seed)
    rows = episode_rows(folder, multiplication_rows(examples, seed=seed + 1, low=low, high=high), seed=seed)
    figures = warm_start_rows(folder, rows, steps=steps, seed=seed)
    (Path(folder) / "warm_start.json").write_text(json.dumps({"steps": steps, "examples": examples, **figures}))
    return {**figures, "folder": str(folder)}
