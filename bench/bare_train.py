"""The training and checkpoint baselines of ``bench/scale.py``: a bare torch step on the learner's batch shape.

``SPEC`` (JSON) names the model folder, the precision, LoRA settings, the batch (``rows`` × ``length``), the
micro-batch size, lr, weight decay, grad clip and the repeats. The model is loaded with transformers in the learner's
precision (PEFT adapters on it with ``lora``: only they train). A step: per micro-batch of random token ids (every
position attended), a forward, float32 log-probs of the tokens (``z[x] − logsumexp(z)`` over the vocabulary, as the
learner computes them), a policy-gradient loss with random advantages, backward; then the gradient norm clipped and one
``torch.optim.AdamW`` step. In ``bfloat16`` the model computes in bf16 and AdamW updates float32 master copies of its
weights, copied back after the step (what DeepSpeed's bf16 optimizer keeps). One step untimed (it allocates Adam's
state), then ``repeats`` timed.

Then a checkpoint, as a resumable run needs one: the trained weights and the optimizer state with ``torch.save``, and
the model as a Hugging Face folder (``save_pretrained``; with LoRA the base model with its adapter layers, unmerged),
every file fsynced; timed, with its bytes; then a timed ``torch.load`` of it back into the model and the optimizer: an
untimed first, then ``repeats`` (medians).

Run by ``bench/scale.py`` pinned to the learner's core, with the learner's thread count (``OMP_NUM_THREADS``).

    python bench/bare_train.py SPEC OUT

Writes ``{"step_s", "step_cpu_s", "save_s", "load_s", "checkpoint_bytes", "trainable", "maxrss_bytes"}`` as JSON to
``OUT``.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import statistics
import sys
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

ADAM_BETAS, ADAM_EPS = (0.9, 0.999), 1e-8  # the learner's (asyncrl/learner/update/engine.py)


class MasterWeights:
    """AdamW over float32 copies of the trainable parameters that are not float32 (their gradients upcast, the
    updated values copied back), over the parameters themselves where they are."""

    def __init__(self, params: Iterable[torch.nn.Parameter], spec: dict[str, Any]) -> None:
        self.params = [p for p in params if p.requires_grad]
        self.master = [p if p.dtype == torch.float32 else p.detach().float().requires_grad_() for p in self.params]
        self.clip = spec["grad_clip"]
        self.optimizer = torch.optim.AdamW(
            self.master, lr=spec["lr"], betas=ADAM_BETAS, eps=ADAM_EPS, weight_decay=spec["weight_decay"]
        )

    def step(self) -> None:
        for p, m in zip(self.params, self.master, strict=True):
            if m is not p:
                m.grad = None if p.grad is None else p.grad.float()
                p.grad = None
        if self.clip:
            torch.nn.utils.clip_grad_norm_(self.master, self.clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        with torch.no_grad():
            for p, m in zip(self.params, self.master, strict=True):
                if m is not p:
                    p.copy_(m)


def load_model(spec: dict[str, Any]) -> Any:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=getattr(torch, spec["precision"]))
    if spec.get("lora"):
        from peft import LoraConfig, get_peft_model

        lora = spec["lora"]
        settings = LoraConfig(
            r=lora["rank"], lora_alpha=lora["alpha"], target_modules=lora["target_modules"], task_type="CAUSAL_LM"
        )
        model = get_peft_model(model, settings)
    return model.eval()  # no dropout, as the learner trains


def train_step(model: Any, optimizer: MasterWeights, spec: dict[str, Any]) -> tuple[float, float]:
    """Wall and CPU seconds of one step on a fresh random batch of ``rows`` × ``length`` tokens in micro-batches (CPU
    below wall: the process waited for its core)."""
    vocab = model.config.vocab_size
    rows, length, micro = spec["rows"], spec["length"], spec["micro_batch_size"]
    ids = torch.randint(0, vocab, (rows, length))
    advantages = torch.randn(rows, 1)
    start, cpu = time.perf_counter(), time.process_time()
    for first in range(0, rows, micro):
        batch = ids[first : first + micro]
        logits = model(input_ids=batch, attention_mask=torch.ones_like(batch), use_cache=False).logits[:, :-1].float()
        logprobs = logits.gather(-1, batch[:, 1:, None]).squeeze(-1) - torch.logsumexp(logits, dim=-1)
        loss = -(logprobs * advantages[first : first + micro]).sum() / (rows * (length - 1))
        loss.backward()
    optimizer.step()
    return time.perf_counter() - start, time.process_time() - cpu


def checkpoint(model: Any, optimizer: MasterWeights, folder: Path, lora: bool) -> dict[str, float]:
    """Save seconds and bytes of the trained weights, the optimizer state and an HF export of the model (with LoRA: the
    base model with its adapter layers, unmerged), fsynced; then the seconds to load the first two back."""
    folder.mkdir(parents=True, exist_ok=True)
    trained = {n: p for n, p in model.named_parameters() if p.requires_grad}
    state = folder / "state.pt"
    start = time.perf_counter()
    torch.save({"model": trained, "optimizer": optimizer.optimizer.state_dict()}, state)
    hf_model = model.get_base_model() if lora else model  # PEFT's wrapper would save the adapters alone
    hf_model.save_pretrained(folder / "hf", safe_serialization=True)
    files = [f for f in folder.rglob("*") if f.is_file()]
    for file in files:
        _fsync(file)
    saved = time.perf_counter() - start
    start = time.perf_counter()
    loaded = torch.load(state, weights_only=True)
    model.load_state_dict(loaded["model"], strict=False)
    optimizer.optimizer.load_state_dict(loaded["optimizer"])
    return {
        "save_s": saved,
        "load_s": time.perf_counter() - start,
        "checkpoint_bytes": sum(f.stat().st_size for f in files),
    }


def _fsync(path: Path) -> None:
    with path.open("rb") as file:  # as the learner's checkpoint writer does: what counts is on disk
        os.fsync(file.fileno())


def main() -> None:
    spec, out = json.loads(Path(sys.argv[1]).read_text()), Path(sys.argv[2])
    torch.manual_seed(0)
    model = load_model(spec)
    optimizer = MasterWeights(model.parameters(), spec)
    train_step(model, optimizer, spec)  # allocates Adam's state
    steps = [train_step(model, optimizer, spec) for _ in range(spec["repeats"])]
    figures: dict[str, Any] = {"step_s": [wall for wall, _ in steps], "step_cpu_s": [cpu for _, cpu in steps]}
    figures["trainable"] = sum(p.numel() for p in optimizer.params)
    figures["maxrss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    folder, lora = Path(spec["checkpoint"]), bool(spec.get("lora"))
    saves = []
    for _ in range(spec["repeats"] + 1):  # the first, untimed, imports what saving needs
        saves.append(checkpoint(model, optimizer, folder, lora))
        shutil.rmtree(folder, ignore_errors=True)
    figures |= {key: statistics.median(s[key] for s in saves[1:]) for key in saves[0]}
    out.write_text(json.dumps(figures))


if __name__ == "__main__":
    main()
