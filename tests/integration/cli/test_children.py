"""rl-launch's children: stopped by PID, and whatever they leave behind — even in a session of its own — ended and
reaped by the launcher, which adopts it as a child subreaper. The launcher runs as a real separate process here
(becoming a subreaper would change the pytest process for every later test)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from asyncrl.common.observability.procs import parent_of
from tests.helpers.waits import wait_for

LAUNCHER = """
import sys, time
from pathlib import Path
from asyncrl.cli.children import Children

children = Children(Path(sys.argv[1]))
# A child that starts a grandchild in a session of its own (out of reach of a process-group kill), then dies.
leaver = children.start("leaver", [sys.executable, "-c", "import subprocess; "
    "p = subprocess.Popen(['sleep', '300'], start_new_session=True); print(p.pid, flush=True)"])
leaver.wait()
children.start("sleeper", ["sleep", "300"])
print("subreaper" if children.subreaper else "no subreaper", flush=True)
sys.stdin.readline()  # the test looks at the tree now
children.stop_all(timeout_s=5)
print("stopped", flush=True)
"""


def start_launcher(script: str, log_dir: Path) -> subprocess.Popen[str]:
    """``script`` as a launcher process of its own (stdin and stdout piped), its children's logs in ``log_dir``."""
    return subprocess.Popen(
        [sys.executable, "-c", script, str(log_dir)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=Path(__file__).resolve().parents[3],
    )


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def test_stop_all_ends_and_reaps_what_a_child_left_in_another_session(tmp_path: Path) -> None:
    launcher = start_launcher(LAUNCHER, tmp_path)
    stray = 0
    try:
        assert launcher.stdout.readline().strip() == "subreaper"
        stray = int((tmp_path / "leaver.log").read_text().split()[0])
        assert alive(stray) and parent_of(stray) == launcher.pid, "the orphan was not adopted by the launcher"
        launcher.stdin.write("\n")
        launcher.stdin.flush()
        assert launcher.stdout.readline().strip() == "stopped"
        assert launcher.wait(30) == 0
        wait_for(lambda: not alive(stray), "end of the process the child left behind", timeout_s=5)
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
        if stray and alive(stray):
            subprocess.run(["kill", "-9", str(stray)], check=False)


PINNING_LAUNCHER = """
import sys
from pathlib import Path
from asyncrl.cli.children import Children

children = Children(Path(sys.argv[1]))
script = "import subprocess, sys; p = subprocess.Popen(['sleep', '300']); print(p.pid, flush=True); sys.stdin.read()"
child = children.start("pinned", [sys.executable, "-c", script], cpus="0")
print(child.pid, flush=True)
sys.stdin.readline()
children.stop_all()
"""


def test_a_pinned_child_and_what_it_starts_run_on_their_cpus(tmp_path: Path) -> None:
    launcher = start_launcher(PINNING_LAUNCHER, tmp_path)
    try:
        child = int(launcher.stdout.readline())
        log = wait_for(lambda: (tmp_path / "pinned.log").read_text().split(), "grandchild pid logged", timeout_s=30)
        grandchild = int(log[0])
        for pid in (child, grandchild):  # taskset exec'd the child: what it starts inherits the pinning
            assert _allowed(pid) == "0", pid
    finally:
        launcher.communicate("\n", timeout=60)


def _allowed(pid: int) -> str:
    status = Path(f"/proc/{pid}/status").read_text()
    return next(line.split(":", 1)[1].strip() for line in status.splitlines() if line.startswith("Cpus_allowed_list"))


QUIET_LAUNCHER = """
import sys
from pathlib import Path
from asyncrl.cli.children import Children

children = Children(Path(sys.argv[1]))
child = children.start("child", [sys.executable, "-c", sys.argv[2]])
child.wait()
children.stop_all(timeout_s=5)
print("stopped", flush=True)
"""
ENDED = "import os, time\nif os.fork() == 0:\n    os._exit(0)\ntime.sleep(1)"
"""A child whose own child ended before it did: adopted by the launcher, that one only waits to be reaped (an
environments' process that saw its stdin close)."""
ENDS_SOON = "import subprocess; subprocess.Popen(['sleep', '1.5'], start_new_session=True)"
"""A child that leaves a process that ends by itself a moment later, as an actor's sweeper finishing its sweep (the
launcher once killed it mid-sweep and reported it as left behind on every clean exit)."""


@pytest.mark.parametrize("child", [ENDED, ENDS_SOON], ids=["already-ended", "ends-soon"])
def test_what_ends_by_itself_is_reaped_without_a_warning(tmp_path: Path, child: str) -> None:
    launcher = subprocess.run(
        [sys.executable, "-c", QUIET_LAUNCHER, str(tmp_path), child],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=Path(__file__).resolve().parents[3],
    )
    assert launcher.stdout.strip() == "stopped", launcher.stderr[-2000:]
    assert "left behind" not in launcher.stderr, launcher.stderr[-2000:]
