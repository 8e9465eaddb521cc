"""The run config: presets, overrides, validation messages, and the resolved file."""

from __future__ import annotations

from pathlib import Path

import pytest

from asyncrl.common.config import (
    ConfigError,
    RunConfig,
    field_help,
    known_presets,
    load_config,
    with_host_keys,
    write_resolved,
)


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_defaults_validate() -> None:
    config = load_config()
    assert config.rollout.num_samples == 8 and config.staleness.max_staleness == 1


def test_overrides_parse_toml_values(tmp_path: Path) -> None:
    config = load_config(
        None,
        ["learner.lr=3e-4", "learner.zero_stage=2", 'rollout.stop=["\\n", "."]', "run.name=exp-1", "model.path=x/y"],
    )
    assert config.learner.lr == 3e-4
    assert config.learner.zero_stage == 2
    assert config.rollout.stop == ["\n", "."]
    assert config.model.path == "x/y"  # not TOML: taken as a string
    assert config.run_dir == Path("runs/exp-1")


def test_file_overlays_its_preset_then_overrides_apply(tmp_path: Path) -> None:
    write(tmp_path / "base.toml", "[learner]\nlr = 1e-3\nsteps = 7\n[rollout]\nnum_samples = 4\n")
    child = write(tmp_path / "child.toml", 'preset = "base"\n[learner]\nsteps = 9\n')
    config = load_config(child, ["rollout.num_samples=16"])
    assert (config.learner.lr, config.learner.steps, config.rollout.num_samples) == (1e-3, 9, 16)


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("learner.lr=-1", "learner.lr: Input should be greater than 0 (got -1)"),
        ("learner.zero_stage=5", "learner.zero_stage: Input should be 0, 1, 2 or 3 (got 5)"),
        ("learner.foo=1", "learner.foo: unknown field; allowed here: grad_clip, group_deadline_s, groups_per_step"),
        ("staleness.correction=clip", "staleness.correction: Input should be 'none', 'truncate' or 'mask'"),
        ("transport.heartbeat_ttl_s=1", "heartbeat_ttl_s must exceed heartbeat_s"),
        ("run.name=../etc", "run.name: String should match pattern"),
        ("rollout.cpu_threads=3-1", "rollout.cpu_threads: Value error, '3-1' is not a CPU list"),
        ("rollout.frontend_cpus=a", "rollout.frontend_cpus: Value error, 'a' is not a CPU list"),
    ],
)
def test_invalid_values_name_the_field_and_what_is_allowed(override: str, expected: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(None, [override])
    assert expected in str(err.value)


@pytest.mark.parametrize(
    ("sets", "lag"),
    [
        (["weight_sync.sync_every=1", "staleness.max_staleness=0"], 0),  # synchronous: no overlap
        (["weight_sync.sync_every=1", "staleness.max_staleness=1"], 1),  # the newest version is on the wire
        (["weight_sync.sync_every=3", "staleness.max_staleness=3"], 3),  # two versions never sent, one on the wire
        (["weight_sync.sync_every=3", "weight_sync.overlap=false", "staleness.max_staleness=2"], 2),
    ],
)
def test_sync_every_within_the_staleness_bound_is_accepted(sets: list[str], lag: int) -> None:
    from asyncrl.common.config import weights_lag

    assert weights_lag(load_config(None, sets)) == lag


@pytest.mark.parametrize(
    ("sets", "needed"),
    [
        (["weight_sync.sync_every=2", "staleness.max_staleness=1"], 2),
        (["weight_sync.sync_every=2", "staleness.max_staleness=0"], 1),  # synchronous waits: lag 1, bound 0
        (["weight_sync.sync_every=4", "weight_sync.overlap=false", "staleness.max_staleness=2"], 3),
    ],
)
def test_sync_every_beyond_the_staleness_bound_is_refused_naming_the_bound_to_set(sets: list[str], needed: int) -> None:
    with pytest.raises(ConfigError, match=rf"set staleness.max_staleness >= {needed} or lower sync_every"):
        load_config(None, sets)


def test_malformed_override_and_missing_files_are_explained(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"section\.field=value"):
        load_config(None, ["learner.lr"])
    with pytest.raises(ConfigError, match="no such config file"):
        load_config(tmp_path / "nope.toml")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(write(tmp_path / "bad.toml", "[learner\n"))
    with pytest.raises(ConfigError, match="preset 'nope' not found"):
        load_config(write(tmp_path / "p.toml", 'preset = "nope"\n'))


def test_a_users_file_named_after_a_preset_overlays_that_preset(tmp_path: Path) -> None:
    """``grpo.toml`` saying ``preset = "grpo"`` is the user's change over the package's GRPO, not a cycle; a real
    cycle (a → b → a) is still named one."""
    mine = write(tmp_path / "dapo.toml", 'preset = "dapo"\n[learner]\nsteps = 3\n')
    config = load_config(mine)
    assert (config.learner.steps, config.algorithm.preset, config.algorithm.dynamic_sampling) == (3, "dapo", True)
    write(tmp_path / "a.toml", 'preset = "b"\n')
    write(tmp_path / "b.toml", 'preset = "a"\n')
    with pytest.raises(ConfigError, match="preset cycle through"):
        load_config(tmp_path / "a.toml")


def test_a_presets_bare_name_is_a_config_where_no_such_file_exists(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An installed package has no configs/ folder: ``rl-launch run demo`` runs the packaged demo; a file of that
    name in the working folder comes first."""
    monkeypatch.chdir(tmp_path)
    assert load_config("demo").run.name == "demo"
    write(tmp_path / "demo", '[run]\nname = "mine"\n')
    assert load_config("demo").run.name == "mine"
    assert {"demo", "grpo", "dapo", "ppo", "dpo", "lora", "agent"} <= set(known_presets())


def test_resolved_config_round_trips_through_json(tmp_path: Path) -> None:
    config = load_config(None, [f"run.root={tmp_path}", "run.name=r1", "learner.lr=0.5"])
    path = write_resolved(config)
    assert path == tmp_path / "r1" / "config.json"
    assert RunConfig.from_json(path.read_text()) == config


def test_every_field_has_help() -> None:
    rows = field_help()
    assert rows and all(doc for _, _, doc in rows), [name for name, _, doc in rows if not doc]


def test_a_preset_that_switches_the_loss_does_not_inherit_the_old_loss_options(tmp_path: Path) -> None:
    base = tmp_path / "base.toml"
    base.write_text('[algorithm]\nloss = "ppo_clip"\nloss_options = { clip_high = 0.28 }\nadvantage = "grpo"\n')
    top = tmp_path / "top.toml"
    top.write_text('preset = "base"\n[algorithm]\nloss = "dpo"\nloss_options = { beta = 0.2 }\n')
    algorithm = load_config(top).algorithm
    assert (algorithm.loss, algorithm.loss_options, algorithm.advantage) == ("dpo", {"beta": 0.2}, "grpo")


def test_the_reference_model_precision_defaults_to_the_training_precision() -> None:
    from asyncrl.learner.update.engine import reference_precision

    assert reference_precision(load_config(None, ["learner.precision=bfloat16"])) == "bfloat16"
    both = ["learner.precision=bfloat16", "learner.reference_precision=float32"]
    assert reference_precision(load_config(None, both)) == "float32"


def test_an_override_of_nan_or_inf_is_a_name_not_a_float() -> None:
    assert load_config(None, ["run.name=nan"]).run.name == "nan"
    assert load_config(None, ["run.name=inf"]).run.name == "inf"


def test_an_override_of_a_string_field_keeps_its_text() -> None:
    """``rollout.cpu_threads=1`` was read as the integer 1 and refused; a string field takes the text as given."""
    config = load_config(None, ["rollout.cpu_threads=1", "run.name=2024", "model.path=007"])
    assert config.rollout.cpu_threads == "1" and config.run.name == "2024" and config.model.path == "007"
    assert load_config(None, ['rollout.cpu_threads="0-3"']).rollout.cpu_threads == "0-3"  # quoted: unquoted
    assert load_config(None, ["learner.steps=7"]).learner.steps == 7  # numbers stay numbers elsewhere


def test_this_hosts_curve_key_paths_come_from_the_environment() -> None:
    config = load_config(None, ["transport.curve_client_key=/run/keys/client.key_secret"])
    assert with_host_keys(config, {}) is config
    mine = with_host_keys(config, {"ASYNCRL_CURVE_CLIENT_KEY": "/mnt/secrets/actor-7.key_secret"})
    assert mine.transport.curve_client_key == "/mnt/secrets/actor-7.key_secret"
    assert mine.transport.curve_server_key == "" and config.transport.curve_client_key == "/run/keys/client.key_secret"


@pytest.mark.parametrize("key", ["preset", "algorithm.preset"])
def test_the_preset_switches_from_the_command_line_under_the_files_own_settings(tmp_path: Path, key: str) -> None:
    """``--set preset=dapo`` (or the label ``algorithm.preset``) trains DAPO under the file's own settings; the label
    never disagrees with what trains."""
    mine = write(tmp_path / "mine.toml", 'preset = "grpo"\n[learner]\nlr = 3e-4\n[rollout]\nmax_new_tokens = 6\n')
    config = load_config(mine, [f"{key}=dapo"])
    assert (config.algorithm.preset, config.algorithm.dynamic_sampling, config.learner.lr) == ("dapo", True, 3e-4)
    assert load_config(None, [f"{key}=gspo"]).algorithm.loss == "gspo"
    with pytest.raises(ConfigError, match="preset 'nope' not found; known presets: agent"):
        load_config(mine, [f"{key}=nope"])


def test_dapos_overlong_penalty_follows_the_runs_response_limit() -> None:
    """The preset names no limit: the penalty covers the last quarter before ``rollout.max_new_tokens``; a limit the
    run's responses can never reach is refused in one line."""
    [_, overlong] = load_config("dapo", ["rollout.max_new_tokens=6"]).reward.functions
    assert overlong.options == {"max_tokens": 6, "buffer": 1}
    [_, overlong] = load_config("dapo", ["rollout.max_new_tokens=64"]).reward.functions
    assert overlong.options == {"max_tokens": 64, "buffer": 16}
    unreachable = 'reward.functions=[{name="overlong",options={max_tokens=64,buffer=16}}]'
    with pytest.raises(ConfigError, match=r"penalises responses longer than 48 tokens, which rollout\.max_new_tokens"):
        load_config("dapo", [unreachable, "rollout.max_new_tokens=6"])
