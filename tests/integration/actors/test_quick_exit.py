"""An actor's vLLM processes skip the interpreter's last garbage collection at exit, and no other process does."""

from __future__ import annotations

import gc
import os
import subprocess
import sys

import pytest

from asyncrl.actors import quick_exit
from asyncrl.actors.lifeline import ACTOR_PID_ENV

# A cycle whose finaliser prints: only the final collection at interpreter exit can reach it.
PROGRAM = """
import sys
from asyncrl.actors.quick_exit import skip_final_collection
skip_final_collection()
class Node:
    def __del__(self):
        sys.stdout.write("collected\\n")
node = Node()
node.self = node
del node
"""


def test_the_plugin_registers_the_freeze_once_and_only_in_an_actors_process(monkeypatch) -> None:
    registered = []
    monkeypatch.setattr(quick_exit.atexit, "register", registered.append)
    monkeypatch.setattr(quick_exit, "_registered", False)
    monkeypatch.delenv(ACTOR_PID_ENV, raising=False)
    quick_exit.skip_final_collection()
    assert registered == []
    monkeypatch.setenv(ACTOR_PID_ENV, "1234")
    quick_exit.skip_final_collection()
    quick_exit.skip_final_collection()  # vLLM may load plugins more than once in a process
    assert registered == [gc.freeze]
@pytest.mark.parametrize("in_an_actor", [True, False])
def test_an_actors_process_exits_without_collecting_its_cycles(in_an_actor: bool) -> None:
    env = {k: v for k, v in os.environ.items() if k != ACTOR_PID_ENV}
    if in_an_actor:
        env[ACTOR_PID_ENV] = str(os.getpid())
    out = subprocess.run([sys.executable, "-c", PROGRAM], env=env, capture_output=True, text=True, check=True)
    assert out.stdout == ("" if in_an_actor else "collected\n")


def test_vllm_finds_the_plugin_in_the_installed_package() -> None:
    from importlib.metadata import entry_points

    plugins = {e.name: e.value for e in entry_points(group="vllm.general_plugins")}
    assert plugins.get("asyncrl_quick_exit") == "asyncrl.actors.quick_exit:skip_final_collection", plugins
