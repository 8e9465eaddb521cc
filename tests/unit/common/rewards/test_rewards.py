"""Reward functions on tiny hand-built groups, their weighted sum, the registry, and time-limited calls."""

from __future__ import annotations

import dataclasses
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from asyncrl.actors.timed_calls import CallTimedOut, TimedCalls, WorkerStalled
from asyncrl.common.config import RewardFunction
from asyncrl.common.rewards import functions as rewards
from asyncrl.common.rewards.functions import (
    RewardError,
    bind_functions,
    check_functions,
    check_options,
    combine,
    get_reward,
    load_reward_model,
    register_reward,
    reward_names,
    run_verifier,
    score,
    takes_from_run,
)
from asyncrl.common.wire.messages import RolloutGroup
from tests.helpers.rollouts import make_group
from tests.helpers.waits import wait_for

CONFIG = Path(__file__).resolve().parents[4] / "configs/demo.toml"


@pytest.fixture
def registry():
    """Registrations made in one test are undone afterwards; the real registry is never cleared."""
    with rewards.REWARDS.snapshot() as snapshot:
        yield snapshot


def fn(name: str, weight: float = 1.0, **options) -> RewardFunction:
    return RewardFunction(name=name, weight=weight, options=options)


# --------------------------------------------------------------------------- built-ins


def test_the_built_ins_are_registered() -> None:
    assert {"task", "format", "overlong", "code_tests", "reward_model"} <= set(reward_names())


def test_task_applies_the_verifier_the_config_binds() -> None:
    group = make_group(["19", "20", "19\nbecause 12+7 is 19", "", "１９", "9" * 500])
    [task] = bind_functions([fn("task")], "arithmetic")
    assert task.options == {"verifier": "arithmetic"}
    assert score(task, group) == [1.0, 0.0, 1.0, 0.0, 0.0, 0.0]


def test_task_can_name_the_verifier_for_a_file_task() -> None:
    group = make_group(["olleh", "hello"], task="file", prompt="rev:hello=", answer="olleh")
    [task] = bind_functions([fn("task", verifier="reverse")], "file")  # the config's own choice wins
    assert score(task, group) == [1.0, 0.0]
    with pytest.raises(ValueError, match="unknown verifier 'file'"):
        bind_functions([fn("task")], "file")  # at start, not on every group


@takes_from_run(lambda run, options: {**options, "label": run.task})
def labelled(group: RolloutGroup, options: dict) -> list[float]:
    """A user's reward function that takes the run's task label as an option."""
    return [float(options["label"] == "arithmetic" and options["bonus"] == 1)] * group.num_samples


def test_a_function_declares_the_options_it_takes_from_the_run() -> None:
    """No name decides what is bound: a user's function by import path declares it as the built-ins do; the
    ``environment`` replay takes the run's episodes in place of any options."""
    [user] = bind_functions([fn(f"{__name__}:labelled", bonus=1)], "arithmetic")
    assert user.options == {"bonus": 1, "label": "arithmetic"} and score(user, make_group(["1"])) == [1.0]
    episodes = {"environment": {"name": "calculator"}, "model": "/m", "run": "r"}
    [environment] = bind_functions([fn("environment", stray=1)], "agent", episodes)
    assert environment.options == episodes
    [plain] = bind_functions([fn("format")], "arithmetic", episodes)
    assert plain.options == {}


def test_run_verifier_is_the_one_the_reward_workers_bind() -> None:
    """What a peer trainer scores with: the run's task verifier, or the one its config names, options included."""
    from asyncrl.common.config import load_config

    demo = load_config(CONFIG, [])
    assert run_verifier(demo)("7", "7") == 1.0
    prefix = 'reward.functions=[{ name = "task", options = { verifier = "prefix" } }]'
    assert run_verifier(load_config(CONFIG, ["task.name=count", "eval.name=count", prefix]))("1 2", "1 2 3 4") == 0.5
    two = 'reward.functions=[{ name = "task" }, { name = "format", weight = 0.1 }]'
    with pytest.raises(ValueError, match="one 'task' function at weight 1 is needed here, got task"):
        run_verifier(load_config(CONFIG, [two]))


