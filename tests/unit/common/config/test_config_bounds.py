"""Every numeric setting is bounded and finite, integers are whole numbers (not ``true``), nesting is limited, and the
cross-field rules hold — each refusal a ConfigError naming the setting, before any process starts."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, get_args

import annotated_types
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel

from asyncrl.common.config import (
    GROUP_BASELINE_ADVANTAGES,
    MAX_DEPTH,
    ConfigError,
    RewardFunction,
    RunConfig,
    load_config,
)

ROOT = Path(__file__).resolve().parents[4]
FAST = settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
FUZZ = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
BESIDE = {"eval.every": ["eval.name='arithmetic'"]}
"""Settings a field's own rule needs beside it (evaluation every N steps needs a task to evaluate on)."""


def numeric_fields(model: type[BaseModel] = RunConfig, prefix: str = "") -> list[tuple[str, type, Any]]:
    """(dotted name, int or float, FieldInfo) of every numeric setting of the run config."""
    rows = []
    for name, info in model.model_fields.items():
        kinds = {info.annotation, *get_args(info.annotation)}
        if isinstance(info.annotation, type) and issubclass(info.annotation, BaseModel):
            rows += numeric_fields(info.annotation, f"{prefix}{name}.")
        elif int in kinds or float in kinds:
            rows.append((f"{prefix}{name}", int if int in kinds else float, info))
    return rows + (numeric_fields(RewardFunction, "reward.functions.0.") if model is RunConfig else [])


def bounds(info: Any) -> tuple[float, float, bool, bool]:
    """(low, high, low inclusive, high inclusive) from the field's constraints."""
    low, high, low_in, high_in = -math.inf, math.inf, True, True
    for item in info.metadata:
        if isinstance(item, annotated_types.Ge):
            low = item.ge
        elif isinstance(item, annotated_types.Gt):
            low, low_in = item.gt, False
        elif isinstance(item, annotated_types.Le):
            high = item.le
        elif isinstance(item, annotated_types.Lt):
            high, high_in = item.lt, False
    return low, high, low_in, high_in


NUMERIC = numeric_fields()
FIELD_IDS = [name for name, _, _ in NUMERIC]


def load_with(key: str, value: str) -> RunConfig:
    """``key=value`` over defaults, with the settings a field's own rule needs beside it (the reward list whole)."""
    if key.startswith("reward.functions.0."):
        return load_config(None, [f"reward.functions=[{{name='task', {key.rsplit('.', 1)[1]}={value}}}]"])
    return load_config(None, [f"{key}={value}", *BESIDE.get(key, [])])


def test_the_walk_finds_the_numeric_settings() -> None:
    assert {"learner.groups_per_step", "staleness.max_staleness", "reward.functions.0.weight"} <= set(FIELD_IDS)
    assert len(NUMERIC) > 50


@pytest.mark.parametrize(("name", "kind", "info"), NUMERIC, ids=FIELD_IDS)
def test_every_numeric_setting_has_both_bounds(name: str, kind: type, info: Any) -> None:
    low, high, _, _ = bounds(info)
    assert math.isfinite(low) and math.isfinite(high), f"{name}: needs ge/gt and le/lt"


@pytest.mark.parametrize(("name", "kind", "info"), NUMERIC, ids=FIELD_IDS)
@FAST
@given(data=st.data())
def test_non_finite_and_out_of_bounds_values_are_refused_naming_the_setting(
    name: str, kind: type, info: Any, data: st.DataObject
) -> None:
    low, high, _, _ = bounds(info)
    beyond = [repr(high * 2 + 1), repr(low - abs(low) - 1)]
    if kind is int:
        beyond = [str(int(high) + data.draw(st.integers(1, 10**30))), str(int(low) - data.draw(st.integers(1, 10**30)))]
        beyond += ["true", "false", "1e9", "2.5"]
    value = data.draw(st.sampled_from(["inf", "-inf", "nan", "+inf", "1e308", "-1e308", "1e999", *beyond]))
    with pytest.raises(ConfigError) as raised:
        load_with(name, value)
    message = str(raised.value)
    assert name.rsplit(".", 1)[-1] in message and "\n" not in message, message


