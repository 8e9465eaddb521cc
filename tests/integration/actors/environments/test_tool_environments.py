"""The ``python`` tool: code the model wrote runs in the sandbox from the environments' process, its output comes
back as the tool's answer, and code that tries to get out — read the repository, reach a server on loopback, kill
the process above it, fork without end, loop forever, exhaust memory — gets an error or nothing it was after, while
the episode goes on to a scored answer and the environments' process stays up."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest

from asyncrl.actors.episodes import close_environment_hosts, environment_host
from asyncrl.common.wire.messages import segments
from tests.helpers.scripted_episodes import episode, replay, tools_for

TOOLS = tools_for("qwen2")
README = Path(__file__).resolve().parents[4] / "README.md"


@pytest.fixture(autouse=True, scope="module")
def _hosts_end_with_the_module():
    yield
    close_environment_hosts()


def python(code: str) -> str:
    return "<tool_call>" + json.dumps({"name": "python", "arguments": {"code": code}}) + "</tool_call>"


def tool_answers(rollout) -> list[str]:
    ids = rollout.token_ids
    return [
        TOOLS.tokenizer.decode(ids[s:e].tolist(), skip_special_tokens=True).split("tool\n", 1)[1].split("\n")[0]
        for s, e, by_model in segments(rollout.trained(0))
        if not by_model
    ]


def test_model_code_runs_in_the_sandbox_and_what_tries_to_escape_gets_nothing() -> None:
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    attempts = [
        python("print(37*48)"),
        python(f"print(open({str(README)!r}).read()[:20])"),
        python(f"import socket; socket.create_connection(('127.0.0.1', {port}), timeout=1); print('reached')"),
        python("import os, signal; os.kill(os.getppid(), signal.SIGKILL); print('killed', os.getppid())"),
        python("import os\nwhile True:\n    os.fork()"),
        python("while True: pass"),
        python("x = bytearray(2**31)"),
        "The answer is 1776.",
    ]
    settings = ("environment.name=python", "environment.max_turns=8", "environment.step_timeout_s=30")
    settings += ("environment.options={max_calls=10, cpu_s=1, wall_s=3}", "rollout.max_new_tokens=400")
    settings += ("model.max_model_len=4096", "environment.isolation=process")
    try:
        rollout, engine, turn = episode(TOOLS, attempts, *settings, answer="1776", question="What is 37*48?")
    finally:
        server.close()
    answers = tool_answers(rollout)
    assert len(engine.prompts) == len(attempts) and len(answers) == len(attempts) - 1, answers
    computed, readme, network, kill, bomb, loop, memory = answers
    assert computed == "1776"
    assert readme.startswith("error:") and "No such file" in readme, readme  # the repository is not in the sandbox
    assert network.startswith("error:") and "reached" not in network, network  # no network, not even loopback
    assert "killed 1" in kill or kill.startswith("error:"), kill  # its parent is the sandbox's own init
    assert bomb.startswith("error:") and loop.startswith("error: timeout"), (bomb, loop)
    assert memory.startswith("error: memory"), memory
    assert replay(TOOLS, rollout, turn) == 1.0  # the reward worker's replay runs the same code to the same answers
    assert environment_host(turn.environment).restarts == 0  # the environments' process lived through all of it