def test_the_options_a_config_check_binds_are_those_of_functions_already_in_memory(registry) -> None:
    """What the learner checks before anything starts: a typo'd verifier option is refused, and a function registered
    by path (the environment replay, which imports the actors' code) is not imported to be checked."""
    with pytest.raises(ValueError, match="verifier 'regex'"):
        check_options([fn("task", verifier="regex", patern="x")], "arithmetic")
    registry.register_path("later", "no_such_module_here:later")
    checked = [fn("task", verifier="regex", pattern="=(\\d+)"), fn("later", anything=1), fn("format")]
    check_options(checked, "arithmetic")


def test_the_groups_own_task_name_selects_nothing() -> None:
    """``group.task`` arrives on a socket; it once chose the verifier, import paths included."""
    hostile = make_group(["id"], task="os:system")
    with pytest.raises(ValueError, match=r"needs options\.verifier"):
        score(fn("task"), hostile)  # unbound: refuses rather than fall back to the group's name
    [task] = bind_functions([fn("task")], "arithmetic")
    assert score(task, hostile) == [0.0]  # scored by the config's verifier; "os:system" never resolved


def test_format_needs_a_stop_and_a_non_empty_first_line() -> None:
    group = make_group(
        ["19", "wrong but tidy", "19", "", "  \n19", "19\n\n"],
        finish_reasons=["stop", "stop", "length", "stop", "stop", "abort"],
    )
    assert score(fn("format"), group) == [1.0, 1.0, 0.0, 0.0, 0.0, 0.0]


@pytest.mark.parametrize(
    ("length", "expected"),
    [
        # L_max = 20, L_cache = 5: no penalty up to L_max - L_cache = 15 tokens,
        (0, 0.0),
        (15, 0.0),
        # then (15 - |y|) / 5 inside the buffer: 16 → -1/5, 18 → -3/5, 20 → -5/5,
        (16, -0.2),
        (18, -0.6),
        (20, -1.0),
        # and -1 beyond L_max.
        (21, -1.0),
        (500, -1.0),
    ],
)
def test_overlong_follows_dapo_at_the_buffer_edges(length: int, expected: float) -> None:
    group = make_group(["x"], lengths=[length])
    assert score(fn("overlong", max_tokens=20, buffer=5), group) == [pytest.approx(expected)]


def test_overlong_with_the_whole_length_as_buffer_penalises_every_token() -> None:
    # L_max = L_cache = 4: (0 - |y|) / 4 → 0, -1/4, -4/4.
    group = make_group(["a", "b", "c"], lengths=[0, 1, 4])
    assert score(fn("overlong", max_tokens=4, buffer=4), group) == [0.0, -0.25, -1.0]


@pytest.mark.parametrize(
    "options", [{}, {"max_tokens": 10}, {"max_tokens": 10, "buffer": 0}, {"max_tokens": 3, "buffer": 4}]
)
def test_overlong_refuses_options_without_a_valid_buffer(options: dict) -> None:
    with pytest.raises(ValueError, match="buffer <= max_tokens"):
        score(RewardFunction(name="overlong", options=options), make_group(["x"]))


# --------------------------------------------------------------------------- reward model


