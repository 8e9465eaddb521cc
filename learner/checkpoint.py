"""Checkpoints: what a resumed run needs that Redis does not already hold, written so that a crash never leaves half
of one, verified before it is trusted.

One checkpoint is the folder ``runs/<name>/checkpoints/step-<N>/``::

    policy/ds/     DeepSpeed checkpoint of the policy: weights, optimizer and scheduler state (``save_checkpoint``)
    critic/ds/     the same for the critic, when the run trains one
    hf/            the policy as a Hugging Face folder (safetensors, config, tokenizer), loadable as is
    state.json     :class:`SavedState`: step and policy version, KL coefficient, RNG states, config hash, and the
                   dispatcher and replay positions at save time
    manifest.json  sha256 and size of every other file

It is written into ``.tmp-step-<N>/``, every file is fsynced and hashed into the manifest, and only then is the folder
renamed to ``step-<N>`` (atomic): a folder named ``step-<N>`` with a manifest is complete. A resume verifies every
file against the manifest and refuses a checkpoint with a changed or missing file, naming it.

**A save that fails** removes its ``.tmp-step-<N>/``; when the disk refused it (full, read-only, not writable: an
``OSError`` such as ENOSPC, or torch's ``[enforce fail at inline_container.cc] unexpected pos`` from a short write)
the learner stops with one line (:class:`CheckpointError`, also logged) that names the folder, its mount point and
free bytes, and what to do. A ``.tmp-step-*`` left by a learner that died mid-save never blocks anything: the next
learner removes it at start (or, where it cannot, ignores it: only ``step-<N>`` folders with a manifest count), and a
save removes one of its own name before it starts.

**What lives where.** The control plane and the replay stream live in Redis (AOF-persisted) and are *not* rolled back
by a resume: group ids, the ``created``/``released`` counters (the prompt stream's position), the in-flight ledger,
the queue, the replay stream and its consumer group hold groups that the discarded steps never saw, and rolling them
back would reuse ids or lose work. The checkpoint holds only what Redis cannot: the model and optimizer, the KL
controller, the RNGs, the step. The positions in ``state.json`` (dispatcher counters, the consumer group's
last-delivered id) are a record for people and for a resume into an empty Redis (:meth:`Dispatcher.adopt`).

**Exactly once.** The groups trained after the checkpoint are the only ones whose effect a resume loses; Redis knows
which they are (:mod:`asyncrl.learner.trained`): their replay entries are acknowledged only once a checkpoint covers
them, so a resume takes their ids out of the ``done`` set and trains them again from the pending list. Every other group
is either in the checkpoint (trained at or before its step) or not trained yet (queued, in flight, or in the stream).
Resuming from an older checkpoint than the latest, the groups trained between the two were acknowledged by the later one
and cannot be read again: they are counted lost (``restore_lost`` in the dispatcher's counters) and admission releases
replacements; the later checkpoints move to ``discarded/`` so that ``latest`` never picks one of them.
"""

from __future__ import annotations

import base64
import contextlib
import errno
import hashlib
import json
import os
import random
import re
import shutil
import time
import traceback
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from asyncrl.common.config import RunConfig
from asyncrl.common.observability.logs import get_logger
from asyncrl.common.private import open_private, private_dir
from asyncrl.learner import dist, ranks

if TYPE_CHECKING:
    from asyncrl.learner.critic import ValueEngine
    from asyncrl.learner.engine import PolicyEngine

log = get_logger("checkpoint")

MANIFEST = "manifest.json"
STATE = "state.json"
DS_TAG = "ds"
"""DeepSpeed's tag folder inside ``policy/`` and ``critic/``."""
RESUMABLE_CHANGES = (
    "learner.steps",
    "learner.wait_for_batch_s",
    "learner.no_actors_s",
    "learner.group_deadline_s",
    "run.root",
)
RESUMABLE_SECTIONS = ("checkpoint.", "transport.", "monitoring.")
"""Settings a resume may change without a warning: they do not change what is trained."""
_STEP_DIR = re.compile(r"step-(\d+)")
_HASH_CHUNK = 2**20


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used; the message names the file and says what to do."""


# --------------------------------------------------------------------------- run state


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
    """:func:`config_hash` of the run's config: a resume with other training settings is named in a warning."""
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
    name, keys, pos, has_gauss, cached = np.random.get_state()
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


