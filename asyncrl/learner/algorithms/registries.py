"""The four algorithm registries, their decorators, and settings validated per variant.

Each axis of DESIGN.md "Algorithms as data" is a :class:`~asyncrl.common.registry.Registry` keyed by the name
used in the config. A registered function has the axis's one signature (see ``types.py``) and declares
its settings model by annotating its ``settings`` parameter::

    class GRPOSettings(Settings):
        name: Literal["grpo"] = "grpo"
        epsilon: float = 1e-6

    @register_advantage("grpo")
    def grpo(inp: AdvantageInput, settings: GRPOSettings) -> AdvantageOutput: ...

The annotation is the single link between a function and its settings, so a user's function named
in the config by import path (``package.module:function``) brings its settings model with it. The
decorator refuses a name already taken by a different function and a settings tag that is not the
key. ``*_settings(name, options)`` validates a config's options against the variant's model (an
unknown option is an error naming it); ``build_*(name, options)`` returns the function with its
validated settings bound, which is what the learner calls.
"""

from __future__ import annotations

import functools
import json
import typing
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError
from torch import Tensor

from asyncrl.common.config import ConfigError
from asyncrl.common.registry import Contract, Registry
from asyncrl.learner.algorithms.types import (
    AdvantageFn,
    AdvantageInput,
    AdvantageOutput,
    AggregationFn,
    GlobalCounts,
    KLEstimatorFn,
    LossFn,
    LossInput,
    LossOutput,
    Settings,
)

F = TypeVar("F", bound=Callable[..., Any])

ADVANTAGES: Registry[AdvantageFn] = Registry(
    "advantage estimator",
    Contract("f(inp: AdvantageInput, settings) -> AdvantageOutput", 1, ("settings",)),
    group="advantages",
)
"""``fn(inp: AdvantageInput, settings) -> AdvantageOutput`` by name."""
LOSSES: Registry[LossFn] = Registry(
    "policy loss", Contract("f(inp: LossInput, settings) -> LossOutput", 1, ("settings",)), group="losses"
)
"""``fn(inp: LossInput, settings) -> LossOutput`` by name."""
AGGREGATIONS: Registry[AggregationFn] = Registry(
    "loss aggregation",
    Contract("f(per_token_loss, response_mask, counts, settings) -> scalar", 3, ("settings",)),
    group="aggregations",
)
"""``fn(per_token_loss [B, T], response_mask [B, T], counts: GlobalCounts, settings) -> scalar`` by name."""
KL_ESTIMATORS: Registry[KLEstimatorFn] = Registry(
    "KL estimator",
    Contract("f(logprobs, ref_logprobs, settings) -> per-token KL", 2, ("settings",)),
    group="kl_estimators",
)
"""``fn(logprobs [B, T], ref_logprobs [B, T], settings) -> [B, T]`` by name."""

ALL_REGISTRIES: tuple[Registry[Any], ...] = (ADVANTAGES, LOSSES, AGGREGATIONS, KL_ESTIMATORS)


# --------------------------------------------------------------------------- registering


def register_advantage(name: str) -> Callable[[F], F]:
    """Decorator: register an advantage estimator as ``name`` (its settings tag must be ``name``)."""
    return _registrar(ADVANTAGES, name)


def register_loss(name: str) -> Callable[[F], F]:
    """Decorator: register a policy loss as ``name``."""
    return _registrar(LOSSES, name)


def register_aggregation(name: str) -> Callable[[F], F]:
    """Decorator: register a loss aggregation as ``name``."""
    return _registrar(AGGREGATIONS, name)


def register_kl_estimator(name: str) -> Callable[[F], F]:
    """Decorator: register a per-token KL estimator as ``name``."""
    return _registrar(KL_ESTIMATORS, name)


def _registrar(registry: Registry[Any], name: str) -> Callable[[F], F]:
    def wrap(fn: F) -> F:
        model = settings_type(fn)
        tag = settings_tag(model)
        if tag != name:
            raise ValueError(
                f"{registry.kind} {name!r}: its settings model {model.__name__} has tag {tag!r}; "
                f"declare name: Literal[{name!r}] = {name!r}"
            )
        return registry.register(name)(fn)

    return wrap


# --------------------------------------------------------------------------- settings


@functools.cache
def settings_type(fn: Callable[..., Any]) -> type[Settings]:
    """The settings model of ``fn``: the annotation of its parameter named ``settings``, a :class:`Settings` (whose
    ``requires()`` the learner asks what to compute)."""
    try:
        hints = typing.get_type_hints(fn)
    except Exception as exc:  # an annotation naming something its module does not define
        raise ValueError(f"cannot read the annotations of {_qualname(fn)}: {exc}") from None
    model = hints.get("settings")
    if not (isinstance(model, type) and issubclass(model, Settings)):
        raise ValueError(
            f"{_qualname(fn)} must annotate its `settings` parameter with a settings model: a subclass of "
            "asyncrl.learner.algorithms.types.Settings (a pydantic model)"
        )
    return model


