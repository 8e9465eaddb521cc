"""``rl-launch run --pin ROLE=CPUS``: which settings are taken, and what a bad one is told."""

from __future__ import annotations

import pytest

from asyncrl.cli.children import parse_pins, pinned
from asyncrl.common.config.training import cpu_list


def test_cpu_lists_are_tasksets() -> None:
    assert cpu_list("0") == {0} and cpu_list("1-3") == {1, 2, 3} and cpu_list("0,2-3") == {0, 2, 3}
    assert cpu_list("") == cpu_list("a") == cpu_list("3-1") == cpu_list("1,") == set()


def test_pins_name_a_role_and_cpus_of_this_machine() -> None:
    assert parse_pins(["learner=0", "actors=1", "rewards=1"], {0, 1}) == {"learner": "0", "actors": "1", "rewards": "1"}
    with pytest.raises(ValueError, match="ROLE one of learner, actors, rewards"):
        parse_pins(["critic=0"], {0, 1})
    with pytest.raises(ValueError, match=r"CPUs \[2, 3\] are not among this machine's 0,1"):
        parse_pins(["actors=1-3"], {0, 1})
    with pytest.raises(ValueError, match="expected ROLE=CPUS"):
        parse_pins(["learner"], {0, 1})


def test_a_pinned_command_runs_under_taskset() -> None:
    assert pinned(["rl-learner", "train"], "0") == ["taskset", "--cpu-list", "0", "rl-learner", "train"]
    assert pinned(["rl-learner", "train"], None) == ["rl-learner", "train"]
