"""The configured algorithm assembled from the registries: every name and option of ``[algorithm]`` (and the
off-policy correction of ``[staleness]``) resolved and validated, with no model and no DeepSpeed — so that every
command can check a config in a second before it starts anything (``cli/preflight.py``), and the policy update
(``learner/update/policy.py``) runs what it returns."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from pydantic import ValidationError

from asyncrl.common.config import ConfigError, RunConfig
from asyncrl.learner.algorithms.kl import KLRewardSettings
from asyncrl.learner.algorithms.losses import OffPolicySettings
from asyncrl.learner.algorithms.registries import (
    OPTION_TABLES,
    advantage_settings,
    build_advantage,
    build_aggregation,
    build_loss,
    loss_settings,
    settings_type,
)
from asyncrl.learner.algorithms.types import AdvantageInput, LossInput, Need, Settings


@dataclass(frozen=True)
class Algorithm:
    """The configured algorithm with every option validated and bound; what the update computes follows ``needs``."""

    advantage: Callable[[AdvantageInput], Any]
    loss: Callable[[LossInput], Any]
    aggregate: Callable[..., torch.Tensor]
    kl_reward: KLRewardSettings
    needs: frozenset[Need]
    """What the variants require computed (``Settings.requires``): values, reference log-probs, entropy, …"""


def assemble(config: RunConfig) -> Algorithm:
    """Resolve and validate ``config.algorithm`` against the registries; raises :class:`ConfigError` naming the
    option (``algorithm.loss_options={clip_hgh=0.3}`` → "policy loss 'ppo_clip': unknown option(s) 'clip_hgh'")."""
    algorithm = config.algorithm
    _check_names(config)
    loss_options = _loss_options(config)
    try:
        kl_reward = KLRewardSettings(**algorithm.kl_reward)
    except ValidationError as exc:
        raise ConfigError(f"algorithm.kl_reward: {_problems(exc)}") from None
    advantage = advantage_settings(algorithm.advantage, algorithm.advantage_options)
    needs = _needs(f"advantage {algorithm.advantage!r}", advantage)
    needs |= _needs(f"policy loss {algorithm.loss!r}", loss_settings(algorithm.loss, loss_options))
    if kl_reward.mode != "off":
        needs |= {Need.TOKEN_KL}
    return Algorithm(
        advantage=build_advantage(algorithm.advantage, algorithm.advantage_options),
        loss=build_loss(algorithm.loss, loss_options),
        aggregate=build_aggregation(algorithm.aggregation, algorithm.aggregation_options),
        kl_reward=kl_reward,
        needs=frozenset(needs),
    )


def _needs(variant: str, settings: Settings) -> frozenset[Need]:
    """What ``settings.requires()`` names, as :class:`Need` members; :class:`ConfigError` for a name the learner
    does not compute (a variant of a user's own may name them as strings)."""
    named = settings.requires()
    known = [need.value for need in Need]
    if unknown := sorted(str(n) for n in named if n not in known):
        raise ConfigError(
            f"{variant} requires {', '.join(unknown)}, which the learner does not compute (it computes "
            f"{', '.join(known)})"
        )
    return frozenset(Need(n) for n in named)


def _check_names(config: RunConfig) -> None:
    """Each ``algorithm.<axis>`` names a registered variant, or by import path a function of its axis: the call its
    registry makes (``learner/algorithms/registries.py``) and a ``settings`` parameter annotated with its settings
    model. Raises ``ValueError`` naming the setting (``algorithm.loss = 'os:system': not a policy loss …``)."""
    for axis, registry in OPTION_TABLES:
        name = getattr(config.algorithm, axis)
        function = registry.get(name, f"algorithm.{axis}")
        try:
            settings_type(function)
        except ValueError as exc:
            raise ConfigError(f"algorithm.{axis} = {name!r}: {exc}") from None


SECTION_OPTIONS = {"off_policy": "staleness"}
"""Loss options that ``[section]`` sets for the whole run: refused in ``loss_options``, where they would quietly
override the section for the loss weights while the rest of the learner (π_old, the guard) followed the section."""


def _loss_options(config: RunConfig) -> dict[str, Any]:
    """The loss's own options, plus the run's off-policy correction (``[staleness]``) where the loss takes one."""
    options = dict(config.algorithm.loss_options)
    for option, section in SECTION_OPTIONS.items():
        if option in options:
            raise ConfigError(
                f"algorithm.loss_options.{option}: set by [{section}] for the whole run (the loss and π_old follow it "
                f"together); move these settings to [{section}] and remove loss_options.{option}"
            )
    staleness = config.staleness
    correction = {name: getattr(staleness, name) for name in OffPolicySettings.model_fields}
    settings = loss_settings(config.algorithm.loss, options)
    if "off_policy" in type(settings).model_fields:
        options["off_policy"] = correction
    return options


def _problems(exc: ValidationError) -> str:
    return "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
