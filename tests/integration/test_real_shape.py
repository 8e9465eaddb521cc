"""The loop at the shape users train: Qwen2.5-0.5B's vocabulary (151,936 rows, tied, padded far beyond the
tokenizer), widths, heads and chat template, two layers deep, in bf16 (the actor samples in bf16, the weights travel
as bf16, the learner trains with bf16 compute on a CPU with bf16 instructions — AVX512-BF16 or AMX — and in float32 on
one without, where PyTorch's bf16 kernels run tens of times slower and the commands warn about it).

``rl-learner init-model --shape`` writes the folder; ``rl-launch run`` trains one step on it with one actor, which then
loads the step's weights. A model
with random weights samples almost every id from the 151k padded rows the tokenizer never wrote, so the ids on the
wire, the chunked log-softmax and entropy over the large LM head and the bf16 weight broadcast all carry real load;
the off-policy mismatch of bf16 sampling against the learner's training is measured on every step, never shown as 0.
"""

from __future__ import annotations

import json
import math
import subprocess
from pathlib import Path

import pytest

from asyncrl.cli.preflight import HALF_PRECISION_FLAGS, cpu_flags
from asyncrl.common.data.prompts import model_vocab_size
from asyncrl.common.tiny_models.chat import chat_examples
from asyncrl.common.tiny_models.shapes import SHAPES
from tests.helpers.runs import step_rows
from tests.helpers.stack import BIN, ONE_PROCESS_ENGINE, ROOT, finish, launch

SHAPE, LAYERS, STEPS = "qwen2.5-0.5b", 2, 1
LEARNER_PRECISION = "bfloat16" if cpu_flags() & set(HALF_PRECISION_FLAGS["bfloat16"]) else "float32"
"""The learner's precision on this machine's CPU (``cli/preflight.py: slow_precision``)."""


@pytest.fixture(scope="module")
def shaped(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(model folder, chat data): the shape at two layers in bf16, made by the command users run."""
    folder = tmp_path_factory.mktemp("shape")
    model = folder / "model"
    made = subprocess.run(
        [BIN / "rl-learner", "init-model", "--set", f"model.path={model}", "--shape", SHAPE,
         "--layers", str(LAYERS), "--dtype", "bfloat16"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert made.returncode == 0, made.stderr
    assert f"{SHAPES[SHAPE].parameters(LAYERS) / 1e6:,.0f} M parameters, bfloat16" in made.stderr
    data = folder / "chat.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in chat_examples(32, seed=4)))
    return model, data


def test_the_folder_has_the_published_shape(shaped: tuple[Path, Path]) -> None:
    model, _ = shaped
    config = json.loads((model / "config.json").read_text())
    shape = SHAPES[SHAPE]
    assert model_vocab_size(model) == shape.vocab == 151_936
    assert (config["hidden_size"], config["num_attention_heads"], config["num_key_value_heads"]) == (896, 14, 2)
    assert (config["num_hidden_layers"], config["tie_word_embeddings"], config["dtype"]) == (2, True, "bfloat16")
    template = json.loads((model / "tokenizer_config.json").read_text())["chat_template"]
    assert "You are Qwen" in template  # Qwen2.5's default system turn comes with its template


def test_a_bf16_run_at_the_real_vocabulary_trains_and_measures_its_mismatch(
    shaped: tuple[Path, Path], tmp_path: Path
) -> None:
    model, data = shaped
    overrides = [
        f"learner.steps={STEPS}", "learner.groups_per_step=2", "learner.micro_batch_size=8",
        "model.dtype=bfloat16", f"learner.precision={LEARNER_PRECISION}", "model.max_model_len=128",
        "task.name=file", f"task.path={json.dumps(str(data))}", 'task.options={verifier="arithmetic"}',
        "rollout.num_samples=4", "rollout.max_new_tokens=8", "staleness.max_staleness=0", ONE_PROCESS_ENGINE,
        "monitoring.samples_every=1",
    ]  # fmt: skip
    launcher = launch(tmp_path, model, "shape", *overrides, actors=1)
    assert finish(launcher, timeout_s=900) == 0
    steps = step_rows(tmp_path / "shape")
    assert [int(r["step"]) for r in steps] == list(range(1, STEPS + 1))
    for row in steps:
        assert math.isfinite(row["train/loss"]) and math.isfinite(row["train/grad_norm"]), row
        assert row["train/applied"] == 1.0
        # nearly uniform over 151,936 rows: the entropy of a random model is close to ln(V) = 11.9 nats
        assert 10.0 < row["train/loss/entropy"] <= math.log(151_936) + 1e-3, row
        # bf16 sampling against the learner's bf16 (or float32) forward differ in their kernels: measured, and small
        assert 0.0 < row["train/offpolicy/mismatch_kl"] < 0.05, row
    samples = [json.loads(line) for line in (tmp_path / "shape" / "samples.jsonl").read_text().splitlines()]
    # a response of ids the tokenizer never wrote decodes to nothing: sampled, carried, scored and trained all the same
    assert any(s["tokens"] == 8 and s["response"] == "" for s in samples), samples
    # the step's weights reached the actor as bf16: 331,920,640 bytes of them, the tied 151,936-row embedding included
    loaded = (tmp_path / "shape" / "logs" / "actor-0.log").read_text()
    assert f"loaded new weights version={STEPS} " in loaded and "bytes=331920640.0" in loaded