def flat_config(config: RunConfig) -> dict[str, Any]:
    """``{"section.field": value}`` of every field, as JSON values."""
    return {
        f"{section}.{name}": value
        for section, values in config.model_dump(mode="json").items()
        for name, value in values.items()
    }


def _trains_the_same(name: str) -> bool:
    return name not in RESUMABLE_CHANGES and not name.startswith(RESUMABLE_SECTIONS)


def config_hash(config: RunConfig) -> str:
    """sha256 of the settings that change what is trained (not steps, checkpoints, transport or monitoring)."""
    relevant = {k: v for k, v in flat_config(config).items() if _trains_the_same(k)}
    return hashlib.sha256(json.dumps(relevant, sort_keys=True).encode()).hexdigest()


def config_changes(saved: dict[str, Any], config: RunConfig) -> list[str]:
    """The training settings that differ between a checkpoint's config and ``config``: ``name: old -> new``."""
    now = flat_config(config)
    names = sorted(k for k in saved.keys() | now.keys() if _trains_the_same(k) and saved.get(k) != now.get(k))
    return [f"{k}: {saved.get(k)!r} -> {now.get(k)!r}" for k in names]


# --------------------------------------------------------------------------- files, manifest, verification


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


def complete_checkpoints(root: Path) -> list[tuple[int, Path]]:
    """(step, folder) of every complete checkpoint under ``root`` (a ``step-<N>`` folder with a manifest), by step."""
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        match = _STEP_DIR.fullmatch(child.name)
        if match and child.is_dir() and (child / MANIFEST).is_file():
            found.append((int(match.group(1)), child))
    return sorted(found)


def checkpoint_step(folder: Path) -> int | None:
    """The step of a ``step-<N>`` checkpoint folder (None for a folder named otherwise)."""
    match = _STEP_DIR.fullmatch(folder.name)
    return int(match.group(1)) if match else None


def find_checkpoint(spec: str, root: Path) -> Path:
    """The folder ``spec`` names: ``latest`` (the complete checkpoint of the highest step under ``root``), or a path."""
    if spec != "latest":
        path = Path(spec)
        if not path.is_dir():
            raise CheckpointError(f"{path}: no such checkpoint folder (pass --resume latest or a step-<N> folder)")
        return path
    saved = complete_checkpoints(root)
    if not saved:
        raise CheckpointError(
            f"no complete checkpoint in {root} to resume from; set checkpoint.every to save periodically "
            "(a run also saves at its end and on SIGTERM)"
        )
    return saved[-1][1]


# --------------------------------------------------------------------------- save, load, prune


