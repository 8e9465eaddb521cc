"""The run configuration: one validated schema for a whole run, loaded from TOML.

Every field's docstring is its help text (``rl-learner fields`` prints them). A config file may name a ``preset`` (a
TOML file beside it, or one the package ships in ``asyncrl/presets/``) that it overlays; then ``--set a.b=c``
overrides apply, then validation. The resolved config is written to ``runs/<name>/config.json`` and published to
Redis, so that an actor started with only ``--redis URL --run NAME`` works from exactly the same settings as the
learner.

The schema is split by concern — :mod:`.base` (what every section shares), :mod:`.training` (what a run trains and
how), :mod:`.operations` (how its processes keep in step), :mod:`.run` (the whole :class:`RunConfig`) and
:mod:`.loading` (files, presets, overrides) — and read through this package: ``from asyncrl.common.config import
RunConfig, load_config``. Imports nothing of asyncrl but :mod:`asyncrl.common.redact` and
:mod:`asyncrl.common.net` (both the standard library only).
"""

from asyncrl.common.config.base import GROUP_BASELINE_ADVANTAGES, MAX_DEPTH, ConfigError, Section
from asyncrl.common.config.loading import (
    HOST_KEY_ENV,
    bind_refusal,
    field_help,
    known_presets,
    load_config,
    preset_dir,
    with_host_keys,
    write_resolved,
)
from asyncrl.common.config.operations import HealthSection, TransportSection
from asyncrl.common.config.run import RunConfig, broadcast_overlaps, weights_lag
from asyncrl.common.config.training import (
    EnvironmentSection,
    LearnerSection,
    RewardFunction,
    RewardSection,
    RolloutSection,
    TaskSection,
)

__all__ = [
    "GROUP_BASELINE_ADVANTAGES",
    "HOST_KEY_ENV",
    "MAX_DEPTH",
    "ConfigError",
    "EnvironmentSection",
    "HealthSection",
    "LearnerSection",
    "RewardFunction",
    "RewardSection",
    "RolloutSection",
    "RunConfig",
    "Section",
    "TaskSection",
    "TransportSection",
    "bind_refusal",
    "broadcast_overlaps",
    "field_help",
    "known_presets",
    "load_config",
    "preset_dir",
    "weights_lag",
    "with_host_keys",
    "write_resolved",
]
