"""Algorithms as data: advantage estimators, policy losses, loss aggregations and KL estimators.

Each is a registry keyed by the name used in the config (DESIGN.md "Algorithms as data"); importing
this package registers the built-ins. The learner resolves its three functions once at start-up and
then runs, for every step::

    advantage = build_advantage(name, options)       # whole batch: AdvantageInput -> AdvantageOutput
    loss = build_loss(name, options)                 # micro-batch: LossInput -> LossOutput
    aggregate = build_aggregation(name, options)     # (per_token_loss, mask, GlobalCounts) -> scalar

Built-ins: advantages ``grpo``, ``dr_grpo``, ``rloo``, ``batch_mean``, ``gae``, ``reinforce_pp`` (every
one with ``normalize``); losses ``ppo_clip``, ``gspo``, ``dpo``; aggregations ``token_mean``,
``seq_mean_token_sum``, ``seq_mean_token_mean``, ``seq_mean_token_sum_norm``; KL estimators ``k1``,
``k2``, ``k3``. A config may also name a user's function by import path ``package.module:function``;
its ``settings`` annotation is its settings model. Outside the registries: :class:`KLController` (the
KL-in-reward coefficient, fixed or adaptive) and :func:`token_entropy` (for the entropy bonus).
"""

from __future__ import annotations

from asyncrl.learner.algorithms import advantages, aggregations, entropy, kl, losses
from asyncrl.learner.algorithms.advantages import AdvantageSettings
from asyncrl.learner.algorithms.entropy import token_entropy
from asyncrl.learner.algorithms.kl import KLController, KLRewardSettings
from asyncrl.learner.algorithms.losses import OffPolicySettings, PolicyGradientSettings, importance_weights
from asyncrl.learner.algorithms.registries import (
    ADVANTAGES,
    AGGREGATIONS,
    ALL_REGISTRIES,
    KL_ESTIMATORS,
    LOSSES,
    advantage_settings,
    aggregation_settings,
    build_advantage,
    build_aggregation,
    build_kl_estimator,
    build_loss,
    kl_settings,
    loss_settings,
    register_advantage,
    register_aggregation,
    register_kl_estimator,
    register_loss,
    settings_tag,
    settings_type,
)
from asyncrl.learner.algorithms.types import (
    REQUIREMENTS,
    AdvantageInput,
    AdvantageOutput,
    GlobalCounts,
    LossInput,
    LossOutput,
    Need,
    Settings,
)

__all__ = [
    "ADVANTAGES",
    "AGGREGATIONS",
    "ALL_REGISTRIES",
    "KL_ESTIMATORS",
    "LOSSES",
    "REQUIREMENTS",
    "AdvantageInput",
    "AdvantageOutput",
    "AdvantageSettings",
    "GlobalCounts",
    "KLController",
    "KLRewardSettings",
    "LossInput",
    "LossOutput",
    "Need",
    "OffPolicySettings",
    "PolicyGradientSettings",
    "Settings",
    "advantage_settings",
    "advantages",
    "aggregation_settings",
    "aggregations",
    "build_advantage",
    "build_aggregation",
    "build_kl_estimator",
    "build_loss",
    "entropy",
    "importance_weights",
    "kl",
    "kl_settings",
    "loss_settings",
    "losses",
    "register_advantage",
    "register_aggregation",
    "register_kl_estimator",
    "register_loss",
    "settings_tag",
    "settings_type",
    "token_entropy",
]
