"""A group an environment fault touched is never trained (``actors/faults.py``), on a real redis-server: it goes back
to the front of the queue to be generated again, up to ``environment.fault_attempts`` times counted across actors,
then it is dead-lettered and the learner's dispatcher retires it at once, counted ``refused``. The rollout actor's
use of it runs in the agent run (``tests/e2e/test_agent_run.py``: its environment host hung and killed mid-run)."""

from __future__ import annotations

from asyncrl.actors.faults import faulted_episodes, settle_faulted
from asyncrl.common.wire.messages import Decoder, PromptGroup, decode_blob
from tests.helpers.dispatch import make_config, make_dispatcher
from tests.helpers.rollouts import make_group


def test_a_faulted_group_is_generated_again_then_dead_lettered_never_scored(redis_client) -> None:
    d = make_dispatcher(redis_client, make_config(max_staleness=0, groups_per_step=2))
    assert d.release(0) == 2
    group = d.plane.prompts.take_prompt("a1", timeout_s=1)
    rollout = make_group(["19", "1", "18"], finish_reasons=["stop", "environment_error", "length"])
    assert faulted_episodes(rollout) == 1 and faulted_episodes(make_group(["19"])) == 0

    for attempt in (1, 2):  # on whichever actor takes it: the count is the group's
        assert settle_faulted(d.plane, group, 1, attempts=3) == "retried"
        again = d.plane.prompts.take_prompt(f"a{attempt + 1}", timeout_s=1)
        assert again.group_id == group.group_id  # the front of the queue: generated again first
        assert redis_client.xlen(d.plane.keys.dead) == 0

    assert settle_faulted(d.plane, group, 2, attempts=3) == "dead_lettered"
    [(_, letter)] = redis_client.xrange(d.plane.keys.dead)
    assert letter[b"source"] == b"actor:environment" and b"in 3 attempts" in letter[b"reason"]
    assert decode_blob(Decoder(PromptGroup), letter[b"payload"]).group_id == group.group_id
    assert d.retire_refused() == 1 and not d.is_known(group.group_id)  # its place freed at the dispatcher's next look
    assert not redis_client.hexists(d.plane.keys.faults, group.group_id)  # the count goes with the group
    assert d.stats()["refused_total"] == 1 and d.release(0) == 1  # a replacement
