"""A checkpoint save that the disk refused, and the folders that saves which died left behind.

When the disk refused a save (full, read-only, not writable: an ``OSError`` such as ENOSPC, or torch's ``[enforce fail
at inline_container.cc] unexpected pos`` from a short write), :func:`disk_refusal` is the one line the learner stops
with: it names the folder, its mount point and free bytes (:func:`disk_of`), and what to do. A ``.tmp-step-*`` left by
a learner that died mid-save never blocks anything: the next learner removes it at start (:func:`remove_partial_saves`;
or, where it cannot, ignores it: only ``step-<N>`` folders with a manifest count).
"""

from __future__ import annotations

import errno
import os
import re
import shutil
from pathlib import Path

from asyncrl.common.observability.logs import get_logger

log = get_logger("checkpoint")

PARTIAL_SAVE = ".tmp-step-*"
"""The temporary folders of saves in progress (or of saves that died: no learner saves at its start)."""
_DISK_FULL_TEXT = ("unexpected pos", "file write failed", "No space left", "Disk quota exceeded")
"""How torch's zip writer (``[enforce fail at inline_container.cc] unexpected pos``, ``PytorchStreamWriter failed
writing file … file write failed``) and the safetensors writer report a short write: without an errno."""
_DISK_ERRNO_TEXT = {errno.EROFS: "Read-only file system", errno.EACCES: "Permission denied"}
_OCTAL = re.compile(r"\\([0-7]{3})")  # mountinfo writes a space in a path as \040


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
    existing = _nearest_existing(path)
    return (_mount_point(existing), *disk_space(existing))


def disk_space(path: Path) -> tuple[int, int]:
    """``(free bytes, total bytes)`` of the file system holding ``path`` (or its nearest existing parent); ``(-1, -1)``
    where it cannot be read."""
    try:
        usage = shutil.disk_usage(_nearest_existing(path))
    except OSError:
        return -1, -1
    return usage.free, usage.total


def _nearest_existing(path: Path) -> Path:
    existing = Path(os.path.realpath(path))
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    return existing


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
