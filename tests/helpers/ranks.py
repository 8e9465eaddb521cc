"""Learner ranks under test: ``torchrun`` of a helper module on loopback (gloo, CPU), ended with its ranks, the test
failed with the output's tail unless every rank exits 0. Shared by the learner's integration tests."""

from __future__ import annotations

import os
import signal
import subprocess

from tests.helpers.torchrun import REPO, launcher_env, torchrun_command

RANKS_TIMEOUT_S = 300  # imports and engine start of two ranks on two shared cores take ≈ 20 s


def stop(proc: subprocess.Popen[str]) -> None:
    """End the launcher and its ranks: they run in their own session, so the group id is the launcher's pid."""
    if proc.poll() is not None:
        return
    for sig, wait_s in ((signal.SIGTERM, 10), (signal.SIGKILL, 10)):
        os.killpg(proc.pid, sig)
        try:
            proc.wait(wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


def run_ranks(module: str, nproc: int, *args: str) -> str:
    """``torchrun --nproc_per_node nproc -m module args`` from the repository root on loopback (gloo, CPU); fails
    the test with the output's tail unless every rank exits 0. Returns the output."""
    command = torchrun_command(nproc, module, *args)
    env = launcher_env(DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    proc = subprocess.Popen(
        command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        output, _ = proc.communicate(timeout=RANKS_TIMEOUT_S)
    finally:
        stop(proc)
    assert proc.returncode == 0, output[-6000:]
    return output
