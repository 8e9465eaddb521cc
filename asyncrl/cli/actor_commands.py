"""What the learner's commands ask of vLLM, which the learner never imports (DESIGN.md's dependency rule): an
``rl-actor`` command on the same config and overrides, in a child process, whose one ``error:`` line (or, when vLLM's
engine died, the engine's own error) becomes the command's refusal."""

from __future__ import annotations

from pathlib import Path


def rl_actor_command(command: str, config: Path | None, set_: list[str] | None) -> list[str]:
    """The command line of ``rl-actor COMMAND`` on the same config and overrides: what the learner asks of vLLM, in a
    process of its own (the learner never imports vLLM)."""
    import sys

    overrides = [a for o in set_ or [] for a in ("--set", o)]
    return [str(Path(sys.executable).parent / "rl-actor"), command, *([str(config)] if config else []), *overrides]


def check_engine_serving(config: Path | None, set_: list[str] | None) -> None:
    """Where vLLM is installed, whether it could run the config — ``[rollout]``'s settings, ``[lora]`` on the model,
    the attention head size on CPUs — without building an engine: `rl-actor check-settings` in a child process (the
    learner never imports vLLM), its one line and exit 2 when not. Without vLLM here, each actor checks at its
    start."""
    import importlib.util

    if importlib.util.find_spec("vllm") is not None:
        rl_actor_check("check-settings", config, set_)


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
