"""A learner killed mid-run resumes from its last checkpoint and the run loses nothing: real processes, started one by
one as a person would on a cluster (`rl-launch redis`, `rl-actor reward`, `rl-actor`, `rl-learner train`).

The learner is killed with SIGKILL between two checkpoints, restarted with ``--resume latest``, stopped with SIGTERM
(it finishes the step, saves and exits 0), and resumed once more to the end. Then the run is audited from what it
left: metrics.jsonl has steps 1..12 once each, and Redis shows every issued group trained exactly once in the
surviving history, or accounted for (dropped by a rule, still in flight, or lost after its re-issue).
"""

from __future__ import annotations

import json
import signal
from collections import Counter
from pathlib import Path

import pytest

from common.control import ControlPlane
from common.keys import connect
from common.seal import numbered_group_id, run_secret
from learner.checkpoint import complete_checkpoints
from tests.helpers.runs import step_rows
from tests.helpers.stack import BIN, DEMO, Processes, _steps, _wait

pytestmark = pytest.mark.e2e
RUN, STEPS, EVERY = "resume", 12, 3


def test_a_killed_learner_resumes_and_every_group_is_trained_once(tmp_path: Path, model_dir: Path) -> None:
    run_dir = tmp_path / RUN
    procs = Processes(tmp_path / "logs")
    try:
        steps = [f"learner.steps={STEPS}", f"checkpoint.every={EVERY}", "learner.group_deadline_s=60"]
        sets, run_args = procs.start_demo(run_dir, model_dir, *steps)
        config, url = DEMO, run_args[1]
        procs.start("actor-0", [BIN / "rl-actor", *run_args, "--id", "actor-0"], {"VLLM_CPU_OMP_THREADS_BIND": "1"})
        train = [BIN / "rl-learner", "train", config, *sets, "--redis", url]

        # 1. SIGKILL between two checkpoints (after step 7 or 8, or later if the polling misses those)
        first = procs.start("learner-1", train)
        _wait(lambda: len(steps := _steps(run_dir)) >= 7 and steps[-1] % EVERY, "steps 7-8", first)
        first.send_signal(signal.SIGKILL)
        first.wait()
        plane = ControlPlane(connect(url), RUN)
        killed_at = _steps(run_dir)[-1]
        saved = complete_checkpoints(run_dir / "checkpoints")[-1][0]
        trained_before = _trained(plane)
        to_retrain = {group for group, step in trained_before.items() if step > saved}
        assert saved < killed_at < STEPS and to_retrain, (saved, killed_at)

        # 2. resume; SIGTERM a few steps later: the step finishes, a checkpoint of it is saved, exit 0
        second = procs.start("learner-2", [*train, "--resume", "latest"])
        _wait(lambda: len(_steps(run_dir)) >= killed_at + 1, "a step after the resume", second)
        assert procs.stop("learner-2") == 0, procs.log("learner-2")[-3000:]
        stopped_at = _steps(run_dir)[-1]
        assert complete_checkpoints(run_dir / "checkpoints")[-1][0] == stopped_at

        # 3. resume to the end
        third = procs.start("learner-3", [*train, "--resume", "latest"])
        assert third.wait(900) == 0, procs.log("learner-3")[-3000:]

        rows = step_rows(run_dir)
        assert [int(r["step"]) for r in rows] == list(range(1, STEPS + 1))  # no gap, no duplicate
        resumed = rows[saved]  # the first line after the first resume
        assert resumed["restore/from_step"] == saved and resumed["restore/retrained"] == len(to_retrain)
        _audit(plane, trained_expected=STEPS * 16, retrained=to_retrain)
        assert "restore=1" in procs.log("actor-0")  # the actor loaded the restored weights
        pids = {name: procs.procs[name].pid for name in ("actor-0", "reward", "learner-1", "learner-2", "learner-3")}
        _audit_trail(run_dir, plane, url, resumed_from=[saved, stopped_at], pids=pids)
    finally:
        procs.stop_all()


def _audit_trail(run_dir: Path, plane: ControlPlane, url: str, resumed_from: list[int], pids: dict[str, int]) -> None:
    """audit.jsonl after three learners (one killed): every stream entry once and in order, who started and resumed
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
    assert list(dict.fromkeys(learners)) == [pids[f"learner-{n}"] for n in (1, 2, 3)]
    for process, kind, name in (("actor-0", "actor", "actor-0"), ("reward-0", "reward", "reward")):
        assert {(who["kind"], who["pid"]) for who in joined if who["process"] == process} == {(kind, pids[name])}
        assert all(who["host"] for who in joined)
    written = of("checkpoint.written")
    assert {*resumed_from, STEPS} <= {line["step"] for line in written}
    assert all(len(line["manifest_sha256"]) == 64 for line in written)
    assert [line["step"] for line in of("checkpoint.verified")] == resumed_from
    assert [line["step"] for line in of("checkpoint.restored")] == resumed_from
    assert [line["outcome"] for line in of("run.finished")] == ["stopped", "completed"]  # the first was killed
    published = {(line["version"], line["digest"]) for line in of("weights.published")}  # a resume re-sends some
    assert set(range(1, STEPS + 1)) <= {version for version, _ in published}
    assert all(len(digest) == 16 for _, digest in published)
    actor = [line for line in of("weights.loaded") if line["who"]["process"] == "actor-0"]
    assert actor and {(line["version"], line["digest"]) for line in actor} <= published
    assert not of("weights.refused")


def _trained(plane: ControlPlane) -> dict[str, int]:
    raw = plane.client.hgetall(f"asyncrl:{RUN}:trained")
    return {group.decode(): int(step) for group, step in raw.items()}


def _audit(plane: ControlPlane, trained_expected: int, retrained: set[str]) -> None:
    """Every issued group trained once in the surviving history, or accounted for; none trained twice."""
    trained = _trained(plane)
    per_step = Counter(trained.values())
    assert per_step == dict.fromkeys(range(1, STEPS + 1), trained_expected // STEPS), per_step  # twice = one short
    assert len(trained) == trained_expected
    assert retrained <= set(trained)  # trained again after the kill, not lost
    done = {g.decode() for g in plane.client.smembers(plane.keys.done)}
    counts = plane.prompts.dispatch_counts()
    assert set(trained) <= done
    assert len(done - set(trained)) == counts.get("discarded", 0) + counts.get("restore_lost", 0)
    assert counts.get("restore_retrained", 0) == len(retrained)
    secret = run_secret(plane.client, plane.keys)
    issued = {numbered_group_id(RUN, n, secret) for n in range(counts["created"])}
    in_flight = {g.decode() for g in plane.client.hkeys(plane.keys.inflight)}
    assert len(issued - done - in_flight) == counts.get("lost", 0)  # lost after a re-issue, counted
