"""What the learner's commands ask of vLLM. The commands stand above both wings (``cli/``), so the settings check runs
in the command's own process, with the same code each actor runs at its start; building an engine and evaluating a
checkpoint run as an ``rl-actor`` command in a child process, which keeps vLLM's engine logs and a crash of its engine
out of the command's own output: its one ``error:`` line (or, when vLLM's engine died, the engine's own error)
becomes the command's refusal."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from asyncrl.common.config import RunConfig


def rl_actor_command(command: str, config: Path | None, set_: list[str] | None) -> list[str]:
    """The command line of ``rl-actor COMMAND`` on the same config and overrides, for a process of its own."""
    from asyncrl.cli.util import bin_path

    overrides = [a for o in set_ or [] for a in ("--set", o)]
    return [bin_path("rl-actor"), command, *([str(config)] if config else []), *overrides]


def check_engine_serving(resolved: RunConfig) -> None:
    """Where vLLM is installed, whether it could run the config — ``[rollout]``'s settings, ``[lora]`` on the model,
    the attention head size on CPUs — without building an engine (``actors/engine_checks.py``, what each actor checks
    at its start); exit 2 with its one line when not. Without vLLM here, each actor checks at its start. What is asked
    of vLLM is kept per installation (``actors/vllm_facts.py``): vLLM is imported only the first time."""
    from asyncrl.actors.vllm_facts import installed_vllm

    vllm = installed_vllm()
    if vllm is None:
        return
    # vLLM's and transformers' notes on loading (a Triton without CPUs, a config's odd token ids) are the engine's
    # business: the command's output is the resolved config or its one refusal.
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    logging.getLogger("vllm").setLevel(logging.ERROR)  # some of its modules log before vLLM reads the setting
    from asyncrl.actors.engine import EngineSettingsError
    from asyncrl.actors.engine_checks import check_engine_settings
    from asyncrl.cli.util import fail

    try:
        check_engine_settings(resolved, vllm)
    except EngineSettingsError as exc:
        fail(str(exc))


def rl_actor_check(command: str, config: Path | None, set_: list[str] | None, *extra: str) -> str:
    """``rl-actor COMMAND`` on the run's config in a child process; its stdout, or exit 2 with its ``error:`` line
    (or the root cause of a crash)."""
    import subprocess

    from asyncrl.cli.children import FOLLOW_UPS, cause_line
    from asyncrl.cli.util import fail

    done = subprocess.run([*rl_actor_command(command, config, set_), *extra], capture_output=True, text=True)
    if done.returncode != 0:
        said = [line for line in done.stderr.splitlines() if line.startswith("error:")]
        others = "\n".join(line for line in done.stderr.splitlines() if not line.startswith("error:"))
        if not said:
            fail(f"rl-actor {command} failed: {cause_line(others)[:500]}")
        line = said[-1].removeprefix("error: ")
        if any(pointer in line for pointer in FOLLOW_UPS):  # vLLM's frontend points at its engine's traceback
            line += f" (the engine's error: {cause_line(others)[:300]})"
        fail(line)
    return done.stdout
