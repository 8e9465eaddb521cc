"""A typo in any option table fails when the config is checked (every ``rl-learner`` command, before anything
starts), naming the option and what is allowed — not later, inside ``train``, after DeepSpeed started."""

from __future__ import annotations

from pathlib import Path

import pytest

from asyncrl.cli.preflight import check_config
from asyncrl.common.config import ConfigError, load_config, preset_dir
from asyncrl.learner.algorithms.assembly import assemble


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("algorithm.advantage_options={normalise=true}", "advantage estimator 'grpo': unknown option(s) 'normalise'"),
        ("algorithm.loss_options={clip_hgh=0.3}", "policy loss 'ppo_clip': unknown option(s) 'clip_hgh'; allowed: "),
        ("algorithm.loss_options={off_policy={correction='none'}}", "loss_options.off_policy: set by [staleness]"),
        ("algorithm.loss_options={kl_estimator='k4'}", "kl_estimator"),
        ("algorithm.aggregation_options={nrom=2}", "loss aggregation 'token_mean': unknown option(s) 'nrom'"),
        ("algorithm.kl_reward={mode='fixed', cof=0.1}", "algorithm.kl_reward: cof: Extra inputs are not permitted"),
        ("algorithm.loss='ppo_clipp'", "unknown policy loss 'ppo_clipp'"),
    ],
)
def test_an_algorithm_typo_names_the_option(override: str, message: str) -> None:
    config = load_config(None, [override])
    with pytest.raises(ValueError) as raised:
        assemble(config)
    assert message in str(raised.value)


def test_the_error_of_an_unknown_option_lists_the_allowed_ones() -> None:
    with pytest.raises(ConfigError) as raised:
        assemble(load_config(None, ["algorithm.loss_options={clip_hgh=0.3}"]))
    assert "clip_high" in str(raised.value)  # the name the user meant is among those listed


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["task.options={max_digit=2}"], "task 'arithmetic': bad options ['max_digit']"),
        (["task.name='arithmetc'"], "unknown task 'arithmetc'"),
        (["task.name='file'"], "task 'file' needs a data file"),
    ],
)
def test_a_task_typo_is_caught_without_building_the_task(overrides: list[str], message: str) -> None:
    with pytest.raises(ValueError) as raised:
        check_config(load_config(None, overrides))
    assert message in str(raised.value)


@pytest.mark.parametrize("config", sorted(preset_dir().glob("*.toml")), ids=lambda p: p.stem)
def test_every_shipped_config_passes(config: Path) -> None:
    overrides = ["data.path='pairs.jsonl'"] if config.stem == "dpo" else []  # a preferences run needs its file
    check_config(load_config(config, overrides))


def test_no_registered_option_duplicates_a_config_section_unless_it_is_refused() -> None:
    """An option of a loss, estimator or aggregation whose settings are a section's fields (as ``off_policy`` holds
    ``[staleness]``'s) would let a run set one thing in two places: each such option is refused in the config."""
    from asyncrl.common.config import RunConfig
    from asyncrl.learner.algorithms.assembly import SECTION_OPTIONS
    from asyncrl.learner.algorithms.registries import ALL_REGISTRIES, settings_type

    sections = {
        name: set(f.annotation.model_fields) for name, f in RunConfig.model_fields.items() if _model(f.annotation)
    }
    duplicates = set()
    for registry in ALL_REGISTRIES:
        for name in registry.names():
            for option, field in settings_type(registry.get(name)).model_fields.items():
                assert option not in sections, f"{registry} {name!r}: option {option!r} is a config section's name"
                if _model(field.annotation) and any(set(field.annotation.model_fields) <= f for f in sections.values()):
                    duplicates.add(option)
    assert duplicates == set(SECTION_OPTIONS)


def _model(annotation) -> bool:
    from pydantic import BaseModel

    return isinstance(annotation, type) and issubclass(annotation, BaseModel)