class Checkpointer:
    """Saves and loads the checkpoints of one run (collective under data parallelism: every rank calls it)."""

    def __init__(
        self, config: RunConfig, policy: PolicyEngine, critic: ValueEngine | None = None, tokenizer: Any = None
    ) -> None:
        self.config = config
        self.policy = policy
        self.critic = critic
        self.tokenizer = tokenizer
        self.root = config.run_dir / "checkpoints"
        if dist.rank() == 0:
            remove_partial_saves(self.root)

    def save(self, state: SavedState) -> Path:
        """Write ``state`` and the engines to ``step-<N>`` (temporary folder, manifest, rename), then prune.

        A failed save removes its temporary folder; a disk that refused it raises :class:`CheckpointError` naming
        the disk (:func:`disk_refusal`). Collective: a rank whose DeepSpeed shard failed fails every rank's save.
        """
        started = time.perf_counter()
        final, tmp = self.root / f"step-{state.step}", self.root / f".tmp-step-{state.step}"
        ranks.lead("save", state)
        state.has_critic = self.critic is not None
        state.world_size = dist.world_size()
        state.rank_rngs = dist.all_gather_object(capture_rng())[1:]
        try:
            entries = self._write(state, tmp, final)
        except Exception as exc:
            refusal = disk_refusal(exc, tmp)  # the free bytes at the failure, before the clean-up gives some back
            if refusal is not None:
                _release_files(exc)
            if dist.rank() == 0:
                shutil.rmtree(tmp, ignore_errors=True)
            if refusal is None:
                raise
            if tmp.exists():
                refusal += f"; {tmp} could not be removed either (ignored by a resume; delete it when you can)"
            log.error("checkpoint not saved", step=state.step, reason=state.reason, problem=refusal)
            raise CheckpointError(refusal) from exc
        if dist.rank() == 0:
            self._log_saved(state, final, entries, time.perf_counter() - started)
            prune(self.root, self.config.checkpoint.keep, self.config.checkpoint.keep_best)
        dist.barrier()
        return final

    def _write(self, state: SavedState, tmp: Path, final: Path) -> dict[str, dict[str, Any]]:
        """The files of :meth:`save` into ``tmp``, then renamed to ``final`` (rank 0); the manifest's entries."""
        if dist.rank() == 0:
            _remove_partial(tmp)  # of a save of this step that died: a fresh folder, never a FileExistsError
            private_dir(tmp)  # 0700 (the weights); what DeepSpeed writes in it follows the umask
        dist.barrier()
        failed = None
        try:
            self.policy.engine.save_checkpoint(str(tmp / "policy"), tag=DS_TAG, save_latest=False)
            if self.critic is not None:
                self.critic.engine.save_checkpoint(str(tmp / "critic"), tag=DS_TAG, save_latest=False)
        except (OSError, RuntimeError) as exc:  # told to every rank first, so that none waits for a shard
            failed = exc
        problems = [p for p in dist.all_gather_object(None if failed is None else str(failed)) if p is not None]
        if failed is not None:
            raise failed
        if problems:
            raise RuntimeError(f"another learner rank could not write its checkpoint shard: {problems[0]}")
        params = self.policy.state_dict_for_broadcast() if self.config.checkpoint.export_hf else {}
        entries: dict[str, dict[str, Any]] = {}
        if dist.rank() == 0:
            if self.config.checkpoint.export_hf:
                export_hf(self.policy.module, params, self.tokenizer, tmp / "hf")
            (tmp / STATE).write_text(state.to_json())
            entries = write_manifest(tmp)
            _replace(tmp, final)
        return entries

    def _log_saved(self, state: SavedState, path: Path, entries: dict[str, dict[str, Any]], seconds: float) -> None:
        parts: dict[str, int] = {}
        for name, meta in entries.items():
            part = name.split("/", 1)[0] if "/" in name else "state"
            parts[part] = parts.get(part, 0) + int(meta["bytes"])
        log.info(
            "saved checkpoint",
            step=state.step,
            reason=state.reason,
            path=path,
            bytes=sum(parts.values()),
            **{f"{part}_bytes": size for part, size in sorted(parts.items())},
            seconds=round(seconds, 3),
        )

    def load(self, checkpoint: Checkpoint) -> SavedState:
        """Load the engines' weights, optimizer and scheduler state from a verified checkpoint; its run state."""
        ranks.lead("restore", checkpoint)
        state = checkpoint.state
        check_world_size(checkpoint, dist.world_size())
        if state.has_critic != (self.critic is not None):
            have = "a critic" if self.critic is not None else "no critic"
            raise CheckpointError(
                f"{checkpoint.path} was saved by a run {'with' if state.has_critic else 'without'} a critic, and this "
                f"config has {have}; resume with the config the run was started with"
            )
        _load_engine(self.policy.engine, checkpoint.path / "policy")
        if self.critic is not None:
            _load_engine(self.critic.engine, checkpoint.path / "critic")
        return state


def check_world_size(checkpoint: Checkpoint, world_size: int) -> None:
    """A resume needs the ranks that saved the checkpoint (DeepSpeed's ZeRO state is partitioned by rank): another
    number is refused, naming the one to use."""
    saved = checkpoint.state.world_size
    if saved != world_size:
        raise CheckpointError(
            f"{checkpoint.path} was saved by {saved} learner rank(s) and this learner has {world_size}; DeepSpeed's "
            f"ZeRO state is partitioned by rank, so resume with {saved} (torchrun --nproc-per-node {saved} …), or "
            "start a new run with its exported model (checkpoint.export_hf) as model.path"
        )


def _load_engine(engine: Any, folder: Path) -> None:
    path, _ = engine.load_checkpoint(str(folder), tag=DS_TAG, load_optimizer_states=True, load_lr_scheduler_states=True)
    if path is None:
        raise CheckpointError(f"{folder / DS_TAG}: DeepSpeed found no checkpoint to load; resume from another one")


