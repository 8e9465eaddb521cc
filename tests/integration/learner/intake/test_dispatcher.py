"""The dispatcher on a real redis-server: admission control, re-issue, loss, duplicates, restart, prompt sources.

Live and dead actors are real heartbeats in the run's registry (``ControlPlane.beat`` with a short TTL).
Deadlines are tested with an explicit ``now`` instead of sleeping.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import numpy as np
import pytest
from prometheus_client import REGISTRY

from asyncrl.common.config import RunConfig
from asyncrl.common.plane.control import ControlPlane
from asyncrl.common.plane.keys import connect
from asyncrl.common.wire.messages import Decoder, PromptGroup, decode_blob
from asyncrl.learner.intake.dispatcher import Dispatcher
from tests.helpers.dispatch import RUN, actor, encode, make_config, make_dispatcher
from tests.helpers.waits import wait_for


def expired(plane: ControlPlane, process_id: str) -> None:
    """Wait until the heartbeat of ``process_id`` has expired (its TTL passed)."""
    wait_for(lambda: not plane.client.exists(plane.keys.heartbeat(process_id)), f"{process_id}'s heartbeat to expire")


def drain(plane: ControlPlane, holder: str = "drainer") -> list[PromptGroup]:
    """Take every queued group, in the order actors would get them."""
    groups = []
    while (group := plane.prompts.take_prompt(holder, timeout_s=0.05)) is not None:
        groups.append(group)
    return groups


def queued_ids(plane: ControlPlane) -> list[str]:
    """Ids in the queue without taking them, the next to be taken first (actors pop the list's right end)."""
    decoder = Decoder(PromptGroup)
    return [decode_blob(decoder, b).group_id for b in reversed(plane.client.lrange(plane.keys.prompts, 0, -1))]


def metric(name: str) -> float:
    return REGISTRY.get_sample_value(name) or 0.0


def test_max_staleness_0_is_synchronous(redis_client) -> None:
    d = make_dispatcher(redis_client, make_config(max_staleness=0, groups_per_step=4))
    released = metric("asyncrl_dispatcher_released_groups_total")
    # capacity(0) = (0 + 0 + 1) × 4 = 4; nothing released yet → 4
    assert d.release(0) == 4
    # 4 released ≤ 4: full until the learner reaches version 1, however often it asks
    assert d.release(0) == 0 and d.release(0) == 0
    assert d.stats()["queued"] == 4 and d.stats()["in_flight"] == 4
    # capacity(1) = (0 + 1 + 1) × 4 = 8; 4 released → 4 more, issued at version 1
    assert d.release(1) == 4
    assert d.release(1) == 0
    stats = d.stats()
    assert (stats["released_total"], stats["in_flight"], stats["queued"]) == (8, 8, 8)
    groups = drain(d.plane)
    assert [g.issued_version for g in groups] == [0] * 4 + [1] * 4
    assert all(g.num_samples == 3 and g.task == "arithmetic" for g in groups)
    assert all(list(g.prompt_ids) == encode(g.prompt) for g in groups)
    assert metric("asyncrl_dispatcher_released_groups_total") - released == 8
    keys = [k.decode() for k in redis_client.keys("*")]
    assert keys and all(k.startswith(f"asyncrl:{RUN}:") for k in keys), keys


def test_max_staleness_2_releases_three_steps_ahead(redis_client) -> None:
    d = make_dispatcher(redis_client, make_config(max_staleness=2, groups_per_step=4))
    # capacity(0) = (2 + 0 + 1) × 4 = 12
    assert d.release(0) == 12
    assert d.release(0) == 0
    # capacity(1) = (2 + 1 + 1) × 4 = 16; 12 released → 4
    assert d.release(1) == 4
    # a jump of two versions: capacity(3) = (2 + 3 + 1) × 4 = 24; 16 released → 8
    assert d.release(3) == 8
    assert d.stats()["released_total"] == 24
    with pytest.raises(ValueError, match="version"):
        d.release(-1)


def command_calls(client, *names: str) -> dict[str, int]:
    """How many times the server ran each command (``INFO commandstats``; 0 for one it never ran)."""
    stats = client.info("commandstats")
    return {name: int(stats.get(f"cmdstat_{name}", {}).get("calls", 0)) for name in names}


def test_standings_of_a_read_take_one_round_trip_and_agree_with_the_single_lookups(redis_client) -> None:
    d = make_dispatcher(redis_client, make_config(max_staleness=0, groups_per_step=4))
    d.release(0)
    held = [d.plane.prompts.take_prompt("a1", timeout_s=1).group_id for _ in range(3)]
    d.complete(held[:1])
    ids = [*held, "never-issued", held[1]]  # a repeated id is looked up once
    names = ("smismember", "hmget", "sismember", "hget")
    before = command_calls(redis_client, *names)
    standings = d.standings(ids)
    after = command_calls(redis_client, *names)
    assert {n: after[n] - before[n] for n in names} == {"smismember": 1, "hmget": 1, "sismember": 0, "hget": 0}
    assert list(standings) == [*held, "never-issued"]
    for gid, standing in standings.items():
        assert standing.completed == d.plane.prompts.was_completed(gid)
        single = d.plane.prompts.load_group(gid)
        assert (standing.issued is None) == (single is None)
        if single is not None:
            assert (
                standing.issued.prompt == single.prompt
                and standing.issued.prompt_ids.tolist() == single.prompt_ids.tolist()
            )
    assert standings[held[0]].completed and standings[held[0]].issued is None
    assert standings[held[1]].issued.group_id == held[1] and not standings[held[1]].completed
    assert d.standings([]) == {}


def test_completing_groups_frees_no_admission(redis_client) -> None:
    d = make_dispatcher(redis_client, make_config(max_staleness=0, groups_per_step=4))
    assert d.release(0) == 4  # capacity(0) = 4
    trained = [d.plane.prompts.take_prompt("a1", timeout_s=1).group_id for _ in range(2)]
    assert all(d.is_known(g) for g in trained)
    assert d.complete(trained) == 2
    # admission counts released groups (still 4 ≤ 4), not in-flight ones (2): nothing more at v=0
    assert d.release(0) == 0
    stats = d.stats()
    assert (stats["released_total"], stats["in_flight"], stats["completed_total"]) == (4, 2, 2)
    assert not d.is_known(trained[0]) and d.plane.prompts.was_completed(trained[0])
    assert d.plane.prompts.load_group(trained[0]) is None  # payload gone with the ledger entry
    assert d.complete(trained) == 0  # completing again changes nothing


def test_a_group_held_by_a_dead_actor_is_reissued_to_the_front(redis_client) -> None:
    d = make_dispatcher(redis_client, make_config(max_staleness=0, groups_per_step=4))
    reissued_before = metric("asyncrl_dispatcher_reissued_groups_total")
    actor(d.plane, "doomed")
    actor(d.plane, "alive")
    d.release(0)
    held = d.plane.prompts.take_prompt("doomed", timeout_s=1)
    other = d.plane.prompts.take_prompt("alive", timeout_s=1)
    first_issue = d.plane.prompts.ledger()[held.group_id].issued_at
    assert d.reissue_overdue(deadline_s=60) == (0, 0)  # both holders alive, well within the deadline
    actor(d.plane, "doomed", ttl_s=0.1)  # its last heartbeat
    expired(d.plane, "doomed")
    assert d.reissue_overdue(deadline_s=60) == (1, 0)
    entry = d.plane.prompts.ledger()[held.group_id]
    assert entry.attempts == 2 and entry.actor == "" and entry.issued_at > first_issue
    assert d.plane.prompts.ledger()[other.group_id].attempts == 1  # a live holder's group is left alone
    again = d.plane.prompts.take_prompt("alive", timeout_s=1)  # front of the queue, before the two never taken
    assert (again.group_id, again.prompt, again.answer) == (held.group_id, held.prompt, held.answer)
    assert np.array_equal(again.prompt_ids, held.prompt_ids)
    assert d.plane.prompts.ledger()[held.group_id].actor == "alive" and d.plane.prompts.queue_depth() == 2
    assert d.stats()["reissued_total"] == 1
    assert metric("asyncrl_dispatcher_reissued_groups_total") - reissued_before == 1


def test_a_group_pushed_again_to_the_dead_worker_it_was_reissued_for_is_not_lost(redis_client) -> None:
    """The soak's race: reward worker W dies holding a group; the learner re-issues it; the actor, whose peer list
    lags the registry by up to 2 s, takes it again at once and pushes it to W again. That is W's death once, not the
    group failing twice: it is re-issued again with its attempts unchanged, and not lost. A group that a worker alive
    at the push then loses still counts the attempt (the poison-group limit holds)."""
    d = make_dispatcher(redis_client, make_config(max_staleness=0, groups_per_step=4))
    actor(d.plane, "actor-0")
    actor(d.plane, "reward-1", ttl_s=0.1)
    actor(d.plane, "reward-2", ttl_s=30)
    d.release(0)
    group = d.plane.prompts.take_prompt("actor-0", timeout_s=1)
    assert d.plane.prompts.pushed(group.group_id, "actor-0", "reward-1")
    expired(d.plane, "reward-1")
    assert d.reissue_overdue(deadline_s=60) == (1, 0)
    assert d.plane.prompts.ledger()[group.group_id].attempts == 2
    for _ in range(2):  # the lagging actor sends it to the dead worker, twice over
        assert d.plane.prompts.take_prompt("actor-0", timeout_s=1).group_id == group.group_id
        assert d.plane.prompts.pushed(group.group_id, "actor-0", "reward-1")
        assert d.reissue_overdue(deadline_s=60) == (1, 0)
        assert d.plane.prompts.ledger()[group.group_id].attempts == 2
    # now to a worker alive at the push, which then dies: that is a second failure of the group, and it is lost
    assert d.plane.prompts.take_prompt("actor-0", timeout_s=1).group_id == group.group_id
    assert d.plane.prompts.pushed(group.group_id, "actor-0", "reward-2")
    actor(d.plane, "reward-2", ttl_s=0.1)
    expired(d.plane, "reward-2")
    assert d.reissue_overdue(deadline_s=60) == (0, 1)


def test_a_group_overdue_twice_is_lost_and_replaced(redis_client) -> None:
    d = make_dispatcher(redis_client, make_config(max_staleness=0, groups_per_step=4))
    lost_before = metric("asyncrl_dispatcher_lost_groups_total")
    actor(d.plane, "slow")
    assert d.release(0) == 4
    t0 = time.time()
    held = d.plane.prompts.take_prompt("slow", timeout_s=1)
    assert d.reissue_overdue(deadline_s=10, now=t0 + 5) == (0, 0)
    # past the deadline: the held group and the three queued ones are re-issued — the queued ones are
    # moved to the front, not duplicated, so the queue holds 4 (not 3 + 4)
    assert d.reissue_overdue(deadline_s=10, now=t0 + 11) == (4, 0)
    assert queued_ids(d.plane) == [d.group_id(n) for n in range(4)]  # oldest (then lowest id) first
    assert {e.attempts for e in d.plane.prompts.ledger().values()} == {2}
    assert d.reissue_overdue(deadline_s=10, now=t0 + 15) == (0, 0)  # the deadline restarts at re-issue
    # overdue again → lost: ledger entries, payloads and queued copies removed; admission no longer counts them
    assert d.reissue_overdue(deadline_s=10, now=t0 + 22) == (0, 4)
    stats = d.stats()
    assert (stats["released_total"], stats["in_flight"], stats["queued"], stats["lost_total"]) == (0, 0, 0, 4)
    assert metric("asyncrl_dispatcher_lost_groups_total") - lost_before == 4
    assert not d.is_known(held.group_id) and not d.plane.prompts.was_completed(held.group_id)
    # capacity(0) = 4, released_total = 4 − 4 lost = 0 → 4 replacements with new ids
    assert d.release(0) == 4
    assert sorted(d.plane.prompts.ledger()) == [d.group_id(n) for n in range(4, 8)]


def test_a_restarted_learner_does_not_count_the_time_no_learner_ran(redis_client, monkeypatch) -> None:
    """Groups scored while the learner was down wait in the replay stream: a restart slower than the deadline must not
    re-issue them, and two such restarts must not count them lost. Deadlines count from the learner's start."""
    first = make_dispatcher(redis_client, make_config(max_staleness=0, groups_per_step=4))
    assert first.release(0) == 4
    issued = time.time()
    monkeypatch.setattr(time, "time", lambda: issued + 100)  # this learner starts 100 s later (deadline 10 s)
    second = make_dispatcher(redis_client, make_config(max_staleness=0, groups_per_step=4))
    monkeypatch.undo()
    assert second.reissue_overdue(deadline_s=10, now=issued + 105) == (0, 0)
    assert second.reissue_overdue(deadline_s=10, now=issued + 111) == (4, 0)  # a full deadline after the start
    assert second.reissue_overdue(deadline_s=10, now=issued + 122) == (0, 4)  # overdue twice while it ran: lost


def test_a_reissued_group_completed_by_its_first_holder_is_a_known_duplicate(redis_client) -> None:
    d = make_dispatcher(redis_client, make_config(max_staleness=0, groups_per_step=2))
    duplicates_before = metric("asyncrl_dispatcher_duplicate_groups_total")
    actor(d.plane, "slow")
    d.release(0)  # capacity(0) = (0 + 0 + 1) × 2 = 2
    t0 = time.time()
    held = d.plane.prompts.take_prompt("slow", timeout_s=1)
    assert d.reissue_overdue(deadline_s=10, now=t0 + 11) == (2, 0)
    assert d.plane.prompts.queue_depth() == 2
    # the slow holder delivers after all: the learner trains it; its re-issued copy leaves the queue unused
    assert d.is_known(held.group_id) and d.complete([held.group_id]) == 1
    assert d.plane.prompts.queue_depth() == 1
    # had an actor taken the copy, it arrives later: the learner sees it was completed and drops it
    assert not d.is_known(held.group_id) and d.plane.prompts.was_completed(held.group_id)
    d.note_duplicate(held.group_id)
    assert d.stats()["duplicates_total"] == 1
    assert metric("asyncrl_dispatcher_duplicate_groups_total") - duplicates_before == 1


def test_payloads_survive_a_learner_restart(redis_server, redis_client) -> None:
    config = make_config(max_staleness=1, groups_per_step=2)
    first = make_dispatcher(redis_client, config)
    actor(first.plane, "doomed", ttl_s=0.3)
    assert first.release(0) == 4  # capacity(0) = (1 + 0 + 1) × 2 = 4
    held = first.plane.prompts.take_prompt("doomed", timeout_s=1)
    del first  # the learner process ends; only Redis remembers

    restarted = connect(redis_server.url)
    try:
        second = make_dispatcher(restarted, config)
        assert second.stats()["released_total"] == 4 and second.release(0) == 0
        expired(second.plane, "doomed")
        assert second.reissue_overdue(deadline_s=60) == (1, 0)
        before = drain(second.plane)
        assert before[0].group_id == held.group_id and before[0].prompt == held.prompt
        assert second.release(1) == 2  # capacity(1) = (1 + 1 + 1) × 2 = 6; 4 released → 2
        after = drain(second.plane)
    finally:
        restarted.close()
    # ids and prompts continue where the first learner stopped: the same as one uninterrupted run
    assert [g.group_id for g in after] == [second.group_id(4), second.group_id(5)]
    reference = make_dispatcher(redis_client, make_config(max_staleness=1, groups_per_step=2, run="reference"))
    reference.release(1)
    got = sorted(before + after, key=lambda g: g.group_id)
    assert [(g.prompt, g.answer) for g in got] == [(g.prompt, g.answer) for g in drain(reference.plane)]


def test_group_ids_are_unique_within_a_run(redis_client) -> None:
    d = make_dispatcher(redis_client, make_config(max_staleness=1, groups_per_step=3))
    seen: list[str] = []
    d.release(0)
    seen += d.plane.prompts.ledger()
    t0 = time.time()
    d.reissue_overdue(deadline_s=1, now=t0 + 2)
    assert d.reissue_overdue(deadline_s=1, now=t0 + 4) == (0, 6)  # all lost: their ids must not come back
    for version in range(4):
        d.release(version)
        seen += [g for g in d.plane.prompts.ledger() if g not in seen]
    created = d.stats()["created_total"]
    assert created == len(seen) == len(set(seen)) == 6 + (1 + 3 + 1) * 3
    assert all(re.fullmatch(rf"{RUN}-\d{{8}}-[0-9a-f]{{16}}", g) for g in seen)  # number, then the keyed tag
    assert sorted(seen) == [d.group_id(n) for n in range(created)]


def test_a_file_task_serves_every_row_once_per_pass(redis_client, tmp_path: Path) -> None:
    rows = [{"prompt": "1+2=", "answer": "3"}, {"prompt": "4*5=", "answer": "20"}, {"prompt": "9-7=", "answer": 2}]
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = make_config(max_staleness=0, groups_per_step=4)
    config.task.name, config.task.path, config.task.options = "file", str(data), {"verifier": "arithmetic"}
    d = make_dispatcher(redis_client, config)
    assert d.release(0) == 4
    groups = drain(d.plane)
    expected = {r["prompt"]: str(r["answer"]) for r in rows}
    assert {g.prompt for g in groups[:3]} == set(expected)  # one pass visits each row once
    assert all(g.answer == expected[g.prompt] and g.task == "arithmetic" for g in groups)
    assert all(list(g.prompt_ids) == encode(g.prompt) and g.num_samples == 3 for g in groups)

    config.run.name, config.task.options = "plain", {}
    assert drain_one_task_name(redis_client, config) == "file"
    config.task.path = ""
    with pytest.raises(ValueError, match=r"task\.path"):
        make_dispatcher(redis_client, config)


def drain_one_task_name(client, config: RunConfig) -> str:
    d = make_dispatcher(client, config)
    d.release(0)
    return drain(d.plane)[0].task


def test_a_failed_release_leaves_the_prompt_stream_in_step(redis_client) -> None:
    calls = 0

    def flaky(text: str) -> list[int]:
        nonlocal calls
        calls += 1
        if calls == 3:
            raise RuntimeError("tokenizer hiccup")
        return encode(text)

    config = make_config(max_staleness=0, groups_per_step=4)
    d = Dispatcher(config, ControlPlane(redis_client, RUN), flaky)
    with pytest.raises(RuntimeError, match="hiccup"):
        d.release(0)  # two examples drawn, nothing committed
    assert d.stats()["released_total"] == 0 and d.plane.prompts.ledger() == {} and d.plane.prompts.queue_depth() == 0
    assert d.release(0) == 4
    reference = make_dispatcher(redis_client, make_config(max_staleness=0, groups_per_step=4, run="reference"))
    reference.release(0)
    assert [g.prompt for g in drain(d.plane)] == [g.prompt for g in drain(reference.plane)]


def test_a_discarded_group_is_replaced_and_its_twin_is_a_duplicate(redis_client) -> None:
    d = make_dispatcher(redis_client, make_config(max_staleness=0, groups_per_step=2))
    assert d.release(0) == 2  # capacity(0) = (0 + 0 + 1) × 2 = 2
    stale = d.plane.prompts.take_prompt("a1", timeout_s=1).group_id
    # the learner drops it (too stale): without a replacement, step 0 could never get its 2 groups
    assert d.discard([stale, stale]) == 1 and d.discard([stale]) == 0
    assert d.plane.prompts.was_completed(stale) and not d.is_known(stale)
    # released_total = 2 − 1 discarded = 1 ≤ capacity(0) = 2 → 1 replacement
    assert d.release(0) == 1
    stats = d.stats()
    assert (stats["released_total"], stats["discarded_total"], stats["in_flight"]) == (2, 1, 2)


def test_a_refused_group_frees_its_slot_at_the_next_look_and_is_not_issued_again(redis_client) -> None:
    """A reward worker's final refusal (``note_refused``) retires the group at the dispatcher's next poll — not at
    its deadline, re-issued to be refused again — and admission releases a replacement; an id not in flight (already
    trained, or never this run's) changes nothing."""
    d = make_dispatcher(redis_client, make_config(max_staleness=0, groups_per_step=2))
    assert d.release(0) == 2
    refused = d.plane.prompts.take_prompt("a1", timeout_s=1).group_id
    d.plane.prompts.note_refused(refused)
    d.plane.prompts.note_refused("not-one-of-this-runs-groups")
    before = metric("asyncrl_dispatcher_refused_groups_total")
    assert d.retire_refused() == 1 and d.retire_refused() == 0  # taken once
    assert not d.is_known(refused) and d.plane.prompts.was_completed(refused)  # a late copy is not scored again
    assert metric("asyncrl_dispatcher_refused_groups_total") == before + 1
    assert d.release(0) == 1  # released_total = 2 − 1 refused: a replacement
    assert refused not in [g.group_id for g in drain(d.plane)]
    stats = d.stats()
    assert (stats["released_total"], stats["refused_total"], stats["in_flight"]) == (2, 1, 2)