@pytest.fixture(scope="module")
def reward_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A randomly initialised 2-layer LlamaForSequenceClassification (one label) with a character tokenizer."""
    import torch
    from transformers import LlamaConfig, LlamaForSequenceClassification

    from asyncrl.common.data.tasks import TASK_ALPHABET
    from asyncrl.common.tiny_models.character import build_char_tokenizer

    out = tmp_path_factory.mktemp("reward-model")
    tokenizer = build_char_tokenizer(TASK_ALPHABET, model_max_length=128)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=128,
        num_labels=1,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    LlamaForSequenceClassification(config).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def test_reward_model_scores_in_batches_exactly_as_one_by_one(reward_model_dir: Path) -> None:
    group = make_group(["19", "2", "1234567890", "", "19\nbecause", "-7"])
    batched = score(fn("reward_model", path=str(reward_model_dir), batch_size=4), group)
    single = score(fn("reward_model", path=str(reward_model_dir), batch_size=1), group)
    assert batched == pytest.approx(single, abs=1e-5)
    assert len(set(round(s, 4) for s in single)) == len(single)  # the text matters, not only the padding


def test_reward_model_scores_prompt_plus_response_like_a_plain_forward(reward_model_dir: Path) -> None:
    import torch

    model, tokenizer = load_reward_model(str(reward_model_dir))
    assert load_reward_model(str(reward_model_dir))[0] is model  # loaded once, cached
    with torch.no_grad():
        expected = model(**tokenizer("12+7=19", return_tensors="pt")).logits[0, 0].item()
    assert score(fn("reward_model", path=str(reward_model_dir)), make_group(["19"])) == [pytest.approx(expected)]


def test_reward_model_without_a_path_says_so() -> None:
    with pytest.raises(ValueError, match=r"options\.path"):
        score(fn("reward_model"), make_group(["19"]))


# --------------------------------------------------------------------------- combining


def test_combine_sums_with_weights_and_keeps_raw_scores() -> None:
    group = make_group(["19", "20", "19"], finish_reasons=["stop", "stop", "length"], lengths=[2, 9, 12])
    functions = [fn("task", verifier="arithmetic"), fn("format", 0.5), fn("overlong", 2.0, max_tokens=12, buffer=4)]
    rewards_, details, turns = combine(group, functions)
    assert not len(turns)  # no function scored turns
    # task [1, 0, 1]; format [1, 1, 0]; overlong: 2 → 0, 9 → (8 - 9)/4 = -0.25, 12 → (8 - 12)/4 = -1
    # reward = task + 0.5 * format + 2 * overlong = [1.5, 0.5 - 0.5, 1 - 2]
    assert rewards_ == [1.5, 0.0, -1.0]
    assert details == [
        {"task": 1.0, "format": 1.0, "overlong": 0.0},
        {"task": 0.0, "format": 1.0, "overlong": -0.25},
        {"task": 1.0, "format": 0.0, "overlong": -1.0},
    ]


def test_combine_keys_a_repeated_function_apart() -> None:
    functions = [fn("tests.helpers.slow_rewards:constant", value=1.0), fn("tests.helpers.slow_rewards:constant", 2.0)]
    rewards_, details, _ = combine(make_group(["a"]), functions)
    # 1 * 1.0 + 2 * 0.25
    assert rewards_ == [1.5]
    assert details == [{"tests.helpers.slow_rewards:constant": 1.0, "tests.helpers.slow_rewards:constant#2": 0.25}]


def test_combine_uses_the_callers_call() -> None:
    seen = []

    def call(function: RewardFunction, group) -> list[float]:
        seen.append(function.name)
        return [3.0] * group.num_samples

    rewards_, details, _ = combine(make_group(["a", "b"]), [fn("task"), fn("format", -1.0)], call=call)
    assert (rewards_, details) == ([0.0, 0.0], [{"task": 3.0, "format": 3.0}] * 2)
    assert seen == ["task", "format"]


def episodes() -> RolloutGroup:
    """Two responses: two model turns around an environment's token, then a single turn."""
    return dataclasses.replace(
        make_group(["ab", "c"], lengths=[5, 2]), loss_mask=np.array([1, 1, 0, 1, 1, 1, 1], np.int32)
    )


def test_a_function_may_score_each_model_turn(registry) -> None:
    """A per-turn score counts with its sum; weighted, it makes the group's turn rewards, one per model turn of each
    response (a single-turn response has one), with zeros where another function gave none. A score with the wrong
    number of turns is refused."""
    group = episodes()

    def call(function: RewardFunction, group) -> list:
        return [(0.5, 1.0), (2.0,)] if function.name == "environment" else [1.0, 0.0]

    functions = [fn("environment", 2.0), fn("format")]
    rewards_, details, turns = combine(group, functions, call=call)
    assert rewards_ == [2 * 1.5 + 1.0, 2 * 2.0]
    assert details == [{"environment": 1.5, "format": 1.0}, {"environment": 2.0, "format": 0.0}]
    assert turns.tolist() == [1.0, 2.0, 4.0] and turns.dtype == np.float32
    register_reward("turns")(lambda group, options: [(1.0,), (1.0,)])
    with pytest.raises(RewardError, match="score 0 has 1 turn rewards for 2 model turns"):
        score(fn("turns"), group)
    register_reward("turns_nan")(lambda group, options: [(1.0, float("nan")), (1.0,)])
    with pytest.raises(RewardError, match="score 0, turn 1 is not finite"):
        score(fn("turns_nan"), group)


