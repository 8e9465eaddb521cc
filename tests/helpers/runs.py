"""Reading a run's metrics.jsonl as a person does: one row per training step, and the eval rounds beside them."""

from __future__ import annotations

import collections
import itertools
import json
import os
from pathlib import Path


def rows(run_dir: Path) -> list[dict]:
    """Every complete line of metrics.jsonl (a line being written is left out)."""
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines if line.endswith("}")]


def step_rows(run_dir: Path) -> list[dict]:
    """The training steps' rows, in file order (an eval round's row has ``eval/step``:
    ``learner/intake/evaluation.py``)."""
    return [row for row in rows(run_dir) if "eval/step" not in row]


def actors_trained(run_dir: Path) -> set[str]:
    """The actors whose groups some training step of the run has used so far."""
    prefix = "rollout/groups_from/"
    return {key[len(prefix) :] for row in step_rows(run_dir) for key, n in row.items() if key.startswith(prefix) and n}


def eval_rows(run_dir: Path) -> list[dict]:
    return [row for row in rows(run_dir) if "eval/step" in row]


def check_samples(
    path: Path, steps: list[int], per_step: int, staleness: int | None = None, prompt_end: str = "="
) -> None:
    """samples.jsonl: at the configured cadence, the random picks and the step's worst and best, with every field a
    person needs; every sample at ``staleness`` when given (0 in a synchronous run); each prompt as the model saw it,
    ending in ``prompt_end`` (the task's ``=``, or a chat template's generation prompt)."""
    samples = [json.loads(line) for line in path.read_text().splitlines()]
    assert sorted({r["step"] for r in samples}) == steps
    fields = {
        "step",
        "version",
        "pick",
        "group_id",
        "response_index",
        "prompt",
        "response",
        "reward",
        "details",
        "advantage",
        "finish_reason",
        "staleness",
        "tokens",
    }
    for step in steps:
        picks = [r["pick"] for r in samples if r["step"] == step]
        assert picks[:per_step] == ["random"] * per_step and picks[per_step:] in (["worst", "best"], ["worst"])
    for r in samples:
        assert set(r) == fields | {"timeline"} and r["prompt"].endswith(prompt_end), r["prompt"]
        times = list(r["timeline"].values())  # issued, taken, generated, stored, batch complete: one clock here
        assert list(r["timeline"]) == ["issued", "taken", "generated", "stored", "batch_complete"]
        assert all(b >= a - 0.01 for a, b in itertools.pairwise(times)), r["timeline"]
        assert isinstance(r["advantage"], float) and r["details"] and r["finish_reason"]
        assert staleness is None or r["staleness"] == staleness


def processes_of(run_dir: Path) -> list[str]:
    """Processes still running whose command line or working folder is the run's."""
    found = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            argv = (proc / "cmdline").read_bytes()
            cwd = os.readlink(proc / "cwd")
        except OSError:
            continue
        if str(run_dir).encode() in argv or cwd.startswith(str(run_dir)):
            found.append(f"{proc.name}: {argv[:200]!r}")
    return found


def not_loaded(events: list[dict], failed: set[int], stopped: dict[str, float]) -> dict[str, set[int]]:
    """Per actor, the versions published to it whose transfer went through (not in ``failed``) that it did not load.
    An actor stopped (``stopped``: when) may miss those published after that, and any newer than the last it loaded
    before: one killed between receiving a version and loading it (a step's SIGKILL, a node's death) — the learner may
    publish that version before the actor's load of the one before is in the audit trail."""
    published: dict[str, set[int]] = collections.defaultdict(set)
    loaded: dict[str, set[int]] = collections.defaultdict(set)
    last_load: dict[str, int] = {}  # a stopped actor's newest version loaded before it was stopped
    for e in events:
        if e["event"] == "weights.loaded":
            actor, version = e["who"]["process"], int(e["version"])
            loaded[actor].add(version)
            if e["unix"] <= stopped.get(actor, 0.0):
                last_load[actor] = max(version, last_load.get(actor, 0))
    for e in events:
        if e["event"] == "weights.published":
            version = int(e["version"])
            for member in e["members"]:
                after = member in stopped and (e["unix"] > stopped[member] or version > last_load.get(member, 0))
                if not after:
                    published[member].add(version)
    return {actor: versions - failed - loaded[actor] for actor, versions in published.items()}


def cluster_run_toml(run: str, model: Path, steps: int, groups: int, more: str = "") -> str:
    """The demo as a run on a cluster's nodes: ``run``'s name, the model folder, ``steps`` of ``groups`` groups, no
    eval rounds, a small KV cache and the engine's worker in its actor's process; ``more`` TOML after it."""
    return f"""preset = "demo"

[run]
name = "{run}"

[model]
path = "{model}"

[learner]
steps = {steps}
groups_per_step = {groups}

[eval]
every = 0

[rollout]
kv_cache_bytes = 67108864
cpu_single_process = true
{more}"""


def saved(root: Path, step: int, run: str = "finished") -> None:
    """A checkpoint folder of ``run`` under ``root`` at ``step`` that counts as complete (it has a manifest) and holds
    nothing else: what a command that only looks for the newest checkpoint sees."""
    from asyncrl.learner.checkpoint.format import MANIFEST

    folder = root / run / "checkpoints" / f"step-{step}"
    folder.mkdir(parents=True)
    (folder / MANIFEST).write_text("{}")
