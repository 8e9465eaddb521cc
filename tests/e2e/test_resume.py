"""A LoRA learner of two ranks killed mid-run, twice, resumes from its last checkpoint and the run loses nothing, with
forged rollouts sent into it before its first step. Real processes started one by one as a person would on a
multi-GPU host (`rl-launch redis`, `rl-actor reward`, `rl-actor`, ``torchrun --nproc-per-node 2 --no-python
rl-learner train``, ZeRO-3 over gloo), training the demo through configs/lora.toml's adapters: each version sends the
adapters alone, which the actor's engine serves as its LoRA adapter.

0. Forgeries, while the learner waits for its first batch (the actor starts after them, so the real groups behind
   the ids they hijack come back later): a peer that reaches the reward worker's socket sends a group whose ``task``
   is an import path (that once ran a shell command in the reward worker), a group under an id the run never issued,
   a hijacked live id with its own prompt, and — as a forger who somehow read the live group's issue record — the
   right prompt with 12 KB responses, with a token version from the future, and with the wrong number of responses;
   and, as a reward worker that checked nothing would, three of them straight into the replay stream. Each is refused
   with its reason and dead-lettered, nothing is trained on them. That forger holds the run secret (an insider who
   reached the run's Redis); a stranger on the same machine who sends the same groups, and a right-looking group
   under every live id, without it is refused at the handshake, before any of them is read.
1. Rank 1 is killed with SIGKILL between two checkpoints: the run stops (every rank and the launcher exit, none
   hangs) and rank 0 says which rank it lost and how to resume. That learner profiles its step 2 (``--profile 2``).
2. ``--resume latest`` with two ranks; the whole learner (torchrun and both ranks) is then killed with SIGKILL
   between two checkpoints, as when its host dies: nothing of it gets to clean up.
3. Resumed again, then stopped with SIGTERM to rank 0: the step finishes, a checkpoint of it is saved, exit 0.
4. Resumed once more, to the end; the reward worker and the actor then exit 0 by themselves. On the way, the actor
   receives version :data:`TAMPERED`'s adapters with one bit of a bucket flipped after the broadcast and before its
   digest check, as if altered in transit (tests/helpers/tamper/, on the actor's ``PYTHONPATH``): it refuses that
   version (its log, ``weights.refused`` in the audit trail), keeps serving the adapters it had, and loads the next.

Then the run is audited from what it left: metrics.jsonl has steps 1..N once each and its reward rose; Redis shows every
issued group trained exactly once in the surviving history, or accounted for (dropped by a rule, still in flight, or
lost after its re-issue), the real groups behind the hijacked ids included, and nothing but the forgeries dead-lettered;
the actor loaded the adapters the two ranks sent — gathered under ZeRO-3 — the restored ones included, and all but the
tampered version; audit.jsonl tells who started and resumed the run, and which version the actor refused. Last, the
run's final checkpoint as users take it: ``rl-learner eval --checkpoint latest`` serves its merged ``hf/`` export on
vLLM and writes every greedy answer (``--samples``), and transformers, loading the PEFT ``adapter/`` folder over the
base model and the ``hf/`` folder, answers every prompt the same (tests/helpers/lora_exports.py). The equality of two
ranks and one on the same batches is tests/integration/learner/test_learner_ranks.py's; a full-weight run's resume is
tests/e2e/test_redis_restart.py's.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import signal
import tomllib
from collections import Counter
from pathlib import Path

import numpy as np
from transformers import AutoTokenizer

from asyncrl.common.plane.control import ControlPlane
from asyncrl.common.plane.keys import connect
from asyncrl.common.plane.replay import ReplayWriter
from asyncrl.common.plane.run_secret import run_seal, run_secret
from asyncrl.common.rewards.verifiers import bind_verifier
from asyncrl.common.transport.channel import ChannelBlocked, PushChannel
from asyncrl.common.wire.messages import RolloutGroup, ScoredGroup
from asyncrl.common.wire.seal import numbered_group_id
from asyncrl.learner.checkpoint.format import open_checkpoint
from asyncrl.learner.checkpoint.history import complete_checkpoints
from tests.helpers.forgery import NEVER_ISSUED, check_refusals, forgeries, queued_ids, reward_endpoints, right_texts
from tests.helpers.lora_exports import base_accuracy, disagreements
from tests.helpers.runs import step_rows
from tests.helpers.scrape import metric
from tests.helpers.stack import BIN, DEMO, ROOT, Processes, _steps, _wait, running
from tests.helpers.torchrun import learner_command, rank_pid

RUN, STEPS, EVERY, GROUPS = "resume", 36, 2, 16
LORA_PRESET = tomllib.loads((ROOT / "configs/lora.toml").read_text())
LORA = [f"lora.{key}={json.dumps(value)}" for key, value in LORA_PRESET["lora"].items()]
LORA.append(f"learner.lr={LORA_PRESET['learner']['lr']}")
"""configs/lora.toml's adapters and learning rate."""


