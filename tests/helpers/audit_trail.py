"""A run's audit trail as a test reads it."""

from __future__ import annotations

from asyncrl.common.plane import audit as audit_module
from asyncrl.common.plane.audit_file import entry_line
from asyncrl.common.plane.keys import RunKeys


def entries(client, run: str) -> list[dict]:
    """The run's audit stream as audit.jsonl lines (once this process's writer has written what it recorded)."""
    assert audit_module.flush(30, client)
    return [entry_line(i.decode(), f) for i, f in client.xrange(RunKeys(run).audit)]
