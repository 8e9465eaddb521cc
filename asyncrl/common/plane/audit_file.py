"""The audit trail's file: ``audit.jsonl`` in the run folder, a copy of the run's audit stream (:class:`AuditMirror`),
one JSON object per entry (:func:`entry_line`). The stream and what goes into it are
:mod:`asyncrl.common.plane.audit`.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from asyncrl.common.observability.logs import get_logger
from asyncrl.common.observability.metrics import AUDIT_FAILURES, AUDIT_MIRRORED
from asyncrl.common.plane import replies
from asyncrl.common.plane.audit import EXIT_FLUSH_S, RESERVED, client_secrets, failed, flush, scrub
from asyncrl.common.plane.keys import RunKeys
from asyncrl.common.private import open_private, private_dir

if TYPE_CHECKING:
    import redis

log = get_logger("audit")


def entry_line(entry_id: str, fields: Mapping[bytes, bytes], secrets: tuple[str, ...] = ()) -> dict:
    """The audit.jsonl object of one stream entry (scrubbed once more: anyone with the Redis password can XADD)."""
    text = {_text(k): _text(v) for k, v in fields.items()}
    try:
        data = json.loads(text.get("data") or "{}")
        if not isinstance(data, dict):
            raise ValueError("data is not a JSON object")
        pid = int(text.get("pid", "0"))
        unix = float(text.get("unix", "0"))
    except ValueError as exc:
        AUDIT_FAILURES.labels("mirror").inc()
        return {"id": entry_id, "event": "audit.unreadable", "reason": scrub(str(exc), secrets)}
    who = {"process": text.get("process", ""), "kind": text.get("kind", ""), "host": text.get("host", ""), "pid": pid}
    data = {f"{k}_" if k in RESERVED else k: v for k, v in data.items()}
    line = {"id": entry_id, "time": text.get("time", ""), "unix": unix, "event": text.get("event", ""), "who": who}
    return scrub(line | data, secrets)


def recorded_lost(client: redis.Redis, run: str, process_ids: set[str], page: int = 1_000) -> set[str]:
    """Of ``process_ids``, those whose newest lifecycle entry in ``run``'s audit stream is ``process.lost`` (not a later
    ``process.joined``): losses a learner already recorded, which a learner started after it must not record again.
    Reads the stream from its newest entry back, a page at a time, until each id's newest entry is found."""
    pending, lost, newest = set(process_ids), set(), "+"
    key = RunKeys(run).audit
    while pending:
        entries = replies.stream_range(client.xrevrange(key, max=newest, count=page))
        for entry_id, fields in entries:
            line = entry_line(_text(entry_id), fields)
            if line["event"] == "process.lost" and line.get("process") in pending:
                pending.discard(line["process"])
                lost.add(line["process"])
            elif line["event"] == "process.joined":
                pending.discard(line["who"]["process"])
        if len(entries) < page:
            break
        newest = "(" + _text(entries[-1][0])
    return lost


def _text(value: bytes | str) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def _stream_id(text: str) -> tuple[int, int]:
    ms, _, seq = text.partition("-")
    return int(ms), int(seq or 0)


class AuditMirror:
    """Copies the audit stream of ``run`` into ``path`` (``audit.jsonl``): every entry once, in stream order.

    Where it stands is the file itself — the ``id`` of its last complete line — so a mirror started on a file another
    (killed) learner wrote continues right after that entry: nothing twice, and nothing skipped while the stream
    still holds it (it keeps about :data:`AUDIT_MAXLEN`). A half-written last line (a crash mid-write) is cut off;
    its entry is copied again. Lines are appended and flushed (and fsynced) per batch; the file is 0600 in a 0700
    folder (``common/private.py``): it holds no secret, but it reveals the run (its hosts, processes and refusals).

    :meth:`start` polls every ``period_s`` on a daemon thread; :meth:`close` stops it and copies what remains.
    """

    BATCH = 500

    def __init__(self, client: redis.Redis, run: str, path: Path, period_s: float = 1.0) -> None:
        self.client = client
        self.key = RunKeys(run).audit
        self.path = Path(path)
        self.period_s = period_s
        self.last_id = self._resume_point()
        self._secrets = client_secrets(client)
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="audit-mirror", daemon=True)

    def start(self) -> AuditMirror:
        self._thread.start()
        return self

    def pump(self) -> int:
        """Append every entry after :attr:`last_id`; returns how many. Raises Redis errors (the thread logs them)."""
        copied = 0
        with self._lock:
            while entries := replies.stream_range(
                self.client.xrange(self.key, min=f"({self.last_id}", count=self.BATCH)
            ):
                lines = [entry_line(_text(entry_id), fields, self._secrets) for entry_id, fields in entries]
                self._append(lines)
                self.last_id, copied = lines[-1]["id"], copied + len(lines)
                if len(entries) < self.BATCH:
                    break
        AUDIT_MIRRORED.inc(copied)
        return copied

    def close(self) -> None:
        """Stop polling and copy what remains, this process's queued events included (idempotent; a Redis that is
        gone is logged)."""
        if self._stop.is_set():
            return
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(self.period_s + 30)
        flush(EXIT_FLUSH_S)
        try:
            self.pump()
        except Exception as exc:
            failed("mirror", "close", exc)

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            try:
                self.pump()
            except Exception as exc:  # Redis away: try again at the next period; the entries wait in the stream
                failed("mirror", "poll", exc)

    def _append(self, lines: list[dict]) -> None:
        with open_private(self.path, "a") as f:  # 0600 in a 0700 folder: the trail reveals the run
            f.writelines(json.dumps(line, default=str) + "\n" for line in lines)
            f.flush()
            os.fsync(f.fileno())

    def _resume_point(self) -> str:
        """The ``id`` of the file's last complete line ("0-0" for a new file); a partial last line is cut off."""
        if not self.path.is_file():
            private_dir(self.path.parent)
            return "0-0"
        last_id, end = _last_line_id(self.path)
        size = self.path.stat().st_size
        if end < size:
            log.warning("audit.jsonl ended in a partial line; cut it off", path=self.path, bytes=size - end)
            os.truncate(self.path, end)
        return last_id


def _last_line_id(path: Path, chunk: int = 65_536) -> tuple[str, int]:
    """(the ``id`` of the last complete line that has one, the offset just past the last complete line)."""
    with path.open("rb") as f:
        size = pos = f.seek(0, os.SEEK_END)
        buf = b""
        end = None
        while pos > 0:
            step = min(chunk, pos)
            pos -= step
            f.seek(pos)
            buf = f.read(step) + buf
            lines = buf.split(b"\n")
            if end is None and len(lines) > 1:
                end = size - len(lines[-1])
            known = lines[:-1] if pos == 0 else lines[1:-1]  # lines whose start is known
            for line in reversed(known):
                try:
                    entry_id = json.loads(line)["id"]
                    _stream_id(entry_id)
                    return entry_id, end if end is not None else 0
                except (ValueError, KeyError, TypeError):
                    continue
        return "0-0", end if end is not None else 0
