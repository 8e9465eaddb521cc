"""How the tests and ``bench/gpu_check.py`` start learner ranks: ``torchrun`` on loopback, from the repository root,
in an environment without the variables of a launcher this process may itself run under."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from common.redis_server import free_port

REPO = Path(__file__).resolve().parents[2]
LAUNCHER_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def torchrun_command(nproc: int, module: str, *args: str) -> list[str]:
    """``torchrun --nproc_per_node nproc -m module args`` with a free loopback port."""
    torchrun = Path(sys.executable).parent / "torchrun"
    command = [str(torchrun), "--nproc_per_node", str(nproc), "--master_addr", "127.0.0.1"]
    return [*command, "--master_port", str(free_port()), "-m", module, *args]


def launcher_env(**extra: str) -> dict[str, str]:
    """This process's environment without a launcher's variables, plus ``extra``."""
    return {**{k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS}, **extra}
