"""A LoRA checkpoint's two exports against what vLLM answered: ``adapter/`` (a PEFT adapter folder over the base
model) and ``hf/`` (the adapters merged in), each loaded in transformers, answer every prompt greedily with the tokens
vLLM answered with when it served ``hf/`` (``rl-learner eval --samples``).

Greedy decoding picks the most likely token; where two tokens are within :data:`TIE` of each other, float rounding
(vLLM's CPU kernels against torch's, merged weights against the unmerged sum) decides which. Such a tie is the one
allowed difference: the answers must agree up to the first step whose two best tokens tie.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

TIE = 1e-3
"""Log-probability gap under which the two best tokens are a tie that float rounding may break either way."""


def load_exports(base: Path, checkpoint: Path):
    """(the base model with ``checkpoint/adapter`` through PEFT, the merged ``checkpoint/hf``), float32, eval mode."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    def plain(folder: Path):
        return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()

    return PeftModel.from_pretrained(plain(base), checkpoint / "adapter").eval(), plain(checkpoint / "hf")


def greedy(model, prompt_ids: list[int], max_new_tokens: int, eos: int | None) -> list[int]:
    """Greedy answer to ``prompt_ids``, one token at a time (a full forward each: exact, and the models are tiny)."""
    ids = list(prompt_ids)
    for _ in range(max_new_tokens):
        token = int(next_logprobs(model, ids).argmax())
        ids.append(token)
        if token == eos:
            break
    return ids[len(prompt_ids) :]


def next_logprobs(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0, -1].float(), -1)


def tied(model, prompt_ids: list[int], answer: list[int], other: list[int]) -> bool:
    """Whether ``answer`` and ``other`` part where ``model``'s two best next tokens are within :data:`TIE`."""
    shared = min(len(answer), len(other))
    common = next((i for i in range(shared) if answer[i] != other[i]), shared)
    top = next_logprobs(model, list(prompt_ids) + answer[:common]).topk(2).values
    return float(top[0] - top[1]) < TIE


def base_accuracy(base: Path, samples: Path, max_new_tokens: int, eos: int | None, verifier) -> float:
    """The base model's greedy accuracy on the prompts of ``samples`` (scored by ``verifier`` against each row's
    answer): the skill the adapters started from."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(base)
    rows = [json.loads(line) for line in samples.read_text().splitlines()]
    scores = []
    for row in rows:
        answer = greedy(model, row["prompt_ids"], max_new_tokens, eos)
        scores.append(verifier(tokenizer.decode(answer, skip_special_tokens=True), row["answer"]))
    return sum(scores) / len(rows)


def disagreements(base: Path, checkpoint: Path, samples: Path, max_new_tokens: int, eos: int | None) -> list[dict]:
    """Every prompt of ``samples`` whose greedy answers from the two exports and vLLM differ other than at a tie
    (``eos``: the token a greedy answer ends at, as vLLM's does)."""
    adapter, merged = load_exports(base, checkpoint)
    exports = {"adapter": adapter, "hf": merged}
    differ = []
    for row in map(json.loads, samples.read_text().splitlines()):
        served, prompt = row["response_ids"], row["prompt_ids"]
        answers = {name: greedy(model, prompt, max_new_tokens, eos) for name, model in exports.items()}
        for name, answer in answers.items():
            # vLLM may have stopped at a stop string, where transformers goes on: what it served must be a prefix
            if answer[: len(served)] != served and not tied(merged, prompt, answer, served):
                differ.append({"prompt": row["prompt"], "vllm": served, **answers, "export": name})
    return differ