TAMPER = ROOT / "tests/helpers/tamper"
TAMPERED = STEPS - 6
"""The version whose adapters the actor receives with one bit flipped: broadcast by the last learner (the third resume
stops a step or two after the second's checkpoint, well before it), so it is sent once, and the version before it was
loaded clean."""
EVAL_PROMPTS = 64
"""configs/demo.toml's eval.limit: the greedy answers compared across vLLM and the two exports."""


def mean_reward(rows: list[dict]) -> float:
    return sum(r["rollout/reward_mean"] for r in rows) / len(rows)


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
        sets, run_args = procs.start_demo(run_dir, model_dir, "learner.zero_stage=3", *LORA, *steps)
        config, url = DEMO, run_args[1]
        plane = ControlPlane(connect(url), RUN)
        train = ["train", config, *sets, "--redis", url]
        leaders: dict[str, int] = {}

        def start(name: str, *extra: str):
            proc = procs.start(name, learner_command(2, *train, *extra))
            leaders[name] = _wait(lambda: rank_pid(proc.pid, 0), f"rank 0 of {name}", proc)
            return proc

        # 0. forgeries while the first learner waits for its first batch, then the actor
        first = start("learner-1", "--profile", "2")
        sent = strike(plane, first)
        procs.start_actor("actor-0", run_args, core=1, env=tampering(TAMPERED))

        # 1. kill -9 of rank 1 after a checkpoint and before the next
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
        assert stopped_at < TAMPERED - 1  # the tampered version and the one before it come from the last learner

        # 4. resume to the end: the run wants actors while it goes on (the autoscaling signal), none once finished
        fourth = start("learner-4", "--resume", "latest")
        _wait(lambda: plane.run.actors_wanted() >= 1, "the actors wanted", fourth)
        _wait(lambda: "refused new weights" in procs.log("actor-0"), f"version {TAMPERED} refused", fourth)
        [actor] = [h for h in plane.registry.processes()[0] if h.process_id == "actor-0"]
        assert metric(actor, "asyncrl_actor_weight_digest_mismatches_total") == 1  # what the alert reads
        assert fourth.wait(900) == 0, procs.log("learner-4")[-3000:]
        assert plane.run.actors_wanted() == 0
        for name in ("reward", "actor-0"):  # the run finished: both exit 0 by themselves
            assert procs.procs[name].wait(60) == 0, procs.log(name)[-3000:]
            assert "run finished; the" in procs.log(name)

        rows = step_rows(run_dir)
        assert [int(r["step"]) for r in rows] == list(range(1, STEPS + 1))  # no gap, no duplicate
        first, last = mean_reward(rows[:10]), mean_reward(rows[-10:])
        for saved, retrain in ((first_saved, first_retrain), (second_saved, second_retrain)):
            resumed = rows[saved]  # the first line after that resume
            assert resumed["restore/from_step"] == saved and resumed["restore/retrained"] == len(retrain)
        _audit(plane, retrained=[first_retrain, second_retrain])
        check_refusals(plane, sent)  # each forgery refused where expected, and nothing else dead-lettered
        hijacked = {group.group_id for _, _, group in sent} - {NEVER_ISSUED.format(run=RUN)}
        trained, in_flight = set(_trained(plane)), {g.decode() for g in plane.client.hkeys(plane.keys.inflight)}
        assert hijacked <= trained | in_flight  # the real groups behind hijacked ids were not pushed out
        assert sum(r.get("groups/refused", 0) for r in rows) == 4  # the future version and the replay three
        assert "refused a scored group that does not match its issue record" in procs.log("learner-1")
        assert "refused a rollout group without scoring it" in procs.log("reward")
        actor_log = procs.log("actor-0")
        assert re.search(rf"loaded new weights version={STEPS} .*restore=3", actor_log)  # the third resume's
        _refused_once(actor_log, TAMPERED)
        assert "learner rank following rank 0 rank=1 world_size=2" in procs.log("learner-4")
        pids = {"actor-0": procs.procs["actor-0"].pid, "reward": procs.procs["reward"].pid, **leaders}
        _audit_trail(run_dir, plane, url, resumed_from=[first_saved, second_saved, stopped_at], pids=pids)

        # 5. the last checkpoint's exports: vLLM serves hf/; transformers loads adapter/ (over the base) and hf/
        answers = run_dir / "answers.jsonl"
        offline = procs.start(
            "offline", [BIN / "rl-learner", "eval", config, *sets, "--set", "eval.temperature=0",
                        "--set", "eval.num_samples=1", "--checkpoint", "latest", "--json", "--samples", answers],
        )
        assert offline.wait(600) == 0, procs.log("offline")[-3000:]
        said = procs.log("offline").strip().splitlines()  # what a person sees: the figures, vLLM's lines in eval.log
        assert len(said) == 1 and said[0].startswith('{"model"'), said[:20]
        figures = json.loads(said[0])
        print("offline eval of the last checkpoint:", figures)
        last_checkpoint = run_dir / "checkpoints" / f"step-{STEPS}"
        assert figures["model"] == str(last_checkpoint / "hf")
        assert (figures["eval/groups"], figures["eval/k"]) == (EVAL_PROMPTS, 1)
        assert len(answers.read_text().splitlines()) == EVAL_PROMPTS
        eos = AutoTokenizer.from_pretrained(model_dir).eos_token_id
        assert not disagreements(model_dir, last_checkpoint, answers, max_new_tokens=6, eos=eos)
        started = base_accuracy(model_dir, answers, max_new_tokens=6, eos=eos, verifier=bind_verifier("arithmetic"))
        skill = figures["eval/accuracy"] - started
        print(f"reward {first:.3f} -> {last:.3f}; greedy accuracy {started:.3f} -> {figures['eval/accuracy']:.3f}")
        assert last > first + 0.05 or skill > 0.06, (  # LoRA in 36 steps learns less than the demo: one clear rise
            f"the adapters did not learn: reward {first:.3f} -> {last:.3f}, greedy accuracy {started:.3f} -> "
            f"{figures['eval/accuracy']:.3f}"
        )
    finally:
        procs.stop_all()