@pytest.mark.parametrize(("name", "kind", "info"), NUMERIC, ids=FIELD_IDS)
@FAST
@given(data=st.data())
def test_values_within_bounds_round_trip_through_the_resolved_json(
    name: str, kind: type, info: Any, data: st.DataObject
) -> None:
    low, high, low_in, high_in = bounds(info)
    if kind is int:
        value: Any = data.draw(st.integers(int(low) + (not low_in), int(high) - (not high_in)))
    else:
        value = data.draw(
            st.floats(low, high, exclude_min=not low_in, exclude_max=not high_in, allow_nan=False, allow_infinity=False)
        )
    try:
        config = load_with(name, repr(value))
    except ConfigError as exc:  # a rule across settings (max_new_tokens < max_model_len, ...) names the field too
        assert name.rsplit(".", 1)[-1] in str(exc) and "\n" not in str(exc), str(exc)
        return
    again = RunConfig.from_json(config.to_json())
    assert again == config
    node: Any = again
    for part in name.split("."):
        node = node[int(part)] if part.isdigit() else getattr(node, part)
    assert node == value and type(node) is kind


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("learner.groups_per_step=1e9", "learner.groups_per_step: a whole number is needed"),
        ("learner.groups_per_step=1000000000", "learner.groups_per_step: Input should be less than or equal to 65536"),
        (
            "staleness.max_staleness=1000000000000",
            "staleness.max_staleness: Input should be less than or equal to 1000",
        ),
        ("staleness.max_staleness=1e12", "staleness.max_staleness: a whole number is needed"),
        ("reward.timeout_s=inf", "reward.timeout_s: Input should be a finite number"),
        ("learner.lr=inf", "learner.lr: Input should be a finite number"),
        ("reward.functions=[{name='task', weight=nan}]", "reward.functions.0.weight: nan is not a finite number"),
        ("transport.max_message_mb=1e30", "transport.max_message_mb: Input should be less than or equal to 4096"),
        ("task.options={x=inf}", "task.options.x: inf is not a finite number"),
        ("algorithm.loss_options={clip_high=nan}", "algorithm.loss_options.clip_high: nan is not a finite number"),
        ("task.options=" + "{a=" * 2000 + "1" + "}" * 2000, "task.options: nested more than 32 levels deep"),
        ("task.options=" + "{a=" * 40 + "1" + "}" * 40, "task.options: nested more than 32 levels deep"),
        ("rollout.engine_args={x=" + "[" * 100 + "]" * 100 + "}", "rollout.engine_args: nested more than 32 levels"),
        ("rollout.max_new_tokens=512", "set rollout.max_new_tokens below 512 or raise model.max_model_len"),
        ("eval.max_new_tokens=600", "set eval.max_new_tokens below 512 or raise model.max_model_len"),
        ("rollout.num_samples=1", "rollout.num_samples = 1 with algorithm.advantage = 'grpo'"),
        ("learner.steps=true", "learner.steps: a whole number is needed, not true or false"),
        ("learner.zero_stage=true", "learner.zero_stage: Value error, a number is needed, not true or false"),
        ("learner.steps=" + "9" * 5000, "learner.steps: Input should be a valid integer"),
        ("run.seed=-1", "run.seed: Input should be greater than or equal to 0"),
    ],
)
def test_hostile_settings_are_refused_in_one_line_naming_the_setting(override: str, message: str) -> None:
    with pytest.raises(ConfigError) as raised:
        load_config(None, [override])
    assert message in str(raised.value) and "\n" not in str(raised.value)
    assert len(str(raised.value)) < 400  # the value given is shown cut short


@pytest.mark.parametrize("advantage", sorted(GROUP_BASELINE_ADVANTAGES))
def test_a_group_baseline_needs_two_samples_and_dynamic_sampling_too(advantage: str) -> None:
    with pytest.raises(ConfigError, match=r"set rollout\.num_samples >= 2"):
        load_config(None, ["rollout.num_samples=1", f"algorithm.advantage='{advantage}'"])
    with pytest.raises(ConfigError, match="dynamic_sampling = false"):
        load_config(
            None, ["rollout.num_samples=1", "algorithm.advantage='batch_mean'", "algorithm.dynamic_sampling=true"]
        )
    assert load_config(None, ["rollout.num_samples=1", "algorithm.advantage='batch_mean'"]).rollout.num_samples == 1
    assert load_config(None, ["rollout.num_samples=2", f"algorithm.advantage='{advantage}'"]).rollout.num_samples == 2


def test_the_group_baseline_estimators_are_those_that_give_a_lone_response_advantage_zero() -> None:
    """The config's list, checked against what every registered estimator does with groups of one."""
    from asyncrl.learner.algorithms import ADVANTAGES, build_advantage
    from asyncrl.learner.algorithms.types import AdvantageInput

    mask = torch.ones(4, 3, dtype=torch.bool)
    lone = AdvantageInput(
        torch.tensor([0.0, 1.0, 2.0, 5.0]), torch.arange(4), mask, token_kl=torch.zeros(4, 3), values=torch.zeros(4, 3)
    )
    zero = {name for name in ADVANTAGES.names() if not build_advantage(name)(lone).advantages.any()}
    assert zero == GROUP_BASELINE_ADVANTAGES


