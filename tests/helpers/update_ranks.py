"""Steps of :class:`asyncrl.learner.update.policy.PolicyUpdate` on every learner rank, led by rank 0 as in a run
(learner/ranks.py).

Run from the repository root, one rank or several, each ``--case ZERO_STAGE:PRESET`` in turn in the same processes
(one launch pays the imports and the process group once)::

    python -m tests.helpers.update_ranks MODEL_DIR OUT_DIR --case 2:grpo --case 2:ppo
    torchrun --nproc_per_node 2 --master_port PORT -m tests.helpers.update_ranks MODEL_DIR OUT_DIR --case 3:grpo

For each case, rank 0 trains step 1 on :func:`groups` ``(seed 1)``, saves a checkpoint of it (every rank writes its
shard), trains step 2 on ``groups(2)`` and takes the broadcast weights (``params()``: a gather on every rank under
ZeRO-3); then restores the checkpoint and trains step 2 again. The batch has 9 rows, so two ranks get shards of 5
and 4. Rank 0 writes, in ``OUT_DIR/<stage>-<preset>/``, ``stats.json`` (loss and grad norm of each step, the world
size), ``step2.safetensors`` and ``step2-again.safetensors`` (the weights after step 2, and after step 2 trained again
from the checkpoint). Preset ``ppo`` trains the critic beside the policy (GAE, with the reference's KL in the reward).
The mismatch guard and the token veto are off: :func:`groups`' behaviour log-probs are random, far from the tiny
model's, and the guard would drop every sequence of them (loss and grad norm 0, the weights unmoved: a comparison of
ranks that trained nothing). The guard has tests of its own.
"""

from __future__ import annotations

import argparse
import json
import tomllib
from pathlib import Path

import numpy as np
from safetensors.torch import save_file

from asyncrl.common.config import RunConfig
from asyncrl.common.data.tasks import TASK_ALPHABET
from asyncrl.common.wire.messages import RolloutGroup, ScoredGroup
from asyncrl.learner import dist, ranks
from asyncrl.learner.algorithms.assembly import assemble
from asyncrl.learner.checkpoint.checkpointer import Checkpointer
from asyncrl.learner.checkpoint.format import SavedState, capture_rng, open_checkpoint
from asyncrl.learner.follower import follow
from asyncrl.learner.update.policy import PolicyUpdate

SAMPLES = 3  # responses per group; 3 groups a step: 9 rows
FIRST_TOKEN_ID = 4  # ids 0..3 are <pad> <s> </s> <unk> in the tiny model's tokenizer
FIGURES = ("loss", "grad_norm", "critic/loss", "critic/grad_norm")  # a step's, compared across rank counts
REPO = Path(__file__).resolve().parents[2]


def run_config(model_dir: str, out_dir: Path, zero_stage: int, preset: str = "grpo") -> RunConfig:
    """A small step on the tiny model; ``preset`` ``ppo`` brings the critic (GAE) and the reference (KL reward); no
    mismatch guard or token veto (module docstring)."""
    algorithm = tomllib.loads((REPO / "configs" / f"{preset}.toml").read_text())
    staleness = {"max_staleness": 0, "max_sequence_kl": 0.0, "veto": 0.0}
    return RunConfig.model_validate(
        {
            "run": {"name": "ranks", "root": str(out_dir / "runs")},
            "model": {"path": model_dir},
            "rollout": {"num_samples": SAMPLES, "max_new_tokens": 6},
            "learner": {"groups_per_step": 3, "micro_batch_size": 2, "lr": 1e-3, "zero_stage": zero_stage},
            "staleness": staleness,
            "checkpoint": {"export_hf": False},
            **{section: algorithm[section] for section in ("algorithm", "critic") if section in algorithm},
        }
    )


def groups(seed: int) -> list[ScoredGroup]:
    """3 scored groups of 3 responses with different prompt and response lengths and rewards."""
    rng = np.random.default_rng(seed)
    high = FIRST_TOKEN_ID + len(TASK_ALPHABET)
    made = []
    for index in range(3):
        prompt_ids = rng.integers(FIRST_TOKEN_ID, high, 3 + index).astype(np.int32)
        lengths = rng.integers(2, 7, SAMPLES).astype(np.int32)
        total = int(lengths.sum())
        rollout = RolloutGroup(
            group_id=f"g{seed}-{index}",
            task="arithmetic",
            prompt="x" * len(prompt_ids),
            prompt_ids=prompt_ids,
            answer="1",
            token_ids=rng.integers(FIRST_TOKEN_ID, high, total).astype(np.int32),
            logprobs=rng.uniform(-3, -0.5, total).astype(np.float32),
            versions=np.zeros(total, np.int32),
            lengths=lengths,
            texts=["?"] * SAMPLES,
            finish_reasons=["stop"] * SAMPLES,
        )
        made.append(ScoredGroup(rollout=rollout, rewards=rng.uniform(0, 1, SAMPLES).astype(np.float32)))
    return made


def case_dir(out_dir: Path, zero_stage: int, preset: str) -> Path:
    return out_dir / f"{zero_stage}-{preset}"


def train_case(config: RunConfig, out_dir: Path) -> None:
    """One case on every rank: rank 0 leads the steps above and writes what they gave, the others follow."""
    if dist.world_size() > 1 and not ranks.leading():
        follow(config)
        return
    update = PolicyUpdate(config, assemble(config), pad_token_id=0)
    checkpointer = Checkpointer(config, update.engine, update.critic)
    try:
        first = update.train(update.collate(groups(1)))
        saved = checkpointer.save(SavedState(1, 1, kl_coef=update.kl_control.coef, rng=capture_rng()))
        second = update.train(update.collate(groups(2)))
        after = {name: t.detach().cpu().clone() for name, t in update.params().items()}
        update.restore_kl_coef(checkpointer.load(open_checkpoint(saved)).kl_coef)
        again = update.train(update.collate(groups(2)))
        after_again = {name: t.detach().cpu().clone() for name, t in update.params().items()}
    finally:
        ranks.lead("stop")
    stats = {
        "world_size": dist.world_size(),
        "steps": [{k: s[k] for k in FIGURES if k in s} for s in (first, second, again)],
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "stats.json").write_text(json.dumps(stats))
    save_file(after, str(out_dir / "step2.safetensors"))
    save_file(after_again, str(out_dir / "step2-again.safetensors"))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model_dir")
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--case", action="append", required=True, help="ZERO_STAGE:PRESET, e.g. 3:ppo (repeatable)")
    args = parser.parse_args(argv)
    ranks.start()
    for case in args.case:
        stage, preset = case.split(":")
        out = case_dir(args.out_dir, int(stage), preset)
        train_case(run_config(args.model_dir, out, int(stage), preset), out)
    dist.shutdown()


if __name__ == "__main__":
    main()
