"""The adapters for reasoning-gym, skyrl-gym and TextArena with the real packages (``asyncrl[envs]``): rows drawn
from a reasoning-gym dataset and scored by its own ``score_answer``; a skyrl-gym multi-turn environment and a
TextArena game driven through real episodes (a scripted engine, a real chat tokenizer) and replayed as the reward
worker does. (A run with a real engine is tests/integration/test_chat_models.py's, with a test environment.)"""

from __future__ import annotations

import json
import random

import pytest
import reasoning_gym  # noqa: F401  here, not in a test: its first import may run fc-list (matplotlib's font cache)

from asyncrl.cli.preflight import check_config
from asyncrl.common.config import load_config
from asyncrl.common.data.gyms import _reasoning_dataset, textarena_game
from asyncrl.common.data.tasks import get_task
from asyncrl.common.rewards.functions import bind_functions
from asyncrl.common.rewards.verifiers import bind_verifier
from asyncrl.common.wire.messages import segments
from tests.helpers.scripted_episodes import episode, replay, tools_for

TOOLS = tools_for("qwen2")


def test_reasoning_gym_rows_are_drawn_by_seed_and_scored_by_the_datasets_own_rule() -> None:
    task = get_task("reasoning_gym", dataset="leg_counting", size=50, seed=3)
    rows = [task.sample(random.Random(0)) for _ in range(2)]
    assert rows[0] == rows[1] and "legs" in rows[0].prompt
    key = json.loads(rows[0].answer)
    entry = _reasoning_dataset(key["dataset"], key["seed"], key["size"], key["config"])[key["index"]]
    assert entry["question"] == rows[0].prompt
    verify = bind_verifier("reasoning_gym")
    assert verify(entry["answer"], rows[0].answer) == 1.0
    assert verify(f"Counting... <answer>{entry['answer']}</answer>", rows[0].answer) == 1.0
    assert verify("<answer>-1</answer>", rows[0].answer) == 0.0
    # The run's config resolves the task and binds the task's verifier to it, as a reward worker does.
    config = load_config(None, ["task.name=reasoning_gym", "task.options={dataset='leg_counting', size=50}"])
    check_config(config)
    [bound] = bind_functions(config.reward.functions, "reasoning_gym")
    assert bound.options["verifier"] == "reasoning_gym"
    with pytest.raises(ValueError, match="dataset 'no_such_dataset'"):
        get_task("reasoning_gym", dataset="no_such_dataset")


def test_a_skyrl_gym_environment_runs_episodes_with_its_turn_rewards() -> None:
    """skyrl-gym's gsm8k_multi_turn: a wrong answer gets a nudge and its format reward, a right one ends it."""
    settings = ("environment.name=skyrl_gym", "environment.options={env='gsm8k_multi_turn', extras={max_turns=3}}")
    rollout, engine, turn = episode(TOOLS, ["#### 41", "#### 42"], *settings)
    assert len(engine.prompts) == 2
    assert [t for _, _, t in segments(rollout.trained(0))] == [True, False, True]
    (_, _, _), (start, end, _), _ = segments(rollout.trained(0))
    assert "tentative numeric answer" in TOOLS.tokenizer.decode(rollout.token_ids[start:end].tolist())
    assert replay(TOOLS, rollout, turn) == pytest.approx(0.2 / 3 + 1.0)  # gsm8k's format score per turn, then 1


def test_a_textarena_game_is_the_environment_of_the_row_that_opened_it() -> None:
    task = get_task("textarena", game="GuessTheNumber-v0", seeds=100)
    row = task.sample(random.Random(1))
    seed = json.loads(row.answer)["seed"]
    game = textarena_game("GuessTheNumber-v0", seed)
    while hasattr(game, "env"):
        game = game.env
    target = game.game_number
    wrong = 1 if target != 1 else 2
    rollout, engine, turn = episode(
        TOOLS, [f"[{wrong}]", f"[{target}]"], "environment.name=textarena", answer=row.answer, question=row.prompt
    )
    assert len(engine.prompts) == 2
    (_, _, _), (start, end, _), _ = segments(rollout.trained(0))
    hint = TOOLS.tokenizer.decode(rollout.token_ids[start:end].tolist())
    assert "higher" in hint.lower() or "lower" in hint.lower()
    assert "You are Player 0" not in hint  # only what the game added
    assert replay(TOOLS, rollout, turn) == 1.0
    lost, _, _ = episode(TOOLS, ["[999]"], "environment.name=textarena", answer=row.answer, question=row.prompt)
    assert replay(TOOLS, lost, turn) <= 0.0
