"""Forged rollouts: a peer that reaches a reward worker's socket sends forged rollouts into a live
run (real processes: `rl-launch redis`, `rl-actor reward`, `rl-actor`, `rl-learner train`).

The forger strikes while the learner waits for its first batch; the actor starts after, so the real groups behind
the ids it hijacks come back later than the forgeries. It sends a group whose ``task`` is an import path (that once
ran a shell command in the reward worker), a group under an id the run never issued, a hijacked live id with its
own prompt, and — as a forger who somehow read the live group's issue record — the right prompt with 12 KB
responses, with a token version from the future, and with the wrong number of responses; and, as a reward worker
that checked nothing would, three of them straight into the replay stream. Each is refused with its reason and
dead-lettered, nothing is trained on them. That forger holds the run secret (an insider who reached the run's Redis);
a stranger on the same machine who sends the same groups, and a right-looking group under every live id, without it
is refused before any of them is decoded, and the run then trains every real group exactly once (the hijacked
ids included) and completes; its reward worker and actor then exit 0 by themselves.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from asyncrl.common.plane.control import ControlPlane
from asyncrl.common.plane.dead_letters import DEAD_LETTER_EXCERPT
from asyncrl.common.plane.keys import connect
from asyncrl.common.plane.replay import ReplayWriter
from asyncrl.common.transport.channel import PushChannel
from asyncrl.common.wire.messages import RolloutGroup, ScoredGroup
from asyncrl.common.wire.seal import numbered_group_id, run_seal, run_secret
from tests.helpers.forgery import honest, reward_endpoints, right_texts
from tests.helpers.runs import step_rows
from tests.helpers.scrape import metric
from tests.helpers.stack import BIN, DEMO, Processes, _wait

pytestmark = pytest.mark.e2e
RUN, STEPS, GROUPS = "forged", 8, 16


def queued_ids(plane: ControlPlane, count: int) -> list[str]:
    """``count`` released ids nobody has taken yet (no actor runs yet: their real groups come after any forgery)."""
    ledger = plane.prompts.ledger()
    return sorted(g for g, e in ledger.items() if not e.actor)[:count]


def forgeries(plane: ControlPlane) -> list[tuple[str, str, RolloutGroup]]:
    """(where it is sent, the reason expected in the dead-letter stream, the forged group).

    ``socket``: to the reward worker's PULL socket, as any peer that reaches it can; ``replay``: straight into the
    replay stream, as a reward worker that checked nothing would write it (the learner trusts no worker either).
    """
    hijacked, long, future, few = (plane.prompts.load_group(g) for g in queued_ids(plane, 4))
    stranger = dataclasses.replace(
        honest(hijacked, [1] * 8), prompt="9+9=", prompt_ids=hijacked.prompt_ids[::-1].copy(), answer="1"
    )
    never = honest(dataclasses.replace(hijacked, group_id=f"{RUN}-99999999"), [1] * 8)
    oversized = honest(long, [1600] * 8)  # 12.8k tokens
    return [
        ("socket", "the newest published is", honest(future, [1] * 8, versions=10**6)),  # only the learner knows
        ("socket", "task 'os:system' is not this run's task", dataclasses.replace(never, task="os:system")),
        ("socket", "not in flight: never issued by this run", never),
        ("socket", "its prompt differs from the one issued", stranger),
        ("socket", "a response has 1600 tokens; rollout.max_new_tokens is 6", oversized),
        ("socket", "it has 2 responses; 8 were asked for", honest(few, [1, 1])),
        ("replay", "not in flight: never issued by this run", never),
        ("replay", "its prompt differs from the one issued", stranger),
        ("replay", "a response has 1600 tokens; rollout.max_new_tokens is 6", oversized),
    ]


def test_forged_groups_are_refused_and_every_real_group_is_trained_once(tmp_path: Path, model_dir: Path) -> None:
    run_dir = tmp_path / RUN
    procs = Processes(tmp_path / "logs")
    try:
        sets, run_args = procs.start_demo(run_dir, model_dir, f"learner.steps={STEPS}")
        config, url = DEMO, run_args[1]
        learner = procs.start("learner", [BIN / "rl-learner", "train", config, *sets, "--redis", url])
        plane = ControlPlane(connect(url), RUN)
        _wait(lambda: len(queued_ids(plane, 4)) == 4, "the first prompt groups released", learner)
        _wait(lambda: reward_endpoints(plane), "the reward worker's registration", learner)  # it may start last
        [endpoint] = reward_endpoints(plane)
        sent = forgeries(plane)
        # An insider: it holds the run secret (it reached the run's Redis), so its messages pass the seal and meet
        # the issue-record checks. A stranger on the same machine sends the same groups and more without the seal.
        push = PushChannel("rollouts", send_timeout_s=10, seal=run_seal(plane.client, plane.keys, "rollouts"))
        push.connect(endpoint)
        stranger = PushChannel("rollouts", send_timeout_s=10)
        stranger.connect(endpoint)
        try:
            for _, _, group in (f for f in sent if f[0] == "socket"):
                push.send(group)
                stranger.send(group)
            sprayed = [dataclasses.replace(g, texts=["19"] * 8) for g in right_texts(plane)]
            for group in sprayed:
                stranger.send(group)  # right answers over other token ids, under every id it knows is in flight
            rigged = [ScoredGroup(rollout=g, rewards=np.ones(8, np.float32)) for w, _, g in sent if w == "replay"]
            ReplayWriter(plane.client, plane.keys).add(rigged)
            # the socket closes with linger 0: wait until every forgery was refused by the worker or the learner
            _wait(lambda: plane.client.xlen(plane.keys.dead) >= len(sent), "every refusal", learner)
        finally:
            push.close()
            stranger.close()
        assert not (run_dir / "metrics.jsonl").exists()  # no step trained on them
        [worker] = [h for h in plane.registry.processes()[0] if h.kind == "reward"]
        unsealed = len([f for f in sent if f[0] == "socket"]) + len(sprayed)
        _wait(lambda: metric(worker, "asyncrl_channel_unsealed_messages_total") == unsealed, "the stranger's", learner)
        procs.start_actor("actor-0", run_args, core=1)
        assert learner.wait(900) == 0, procs.log("learner")[-3000:]
        # the worker lived through all of it; the run finished, it and the actor exit 0 by themselves
        for name in ("reward", "actor-0"):
            assert procs.procs[name].wait(60) == 0, procs.log(name)[-3000:]
            assert "run finished; the" in procs.log(name)
        _check_refusals(plane, sent)
        _audit(plane, hijacked={g.group_id for _, _, g in sent} - {f"{RUN}-99999999"})
    finally:
        procs.stop_all()
    rows = step_rows(run_dir)
    assert [int(r["step"]) for r in rows] == list(range(1, STEPS + 1))
    assert sum(r["groups/refused"] for r in rows) == 4  # the future version from the socket, and the replay three
    assert "refused a scored group that does not match its issue record" in procs.log("learner")
    assert "refused a rollout group without scoring it" in procs.log("reward")


def _check_refusals(plane: ControlPlane, sent: list[tuple[str, str, RolloutGroup]]) -> None:
    """Each forgery is in the dead-letter stream once, refused where expected, with its reason and its payload (a
    large one's first bytes, with its size and digest); nothing else is there (no real group)."""
    expected = Counter(
        ("learner:refused" if where == "replay" or "newest" in reason else "reward:refused", reason)
        for where, reason, _ in sent
    )
    found: Counter = Counter()
    for _, fields in plane.client.xrange(plane.keys.dead):
        source, reason = fields[b"source"].decode(), fields[b"reason"].decode()
        matches = [key for key in expected if key[0] == source and key[1] in reason]
        assert len(matches) == 1, (source, reason)
        found[matches[0]] += 1
        if int(fields[b"size"]) > len(fields[b"payload"]):  # the oversized forgery: its start is kept, not all of it
            assert len(fields[b"payload"]) == DEAD_LETTER_EXCERPT and len(fields[b"digest"]) == 64
            continue
        assert b"forger" in fields[b"payload"]  # the excerpt kept holds the header, which names the sender
    assert found == expected


def _audit(plane: ControlPlane, hijacked: set[str]) -> None:
    """Each step trained GROUPS real groups; every issued group is trained once, discarded, lost or in flight."""
    trained = {g.decode(): int(s) for g, s in plane.client.hgetall(plane.keys.trained).items()}
    assert Counter(trained.values()) == dict.fromkeys(range(1, STEPS + 1), GROUPS)
    counts = plane.prompts.dispatch_counts()
    done = {g.decode() for g in plane.client.smembers(plane.keys.done)}
    in_flight = {g.decode() for g in plane.client.hkeys(plane.keys.inflight)}
    secret = run_secret(plane.client, plane.keys)
    issued = {numbered_group_id(RUN, n, secret) for n in range(counts["created"])}
    assert set(trained) <= done and len(done - set(trained)) == counts.get("discarded", 0)
    assert len(issued - done - in_flight) == counts.get("lost", 0) == 0  # no real group lost to a forgery
    assert hijacked <= set(trained) | in_flight  # the real groups behind hijacked ids were not pushed out
