"""The on-disk form of one checkpoint and its verification: what the folder holds, the run state in ``state.json``
(:class:`SavedState`, with the RNG states of :func:`capture_rng`), the manifest that pins every file
(:func:`write_manifest`), and :func:`open_checkpoint`, which trusts a folder only once every file matched it.

One checkpoint is the folder ``runs/<name>/checkpoints/step-<N>/``::

    policy/ds/     DeepSpeed checkpoint of the policy: weights, optimizer and scheduler state (``save_checkpoint``)
    critic/ds/     the same for the critic, when the run trains one
    hf/            the policy as a Hugging Face folder (safetensors, config, tokenizer), loadable as is
    state.json     :class:`SavedState`: step and policy version, KL coefficient, RNG states, config hash, and the
                   dispatcher and replay positions at save time
    manifest.json  sha256 and size of every other file

A save (:mod:`asyncrl.learner.checkpoint.checkpointer`) writes it into ``.tmp-step-<N>/``, fsyncs and hashes every file
into the manifest, and only then renames the folder to ``step-<N>`` (atomic): a folder named ``step-<N>`` with a
manifest is complete. A resume verifies every file against the manifest and refuses a checkpoint with a changed or
missing file, naming it.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import random
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import numpy as np
import torch

from asyncrl.common.observability.logs import get_logger

log = get_logger("checkpoint")

MANIFEST = "manifest.json"
STATE = "state.json"
DS_TAG = "ds"
"""DeepSpeed's tag folder inside ``policy/`` and ``critic/``."""
_HASH_CHUNK = 2**20


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used; the message names the file and says what to do."""


@dataclass
class SavedState:
    """Everything of the learner's state that is neither in DeepSpeed's checkpoint nor in Redis (``state.json``)."""

    step: int
    """Optimizer steps done; the first step after a resume is ``step + 1``."""
    version: int
    """Policy version of the checkpointed weights (equal to ``step``: every step bumps it)."""
    kl_coef: float = 0.0
    """The KL-in-reward controller's coefficient (adaptive mode changes it every step)."""
    rng: dict[str, Any] = field(default_factory=dict)
    """Python, NumPy and torch RNG states (:func:`capture_rng`)."""
    config_hash: str = ""
    """:func:`~asyncrl.learner.checkpoint.settings.config_hash` of the run's config: a resume with other training
    settings is named in a warning."""
    config: dict[str, Any] = field(default_factory=dict)
    """The resolved config, flattened (to name the fields a resume changes)."""
    dispatch: dict[str, int] = field(default_factory=dict)
    """The dispatcher's counters in Redis at save time (``created`` = the prompt stream's position)."""
    replay: dict[str, Any] = field(default_factory=dict)
    """The replay consumer group's position at save time (last-delivered id, pending, stream length)."""
    metrics_lines: int = 0
    """Lines of metrics.jsonl at save time (one per step)."""
    reward_mean: float | None = None
    """Mean reward of the steps since the checkpoint before (ranks checkpoints for ``keep_best``)."""
    restore: int = 0
    """Restore generation of the weight manifests at save time (bumped by every resume)."""
    has_critic: bool = False
    world_size: int = 1
    """Learner ranks that saved it: DeepSpeed's ZeRO state is partitioned by rank, so a resume needs as many."""
    rank_rngs: list[dict[str, Any]] = field(default_factory=list)
    """The RNG states of ranks 1…N−1 (:func:`capture_rng` on each), in rank order."""
    reason: str = "every"
    """Why it was saved: ``every``, ``end``, ``sigterm`` or ``max_minutes`` (the time budget)."""
    saved_at: float = field(default_factory=time.time)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1, sort_keys=True)

    @classmethod
    def from_file(cls, path: Path) -> SavedState:
        try:
            data = json.loads(path.read_text())
            known = {f.name for f in fields(cls)}
            return cls(**{k: v for k, v in data.items() if k in known})
        except (OSError, ValueError, TypeError) as exc:
            raise CheckpointError(f"{path}: unreadable run state ({exc}); resume from another checkpoint") from exc


