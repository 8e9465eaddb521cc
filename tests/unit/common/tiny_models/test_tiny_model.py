"""The tiny model folder: char tokenizer round trip, transformers loads it, warm start learns.

That vLLM loads it and reports behaviour log-probs equal to a transformers forward pass of the same folder (float32)
is checked through a real rollout actor, in tests/integration/actors/test_rollout_actor.py.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from asyncrl.common.data.tasks import TASK_ALPHABET as ALPHABET
from asyncrl.common.tiny_models.character import build_char_tokenizer, init_model, model_fingerprint, warm_start


def addition_examples(n: int, seed: int = 0) -> list[tuple[str, str]]:
    """Random two-digit additions as (prompt, answer) pairs, e.g. ("12+7=", "19")."""
    rng = random.Random(seed)
    pairs = ((rng.randint(0, 99), rng.randint(0, 99)) for _ in range(n))
    return [(f"{a}+{b}=", str(a + b)) for a, b in pairs]


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, float], str]:
    """A folder warm-started on additions: (path, warm_start's figures, fingerprint before the warm start)."""
    folder = init_model(tmp_path_factory.mktemp("tiny") / "model", alphabet=ALPHABET, seed=0)
    before = model_fingerprint(folder)
    stats = warm_start(folder, addition_examples(2000), steps=150, seed=0)
    return folder, stats, before


def test_tokenizer_round_trips_one_token_per_character() -> None:
    tokenizer = build_char_tokenizer(ALPHABET)
    assert len(tokenizer) == len(ALPHABET) + 4
    for text in ["12+7=19", "a b\nc  d\n\n", " x ", '{"k": [1, (2)]}', ""]:
        ids = tokenizer(text).input_ids
        assert ids[0] == tokenizer.bos_token_id
        assert len(ids) == len(text) + 1
        assert tokenizer.convert_ids_to_tokens(ids[1:]) == list(text)
        assert tokenizer.decode(ids, skip_special_tokens=True) == text
        assert tokenizer.decode(ids[1:]) == text
    assert tokenizer.decode([tokenizer.convert_tokens_to_ids("7"), tokenizer.eos_token_id]) == "7</s>"
    assert tokenizer("A").input_ids[1] == tokenizer.unk_token_id


def test_tokenizer_rejects_repeated_characters() -> None:
    with pytest.raises(ValueError, match="repeated"):
        build_char_tokenizer("abca")


def test_folder_loads_with_auto_classes(tmp_path: Path) -> None:
    folder = init_model(tmp_path / "model", alphabet=ALPHABET, seed=1)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder)
    assert json.loads((folder / "tokenizer_config.json").read_text())["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert tokenizer("9+9=").input_ids == build_char_tokenizer(ALPHABET)("9+9=").input_ids
    assert tokenizer.decode(tokenizer("a b\n").input_ids, skip_special_tokens=True) == "a b\n"
    assert tokenizer.eos_token == "</s>" and model.generation_config.eos_token_id == tokenizer.eos_token_id
    assert not model.config.tie_word_embeddings and model.config.vocab_size == len(tokenizer)
    with torch.no_grad():
        logits = model(torch.tensor([tokenizer("12+7=").input_ids])).logits
    assert logits.shape == (1, 6, len(tokenizer)) and torch.isfinite(logits).all()


def test_fingerprint_depends_on_seed_only(tmp_path: Path) -> None:
    first = model_fingerprint(init_model(tmp_path / "a", alphabet=ALPHABET, seed=3))
    assert first == model_fingerprint(init_model(tmp_path / "b", alphabet=ALPHABET, seed=3))
    assert first != model_fingerprint(init_model(tmp_path / "c", alphabet=ALPHABET, seed=4))


def test_warm_start_lowers_the_loss_and_saves(trained: tuple[Path, dict[str, float], str]) -> None:
    folder, stats, before = trained
    assert stats["loss_last"] < 0.5 * stats["loss_first"], stats
    assert model_fingerprint(folder) != before


def test_warm_start_keeps_the_folder_dtype(tmp_path: Path) -> None:
    folder = init_model(tmp_path / "model", alphabet=ALPHABET, dtype="bfloat16")
    warm_start(folder, addition_examples(8), steps=2, batch=4)
    model = AutoModelForCausalLM.from_pretrained(folder)
    assert model.config.dtype == torch.bfloat16 and model.lm_head.weight.dtype == torch.bfloat16


def test_a_batch_split_by_length_trains_as_one_padded_batch(tmp_path: Path) -> None:
    """Short rows beside long ones (a direct answer beside a tool call): the batch is split in two by length, and its
    loss and gradients are those of the one right-padded batch; a batch of like lengths is kept whole, as sampled."""
    from asyncrl.common.tiny_models.character import _batch_loss, _buckets, _collate

    folder = init_model(tmp_path / "model", alphabet=ALPHABET)
    rng = random.Random(0)
    texts = [[rng.randrange(4, 20) for _ in range(n)] for n in (8, 9, 9, 10, 40, 42, 8, 41)]
    rows = [(ids, list(ids)) for ids in texts]  # every token trained
    short, long = _buckets(rows)
    assert sorted(map(len, (ids for ids, _ in short))) == [8, 8, 9, 9, 10] and len(long) == 3
    alike = rows[:4]
    assert _buckets(alike) == [alike]

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)

    def loss_and_grads(loss: torch.Tensor) -> tuple[float, list[torch.Tensor]]:
        loss.backward()
        grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
        model.zero_grad(set_to_none=True)
        return loss.item(), grads

    split, split_grads = loss_and_grads(_batch_loss(model, rows, pad_id=0))
    whole, whole_grads = loss_and_grads(model(**_collate(rows, pad_id=0)).loss)
    assert split == pytest.approx(whole, rel=1e-5)
    for got, want in zip(split_grads, whole_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)
