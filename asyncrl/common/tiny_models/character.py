"""The tiny model maker: a character-level Llama checkpoint folder built locally, never fetched from a hub.

Tests and the demo need a policy that vLLM and transformers both load from a plain folder, that runs at thousands of
tokens/s on two CPU cores, and that can start reinforcement learning from partial skill. This module writes such a
folder (Llama config, random weights from a seed, a character-level tokenizer), can briefly fine-tune it on a task's
(prompt, answer) pairs, and hashes it for the run config.
"""

from __future__ import annotations

import hashlib
import json
import random
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import cast

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
)

Row = tuple[list[int], list[int]]  # (input ids, labels) of one example

PAD, BOS, EOS, UNK = "<pad>", "<s>", "</s>", "<unk>"
SPECIAL_TOKENS = (PAD, BOS, EOS, UNK)  # ids 0..3, in this order; alphabet characters follow from id 4
IGNORE_INDEX = -100  # the label value that transformers' causal-LM loss skips


def build_char_tokenizer(alphabet: str, *, model_max_length: int = 512) -> PreTrainedTokenizerFast:
    """Build a tokenizer with one token per character of `alphabet` plus `<pad> <s> </s> <unk>`.

    A WordLevel model over single characters, with a pre-tokenizer that isolates every character (newline and space
    included), so the token count equals the character count. Encoding prepends `<s>` through the post-processor, so
    vLLM prompts start with BOS exactly as transformers inputs do. The decoder is `Fuse` (concatenate): the default
    WordLevel decoding would join tokens with spaces and break the round trip. Characters outside the alphabet
    become `<unk>`.
    """
    if not alphabet or len(set(alphabet)) != len(alphabet):
        raise ValueError(f"alphabet must be non-empty with no repeated characters, got {alphabet!r}")
    vocab = {token: index for index, token in enumerate([*SPECIAL_TOKENS, *alphabet])}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    backend.decoder = decoders.Fuse()
    backend.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, vocab[BOS])]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        unk_token=UNK,
        clean_up_tokenization_spaces=False,
        model_max_length=model_max_length,
    )


@contextmanager
def _seeded(seed: int) -> Iterator[None]:
    """Seed torch's global generator inside the block and restore the caller's state after it."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


def init_model(
    out_dir: str | Path,
    *,
    alphabet: str,
    hidden: int = 128,
    layers: int = 2,
    heads: int = 4,
    intermediate: int = 256,
    max_position: int = 512,
    seed: int = 0,
    dtype: str = "float32",
) -> Path:
    """Write a Hugging Face checkpoint folder: Llama config, random weights from `seed`, char tokenizer.

    The same arguments give byte-identical weights. Embeddings are untied so that a weight broadcast is one tensor
    per parameter name. Returns the folder's path.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_char_tokenizer(alphabet, model_max_length=max_position)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=max_position,
        tie_word_embeddings=False,
        # transformers types a special token's id for every kind of tokenizer; the char tokenizer's are ints
        pad_token_id=cast(int, tokenizer.pad_token_id),
        bos_token_id=cast(int, tokenizer.bos_token_id),
        eos_token_id=cast(int, tokenizer.eos_token_id),
        dtype=dtype,
    )
    with _seeded(seed):
        model = LlamaForCausalLM(config)
    model.to(getattr(torch, dtype))
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    model.save_pretrained(out, safe_serialization=True)
    _save_tokenizer(tokenizer, out)
    return out


def _save_tokenizer(tokenizer: PreTrainedTokenizerFast, out: Path) -> None:
    """Save the tokenizer, naming its class `PreTrainedTokenizerFast` in tokenizer_config.json.

    transformers 5 writes `TokenizersBackend`, a name transformers 4.x (which a GPU machine's vLLM may pin) does not
    know; both versions load `PreTrainedTokenizerFast` from tokenizer.json unchanged.
    """
    tokenizer.save_pretrained(out)
    config_path = out / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def _encode_examples(tokenizer: PreTrainedTokenizerFast, examples: list[tuple[str, str]]) -> list[Row]:
    """Turn (prompt, answer) pairs into (input ids, labels): `<s> prompt answer </s>`, prompt positions masked."""
    encoded = []
    for prompt, answer in examples:
        prompt_ids = tokenizer(prompt).input_ids  # starts with <s>
        answer_ids = [*tokenizer(answer, add_special_tokens=False).input_ids, tokenizer.eos_token_id]
        encoded.append((prompt_ids + answer_ids, [IGNORE_INDEX] * len(prompt_ids) + answer_ids))
    return encoded