def capture_rng() -> dict[str, Any]:
    """The process's Python, NumPy and torch (CPU and CUDA) RNG states, as JSON values."""
    version, internal, gauss = random.getstate()
    numpy_state = np.random.get_state()
    assert isinstance(numpy_state, tuple)  # the global generator is MT19937: its legacy state is a tuple
    name, keys, pos, has_gauss, cached = numpy_state
    states = {
        "python": [version, list(internal), gauss],
        "numpy": [name, keys.tolist(), int(pos), int(has_gauss), float(cached)],
        "torch": _b64(torch.get_rng_state()),
    }
    if torch.cuda.is_available():
        states["cuda"] = [_b64(s) for s in torch.cuda.get_rng_state_all()]
    return states


def restore_rng(states: dict[str, Any]) -> None:
    """Put back the RNG states of :func:`capture_rng` (a missing entry is left as it is)."""
    if "python" in states:
        version, internal, gauss = states["python"]
        random.setstate((version, tuple(internal), gauss))
    if "numpy" in states:
        name, keys, pos, has_gauss, cached = states["numpy"]
        np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    if "torch" in states:
        torch.set_rng_state(_unb64(states["torch"]))
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([_unb64(s) for s in states["cuda"]])


def _b64(state: torch.Tensor) -> str:
    return base64.b64encode(state.cpu().numpy().tobytes()).decode()


def _unb64(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8)


def _files(folder: Path) -> Iterator[Path]:
    for path in sorted(folder.rglob("*")):
        if path.is_file() and path != folder / MANIFEST:
            yield path


def _sha256(path: Path, sync: bool = False) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            digest.update(chunk)
        if sync:
            os.fsync(f.fileno())
    return digest.hexdigest()


def write_manifest(folder: Path) -> dict[str, dict[str, Any]]:
    """Hash (and fsync) every file under ``folder`` into ``manifest.json``; returns its entries."""
    entries = {
        p.relative_to(folder).as_posix(): {"sha256": _sha256(p, sync=True), "bytes": p.stat().st_size}
        for p in _files(folder)
    }
    (folder / MANIFEST).write_text(json.dumps({"files": entries}, indent=1, sort_keys=True))
    _fsync(folder / MANIFEST)
    return entries


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@dataclass(frozen=True)
class Checkpoint:
    """A checkpoint folder whose every file matched its manifest when it was opened (:func:`open_checkpoint`)."""

    path: Path
    state: SavedState
    files: dict[str, dict[str, Any]]

    @property
    def bytes(self) -> int:
        return sum(int(meta["bytes"]) for meta in self.files.values())


def open_checkpoint(path: Path) -> Checkpoint:
    """Verify ``path`` against its manifest and read its run state; :class:`CheckpointError` names a bad file."""
    manifest = path / MANIFEST
    if not manifest.is_file():
        raise CheckpointError(f"{manifest} is missing: {path} is not a complete checkpoint; resume from another one")
    try:
        entries = json.loads(manifest.read_text())["files"]
    except (ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{manifest} is unreadable ({exc}); resume from another checkpoint") from exc
    for name, meta in entries.items():
        _verify_file(path / name, meta)
    for extra in _files(path):
        if extra.relative_to(path).as_posix() not in entries:
            log.warning("ignored a file that the checkpoint's manifest does not list", file=extra)
    if STATE not in entries:
        raise CheckpointError(f"{path / STATE} is not in {manifest}; resume from another checkpoint")
    return Checkpoint(path, SavedState.from_file(path / STATE), entries)


def _verify_file(path: Path, meta: dict[str, Any]) -> None:
    if not path.is_file():
        raise CheckpointError(f"{path} is missing (listed in its manifest.json); resume from another checkpoint")
    got = _sha256(path)
    if got != meta.get("sha256"):
        raise CheckpointError(
            f"{path} does not match its manifest.json (sha256 {got[:16]}…, expected {str(meta.get('sha256'))[:16]}…): "
            "the file changed after the checkpoint was written; resume from another checkpoint"
        )


def manifest_digest(folder: Path) -> dict[str, Any]:
    """``files``, ``bytes`` and ``manifest_sha256`` of a complete checkpoint, read from its manifest: the sha256 of
    manifest.json pins every file's content, so it is the checkpoint's digest (for the audit trail)."""
    entries = json.loads((folder / MANIFEST).read_text())["files"]
    total = sum(int(meta["bytes"]) for meta in entries.values())
    return {"files": len(entries), "bytes": total, "manifest_sha256": _sha256(folder / MANIFEST)}