def tampering(version: int) -> dict[str, str]:
    """The environment of an actor whose engine receives ``version``'s adapters with one bit flipped in transit
    (tests/helpers/tamper/sitecustomize.py, first on its ``PYTHONPATH``; the spike's folder is not needed here)."""
    path = [str(TAMPER), str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]
    return {"PYTHONPATH": os.pathsep.join(path), "ASYNCRL_TAMPER_VERSION": str(version)}


def _refused_once(actor_log: str, version: int) -> None:
    """The actor's log: ``version`` arrived altered and was refused while the version before it went on serving, it
    was never loaded, and the next version replaced the one that had served through it."""
    assert f"planted a tampering: version {version} bucket 0 " in actor_log, actor_log[-3000:]
    refusals = re.findall(r"refused new weights: .* version=(\d+) serving=(\d+) ", actor_log)
    assert refusals == [(str(version), str(version - 1))], refusals
    assert not re.search(rf"loaded new weights version={version} ", actor_log)
    [line] = re.findall(rf"loaded new weights version={version + 1} previous=\d+ .*", actor_log)
    assert f"previous={version - 1} " in line, line
    print(f"refused version {version} while serving {version - 1}; loaded {version + 1} next: {line}")


def strike(plane: ControlPlane, learner) -> list[tuple[str, str, RolloutGroup]]:
    """The forgeries of :func:`tests.helpers.forgery.forgeries`, sent while no actor runs yet; returns them once every
    one was refused (by the reward worker or the learner) and the stranger was refused at the handshake, with none of
    its messages read."""
    _wait(lambda: len(queued_ids(plane, 4)) == 4, "the first prompt groups released", learner)
    _wait(lambda: reward_endpoints(plane), "the reward worker's registration", learner)  # it may start last
    [endpoint] = reward_endpoints(plane)
    sent = forgeries(plane)
    # An insider: it holds the run secret (it reached the run's Redis), so its messages pass the seal and meet the
    # issue-record checks. A stranger on the same machine sends the same groups and more without the run's credential:
    # its connection fails the CURVE handshake, so none of them is read. Between two of its failed handshakes its socket
    # may have no connection to queue on, and then a send blocks: that too is the stranger refused, so a blocked send
    # is given up at once (a tenth of a second: dozens of sprayed groups, each blocking, once held the strike for 40 s).
    push = PushChannel("rollouts", send_timeout_s=10, seal=run_seal(plane.client, plane.keys, "rollouts"))
    push.connect(endpoint)
    stranger = PushChannel("rollouts", send_timeout_s=0.1)
    stranger.connect(endpoint)

    def from_stranger(group: RolloutGroup) -> None:
        with contextlib.suppress(ChannelBlocked):
            stranger.send(group)

    try:
        for _, _, group in (f for f in sent if f[0] == "socket"):
            push.send(group)
            from_stranger(group)
        sprayed = [dataclasses.replace(g, texts=["19"] * 8) for g in right_texts(plane)]
        for group in sprayed:
            from_stranger(group)  # right answers over other token ids, under every id it knows is in flight
        rigged = [ScoredGroup(rollout=g, rewards=np.ones(8, np.float32)) for w, _, g in sent if w == "replay"]
        ReplayWriter(plane.client, plane.keys).add(rigged)
        # the socket closes with linger 0: wait until every forgery was refused by the worker or the learner
        _wait(lambda: plane.client.xlen(plane.keys.dead) >= len(sent), "every refusal", learner)
    finally:
        push.close()
        stranger.close()
    [worker] = [h for h in plane.registry.processes()[0] if h.kind == "reward"]
    _wait(lambda: metric(worker, "asyncrl_channel_refused_handshakes_total") >= 1, "the stranger refused", learner)
    assert metric(worker, "asyncrl_channel_unsealed_messages_total") == 0  # nothing of the stranger's was read
    return sent


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
    [refused] = of("weights.refused")  # the tampered version, by the actor, and nothing else
    assert (refused["version"], refused["who"]["process"]) == (TAMPERED, "actor-0"), refused
    assert refused["reason"].startswith("bucket 0 ") and (TAMPERED, refused["digest"]) in published, refused
    loaded = {line["version"] for line in actor}
    assert TAMPERED not in loaded and {TAMPERED - 1, TAMPERED + 1} <= loaded


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
