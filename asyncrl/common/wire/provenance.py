"""Does a rollout answer a prompt group this run issued? Checked by the reward worker before it scores one and by
the learner before it trains on one.

Reward workers take rollouts from any peer that reaches their socket. A group is scored, and then trained, only if
it matches its issue record — the :class:`~asyncrl.common.wire.messages.PromptGroup` the dispatcher stored
when it released that id (``common/plane/control.py``, the ``groups`` hash) and still holds because the group is in
flight. Anything else is refused with the reason and dead-lettered; the issue record is left alone, so a forged
copy of a live id never costs the real group its place (without that, a hijacked id made the real group count as lost,
and a 12.7 KB forged group made a step 8–9× slower).

What must match, and why each bound holds for every honest actor:

==================  =========================================================================================
id                  issued by this run and in flight (not completed, discarded or lost)
task, prompt,       exactly the issued ones: the actor copies them from the prompt group it took
answer, extra,
purpose,
prompt_ids
K                   ``num_samples`` responses, as issued
issued_version      as issued (a re-issue keeps it)
response lengths    each at most the group's ``max_new_tokens`` (an eval group's own), else
                    ``rollout.max_new_tokens`` (vLLM stops there); an episode's, and each row of an episode
                    kept per turn, at most its token budget
token versions      none above the newest version the learner has published (no actor can hold a later one)
==================  =========================================================================================

The reward worker checks all but the last (it does not follow versions), so a forgery never reaches a reward
function — nor, with ``code_tests``, the sandbox; the learner checks everything again, trusting no reward worker
either. Staleness (too old a version) is not a forgery and stays the learner loop's own check: such a group is
discarded and replaced, as before.
"""

from __future__ import annotations

import numpy as np

from asyncrl.common.config import RunConfig
from asyncrl.common.wire.messages import PromptGroup, RolloutGroup


def issue_mismatch(
    issued: PromptGroup | None,
    group: RolloutGroup,
    max_new_tokens: int,
    newest_version: int | None = None,
    episode_tokens: int = 0,
) -> str | None:
    """Why ``group`` does not answer ``issued`` (its id's issue record, None when there is none), or None if it does.

    ``newest_version`` None skips the version bound (the reward worker does not follow versions). In a run whose
    responses are multi-turn episodes, ``episode_tokens`` (:func:`episode_tokens`) bounds every response instead of
    ``max_new_tokens``, which bounds each of its turns.
    """
    if issued is None:
        return "its id is not in flight: never issued by this run, or given up as lost after its re-issue"
    for name in ("task", "prompt", "answer", "extra", "purpose"):
        if getattr(group, name) != getattr(issued, name):
            return f"its {name} differs from the one issued"
    if not np.array_equal(group.prompt_ids, issued.prompt_ids):
        return "its prompt_ids differ from the ones issued"
    if group.num_samples != issued.num_samples:
        return f"it has {group.num_samples} responses; {issued.num_samples} were asked for"
    if group.issued_version != issued.issued_version:
        return f"its issued_version {group.issued_version} is not the issued {issued.issued_version}"
    longest, limit = group.longest_row(), episode_tokens or issued.max_new_tokens or max_new_tokens
    if longest > limit:
        setting = "the group's max_new_tokens" if issued.max_new_tokens else "rollout.max_new_tokens"
        setting = "an episode's token budget" if episode_tokens else setting
        what = "a row of a response" if len(group.row_starts) else "a response"
        return f"{what} has {longest} tokens; {setting} is {limit}"
    newest = int(group.versions.max(initial=0))
    if newest_version is not None and newest > newest_version:
        return f"a token is stamped version {newest}; the newest published is {newest_version}"
    return None


def episode_tokens(config: RunConfig) -> int:
    """The most tokens one episode may hold in a run with an environment (``environment.max_episode_tokens``, else
    ``model.max_model_len``); 0 in a run without one."""
    if not config.environment.name:
        return 0
    return config.environment.max_episode_tokens or config.model.max_model_len
