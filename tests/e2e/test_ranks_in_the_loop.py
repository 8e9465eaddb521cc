"""Two learner ranks in the loop: ``torchrun --nproc-per-node 2 --no-python rl-learner train`` (ZeRO-3; gloo)
against a real actor (vLLM) and reward worker, as a person would run it on a multi-GPU host.

Rank 1 is killed with SIGKILL between two checkpoints: the run stops (every rank and the launcher exit, none hangs)
and rank 0 says which rank it lost and how to resume. ``--resume latest`` with two ranks then trains to the end:
steps 1..N once each in metrics.jsonl, each step's groups trained once in the surviving history (Redis), and the
actor loaded the weights the two ranks sent — gathered bucket by bucket under ZeRO-3 — the restored ones included.
The first learner profiles its step 2 (``--profile 2``). The equality of two ranks and one on the same batches is
tests/integration/test_learner_ranks.py's.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
from collections import Counter
from pathlib import Path

import pytest

from common.control import ControlPlane
from common.keys import connect
from common.procs import child_pids
from common.redis_server import free_port
from learner.checkpoint import complete_checkpoints, open_checkpoint
from tests.helpers.runs import step_rows
from tests.helpers.stack import BIN, DEMO, Processes, _steps, _wait

pytestmark = pytest.mark.e2e
RUN, STEPS, EVERY, GROUPS = "ranks", 6, 2, 16


def torchrun(nproc: int, *args: object) -> list[object]:
    launcher = [BIN / "torchrun", "--nproc-per-node", nproc, "--master-addr", "127.0.0.1"]
    return [*launcher, "--master-port", free_port(), "--no-python", BIN / "rl-learner", *args]


def rank_pid(launcher_pid: int, rank: int) -> int | None:
    """The PID of the launcher's child whose environment says ``RANK=rank``."""
    for pid in child_pids(launcher_pid):
        with contextlib.suppress(OSError):  # gone meanwhile
            if f"RANK={rank}".encode() in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
                return pid
    return None


def test_two_ranks_train_in_the_loop_and_resume_after_one_is_killed(tmp_path: Path, model_dir: Path) -> None:
    """ZeRO-3, the stage that gathers each bucket before a broadcast; two ranks train like one under ZeRO-2 as well
    in tests/integration/test_learner_ranks.py."""
    zero_stage = 3
    run_dir = tmp_path / RUN
    procs = Processes(tmp_path / "logs")
    try:
        steps = [f"learner.steps={STEPS}", f"checkpoint.every={EVERY}", "learner.group_deadline_s=60"]
        sets, run_args = procs.start_demo(run_dir, model_dir, f"learner.zero_stage={zero_stage}", *steps)
        config, url = DEMO, run_args[1]
        procs.start("actor-0", [BIN / "rl-actor", *run_args, "--id", "actor-0"], {"VLLM_CPU_OMP_THREADS_BIND": "1"})
        train = ["train", config, *sets, "--redis", url]

        # 1. kill -9 of rank 1 after a checkpoint and before the next
        first = procs.start("learner-1", torchrun(2, *train, "--profile", "2"))
        _wait(lambda: len(steps := _steps(run_dir)) >= 3 and steps[-1] % EVERY, "step 3 or 5", first)
        follower = rank_pid(first.pid, 1)
        assert follower is not None, procs.log("learner-1")[-3000:]
        os.kill(follower, signal.SIGKILL)
        assert first.wait(300) != 0  # the launcher and rank 0 end, nobody waits on the dead rank
        log = procs.log("learner-1")
        assert "a learner rank failed; stopping every rank rank=0" in log and "--resume latest" in log, log[-3000:]
        killed_at = _steps(run_dir)[-1]
        profile = (run_dir / "profile-step-2.txt").read_text()  # rank 0's step 2, under cProfile
        assert "most cumulative time" in profile and "loop.py" in profile and "train_step" in profile
        assert (run_dir / "profile-step-2.prof").stat().st_size > 0
        saved = complete_checkpoints(run_dir / "checkpoints")[-1]
        assert saved[0] < STEPS and open_checkpoint(saved[1]).state.world_size == 2

        # 2. resume with two ranks to the end
        second = procs.start("learner-2", torchrun(2, *train, "--resume", "latest"))
        assert second.wait(900) == 0, procs.log("learner-2")[-3000:]

        assert [int(r["step"]) for r in step_rows(run_dir)] == list(range(1, STEPS + 1)), killed_at
        plane = ControlPlane(connect(url), RUN)
        trained = {g.decode(): int(s) for g, s in plane.client.hgetall(f"asyncrl:{RUN}:trained").items()}
        assert Counter(trained.values()) == dict.fromkeys(range(1, STEPS + 1), GROUPS)  # once each, none twice
        actor_log = procs.log("actor-0")
        assert re.search(rf"loaded new weights version={STEPS} .*restore=1", actor_log)  # the last, of the resume
        assert "learner rank following rank 0 rank=1 world_size=2" in procs.log("learner-2")
    finally:
        procs.stop_all()