def settings_tag(model: type[BaseModel]) -> str | None:
    """The default of the model's ``name`` field (its registry key), or None when it has none."""
    name = model.model_fields.get("name")
    return name.default if name is not None and isinstance(name.default, str) else None


def advantage_settings(name: str, options: Mapping[str, Any] | None = None) -> Settings:
    """The validated settings of advantage estimator ``name`` (a key or an import path)."""
    return _settings(ADVANTAGES, name, options)


def loss_settings(name: str, options: Mapping[str, Any] | None = None) -> Settings:
    """The validated settings of policy loss ``name``."""
    return _settings(LOSSES, name, options)


def aggregation_settings(name: str, options: Mapping[str, Any] | None = None) -> Settings:
    """The validated settings of loss aggregation ``name``."""
    return _settings(AGGREGATIONS, name, options)


def kl_settings(name: str, options: Mapping[str, Any] | None = None) -> Settings:
    """The validated settings of KL estimator ``name``."""
    return _settings(KL_ESTIMATORS, name, options)


def _settings(registry: Registry[Any], name: str, options: Mapping[str, Any] | None) -> Settings:
    model = settings_type(registry.get(name))
    options = dict(options or {})
    # Checked here rather than left to the model, so a user's model that allows extras still refuses them.
    unknown = sorted(set(options) - set(model.model_fields))
    if unknown:
        allowed = ", ".join(f for f in model.model_fields if f != "name") or "none"
        raise ConfigError(
            f"{registry.kind} {name!r}: unknown option(s) {', '.join(map(repr, unknown))}; allowed: {allowed}"
        )
    try:
        return model.model_validate(options)
    except ValidationError as exc:
        raise ConfigError(f"{registry.kind} {name!r}: {'; '.join(map(_problem, exc.errors()))}") from None


def _problem(error: Any) -> str:
    where = ".".join(map(str, error["loc"]))
    if error["type"] == "extra_forbidden":  # a nested unknown option, e.g. off_policy.corection
        return f"unknown option {where!r}"
    return f"option {where!r}: {error['msg']}"


def _qualname(fn: Callable[..., Any]) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"


# --------------------------------------------------------------------------- building


def build_advantage(name: str, options: Mapping[str, Any] | None = None) -> Callable[[AdvantageInput], AdvantageOutput]:
    """Advantage estimator ``name`` with its settings validated and bound: ``fn(inp) -> AdvantageOutput``."""
    return functools.partial(ADVANTAGES.get(name), settings=advantage_settings(name, options))


def build_loss(name: str, options: Mapping[str, Any] | None = None) -> Callable[[LossInput], LossOutput]:
    """Policy loss ``name`` with its settings bound: ``fn(inp) -> LossOutput``."""
    return functools.partial(LOSSES.get(name), settings=loss_settings(name, options))


def build_aggregation(
    name: str, options: Mapping[str, Any] | None = None
) -> Callable[[Tensor, Tensor, GlobalCounts], Tensor]:
    """Aggregation ``name`` with its settings bound: ``fn(per_token_loss, response_mask, counts) -> scalar``."""
    return functools.partial(AGGREGATIONS.get(name), settings=aggregation_settings(name, options))


def build_kl_estimator(name: str, options: Mapping[str, Any] | None = None) -> Callable[[Tensor, Tensor], Tensor]:
    """KL estimator ``name`` with its settings bound: ``fn(logprobs, ref_logprobs) -> [B, T]``."""
    return functools.partial(KL_ESTIMATORS.get(name), settings=kl_settings(name, options))


# --------------------------------------------------------------------------- the reference

OPTION_TABLES = (("advantage", ADVANTAGES), ("loss", LOSSES), ("aggregation", AGGREGATIONS))
"""The config's ``algorithm.<axis>`` names and the registry each picks from; its options go in ``<axis>_options``."""


def variant_help(set_elsewhere: frozenset[str] = frozenset()) -> list[tuple[str, str, str]]:
    """(``algorithm.<axis>_options.<option>``, default, "``<axis> = <variant>``: " + docstring) of every option of
    every registered variant: the part of the config reference that ``algorithm.*_options`` tables take. Options in
    ``set_elsewhere`` are left out (a section of their own sets them for the whole run)."""
    rows = []
    for axis, registry in OPTION_TABLES:
        for name in registry.names():
            for option, info in settings_type(registry.get(name)).model_fields.items():
                if option == "name" or option in set_elsewhere:
                    continue
                default = "(required)" if info.is_required() else json.dumps(info.get_default(), default=str)
                doc = " ".join((info.description or "").split())
                rows.append((f"algorithm.{axis}_options.{option}", default, f'`{axis} = "{name}"`: {doc}'))
    return rows