def _collate(rows: list[Row], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-pad a batch to its longest row; padded positions are masked out of attention and loss."""
    width = max(len(ids) for ids, _ in rows)
    input_ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    labels = torch.full((len(rows), width), IGNORE_INDEX, dtype=torch.long)
    attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
    for row, (ids, labs) in enumerate(rows):
        input_ids[row, : len(ids)] = torch.tensor(ids)
        labels[row, : len(labs)] = torch.tensor(labs)
        attention_mask[row, : len(ids)] = 1
    return {"input_ids": input_ids, "labels": labels, "attention_mask": attention_mask}


SPLIT_SAVING = 0.25
"""The share of a batch's padded positions that splitting it in two must save before it is split (:func:`_buckets`)."""


def _buckets(rows: list[Row]) -> list[list[Row]]:
    """``rows`` as one batch, or as two by length when that pads at least :data:`SPLIT_SAVING` fewer positions.

    A batch right-padded to its longest row computes every padded position: with the agent's episodes (a direct
    answer ~50 tokens, a tool call ~130) a third of those are padding. Sorted by length, the split at ``k`` pads
    ``k·len[k-1] + (n-k)·len[n-1]`` positions instead of ``n·len[n-1]``; the best ``k`` is kept."""
    ordered = sorted(rows, key=lambda row: len(row[0]))
    lengths = [len(ids) for ids, _ in ordered]
    n, whole = len(ordered), len(ordered) * lengths[-1]
    padded, k = min((k * lengths[k - 1] + (n - k) * lengths[-1], k) for k in range(1, n + 1))
    if padded > (1 - SPLIT_SAVING) * whole:
        return [rows]  # as sampled: a batch that is not split trains exactly as one right-padded batch
    return [ordered[:k], ordered[k:]]


def _batch_loss(model: torch.nn.Module, rows: list[Row], pad_id: int) -> torch.Tensor:
    """The batch's mean cross-entropy over its trained tokens (transformers' causal-LM loss: position ``t`` predicts
    label ``t+1``). Split by :func:`_buckets`, it is the sum over both parts divided by the batch's trained tokens:
    the same loss, and gradient, as one padded batch."""
    parts = _buckets(rows)
    if len(parts) == 1:
        return model(**_collate(rows, pad_id)).loss
    total, trained = torch.zeros(()), 0
    for part in parts:
        inputs = _collate(part, pad_id)
        labels = inputs.pop("labels")[:, 1:]
        logits = model(**inputs).logits[:, :-1]
        total = total + torch.nn.functional.cross_entropy(
            logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum"
        )
        trained += int((labels != IGNORE_INDEX).sum())
    return total / trained


def _train(
    model: torch.nn.Module, rows: list[Row], pad_id: int, *, steps: int, lr: float, batch: int, seed: int
) -> list[float]:
    """Run `steps` AdamW steps on random mini-batches of `rows`; return the per-step losses."""
    sampler = random.Random(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    losses = []
    model.train()
    for _ in range(steps):
        loss = _batch_loss(model, sampler.choices(rows, k=batch), pad_id)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def warm_start(model_dir: str | Path, examples: list[tuple[str, str]], *, steps: int, **options) -> dict[str, float]:
    """Briefly fine-tune the folder's model on (prompt, answer) pairs so RL starts from partial skill.

    Loss is cross-entropy on the answer tokens and the closing `</s>` only (prompt tokens are masked), so the model
    learns to answer and to stop. Options (`lr`, `batch`, `seed`, `threads`) and figures as :func:`warm_start_rows`.
    """
    if not examples:
        raise ValueError("warm_start needs steps >= 1 and at least one example")
    rows = _encode_examples(PreTrainedTokenizerFast.from_pretrained(model_dir), examples)
    return warm_start_rows(model_dir, rows, steps=steps, **options)


def warm_start_rows(
    model_dir: str | Path,
    rows: list[Row],
    *,
    steps: int,
    lr: float = 3e-3,
    batch: int = 32,
    seed: int = 0,
    threads: int = 1,
) -> dict[str, float]:
    """Fine-tune the folder's model on encoded (input ids, labels) rows (labels `IGNORE_INDEX` where not trained).

    Training runs in float32 on `threads` CPU threads (one by default, so it shares a small machine politely); the
    weights are saved back in the folder's own dtype. Returns {"loss_first", "loss_last", "seconds"}: the first and
    last step's mini-batch loss and the wall time.
    """
    if steps < 1 or not rows:
        raise ValueError("warm_start needs steps >= 1 and at least one example")
    started = time.perf_counter()
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        pad_id = AutoConfig.from_pretrained(model_dir).pad_token_id or 0
        saved_dtype = AutoConfig.from_pretrained(model_dir).dtype or torch.float32  # before loading overrides it
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        with _seeded(seed):
            losses = _train(model, rows, pad_id, steps=steps, lr=lr, batch=batch, seed=seed)
        # transformers wraps Module.to with functools.wraps, whose type does not bind self: the dtype reads as self.
        model.to(saved_dtype).save_pretrained(model_dir, safe_serialization=True)  # pyright: ignore[reportArgumentType]
    finally:
        torch.set_num_threads(previous_threads)
    return {"loss_first": losses[0], "loss_last": losses[-1], "seconds": time.perf_counter() - started}


def model_fingerprint(model_dir: str | Path) -> str:
    """sha256 over the folder's files, sorted by relative path: each path, then its length and bytes.

    Goes into the run config so a run records exactly which weights and tokenizer it started from. Lengths are
    hashed so that moving bytes between neighbouring files changes the fingerprint.
    """
    root = Path(model_dir)
    digest = hashlib.sha256()
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        data = path.read_bytes()
        digest.update(path.relative_to(root).as_posix().encode() + b"\0")
        digest.update(len(data).to_bytes(8, "little") + data)
    return digest.hexdigest()
