"""A learner of two ranks killed mid-run, twice, resumes from its last checkpoint and the run loses nothing: real
processes started one by one as a person would on a multi-GPU host (`rl-launch redis`, `rl-actor reward`, `rl-actor`,
``torchrun --nproc-per-node 2 --no-python rl-learner train``, ZeRO-3 over gloo).

1. Rank 1 is killed with SIGKILL between two checkpoints: the run stops (every rank and the launcher exit, none
   hangs) and rank 0 says which rank it lost and how to resume. That learner profiles its step 2 (``--profile 2``).
2. ``--resume latest`` with two ranks; the whole learner (torchrun and both ranks) is then killed with SIGKILL
   between two checkpoints, as when its host dies: nothing of it gets to clean up.
3. Resumed again, then stopped with SIGTERM to rank 0: the step finishes, a checkpoint of it is saved, exit 0.
4. Resumed once more, to the end.

Then the run is audited from what it left: metrics.jsonl has steps 1..N once each; Redis shows every issued group
trained exactly once in the surviving history, or accounted for (dropped by a rule, still in flight, or lost after its
re-issue); the actor loaded the weights the two ranks sent — gathered bucket by bucket under ZeRO-3 — the restored
ones included; audit.jsonl tells who started and resumed the run. The equality of two ranks and one on the same
batches is tests/integration/test_learner_ranks.py's.
"""

from __future__ import annotations

import json
import os
import re
import signal
from collections import Counter
from pathlib import Path

import pytest

from asyncrl.common.plane.control import ControlPlane
from asyncrl.common.plane.keys import connect
from asyncrl.common.wire.seal import numbered_group_id, run_secret
from asyncrl.learner.checkpoint_format import open_checkpoint
from asyncrl.learner.checkpoint_history import complete_checkpoints
from tests.helpers.runs import step_rows
from tests.helpers.stack import DEMO, Processes, _steps, _wait, running
from tests.helpers.torchrun import learner_command, rank_pid

pytestmark = pytest.mark.e2e
RUN, STEPS, EVERY, GROUPS = "resume", 12, 2, 16


def between_checkpoints(run_dir: Path, after: int) -> bool:
    """Step ``after`` or later reached, and the last step is not one a checkpoint is saved at."""
    steps = _steps(run_dir)
    return len(steps) >= after and steps[-1] % EVERY != 0


def test_a_two_rank_learner_killed_twice_resumes_and_every_group_is_trained_once(
    tmp_path: Path, model_dir: Path
) -> None:
    run_dir = tmp_path / RUN
    procs = Processes(tmp_path / "logs")
    try:
        steps = [f"learner.steps={STEPS}", f"checkpoint.every={EVERY}", "learner.group_deadline_s=60"]
        sets, run_args = procs.start_demo(run_dir, model_dir, "learner.zero_stage=3", *steps)
        config, url = DEMO, run_args[1]
        procs.start_actor("actor-0", run_args, core=1)
        plane = ControlPlane(connect(url), RUN)
        train = ["train", config, *sets, "--redis", url]
        leaders: dict[str, int] = {}

        def start(name: str, *extra: str):
            proc = procs.start(name, learner_command(2, *train, *extra))
            leaders[name] = _wait(lambda: rank_pid(proc.pid, 0), f"rank 0 of {name}", proc)
            return proc

        # 1. kill -9 of rank 1 after a checkpoint and before the next
        first = start("learner-1", "--profile", "2")
        _wait(lambda: between_checkpoints(run_dir, 3), "step 3 or 5", first)
        follower = rank_pid(first.pid, 1)
        assert follower is not None, procs.log("learner-1")[-3000:]
        os.kill(follower, signal.SIGKILL)
        assert first.wait(300) != 0  # the launcher and rank 0 end, nobody waits on the dead rank
        log = procs.log("learner-1")
        assert "a learner rank failed; stopping every rank rank=0" in log and "--resume latest" in log, log[-3000:]
        profile = (run_dir / "profile-step-2.txt").read_text()  # rank 0's step 2, under cProfile
        assert "most cumulative time" in profile and "loop.py" in profile and "train_step" in profile
        assert (run_dir / "profile-step-2.prof").stat().st_size > 0
        first_saved, first_retrain = _killed(run_dir, plane)
        assert open_checkpoint(complete_checkpoints(run_dir / "checkpoints")[-1][1]).state.world_size == 2

        # 2. resume; once it saved a checkpoint of its own, SIGKILL to torchrun and both ranks at once
        second = start("learner-2", "--resume", "latest")
        _wait(lambda: between_checkpoints(run_dir, first_saved + EVERY + 1), "a checkpoint after the resume", second)
        ranks = [rank_pid(second.pid, rank) for rank in (0, 1)]  # each in a session of its own (torchrun's doing)
        for pid in (second.pid, *ranks):
            os.kill(pid, signal.SIGKILL)
        second.wait()
        _wait(lambda: not any(map(running, ranks)), "both ranks gone", timeout_s=60)
        second_saved, second_retrain = _killed(run_dir, plane)
        assert second_saved > first_saved

        # 3. resume; SIGTERM to rank 0 a step later: the step finishes, a checkpoint of it is saved, exit 0
        third = start("learner-3", "--resume", "latest")
        _wait(lambda: len(_steps(run_dir)) >= second_saved + 1 and _resumed(run_dir, second_saved), "a step", third)
        os.kill(leaders["learner-3"], signal.SIGTERM)
        assert third.wait(300) == 0, procs.log("learner-3")[-3000:]
        stopped_at = _steps(run_dir)[-1]
        assert complete_checkpoints(run_dir / "checkpoints")[-1][0] == stopped_at

        # 4. resume to the end
        fourth = start("learner-4", "--resume", "latest")
        assert fourth.wait(900) == 0, procs.log("learner-4")[-3000:]

        rows = step_rows(run_dir)
        assert [int(r["step"]) for r in rows] == list(range(1, STEPS + 1))  # no gap, no duplicate
        for saved, retrain in ((first_saved, first_retrain), (second_saved, second_retrain)):
            resumed = rows[saved]  # the first line after that resume
            assert resumed["restore/from_step"] == saved and resumed["restore/retrained"] == len(retrain)
        _audit(plane, retrained=[first_retrain, second_retrain])
        actor_log = procs.log("actor-0")
        assert re.search(rf"loaded new weights version={STEPS} .*restore=3", actor_log)  # the third resume's
        assert "learner rank following rank 0 rank=1 world_size=2" in procs.log("learner-4")
        pids = {"actor-0": procs.procs["actor-0"].pid, "reward": procs.procs["reward"].pid, **leaders}
        _audit_trail(run_dir, plane, url, resumed_from=[first_saved, second_saved, stopped_at], pids=pids)
    finally:
        procs.stop_all()


