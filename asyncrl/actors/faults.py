"""A group an environment fault touched is never trained: the actor generates it again, or gives up on it.

What the model does is trained, with the environment's reward: a malformed tool call, a wrong answer, running out of
turns or tokens. What the infrastructure does is not: an episode that ended as ``environment_error`` — its step
raised, hung past ``environment.step_timeout_s`` or returned nothing usable, or the environments' process died or was
replaced under it — says nothing about the policy, and training it with the reward of an unfinished episode would
teach a crashed container as a bad answer. So the actor does not send such a group to be scored: it gives it back to
the front of the queue, to be generated again from the start on a fresh environment, up to
``environment.fault_attempts`` times (counted per group in Redis, so a retry on another actor counts too); then it
dead-letters it (``actor:environment``) and the learner retires it at once (counted ``refused``). Counted as
``asyncrl_actor_faulted_groups_total{outcome}``.
"""

from __future__ import annotations

from asyncrl.actors.episodes import ENVIRONMENT_ERROR
from asyncrl.common.observability.logs import get_logger
from asyncrl.common.observability.metrics import ACTOR_FAULTED_GROUPS
from asyncrl.common.plane.control import ControlPlane
from asyncrl.common.plane.dead_letters import dead_letter
from asyncrl.common.wire.messages import PromptGroup, RolloutGroup, encode_blob

log = get_logger("actor")


def faulted_episodes(rollout: RolloutGroup) -> int:
    """How many of the group's episodes an environment fault ended."""
    return sum(reason == ENVIRONMENT_ERROR for reason in rollout.finish_reasons)


def settle_faulted(plane: ControlPlane, group: PromptGroup, faulted: int, attempts: int) -> str:
    """Give ``group`` back to be generated again, or dead-letter it once faults ended it ``attempts`` times; which
    (``retried`` or ``dead_lettered``)."""
    seen = plane.prompts.note_fault(group.group_id)
    plane.prompts.add_dispatch_counts({"faulted_groups": 1, "faulted_episodes": faulted})  # metrics.jsonl's per step
    if seen < attempts:
        plane.prompts.return_prompts([group])
        outcome = "retried"
        log.warning(
            "an environment fault ended episodes of a group; generating it again, untrained",
            group=group.group_id,
            faulted=faulted,
            attempt=seen,
            attempts=attempts,
        )
    else:
        reason = f"environment faults ended its episodes in {seen} attempts (environment.fault_attempts = {attempts})"
        dead_letter(plane.client, plane.keys, "actor:environment", reason, encode_blob(group))
        plane.prompts.note_refused(group.group_id)
        outcome = "dead_lettered"
        log.error(
            "dead-lettered a group whose environment kept failing; it is never trained",
            group=group.group_id,
            attempts=seen,
            action="the environment's log says why its steps fail; raise environment.step_timeout_s if they hang",
        )
    ACTOR_FAULTED_GROUPS.labels(outcome).inc()
    return outcome
