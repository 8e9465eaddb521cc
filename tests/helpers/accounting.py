"""The group accounting of a run, read from its Redis: every group it issued was trained exactly once in the
surviving history, or discarded, or lost (and counted so), or is still in flight."""

from __future__ import annotations

from collections import Counter

from asyncrl.common.plane.control import ControlPlane
from asyncrl.common.plane.run_secret import run_secret
from asyncrl.common.wire.seal import numbered_group_id


def group_ledger(plane: ControlPlane, groups_per_step: int) -> tuple[dict[str, int], list[str]]:
    """The run's group figures and what is wrong with them (empty when nothing is), asserting nothing: for a run that
    is still going (``bench/soak.py``) as for one that ended.

    ``created = trained + discarded + lost + in_flight``; each step trained exactly ``groups_per_step`` groups (a group
    trained twice would leave its first step one short: ``short_steps``); ``discarded`` counts the groups completed
    without training (too stale, zero variance, refused by a reward worker — also counted ``refused`` — or trained
    after a checkpoint that a resume went back from and gone from the stream); ``lost`` those issued, neither done nor
    in flight.
    """
    run = plane.keys.run
    trained = {g.decode(): int(s) for g, s in plane.client.hgetall(plane.keys.trained).items()}
    per_step = Counter(trained.values())
    steps = max(per_step, default=0)
    short = {step: per_step.get(step, 0) for step in range(1, steps + 1) if per_step.get(step, 0) != groups_per_step}
    counts = plane.prompts.dispatch_counts()
    secret = run_secret(plane.client, plane.keys)
    issued = {numbered_group_id(run, n, secret) for n in range(counts.get("created", 0))}
    done = {g.decode() for g in plane.client.smembers(plane.keys.done)}
    in_flight = {g.decode() for g in plane.client.hkeys(plane.keys.inflight)}
    discarded, lost = done - set(trained), issued - done - in_flight
    figures = {
        "created": counts.get("created", 0),
        "trained": len(trained),
        "discarded": len(discarded),
        "lost": len(lost),
        "in_flight": len(in_flight),
        "steps_trained": steps,
        "short_steps": len(short),
    }
    kept = ("reissued", "duplicates", "refused", "restore_retrained", "restore_lost")
    figures |= {name: counts.get(name, 0) for name in kept}
    problems = []
    if short:
        problems.append(f"steps without exactly {groups_per_step} groups (a group trained twice, or missing): {short}")
    if not (set(trained) <= done <= issued and in_flight <= issued) or done & in_flight:
        problems.append("a trained, done or in-flight group the run never issued, or one both done and in flight")
    untrained = counts.get("discarded", 0) + counts.get("refused", 0) + counts.get("restore_lost", 0)
    if len(discarded) != untrained:
        problems.append(f"{len(discarded)} groups done untrained, counted {untrained} discarded or refused")
    if len(lost) != counts.get("lost", 0):
        problems.append(f"{len(lost)} groups neither done nor in flight, counted {counts.get('lost', 0)} lost")
    return figures, problems


def account_groups(plane: ControlPlane, steps: int, groups_per_step: int) -> dict[str, int]:
    """Assert the accounting of a run that trained ``steps`` steps of ``groups_per_step`` groups (:func:`group_ledger`
    finds nothing wrong); its figures."""
    figures, problems = group_ledger(plane, groups_per_step)
    assert not problems, problems
    assert figures["steps_trained"] == steps, figures
    assert figures["created"] == figures["trained"] + figures["discarded"] + figures["lost"] + figures["in_flight"]
    return {k: v for k, v in figures.items() if k not in ("steps_trained", "short_steps")}
