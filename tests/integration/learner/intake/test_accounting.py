"""Exact group accounting on a real redis-server: the dispatcher and the batch source, with simulated actors.

Every group a run issues ends in exactly one of four sets: trained, discarded (completed without training), in flight
(in the ledger), lost (given up after its re-issue), and the dispatcher's counters agree with the sets. The actors
are simulated: they take prompt groups from the Redis queue under their id (the ledger records them as holders), beat
their heartbeat, and write scored groups to the replay stream as an actor and a reward worker would. A ``kill -9`` is
the heartbeat key expiring without a goodbye.
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from asyncrl.common.config import RunConfig
from asyncrl.common.plane.control import ControlPlane
from asyncrl.common.plane.replay import ReplayWriter
from asyncrl.common.wire.messages import Heartbeat, PromptGroup
from asyncrl.learner.intake.batch_source import BatchSource
from asyncrl.learner.intake.dispatcher import Dispatcher
from tests.helpers.rollouts import answer

RUN = "acct"


def run_config(tmp_path: Path, model_dir: Path, **sections: dict) -> RunConfig:
    base = {
        "run": {"name": RUN, "root": str(tmp_path / "runs")},
        "model": {"path": str(model_dir)},
        "rollout": {"num_samples": 2, "max_new_tokens": 4},
        # Far beyond any wait of these tests: whatever is re-issued or lost here is so because its holder died.
        "learner": {"groups_per_step": 4, "micro_batch_size": 4, "group_deadline_s": 3600, "wait_for_batch_s": 120},
        "staleness": {"max_staleness": 0},
    }
    for name, values in sections.items():
        base[name] = {**base.get(name, {}), **values}
    return RunConfig.model_validate(base)


class Actors:
    """Simulated rollout actors (and their reward worker) of one run."""

    def __init__(self, plane: ControlPlane) -> None:
        self.plane = plane
        self.replay = ReplayWriter(plane.client, plane.keys)

    def beat(self, actor: str) -> None:
        self.plane.registry.beat(Heartbeat(process_id=actor, kind="actor", state="generating"), ttl_s=3600)

    def kill(self, actor: str) -> None:
        """``kill -9``: no goodbye; its heartbeat key expires (here at once) and its registry entry stays."""
        self.plane.client.delete(self.plane.keys.heartbeat(actor))

    def take(self, actor: str, count: int = 1_000) -> list[PromptGroup]:
        groups = []
        while len(groups) < count and (group := self.plane.prompts.take_prompt(actor, timeout_s=0.05)) is not None:
            groups.append(group)
        return groups

    def answer(self, groups: list[PromptGroup], version: int = 0, rewards=(1.0, 0.0)) -> None:
        """Write each group scored to the replay stream (``tests/helpers/rollouts.py: answer``), stamped ``version``."""
        if groups:
            self.replay.add([answer(g, rewards, version) for g in groups])


def account(source: BatchSource) -> dict[str, set[str]]:
    """Each issued id in exactly one of trained, discarded, in flight and lost; the counters agree. The four sets."""
    plane, dispatcher = source.plane, source.dispatcher
    counts = plane.prompts.dispatch_counts()
    issued = {dispatcher.group_id(n) for n in range(counts["created"])}
    trained = set(source.trained.trained_steps())
    done = {g.decode() for g in plane.client.smembers(plane.keys.done)}
    in_flight = set(plane.prompts.ledger())
    assert trained <= done <= issued and in_flight <= issued and not done & in_flight
    sets = {"trained": trained, "discarded": done - trained, "in_flight": in_flight, "lost": issued - done - in_flight}
    assert sum(len(s) for s in sets.values()) == len(issued)  # disjoint, and together every issued id
    assert len(sets["discarded"]) == counts.get("discarded", 0)
    assert len(sets["lost"]) == counts.get("lost", 0)  # each id counted lost is neither trained nor discarded
    # admission counts what was released and not given up
    assert counts["released"] == len(issued) - len(sets["lost"]) - len(sets["discarded"])
    return sets


@pytest.fixture
def tokenizer(tiny_model_dir: Path):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def test_groups_held_by_a_killed_actor_and_already_admitted_are_trained_not_lost(
    redis_client, tmp_path, tiny_model_dir, tokenizer
) -> None:
    plane = ControlPlane(redis_client, RUN)
    source = BatchSource(run_config(tmp_path, tiny_model_dir), plane, tokenizer, newest_version=0)
    actors = Actors(plane)
    assert source.dispatcher.release(0) == 4  # capacity (0 + 0 + 1) × 4
    actors.beat("a1")
    assert len(actors.take("a1")) == 4
    actors.kill("a1")  # an earlier crash: its groups are re-issued once (attempts 2)
    assert source.dispatcher.reissue_overdue(3600) == (4, 0)
    actors.beat("a2")
    held = actors.take("a2")
    assert len(held) == 4 and all(e.attempts == 2 and e.actor == "a2" for e in plane.prompts.ledger().values())
    actors.answer(held[:2])  # two of a2's groups reach the replay stream; it dies generating the other two
    actors.beat("a3")
    waits = []

    def on_wait() -> None:
        waits.append(1)
        if len(waits) == 1:
            actors.kill("a2")  # after the first overdue check, before the read that admits its two groups
        else:
            actors.answer(actors.take("a3"))  # a live actor serves what is queued (the replacements)

    taken = source.take(0, threading.Event(), on_wait)
    admitted = [e.group.rollout.group_id for e in taken.entries]
    assert admitted[:2] == [g.group_id for g in held[:2]] and len(admitted) == 4
    source.settle(1, taken)
    sets = account(source)
    # The two admitted while a2's heartbeat expired were trained, and only trained; the two it never sent are lost.
    assert {g.group_id for g in held[:2]} <= sets["trained"]
    assert sets["lost"] == {g.group_id for g in held[2:]}
    assert (len(sets["trained"]), len(sets["discarded"]), len(sets["in_flight"])) == (4, 0, 0)
    assert plane.prompts.dispatch_counts()["reissued"] == 4


def test_an_admitted_group_is_never_judged_overdue(redis_client, tmp_path, tiny_model_dir, tokenizer) -> None:
    """The dispatcher leaves alone the ids the batch source holds, whether their holder died or their deadline
    passed."""
    plane = ControlPlane(redis_client, RUN)
    dispatcher = Dispatcher(run_config(tmp_path, tiny_model_dir), plane, tokenizer.encode)
    actors = Actors(plane)
    dispatcher.release(0)
    actors.beat("a1")
    groups = actors.take("a1")
    actors.kill("a1")
    held = {g.group_id for g in groups[:3]}
    far = groups[0].issued_at + 10_000  # every deadline passed too
    assert dispatcher.reissue_overdue(3600, now=far, held=held) == (1, 0)
    ledger = plane.prompts.ledger()
    assert {g for g, e in ledger.items() if e.attempts == 1} == held and len(ledger) == 4


@pytest.mark.parametrize("verdict", ["stale", "zero_variance"])
def test_a_discarded_groups_twin_in_the_same_read_is_a_duplicate_not_trained(
    redis_client, tmp_path, tiny_model_dir, tokenizer, verdict: str
) -> None:
    """A re-issued group's two copies arrive in one read: the first is discarded (stale, or without reward variance),
    the second is a duplicate of it — it is not trained as well (the read's standings predate the discard)."""
    dynamic = verdict == "zero_variance"
    config = run_config(
        tmp_path, tiny_model_dir, algorithm={"dynamic_sampling": dynamic}, learner={"groups_per_step": 2}
    )
    plane = ControlPlane(redis_client, RUN)
    version = 0 if dynamic else 1  # at version 1 with max_staleness 0 the floor is 1: tokens of version 0 are stale
    source = BatchSource(config, plane, tokenizer, newest_version=version)
    actors = Actors(plane)
    source.dispatcher.release(0)
    actors.beat("a1")
    first = actors.take("a1")
    actors.kill("a1")
    assert source.dispatcher.reissue_overdue(3600) == (2, 0)
    actors.beat("a2")
    twin = actors.take("a2", 1)[0]
    assert twin.group_id == first[0].group_id
    # a1's copy (sent before it died) is the one discarded; a2's arrives right after it
    actors.answer([first[0]], version=0, rewards=(1.0, 1.0) if dynamic else (1.0, 0.0))
    actors.answer([twin], version=version)

    def on_wait() -> None:  # a live actor serves the queue: the other group and the replacement
        actors.answer(actors.take("a2"), version=version)

    taken = source.take(version, threading.Event(), on_wait)
    assert twin.group_id not in {e.group.rollout.group_id for e in taken.entries}
    assert taken.verdicts[verdict] == 1 and taken.verdicts["duplicate"] == 1
    source.settle(version + 1, taken)
    sets = account(source)
    assert twin.group_id in sets["discarded"] and len(sets["trained"]) == 2
