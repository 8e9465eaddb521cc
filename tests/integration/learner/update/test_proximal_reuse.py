"""π_old without its own pass: the loss gets the training forward's log-probs, detached, and they are the numbers the
pass before the update would have computed (one optimizer step per batch, no dropout: learner/update/policy.py)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from asyncrl.learner.algorithms.assembly import assemble
from asyncrl.learner.update.batch import longest_first
from asyncrl.learner.update.policy import PolicyUpdate
from tests.helpers.update_ranks import groups, run_config

pytestmark = pytest.mark.usefixtures("one_rank_world")
TIGHT = 1e-5  # the same weights; only the padding of a micro-batch differs from the whole batch's


def spying_update(config, seen: list[torch.Tensor]) -> PolicyUpdate:
    """A PolicyUpdate whose loss records the π_old of each micro-batch it is given."""
    algorithm = assemble(config)
    loss = algorithm.loss

    def recording_loss(inp):
        seen.append(inp.old_logprobs.detach().clone())
        return loss(inp)

    return PolicyUpdate(config, dataclasses.replace(algorithm, loss=recording_loss), pad_token_id=0)


def test_the_loss_gets_the_proximal_log_probs_without_a_pass_of_their_own(tiny_model_dir: Path, tmp_path) -> None:
    config = run_config(str(tiny_model_dir), tmp_path, zero_stage=0)
    seen: list[torch.Tensor] = []
    update = spying_update(config, seen)
    batch = update.collate(groups(1))
    expected = update._old_logprobs(batch)  # what the pass before the update gives, at the same weights

    passes = 0
    no_grad = update.engine.token_logprobs_no_grad

    def counting(*args, **kwargs):
        nonlocal passes
        passes += 1
        return no_grad(*args, **kwargs)

    update.engine.token_logprobs_no_grad = counting
    figures = update.train(batch)

    assert passes == 0  # grpo needs π_old only in the loss
    assert len(seen) == 5  # 9 rows, micro-batches of 2
    width = batch.response_mask.shape[1]
    got = torch.cat([torch.nn.functional.pad(t, (0, width - t.shape[1])) for t in seen])
    order = in_micro_batch_order(batch)  # the micro-batches take the rows longest first
    mask = batch.response_mask[order]
    torch.testing.assert_close(got[mask], expected[order][mask], atol=TIGHT, rtol=0)
    # μ is random in these groups, so the off-policy weights read π_old: the metric is π_old/μ's, not 1's
    assert figures["offpolicy/mismatch_kl"] > 0.1
    assert figures["loss/ratio_mean"] == pytest.approx(1.0, abs=1e-6)  # π_θ/π_old before the one update


def test_a_kl_penalty_in_the_reward_still_computes_proximal_first(tiny_model_dir: Path, tmp_path) -> None:
    config = run_config(str(tiny_model_dir), tmp_path, zero_stage=0, preset="ppo")
    seen: list[torch.Tensor] = []
    update = spying_update(config, seen)
    assert "token_kl" in update.needs
    batch = update.collate(groups(1))
    expected = update._old_logprobs(batch)
    update.train(batch)
    got = torch.cat([torch.nn.functional.pad(t, (0, batch.response_mask.shape[1] - t.shape[1])) for t in seen])
    torch.testing.assert_close(got, expected[in_micro_batch_order(batch)], atol=0, rtol=0)  # the pass's own, handed on


def in_micro_batch_order(batch) -> torch.Tensor:
    """The row indices in the order one rank's micro-batches take them (``learner/update/batch.py: longest_first``)."""
    rows = torch.arange(batch.rows)
    return longest_first({"attention_mask": batch.attention_mask, "row": rows})["row"]


def test_a_steps_figures_do_not_move_with_the_micro_batch_size(tiny_model_dir: Path, tmp_path) -> None:
    """The loss's metrics are the batch's token means (and maxima), whether 9 rows train in 5 passes or in one."""
    figures = []
    for rows in (2, 9):
        config = run_config(str(tiny_model_dir), tmp_path / str(rows), zero_stage=0)
        config = config.model_copy(update={"learner": config.learner.model_copy(update={"micro_batch_size": rows})})
        update = PolicyUpdate(config, assemble(config), pad_token_id=0)
        figures.append(update.train(update.collate(groups(1))))
    cut, whole = figures
    names = (
        "loss/entropy",
        "offpolicy/mismatch_kl",
        "offpolicy/weight_max",
        "offpolicy/weight_mean",
        "offpolicy/dropped_frac",
    )
    for name in names:
        assert cut[name] == pytest.approx(whole[name], rel=1e-4), name


def test_the_mismatch_is_measured_when_mu_stands_in_for_pi_old(tiny_model_dir: Path, tmp_path) -> None:
    """With ``staleness.correction = "none"`` the loss reads μ as π_old, so its own ratio sees no mismatch; the step
    still reports KL(μ ‖ π_old) from its forward — the same figure the correcting run reports on the same batch."""
    figures = {}
    for correction in ("none", "truncate"):
        config = run_config(str(tiny_model_dir), tmp_path / correction, zero_stage=0)
        config = config.model_copy(update={"staleness": config.staleness.model_copy(update={"correction": correction})})
        update = PolicyUpdate(config, assemble(config), pad_token_id=0)
        figures[correction] = update.train(update.collate(groups(1)))["offpolicy/mismatch_kl"]
    assert figures["none"] > 0.1  # μ is random in these groups
    assert figures["none"] == pytest.approx(figures["truncate"], rel=1e-4)
