"""The group accounting of a finished run, read from its Redis: every group it issued was trained exactly once in the
surviving history, or discarded, or lost (and counted so), or is still in flight."""

from __future__ import annotations

from collections import Counter

from asyncrl.common.plane.control import ControlPlane
from asyncrl.common.wire.seal import numbered_group_id, run_secret


def account_groups(plane: ControlPlane, steps: int, groups_per_step: int) -> dict[str, int]:
    """Assert the accounting of a run that trained ``steps`` steps of ``groups_per_step`` groups; its figures.

    ``created = trained + discarded + lost + in_flight``; each step trained exactly ``groups_per_step`` groups (a group
    trained twice would leave its first step one short); ``discarded`` counts the groups completed without training
    (too stale, zero variance, or trained after a checkpoint that a resume went back from and gone from the stream).
    """
    run = plane.keys.run
    trained = {g.decode(): int(s) for g, s in plane.client.hgetall(plane.keys.trained).items()}
    per_step = Counter(trained.values())
    assert per_step == dict.fromkeys(range(1, steps + 1), groups_per_step), per_step
    counts = plane.prompts.dispatch_counts()
    secret = run_secret(plane.client, plane.keys)
    issued = {numbered_group_id(run, n, secret) for n in range(counts["created"])}
    done = {g.decode() for g in plane.client.smembers(plane.keys.done)}
    in_flight = {g.decode() for g in plane.client.hkeys(plane.keys.inflight)}
    assert set(trained) <= done <= issued and in_flight <= issued and not done & in_flight
    discarded = done - set(trained)
    assert len(discarded) == counts.get("discarded", 0) + counts.get("restore_lost", 0)
    lost = issued - done - in_flight
    assert len(lost) == counts.get("lost", 0)  # lost after a re-issue, and counted
    figures = {
        "created": counts["created"],
        "trained": len(trained),
        "discarded": len(discarded),
        "lost": len(lost),
        "in_flight": len(in_flight),
    }
    assert figures["created"] == figures["trained"] + figures["discarded"] + figures["lost"] + figures["in_flight"]
    names = ("reissued", "duplicates", "restore_retrained", "restore_lost")
    return figures | {name: counts.get(name, 0) for name in names}