def export_hf(module: torch.nn.Module, params: dict[str, torch.Tensor], tokenizer: Any, out: Path) -> Path:
    """The policy as a Hugging Face folder: ``params`` (full weights, named as in the HF checkpoint) as safetensors,
    the model's config, and the tokenizer. transformers' ``AutoModelForCausalLM`` and vLLM load it as is."""
    module.save_pretrained(out, state_dict=params, safe_serialization=True)  # type: ignore[operator]
    if tokenizer is not None:
        tokenizer.save_pretrained(out)
    return out


def _replace(tmp: Path, final: Path) -> None:
    """Rename the finished folder into place; a checkpoint of the same step (a discarded history's) is removed."""
    if final.exists():
        log.warning("replaced a checkpoint of the same step from steps a resume discarded", path=final)
        shutil.rmtree(final)
    os.replace(tmp, final)
    with contextlib.suppress(OSError):  # directory fsync: not supported everywhere
        _fsync(final.parent)


PARTIAL_SAVE = ".tmp-step-*"
"""The temporary folders of saves in progress (or of saves that died: no learner saves at its start)."""
_DISK_FULL_TEXT = ("unexpected pos", "file write failed", "No space left", "Disk quota exceeded")
"""How torch's zip writer (``[enforce fail at inline_container.cc] unexpected pos``, ``PytorchStreamWriter failed
writing file … file write failed``) and the safetensors writer report a short write: without an errno."""
_DISK_ERRNO_TEXT = {errno.EROFS: "Read-only file system", errno.EACCES: "Permission denied"}
_OCTAL = re.compile(r"\\([0-7]{3})")  # mountinfo writes a space in a path as \040


def _release_files(exc: BaseException) -> None:
    """Drop the local variables of the frames ``exc`` (and what it was raised from) went through: a writer that
    failed mid-file (torch's zip writer) still holds its file open from there, and a deleted file that is open keeps
    its space on the disk until the error object is gone."""
    seen: set[int] = set()
    chain: BaseException | None = exc
    while chain is not None and id(chain) not in seen:
        seen.add(id(chain))
        traceback.clear_frames(chain.__traceback__)
        chain = chain.__cause__ or chain.__context__


def _remove_partial(tmp: Path) -> None:
    if tmp.exists():
        shutil.rmtree(tmp)  # raises: a folder that cannot be removed is the disk's refusal, named by the caller
        log.warning("removed a checkpoint folder that a save left unfinished", path=tmp)


def remove_partial_saves(root: Path) -> list[Path]:
    """Remove the ``.tmp-step-*`` folders under ``root`` (left by learners that died while saving); one that cannot
    be removed (a read-only disk) is named in a warning and ignored: nothing reads or counts it."""
    removed = []
    for tmp in sorted(root.glob(PARTIAL_SAVE)) if root.is_dir() else []:
        try:
            shutil.rmtree(tmp)
        except OSError as exc:
            log.warning(
                "left an unfinished checkpoint folder in place (it is ignored)",
                path=tmp,
                error=exc.strerror or exc,
                action=f"delete it when its disk is writable: rm -r {tmp}",
            )
        else:
            log.warning("removed a checkpoint folder that a save left unfinished", path=tmp)
            removed.append(tmp)
    return removed


def disk_refusal(exc: BaseException, path: Path) -> str | None:
    """The one line a person reads when the disk under ``path`` refused a write — full (ENOSPC, EDQUOT, or torch's
    short-write error), read-only (EROFS) or not writable (EACCES, EPERM) — naming the path, its mount point, the
    free bytes there and what to do; None when ``exc`` is something else."""
    codes, texts = set(), []
    chain: BaseException | None = exc
    while chain is not None and len(texts) < 8:  # the errors it was raised from, too
        if isinstance(chain, OSError) and chain.errno is not None:
            codes.add(chain.errno)
        texts.append(str(chain))
        chain = chain.__cause__ or chain.__context__
    text = " ".join(texts)
    codes |= {code for code, words in _DISK_ERRNO_TEXT.items() if words in text}
    mount, free, total = disk_of(path)
    where = f"{path} (on the file system mounted at {mount}: {free} bytes free of {total})"
    reason = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else type(exc).__name__
    if codes & {errno.ENOSPC, errno.EDQUOT} or any(words in text for words in _DISK_FULL_TEXT):
        what = (
            f"the disk is full: free space on {mount}, keep fewer checkpoints (checkpoint.keep) or write smaller ones "
            "(checkpoint.export_hf = false), or give the run a larger disk (run.root)"
        )
    elif errno.EROFS in codes:
        what = f"{mount} is mounted read-only: remount it read-write, or give the run a writable disk (run.root)"
    elif codes & {errno.EACCES, errno.EPERM}:
        what = f"this user (uid {os.getuid()}) may not write there: fix the folder's owner or permissions"
    else:
        return None
    return f"checkpoint not saved: writing {where} failed ({reason}); {what}"