@pytest.mark.parametrize(
    ("output", "message"),
    [
        ([1.0], "returned 1 scores for 2 responses"),
        ([1.0, float("nan")], "not finite"),
        ([1.0, "x"], "not a number"),
        (None, "returned a NoneType, not a list of 2 scores"),
        ("ab", "returned a str, not a list"),
        ([1.0, 1e39], None),
    ],
)
def test_unusable_output_is_a_reward_error_naming_the_function(registry, output, message) -> None:
    register_reward("broken")(lambda group, options: output)
    group = make_group(["a", "b"])
    if message is None:  # finite as a Python float, but no float32 holds it
        with pytest.raises(RewardError, match="overflows float32"):
            combine(group, [fn("broken")])
        return
    with pytest.raises(RewardError, match=f"reward function 'broken': .*{message}"):
        score(fn("broken"), group)


# --------------------------------------------------------------------------- registry


def test_a_different_function_cannot_take_a_registered_name(registry) -> None:
    def first(group, options):
        return [0.0] * group.num_samples

    def second(group, options):
        return [1.0] * group.num_samples

    assert register_reward("mine")(first) is first
    assert register_reward("mine")(first) is first  # the same function again (a module reload) is fine
    with pytest.raises(ValueError, match=r"'mine' already registered by .*first"):
        register_reward("mine")(second)
    with pytest.raises(ValueError, match="already registered"):
        register_reward("task")(second)
    with pytest.raises(ValueError, match="no ':'"):
        register_reward("a:b")


def test_the_registry_snapshot_leaves_the_real_one_alone() -> None:
    assert "mine" not in reward_names() and "broken" not in reward_names()


def test_functions_resolve_by_import_path_once() -> None:
    path = "tests.helpers.slow_rewards:constant"
    resolved = get_reward(path)
    assert resolved is get_reward(path)
    assert score(fn(path, value=0.75), make_group(["a", "b"])) == [0.75, 0.75]


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("no_such_reward", "unknown reward function 'no_such_reward'"),
        ("tests.helpers.no_such_module:fn", "cannot be resolved"),
        ("tests.helpers.slow_rewards:missing", "cannot be resolved"),
        ("tests.helpers.slow_rewards:", "not of the form"),
        ("asyncrl.common.wire.messages:SCHEMA_VERSION", "names a int, not something callable"),
    ],
)
def test_bad_names_fail_at_check_time(name: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        check_functions([fn("task"), fn(name)])


def test_no_functions_at_all_is_refused() -> None:
    with pytest.raises(ValueError, match=r"reward\.functions is empty"):
        check_functions([])


# --------------------------------------------------------------------------- time-limited calls


def test_a_call_past_its_limit_is_abandoned_and_the_next_starts_at_once() -> None:
    calls, release = TimedCalls(max_abandoned=2), threading.Event()
    try:
        started = time.monotonic()
        with pytest.raises(CallTimedOut, match=r"timed out after 0\.1 s"):
            calls.run("hang", release.wait, (), timeout_s=0.1)
        assert calls.abandoned() == 1
        assert calls.run("quick", lambda x: x + 1, (1,), timeout_s=5) == 2
        assert time.monotonic() - started < 2
    finally:
        release.set()


def test_a_functions_own_errors_pass_through_unchanged() -> None:
    calls = TimedCalls()

    def raises(kind: type[Exception]) -> None:
        raise kind("from the function")

    with pytest.raises(KeyError, match="from the function"):
        calls.run("f", raises, (KeyError,), timeout_s=5)
    with pytest.raises(TimeoutError, match="from the function") as info:
        calls.run("f", raises, (TimeoutError,), timeout_s=5)
    assert not isinstance(info.value, CallTimedOut) and calls.abandoned() == 0


def test_too_many_hung_calls_stall_instead_of_growing_threads() -> None:
    calls, release = TimedCalls(max_abandoned=2), threading.Event()
    try:
        for _ in range(2):
            with pytest.raises(CallTimedOut):
                calls.run("hang", release.wait, (), timeout_s=0.05)
        threads = threading.active_count()
        with pytest.raises(WorkerStalled, match="2 abandoned calls are still running"):
            calls.run("hang", release.wait, (), timeout_s=0.05)
        assert threading.active_count() == threads  # refused before starting a thread
    finally:
        release.set()
    # released threads finish: room again
    wait_for(lambda: calls.abandoned() == 0, "end of the released calls", timeout_s=5, poll_s=0.01)
    assert calls.run("quick", int, ("7",), timeout_s=5) == 7
