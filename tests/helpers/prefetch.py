"""Warm starts paid in the background: a model that a test late in the serial chain needs is built while the chain
runs other tests, at the lowest CPU priority (``nice 19``), so it takes only the cycles the running tests leave idle
(the suite keeps about one of the two cores busy on average) and slows none of them.

Under ``bin/test`` (xdist) the controller starts each wanted build as soon as a worker has collected a test that uses
it, into ``<session temp>/prefetched/<name>``, and writes the build's exit status next to it when it ends; the test's
fixture (:func:`prefetched`) waits for that status. Without xdist, or when nothing started it, the fixture builds the
model itself, in the foreground. The tests that use a prefetched model run at the end of the chain
(``tests/conftest.py``), so the build has the whole chain to finish in.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
STATUS, LOG = "exit-status", "build.log"


@dataclasses.dataclass(frozen=True)
class Prefetch:
    name: str
    module: str
    """The test module (path from the repository root) whose fixture uses it."""
    command: Callable[[Path], list]
    """The build's command line, given the folder it writes the model to."""

    def wanted_by(self, nodeids: list[str]) -> bool:
        return any(nodeid.split("::", 1)[0] == self.module for nodeid in nodeids)


AGENT = Prefetch(
    "agent",
    "tests/e2e/test_agent_run.py",
    lambda model: [
        BIN / "rl-learner", "init-model", ROOT / "configs/agent.toml", "--set", f"model.path={model}",
        "--kind", "agent", "--warm-steps", "600", "--threads", "1",
    ],
)
PREFETCHES = (AGENT,)


def model_folder(root: Path, prefetch: Prefetch) -> Path:
    return root / "prefetched" / prefetch.name / "model"


def start(root: Path, prefetch: Prefetch) -> subprocess.Popen:
    """Start ``prefetch``'s build under ``root`` at nice 19, in a session of its own (so :func:`stop` ends its
    children too); a thread writes its exit status when it ends."""
    folder = model_folder(root, prefetch).parent
    folder.mkdir(parents=True, exist_ok=True)
    with (folder / LOG).open("w") as log:
        proc = subprocess.Popen(
            prefetch.command(model_folder(root, prefetch)),
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=lambda: os.nice(19),
        )

    def record() -> None:
        (folder / STATUS).write_text(str(proc.wait()))

    threading.Thread(target=record, name=f"prefetch-{prefetch.name}", daemon=True).start()
    return proc


def stop(proc: subprocess.Popen) -> None:
    """End a build the session no longer needs (its test failed early, or was deselected after collection)."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def session_root(factory: pytest.TempPathFactory) -> Path:
    """The session's temp folder: an xdist worker's is a folder inside the controller's (``popen-gw0``)."""
    base = factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


def prefetched(factory: pytest.TempPathFactory, prefetch: Prefetch, timeout_s: float = 900) -> Path:
    """``prefetch``'s model: waited for when the controller started its build, else built here and now."""
    root = session_root(factory)
    folder = model_folder(root, prefetch).parent
    if not folder.exists():
        model = factory.mktemp(prefetch.name) / "model"
        subprocess.run(prefetch.command(model), check=True, timeout=timeout_s)
        return model
    deadline = time.monotonic() + timeout_s
    while not (folder / STATUS).exists():
        assert time.monotonic() < deadline, f"the {prefetch.name} model's build did not end in {timeout_s:.0f} s"
        time.sleep(1)
    status = (folder / STATUS).read_text()
    log = (folder / LOG).read_text(errors="replace")
    assert status == "0", f"the {prefetch.name} model's build exited {status}:\n{log[-3000:]}"
    return model_folder(root, prefetch)
