"""The tiny model folder: char tokenizer round trip, transformers and vLLM both load it, warm start learns.

The vLLM check is the one the rest of the system leans on: behaviour log-probs that vLLM reports for the tokens it
sampled must equal a transformers forward pass of the same folder (float32), or every importance ratio is off.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from common.tiny_model import build_char_tokenizer, init_model, model_fingerprint, warm_start

# Stand-in for common.tasks.TASK_ALPHABET until that module lands.
ALPHABET = '0123456789abcdefghijklmnopqrstuvwxyz+-*/=()<>:,{}[]" \n'
PROMPTS = ["12+7=", "45+38=", "90+9=", "a b\nc"]
LOGPROB_TOLERANCE = 1e-4

# Run in a child process: vLLM spawns engine processes, which re-import the main module (hence the guard).
VLLM_SAMPLE = textwrap.dedent(
    """
    import json, sys, time

    def main(model_dir, out_path, prompts):
        started = time.perf_counter()
        from vllm import LLM, SamplingParams
        imported = time.perf_counter()
        llm = LLM(model=model_dir, enforce_eager=True, kv_cache_memory_bytes=256 * 2**20, dtype="float32",
                  max_model_len=128, seed=0)
        ready = time.perf_counter()
        params = SamplingParams(logprobs=0, temperature=1.0, max_tokens=16, seed=0)
        outputs = llm.generate(prompts, params, use_tqdm=False)
        samples = [
            {
                "prompt_ids": list(out.prompt_token_ids),
                "token_ids": list(out.outputs[0].token_ids),
                "logprobs": [step[tok].logprob for tok, step in zip(out.outputs[0].token_ids, out.outputs[0].logprobs)],
                "text": out.outputs[0].text,
            }
            for out in outputs
        ]
        finished = time.perf_counter()
        timing = {"import_s": imported - started, "start_s": ready - imported, "generate_s": finished - ready}
        with open(out_path, "w") as f:
            json.dump({"samples": samples, "timing": timing}, f)

    if __name__ == "__main__":
        main(sys.argv[1], sys.argv[2], json.loads(sys.argv[3]))
    """
)


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


def vllm_samples(folder: Path, tmp_path: Path) -> dict:
    """Run VLLM_SAMPLE in a child process and return what it wrote."""
    script, out = tmp_path / "vllm_sample.py", tmp_path / "samples.json"
    script.write_text(VLLM_SAMPLE)
    proc = subprocess.run(
        [sys.executable, str(script), str(folder), str(out), json.dumps(PROMPTS)],
        timeout=300,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return json.loads(out.read_text())


def transformers_logprobs(model: torch.nn.Module, prompt_ids: list[int], token_ids: list[int]) -> torch.Tensor:
    """Log-probs of `token_ids` given the prompt and the tokens before each, from one forward pass: shape [len]."""
    ids = torch.tensor([prompt_ids + token_ids])
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits[0].float(), dim=-1)
    positions = torch.arange(len(prompt_ids) - 1, ids.shape[1] - 1)
    return logp[positions, torch.tensor(token_ids)]


@pytest.mark.integration
def test_vllm_logprobs_match_transformers(trained: tuple[Path, dict[str, float], str], tmp_path: Path) -> None:
    folder = trained[0]
    result = vllm_samples(folder, tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    worst, texts = 0.0, []
    for prompt, sample in zip(PROMPTS, result["samples"], strict=True):
        assert sample["prompt_ids"] == tokenizer(prompt).input_ids  # BOS first, as in transformers
        text = tokenizer.decode(sample["token_ids"], skip_special_tokens=True)
        assert sample["token_ids"] and sample["text"] == text and set(text) <= set(ALPHABET)
        texts.append(prompt + text)
        expected = transformers_logprobs(model, sample["prompt_ids"], sample["token_ids"])
        worst = max(worst, (expected - torch.tensor(sample["logprobs"])).abs().max().item())
    print(f"vLLM vs transformers max |logprob diff| = {worst:.2e}; timing {result['timing']}; samples {texts}")
    assert worst < LOGPROB_TOLERANCE