def test_a_toml_file_nested_too_deep_or_with_a_huge_number_is_refused_naming_the_file(tmp_path: Path) -> None:
    deep = tmp_path / "deep.toml"
    deep.write_text("[task.options." + ".".join(["a"] * 2000) + "]\nx = 1\n")
    with pytest.raises(ConfigError, match=r"deep.toml: task.options: nested more than 32 levels deep"):
        load_config(deep)
    arrays = tmp_path / "arrays.toml"
    arrays.write_text("x = " + "[" * 5000 + "\n")
    with pytest.raises(ConfigError, match=r"arrays\.toml: not valid TOML: nested more than 32 levels deep"):
        load_config(arrays)
    big = tmp_path / "big.toml"
    big.write_text("[learner]\nsteps = " + "9" * 100_001 + "\n")
    with pytest.raises(ConfigError, match=r"big\.toml: a number of over 4300 digits"):
        load_config(big)
    infinite = tmp_path / "inf.toml"
    infinite.write_text("[reward]\ntimeout_s = inf\n")
    with pytest.raises(ConfigError, match=r"inf.toml: reward.timeout_s: inf is not a finite number"):
        load_config(infinite)


def test_a_config_path_that_is_no_toml_file_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="a config file of over 16 MiB"):
        load_config("/dev/zero")
    with pytest.raises(ConfigError, match="cannot read the config file"):
        load_config(tmp_path)
    binary = tmp_path / "binary.toml"
    binary.write_bytes(b"\xff\xfe[learner]")
    with pytest.raises(ConfigError, match="not UTF-8"):
        load_config(binary)


def test_nesting_up_to_the_limit_is_accepted() -> None:
    # The whole config is level 1, task is 2, task.options 3: MAX_DEPTH - 3 more tables fit.
    inner = MAX_DEPTH - 3
    options = load_config(None, ["task.options=" + "{a=" * inner + "1" + "}" * inner]).task.options
    assert RunConfig.from_json(load_config(None, [f"task.options={_toml(options)}"]).to_json()).task.options == options


def _toml(value: Any) -> str:
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}={_toml(v)}" for k, v in value.items()) + "}"
    return repr(value)


@FUZZ
@given(st.text(max_size=200))
def test_no_exception_but_config_error_escapes_the_loader_for_any_override(text: str) -> None:
    try:
        load_config(None, [text])
    except ConfigError as exc:
        assert str(exc)


KEYS = st.sampled_from([*FIELD_IDS, "task.options", "rollout.engine_args", "reward.functions", "learner", "x.y.z"])
VALUES = st.one_of(
    st.text(max_size=50),
    st.from_regex(r"[\[\{]{0,60}[0-9a-z=.,'\"+-]{0,20}[\]\}]{0,60}", fullmatch=True),
    st.integers().map(str),
    st.floats().map(repr),
    st.sampled_from(["true", "inf", "nan", "-0.0", "1e999", "9" * 5000, "[" * 3000, "{a=" * 1500]),
)


@FUZZ
@given(KEYS, VALUES)
def test_no_exception_but_config_error_escapes_for_any_value_of_a_known_setting(key: str, value: str) -> None:
    try:
        load_config(None, [f"{key}={value}"])
    except ConfigError as exc:
        assert str(exc)


@FUZZ
@given(st.text(max_size=300))
def test_no_exception_but_config_error_escapes_for_any_toml_file_or_json(text: str) -> None:
    import tempfile

    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "c.toml"
        path.write_bytes(text.encode("utf-8", "replace"))  # a lone surrogate has no UTF-8 form
        for load in (lambda: load_config(path), lambda: RunConfig.from_json(text)):
            try:
                load()
            except ConfigError as exc:
                assert str(exc)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["resolve", "--dry-run", "--set", "learner.groups_per_step=1e9"], "learner.groups_per_step"),
        (["resolve", "--dry-run", "--set", "task.options=" + "{a=" * 2000 + "1" + "}" * 2000], "task.options"),
        (["train", "--set", "reward.timeout_s=inf"], "reward.timeout_s"),
        (["check-data", "--set", "learner.steps=true"], "learner.steps"),
    ],
)
def test_each_command_exits_2_with_one_line_before_anything_starts(args: list[str], message: str) -> None:
    from typer.testing import CliRunner

    from asyncrl.cli.learner import app

    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2 and isinstance(result.exception, SystemExit)  # fail(): no traceback
    assert result.stderr.count("\n") == 1 and message in result.stderr and result.stdout == ""


