"""Rollouts as a forger or a stranger sends them into a live run: shaped as an actor would send them, for groups the
run issued, and the reward workers they are sent to."""

from __future__ import annotations

import dataclasses
from collections import Counter

import numpy as np

from asyncrl.common.plane.control import ControlPlane
from asyncrl.common.plane.dead_letters import DEAD_LETTER_EXCERPT
from asyncrl.common.wire.messages import Heartbeat, PromptGroup, RolloutGroup

NEVER_ISSUED = "{run}-99999999"
"""The id of a forged group the run never issued."""


def honest(issued: PromptGroup, lengths: list[int], versions: int = 0, actor: str = "forger") -> RolloutGroup:
    """A rollout shaped as an actor would send it for ``issued`` (zeros for tokens: any in-vocabulary id would do)."""
    total = sum(lengths)
    return RolloutGroup(
        group_id=issued.group_id,
        task=issued.task,
        prompt=issued.prompt,
        prompt_ids=issued.prompt_ids,
        answer=issued.answer,
        token_ids=np.zeros(total, np.int32),
        logprobs=np.full(total, -1.0, np.float32),
        versions=np.full(total, versions, np.int32),
        lengths=np.asarray(lengths, np.int32),
        texts=["1"] * len(lengths),
        finish_reasons=["stop"] * len(lengths),
        actor_id=actor,
        issued_version=issued.issued_version,
    )


def right_texts(plane: ControlPlane, actor: str = "forger") -> list[RolloutGroup]:
    """A group for every id in flight, as a stranger who predicted the ids would send them: K responses of token 0."""
    return [honest(plane.prompts.load_group(g), [1] * 8, actor=actor) for g in sorted(plane.prompts.ledger())]


def reward_workers(plane: ControlPlane) -> list[Heartbeat]:
    """The heartbeats of the run's live reward workers that have bound their socket: one still starting registers
    with no endpoint and no CURVE key yet, and a peer cannot connect to it."""
    return [h for h in plane.registry.processes()[0] if h.kind == "reward" and h.endpoint]


def reward_endpoints(plane: ControlPlane) -> list[str]:
    """The endpoints of the run's live reward workers that have bound their socket (:func:`reward_workers`)."""
    return [h.endpoint for h in reward_workers(plane)]


def queued_ids(plane: ControlPlane, count: int) -> list[str]:
    """``count`` released ids nobody has taken yet (no actor runs yet: their real groups come after any forgery)."""
    ledger = plane.prompts.ledger()
    return sorted(g for g, e in ledger.items() if not e.actor)[:count]


def forgeries(plane: ControlPlane) -> list[tuple[str, str, RolloutGroup]]:
    """(where it is sent, the reason expected in the dead-letter stream, the forged group).

    ``socket``: to the reward worker's PULL socket, as any peer that reaches it can; ``replay``: straight into the
    replay stream, as a reward worker that checked nothing would write it (the learner trusts no worker either).
    The run is configs/demo.toml's (6 new tokens at most, 8 responses a group).
    """
    hijacked, long, future, few = (plane.prompts.load_group(g) for g in queued_ids(plane, 4))
    stranger = dataclasses.replace(
        honest(hijacked, [1] * 8), prompt="9+9=", prompt_ids=hijacked.prompt_ids[::-1].copy(), answer="1"
    )
    never = honest(dataclasses.replace(hijacked, group_id=NEVER_ISSUED.format(run=plane.keys.run)), [1] * 8)
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


def check_refusals(plane: ControlPlane, sent: list[tuple[str, str, RolloutGroup]]) -> None:
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
        # the excerpt kept holds the header, which names the sender: a real group here is one the run lost
        assert b"forger" in fields[b"payload"], (source, reason, fields[b"payload"][:400])
    assert found == expected
