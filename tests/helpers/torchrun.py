"""How the tests and ``bench/gpu_check.py`` start learner ranks: ``torchrun`` on loopback, from the repository root,
in an environment without the variables of a launcher this process may itself run under; and which of a launcher's
children is which rank."""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path

from asyncrl.common.observability.procs import child_pids
from asyncrl.common.plane.redis_server import free_port

REPO = Path(__file__).resolve().parents[2]
LAUNCHER_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


BIN = Path(sys.executable).parent


def _launcher(nproc: int) -> list[str]:
    """``torchrun`` of ``nproc`` ranks on loopback, with a free port."""
    return [str(BIN / "torchrun"), "--nproc_per_node", str(nproc), "--master_addr", "127.0.0.1",
            "--master_port", str(free_port())]  # fmt: skip


def torchrun_command(nproc: int, module: str, *args: str) -> list[str]:
    """``torchrun --nproc_per_node nproc -m module args`` with a free loopback port."""
    return [*_launcher(nproc), "-m", module, *args]


def learner_command(nproc: int, *args: object) -> list[str]:
    """``torchrun … --no-python rl-learner args``: the learner over ``nproc`` ranks, as a person starts it."""
    return [*_launcher(nproc), "--no-python", str(BIN / "rl-learner"), *map(str, args)]


def rank_pid(launcher_pid: int, rank: int) -> int | None:
    """The PID of the launcher's child whose environment says ``RANK=rank``."""
    for pid in child_pids(launcher_pid):
        with contextlib.suppress(OSError):  # gone meanwhile
            if f"RANK={rank}".encode() in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
                return pid
    return None


def launcher_env(**extra: str) -> dict[str, str]:
    """This process's environment without a launcher's variables, plus ``extra``."""
    return {**{k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS}, **extra}