BUILTIN = "it is one of Python's builtins (system), which was not written for this call"


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        (
            ['reward.functions=[{name="os:system"}]'],
            "reward.functions[0].name = 'os:system': not a reward function (expects f(group, options) -> one score "
            f"per response): {BUILTIN}",
        ),
        (
            ['reward.functions=[{name="task"}, {name="json:dumps"}]'],
            "reward.functions[1].name = 'json:dumps': not a reward function (expects f(group, options) -> one score "
            "per response): its signature (obj, *, skipkeys=False,",
        ),
        (
            ["algorithm.advantage=os:system"],
            "algorithm.advantage = 'os:system': not an advantage estimator (expects f(inp: AdvantageInput, settings) "
            f"-> AdvantageOutput): {BUILTIN}",
        ),
        (
            ["algorithm.loss=tests.helpers.slow_rewards:constant"],
            "algorithm.loss = 'tests.helpers.slow_rewards:constant': not a policy loss (expects f(inp: LossInput, "
            "settings) -> LossOutput): its signature (group, options) cannot take that call",
        ),
        (
            ["rollout.workflow=multi_turn", "environment.name=os:system"],
            "environment.name = 'os:system': not an environment (expects a class Env(row, options) with step(action) "
            "and score()): it is a builtin_function_or_method, not a class",
        ),
        (
            ["task.options={max_digits=1e9}"],
            "task.options: task 'arithmetic': max_digits must be an integer in [1, 9], got 1000000000.0",
        ),
        (
            ["eval.every=5", "eval.name=arithmetic", "eval.options={max_digits=10}"],
            "eval.options: task 'arithmetic': max_digits must be an integer in [1, 9], got 10",
        ),
    ],
)
def test_settings_that_would_fail_once_a_run_started_are_refused_by_resolve(settings: list[str], message: str) -> None:
    """Each passed the schema and ``rl-learner resolve`` before, and failed later: a reward worker called
    ``os.system(group, options)`` on every group, a task's bound was met at ``check-model`` or when the learner built
    it."""
    from typer.testing import CliRunner

    from asyncrl.cli.learner import app

    result = CliRunner().invoke(app, ["resolve", "--dry-run", *(a for s in settings for a in ("--set", s))])
    assert result.exit_code == 2 and result.stdout == "", result.stdout
    assert result.stderr.startswith(f"error: invalid config: {message}") and result.stderr.count("\n") == 1


def test_reward_workers_that_would_refuse_to_bind_are_refused_before_the_run_starts(tmp_path: Path) -> None:
    """``tcp://0.0.0.0:0`` without CURVE keys: ``rl-launch run``, whose reward workers start on this host with its
    keys, refuses it before anything starts; ``rl-learner resolve`` says it once, since a worker on another host
    may name its own keys ($ASYNCRL_CURVE_*), as every pod of a Kubernetes run does."""
    from typer.testing import CliRunner

    from asyncrl.cli.launch import app as launch
    from asyncrl.cli.learner import app

    wide = ["--set", "transport.zmq_endpoint=tcp://0.0.0.0:0", "--set", f"run.root={tmp_path}"]
    wide += ["--set", f"model.path={tmp_path.parent / 'no-model'}"]  # not the demo's folder bin/demo may have made
    refused = CliRunner().invoke(launch, ["run", *wide])
    assert refused.exit_code == 2 and refused.stderr.count("\n") == 1, refused.output
    assert refused.stderr.startswith(
        "error: invalid config: transport.zmq_endpoint = 'tcp://0.0.0.0:0' binds the reward workers beyond loopback "
        "without CURVE keys, which they refuse: set transport.curve_server_key and transport.curve_client_keys"
    )
    assert list(tmp_path.iterdir()) == []  # no Redis, no run folder
    warned = CliRunner().invoke(app, ["resolve", "--dry-run", *wide])
    assert warned.exit_code == 0 and warned.stderr.startswith("warning: transport.zmq_endpoint = 'tcp://0.0.0.0:0'")

    from asyncrl.common.config import bind_refusal

    wide_config = load_config(None, ["transport.zmq_endpoint=tcp://0.0.0.0:5555"])
    host_keys = {"ASYNCRL_CURVE_SERVER_KEY": "k/server.key_secret", "ASYNCRL_CURVE_CLIENT_KEYS": "k/authorized"}
    assert bind_refusal(wide_config, host_keys) is None  # this host's workers bind with their own keys
    assert bind_refusal(wide_config, {"ASYNCRL_CURVE_SERVER_KEY": "k/server.key_secret"}) is not None
    for endpoint in ("tcp://127.0.0.1:0", "tcp://localhost:7000", "tcp://[::1]:0", "ipc:///tmp/x"):
        assert bind_refusal(load_config(None, [f"transport.zmq_endpoint={endpoint}"]), {}) is None