def disk_of(path: Path) -> tuple[Path, int, int]:
    """``(mount point, free bytes, total bytes)`` of the file system holding ``path`` (or its nearest existing
    parent); free is what this user may still write (``f_bavail``)."""
    existing = Path(os.path.realpath(path))
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    mount = _mount_point(existing)
    try:
        usage = shutil.disk_usage(existing)
    except OSError:
        return mount, -1, -1
    return mount, usage.free, usage.total


def _mount_point(path: Path) -> Path:
    """The longest mount point above ``path`` in ``/proc/self/mountinfo`` (which also knows bind mounts of a folder,
    where ``os.path.ismount`` does not); ``os.path.ismount`` where there is no such file."""
    try:
        lines = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        lines = []
    points = [Path(_OCTAL.sub(lambda m: chr(int(m[1], 8)), line.split()[4])) for line in lines if len(line.split()) > 4]
    if points:
        return max((p for p in points if path == p or p in path.parents), key=lambda p: len(p.parts), default=path)
    mount = path
    while not os.path.ismount(mount) and mount != mount.parent:
        mount = mount.parent
    return mount


def reward_of(path: Path) -> float | None:
    """The mean reward a checkpoint recorded, or None (none recorded, or unreadable)."""
    try:
        value = json.loads((path / STATE).read_text()).get("reward_mean")
    except (OSError, ValueError):
        return None
    return float(value) if value is not None else None


def prune(root: Path, keep: int, keep_best: bool) -> list[Path]:
    """Remove complete checkpoints beyond the last ``keep`` (and the best by mean reward when ``keep_best``)."""
    saved = complete_checkpoints(root)
    kept = {path for _, path in saved[-keep:]}
    if keep_best:
        rewarded = [(reward, step, path) for step, path in saved if (reward := reward_of(path)) is not None]
        if rewarded:
            kept.add(max(rewarded)[2])  # ties: the later step
    removed = [path for _, path in saved if path not in kept]
    for path in removed:
        shutil.rmtree(path)
        log.info("removed an old checkpoint", path=path, keep=keep, keep_best=keep_best)
    return removed


def set_aside_after(root: Path, step: int) -> list[Path]:
    """Move the checkpoints after ``step`` (of the steps a resume from ``step`` discards) to ``discarded/``, so that
    ``--resume latest`` never picks one of them. Returns their new paths."""
    later = [path for saved_step, path in complete_checkpoints(root) if saved_step > step]
    if not later:
        return []
    target = root / "discarded" / time.strftime("%Y%m%d-%H%M%S")
    target.mkdir(parents=True, exist_ok=True)
    moved = [Path(shutil.move(str(path), str(target / path.name))) for path in later]
    log.warning(
        "set aside checkpoints of steps this resume discards",
        count=len(moved),
        folder=target,
        action="none; delete the folder when it is no longer needed",
    )
    return moved


# --------------------------------------------------------------------------- metrics.jsonl


def truncate_metrics(path: Path, step: int) -> tuple[int, int]:
    """Keep the lines of a per-step JSONL file (metrics.jsonl, samples.jsonl) up to ``step``; move later ones (steps a
    resume discards, or a half-written line) to ``<name>.discarded.jsonl`` beside it. Returns (kept, moved)."""
    if not path.is_file():
        return 0, 0
    kept, moved = [], []
    for line in path.read_text().splitlines():
        try:
            (kept if int(json.loads(line)["step"]) <= step else moved).append(line)
        except (ValueError, KeyError, TypeError):
            moved.append(line)
    if moved:
        with open_private(path.with_name(f"{path.stem}.discarded.jsonl"), "a") as f:
            f.writelines(line + "\n" for line in moved)
        tmp = path.with_suffix(".jsonl.tmp")
        with open_private(tmp, "w") as f:
            f.write("".join(line + "\n" for line in kept))
        tmp.replace(path)
    return len(kept), len(moved)


def count_lines(path: Path) -> int:
    try:
        with path.open("rb") as f:
            return sum(1 for _ in f)
    except FileNotFoundError:
        return 0