def _killed(run_dir: Path, plane: ControlPlane) -> tuple[int, set[str]]:
    """After a learner was killed: its last complete checkpoint, and the groups it trained after that (to retrain)."""
    killed_at = _steps(run_dir)[-1]
    saved = complete_checkpoints(run_dir / "checkpoints")[-1][0]
    to_retrain = {group for group, step in _trained(plane).items() if step > saved}
    assert saved < killed_at < STEPS and to_retrain, (saved, killed_at)
    return saved, to_retrain


def _resumed(run_dir: Path, saved: int) -> bool:
    """A step after the resume from ``saved`` is in metrics.jsonl (its row says where it restored from)."""
    return any(row.get("restore/from_step") == saved for row in step_rows(run_dir))


def _audit_trail(run_dir: Path, plane: ControlPlane, url: str, resumed_from: list[int], pids: dict[str, int]) -> None:
    """audit.jsonl after four learners (two killed): every stream entry once and in order, who started and resumed
    the run with which config, who joined, the checkpoints, and never the Redis password."""
    text = (run_dir / "audit.jsonl").read_text()
    assert url.split("@")[0].rsplit(":", 1)[1] not in text  # redis://:<password>@host
    lines = [json.loads(line) for line in text.splitlines()]
    stream = [entry_id.decode() for entry_id, _ in plane.client.xrange(plane.keys.audit)]
    assert [line["id"] for line in lines] == stream[: len(lines)]  # no duplicate, no gap

    def of(event: str) -> list[dict]:
        return [line for line in lines if line["event"] == event]

    [started], resumed = of("run.started"), of("run.resumed")
    assert len(started["config_hash"]) == 64 and {line["config_hash"] for line in resumed} == {started["config_hash"]}
    assert [line["from_step"] for line in resumed] == resumed_from
    joined = [line["who"] for line in of("process.joined")]
    learners = [who["pid"] for who in joined if who["process"] == "learner"]
    assert list(dict.fromkeys(learners)) == [pids[f"learner-{n}"] for n in (1, 2, 3, 4)]  # rank 0 of each
    for process, kind, name in (("actor-0", "actor", "actor-0"), ("reward-0", "reward", "reward")):
        assert {(who["kind"], who["pid"]) for who in joined if who["process"] == process} == {(kind, pids[name])}
        assert all(who["host"] for who in joined)
    written = of("checkpoint.written")
    assert {*resumed_from, STEPS} <= {line["step"] for line in written}
    assert all(len(line["manifest_sha256"]) == 64 for line in written)
    assert [line["step"] for line in of("checkpoint.verified")] == resumed_from
    assert [line["step"] for line in of("checkpoint.restored")] == resumed_from
    # the first ended itself when its rank 1 was gone; the second was killed whole and says nothing
    assert [line["outcome"] for line in of("run.finished")] == ["failed", "stopped", "completed"]
    published = {(line["version"], line["digest"]) for line in of("weights.published")}  # a resume re-sends some
    assert set(range(1, STEPS + 1)) <= {version for version, _ in published}
    assert all(len(digest) == 16 for _, digest in published)
    actor = [line for line in of("weights.loaded") if line["who"]["process"] == "actor-0"]
    assert actor and {(line["version"], line["digest"]) for line in actor} <= published
    assert not of("weights.refused")


def _trained(plane: ControlPlane) -> dict[str, int]:
    raw = plane.client.hgetall(plane.keys.trained)
    return {group.decode(): int(step) for group, step in raw.items()}


def _audit(plane: ControlPlane, retrained: list[set[str]]) -> None:
    """Every issued group trained once in the surviving history, or accounted for; none trained twice; the groups
    each resume had to train again were (``retrained``: one set per resume after a kill)."""
    trained = _trained(plane)
    assert Counter(trained.values()) == dict.fromkeys(range(1, STEPS + 1), GROUPS)  # twice = one short
    assert len(trained) == STEPS * GROUPS
    assert set().union(*retrained) <= set(trained)  # trained again after the kill, not lost
    done = {g.decode() for g in plane.client.smembers(plane.keys.done)}
    counts = plane.prompts.dispatch_counts()
    assert set(trained) <= done
    assert len(done - set(trained)) == counts.get("discarded", 0) + counts.get("restore_lost", 0)
    assert counts.get("restore_retrained", 0) == sum(map(len, retrained))
    secret = run_secret(plane.client, plane.keys)
    issued = {numbered_group_id(RUN, n, secret) for n in range(counts["created"])}
    in_flight = {g.decode() for g in plane.client.hkeys(plane.keys.inflight)}
    assert len(issued - done - in_flight) == counts.get("lost", 0)  # lost after a re-issue, counted
