"""The code sandbox: its limits, the fence this machine runs, and each known escape tried and contained.

Every escape program asserts that its escape worked, so a contained escape scores 0 (``passed`` is False) with the
reason of the failure; the test process stands in for the reward worker and must live through each. Where an escape
would only be contained by namespaces, a control runs the same program unfenced to show that the attack is real.
Processes are found from outside by a name the program gives itself (``PR_SET_NAME``; children inherit it). Every
test starts processes (marked ``integration``) but the source checks of stage 2 and the harness, which only parse.
"""

from __future__ import annotations

import ast
import itertools
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import pytest

from asyncrl.common import sandbox
from asyncrl.common.plane.redis_server import EmbeddedRedis
from asyncrl.common.sandbox import run_python_tests
from asyncrl.common.sandbox.fences import MAX_PROCESSES, Isolation, candidates
from asyncrl.common.sandbox.run import HARNESS, MAX_FILE_BYTES, SUPERVISOR, Limits, SandboxResult, run_behind
from tests.helpers.machine import unavailable
from tests.helpers.waits import wait_for

TESTS = "assert add(2, 3) == 5, 'add(2, 3)'\n"
REPO = Path(__file__).resolve().parents[4]
_NAMES = itertools.count()


ROOT = Path(__file__).resolve().parents[4]


def needs_namespaces() -> None:
    fence = sandbox.isolation()
    if not fence.namespaces:
        unavailable(f"this machine runs the {fence.fence} fence, which does not claim to contain this")


def needs_another_uid_or_namespaces() -> None:
    """Guards the escapes that, run as the worker's own uid outside namespaces, would hit this machine for real."""
    fence = sandbox.isolation()
    if not (fence.namespaces or fence.per_run_uid):
        unavailable(f"the {fence.fence} fence runs programs as the worker's uid: not tried here")


def needs_a_process_limit() -> None:
    """Guards the fork bombs: without a process limit one would exhaust this machine, not the sandbox."""
    fence = sandbox.isolation()
    if fence.processes.startswith("not limited"):
        unavailable(f"the {fence.fence} fence here does not limit processes ({fence.processes})")


def process_name() -> str:
    """A name (at most 15 bytes, the kernel's limit) that no other process has."""
    return f"sbx{os.getpid() % 100000}-{next(_NAMES)}"


def named(name: str, code: str) -> str:
    """``code`` run by a process that first calls itself ``name`` (visible in /proc/<pid>/comm, inherited by forks)."""
    return f"import ctypes\nctypes.CDLL(None).prctl(15, {name.encode()!r}, 0, 0, 0)\n" + textwrap.dedent(code)


def processes_named(name: str) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if Path(f"/proc/{entry}/comm").read_text().strip() == name:
                    found.append(int(entry))
            except OSError:  # gone meanwhile
                pass
    return found


def wait_until_gone(name: str, timeout_s: float = 5.0) -> None:
    """Every process called ``name`` ends within ``timeout_s``; a failure lists those still running."""
    try:
        wait_for(lambda: not processes_named(name), f"end of every process called {name}", timeout_s=timeout_s)
    except AssertionError as exc:
        raise AssertionError(f"{exc}; still running: {processes_named(name)}") from None


def unfenced(code: str) -> subprocess.CompletedProcess[str]:
    """The control: the same program as a plain child of the test process."""
    return subprocess.run([sys.executable, "-I", "-c", code], capture_output=True, text=True, timeout=30)


def contained(result: SandboxResult, *words: str) -> None:
    assert not result.passed, result
    for word in words:
        assert word in result.reason, result


@pytest.fixture
def stand_in_worker() -> Iterator[subprocess.Popen[bytes]]:
    """A process of the test's uid with a secret in its environment: what a reward worker looks like from outside."""
    proc = subprocess.Popen(["sleep", "120"], env={"PATH": os.defpath, "ASYNCRL_SECRET": "hunter2"})
    try:
        yield proc
    finally:
        proc.kill()
        proc.wait()


# --------------------------------------------------------------------------- the programs of the sandboxed interpreters


def imported_modules(path: Path) -> set[str]:
    """The top-level name of every module ``path`` imports, at any depth; ``.`` for a relative import."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name.partition(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            names.add("." if node.level else (node.module or "").partition(".")[0])
    return names


@pytest.mark.parametrize("program", [SUPERVISOR, HARNESS], ids=["supervisor", "harness"])
def test_stage_2_and_the_harness_import_the_standard_library_only(program: Path) -> None:
    """They run in interpreters where asyncrl is not importable (``-I -S``; inside the private root, not even its
    files): an import of anything else would fail every run, so it fails here first."""
    assert program.is_file() and program.parent == Path(sandbox.__file__).resolve().parent, program
    imported = imported_modules(program)
    assert imported and imported <= sys.stdlib_module_names, sorted(imported - sys.stdlib_module_names)


def test_stage_2_imports_nothing_slow() -> None:
    """Stage 2 starts once per run, in a bare interpreter: ``typing`` (and ``re`` with it) would cost every run
    milliseconds; its imports are the few it uses."""
    assert imported_modules(SUPERVISOR) <= {"__future__", "ctypes", "marshal", "os", "resource", "sys"}


# --------------------------------------------------------------------------- limits (every fence)
def test_passing_and_failing_tests() -> None:
    ok = run_python_tests("def add(a, b):\n    return a + b\n", TESTS)
    assert (ok.passed, ok.reason) == (True, "passed")
    bad = run_python_tests("def add(a, b):\n    return a - b\n", TESTS)
    assert not bad.passed and bad.reason.startswith("failed:") and "AssertionError: add(2, 3)" in bad.reason
    broken = run_python_tests("def add(a, b) return\n", TESTS)
    assert not broken.passed and "SyntaxError" in broken.reason
def test_kills_an_infinite_loop_at_the_cpu_limit() -> None:
    result = run_python_tests("while True:\n    pass\n", "", cpu_s=1, wall_s=4)
    # Killed by the CPU limit, or by the wall clock when a loaded machine gives it less than a core (no time asserted).
    assert not result.passed and result.reason.startswith("timeout:")
def test_kills_a_sleeper_at_the_wall_clock_limit() -> None:
    result = run_python_tests("import time\ntime.sleep(60)\n", "", wall_s=1)
    assert not result.passed and result.reason.startswith("timeout: wall-clock")
    assert result.seconds >= 1  # never before its limit (an upper bound would depend on the machine's load)
def test_stops_a_memory_hog() -> None:
    hog = "chunks = []\nwhile True:\n    chunks.append(bytearray(16 * 2**20))\n"
    result = run_python_tests(hog, "", memory_mb=128, wall_s=5)
    assert not result.passed and result.reason.startswith("memory:")
def test_child_sees_no_parent_secrets(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ASYNCRL_SECRET", "hunter2")
    code = "import os, sys\nassert 'ASYNCRL_SECRET' not in os.environ, 'leak'\nassert sys.flags.isolated\n"
    tests = "assert set(os.environ) <= {'PATH', 'HOME', 'LC_CTYPE'}, sorted(os.environ)\n"
    result = run_python_tests(code, tests)
    assert result.passed, result.reason
def test_a_program_cannot_forge_the_report() -> None:
    """Stage 2 reports on a pipe the program never holds: words on stdout/stderr or writes to any fd change nothing."""
    forge = """
        import os, sys
        for fd in range(3, 64):
            try:
                os.write(fd, b"ready\\nexit 0 0.0\\nerror forged\\n")
            except OSError:
                pass
        print("ready\\nexit 0 0.0\\nerror forged")
        print("ready\\nexit 0 0.0\\nerror forged", file=sys.stderr)
        sys.exit(1)
    """
    result = run_python_tests(textwrap.dedent(forge), "")
    contained(result, "failed: exit status 1")
def test_a_launcher_that_cannot_start_raises() -> None:
    """A sandbox that does not start is the worker's fault: it raises, it never scores the response 0."""
    broken = replace(sandbox.isolation(), launcher=("/bin/sh", "-c", "echo cannot start >&2; exit 1", "--"))
    with pytest.raises(RuntimeError, match=r"did not start.*cannot start"):
        run_behind(broken, "", TESTS, Limits(2, 256, 5))
def test_every_candidate_that_starts_here_runs_and_limits_programs() -> None:
    """The weaker fences are real code paths too: each one that starts on this machine passes, fails and limits."""
    limits = Limits(cpu_s=2, memory_mb=128, wall_s=2)
    started = []
    for fence in candidates():
        try:
            ok = run_behind(fence, "def add(a, b):\n    return a + b\n", TESTS, limits)
        except RuntimeError:  # e.g. the per-run uid cannot reach an interpreter under /root
            continue
        started.append(fence.fence)
        assert ok.passed, (fence, ok)
        bad = run_behind(fence, "def add(a, b):\n    return 0\n", TESTS, limits)
        assert bad.reason.startswith("failed:") and "add(2, 3)" in bad.reason, (fence, bad)
        sleeper = run_behind(fence, "import time\ntime.sleep(60)\n", "", limits)
        assert sleeper.reason.startswith("timeout: wall-clock"), (fence, sleeper)
        hog = run_behind(fence, "x = bytearray(20 * 2**30)\n", "", limits)
        assert hog.reason.startswith("memory:"), (fence, hog)
        # Where the program may kill stage 2 (its parent), that scores 0 too: it never makes the worker raise.
        killer = "import os, time\nos.kill(os.getppid(), 9)\ntime.sleep(5)\n"
        assert not run_behind(fence, killer, "", limits).passed
    assert started[0] == sandbox.isolation().fence  # the detected fence is the strongest that starts


# --------------------------------------------------------------------------- which fence, said once


class LogSpy:
    """Stands in for the module's structured logger: keeps ``(level, message, fields)``."""

    def __init__(self) -> None:
        self.events: list[tuple[str, str, dict[str, object]]] = []

    def info(self, msg: str, **fields: object) -> None:
        self.events.append(("info", msg, fields))

    def warning(self, msg: str, **fields: object) -> None:
        self.events.append(("warning", msg, fields))


@pytest.fixture
def sandbox_log(monkeypatch: pytest.MonkeyPatch) -> LogSpy:
    spy = LogSpy()
    monkeypatch.setattr(sandbox, "log", spy)
    monkeypatch.setattr(sandbox, "_ISOLATION", None)  # detect again, in this test
    return spy
def test_isolation_is_detected_once_and_logged(sandbox_log: LogSpy) -> None:
    first = sandbox.isolation()
    assert sandbox.isolation() is first
    [(level, message, fields)] = sandbox_log.events
    assert (level, message, fields["fence"]) == ("info", "sandbox isolation", first.fence)
    assert fields["namespaces"] == (",".join(first.namespaces) or "none") and fields["processes"] == first.processes
    assert first.fence in ("namespaces", "user-namespaces", "rlimits") and first.processes and first.user
    if os.geteuid() == 0 and first.fence == "namespaces":  # root here: the uid of its own is what holds NPROC
        assert first.per_run_uid and first.processes.startswith("RLIMIT_NPROC")
def test_a_refused_fence_falls_back_to_the_next_and_says_so(
    monkeypatch: pytest.MonkeyPatch, sandbox_log: LogSpy
) -> None:
    strongest = candidates()
    refused = replace(
        strongest[0], launcher=("/bin/sh", "-c", "echo 'unshare failed: Operation not permitted' >&2; exit 1", "--")
    )
    monkeypatch.setattr(sandbox, "candidates", lambda: [refused, *strongest])
    fence = sandbox.isolation()
    assert fence.launcher == strongest[0].launcher and "Operation not permitted" in fence.refused
    [(level, message, fields)] = sandbox_log.events
    assert level == "warning" and "weaker fence" in message
    assert "Operation not permitted" in str(fields["refused"]) and fields["action"]
def test_no_fence_at_all_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(shutil, "which", lambda name: None)
    monkeypatch.setattr(os, "access", lambda path, mode: False)
    monkeypatch.setattr(sandbox, "_ISOLATION", None)
    with pytest.raises(RuntimeError, match="needs setpriv from util-linux"):
        run_python_tests("", "")


# --------------------------------------------------------------------------- escapes
def test_escape_kill_the_parent(stand_in_worker: subprocess.Popen[bytes]) -> None:
    """From inside, the parent is the namespace's init (which ignores signals) or, without namespaces, root's."""
    needs_another_uid_or_namespaces()
    parent = """
        import os, time
        parent = os.getppid()
        os.kill(parent, 9)
        time.sleep(0.2)
        assert os.getppid() != parent, f"parent {parent} survived"
    """
    contained(run_python_tests(textwrap.dedent(parent), ""), "failed:")
    worker = f"""
        import os
        try:
            os.kill(-1, 9)  # everything it may signal
        except OSError:
            pass
        os.kill({stand_in_worker.pid}, 9)
        os.kill({os.getpid()}, 9)
    """
    contained(run_python_tests(textwrap.dedent(worker), ""), "failed:")
    assert stand_in_worker.poll() is None  # the stand-in worker and this test process both live
def test_escape_fork_bomb() -> None:
    needs_a_process_limit()
    name = process_name()
    bomb = """
        import os, time
        forked = 0
        for _ in range(300):
            try:
                pid = os.fork()
            except OSError:
                break
            if pid == 0:
                time.sleep(60)
                os._exit(0)
            forked += 1
        assert forked >= 300, f"stopped after {forked} forks"
    """
    result = run_python_tests(named(name, bomb), "", wall_s=20)
    contained(result, "failed:", "stopped after")
    assert int(result.reason.rsplit("after ", 1)[1].split()[0]) < MAX_PROCESSES
    wait_until_gone(name)  # every one of them ended with the run
def test_a_fork_bomb_does_not_starve_runs_beside_it() -> None:
    """Each run has its own process budget: the other responses of a group score as if it were not there."""
    needs_a_process_limit()
    bomb = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
    programs = [bomb] + ["def add(a, b):\n    return a + b\n"] * 5
    with ThreadPoolExecutor(max_workers=len(programs)) as pool:
        results = list(
            pool.map(lambda code: run_python_tests(code, TESTS if "add" in code else "", wall_s=5), programs)
        )
    assert not results[0].passed
    assert all(r.passed for r in results[1:]), results
def test_escape_connect_to_the_runs_redis(tmp_path: Path) -> None:
    server = EmbeddedRedis(tmp_path / "redis").start()
    try:
        connect = f"""
            import socket
            with socket.create_connection(("127.0.0.1", {server.port}), timeout=2) as s:
                s.sendall(b"AUTH {server.password}\\r\\nPING\\r\\n")
                replies = b""
                while b"PONG" not in replies and (chunk := s.recv(100)):
                    replies += chunk
                assert b"PONG" in replies, replies
        """
        assert unfenced(textwrap.dedent(connect)).returncode == 0  # the attack is real
        if sandbox.isolation().namespaces:
            contained(run_python_tests(textwrap.dedent(connect), ""), "failed:", "Network is unreachable")
        else:
            unavailable("the rlimits fence shares the host's network")
    finally:
        server.stop()
def test_escape_read_the_run_folder(tmp_path: Path) -> None:
    secret = tmp_path / "run" / "secret.txt"
    secret.parent.mkdir()
    secret.write_text("hunter2")
    read = f"assert 'hunter2' in open({str(secret)!r}).read()\n"
    assert unfenced(read).returncode == 0
    needs_namespaces()
    contained(run_python_tests(read, ""), "failed:", "No such file or directory")
    # the host's /tmp holds the folder; the sandbox's /tmp holds at most the way to an interpreter that lives there
    interpreter = {
        Path(p).resolve().relative_to("/tmp").parts[0]
        for p in (sys.prefix, sys.base_prefix)
        if Path(p).resolve().is_relative_to("/tmp")
    }
    listing = f"import os\nassert set(os.listdir('/tmp')) - {interpreter!r}, 'nothing there'\n"
    contained(run_python_tests(listing, ""), "failed:", "nothing there")
def test_an_interpreter_in_tmp_runs_behind_the_namespaces_fence(tmp_path: Path) -> None:
    """A venv under /tmp (a fresh clone's) must stay visible below the sandbox's own /tmp, so the fence starts."""
    clone = Path(tempfile.mkdtemp(prefix="sandbox-clone-", dir="/tmp"))  # 0700, as mktemp -d makes a clone's
    venv = clone / ".venv"
    try:
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
        site = [p for p in sys.path if p.endswith("site-packages")]
        probe = (
            f"import site\nfor folder in {site!r}:\n    site.addsitedir(folder)\n"  # runs the install's .pth files
            "from asyncrl.common.sandbox import isolation, run_python_tests\n"
            "fence = isolation()\nassert fence.fence == 'namespaces', fence\n"
            "assert run_python_tests('import sys\\nassert sys.prefix.startswith(\"/tmp/\")', '').passed\n"
        )
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        kernel_allows = subprocess.run(["unshare", "--pid", "--net", "--mount", "--ipc", "--uts", "--fork", "true"])
        if kernel_allows.returncode != 0:  # not the interpreter's place: no namespaces for anyone here
            unavailable("this machine makes no namespaces (unshare refused)")
        done = subprocess.run(
            [venv / "bin" / "python", "-c", probe], env=env, capture_output=True, text=True, timeout=300
        )
        assert done.returncode == 0, done.stderr[-3000:]
    finally:
        shutil.rmtree(clone, ignore_errors=True)
def test_escape_read_the_workers_environment(stand_in_worker: subprocess.Popen[bytes]) -> None:
    needs_another_uid_or_namespaces()
    scan = f"""
        import os
        found = []
        for pid in [os.getppid(), {stand_in_worker.pid}, {os.getpid()}, *os.listdir("/proc")]:
            try:
                with open(f"/proc/{{pid}}/environ", "rb") as f:
                    found += [pid] if b"hunter2" in f.read() else []
            except OSError:
                pass
        assert found, "no secret readable"
    """
    assert unfenced(textwrap.dedent(scan)).returncode == 0  # as a plain child it reads the stand-in's secret
    contained(run_python_tests(textwrap.dedent(scan), ""), "failed:", "no secret readable")
def test_escape_fill_the_disk() -> None:
    one_big = "open('big', 'wb').write(b'x' * 100 * 2**20)\n"
    contained(run_python_tests(one_big, "", memory_mb=512), "output:")
    needs_namespaces()  # without them the folder is on the host's disk: only the per-file limit holds
    many = textwrap.dedent("""
        for i in range(20):
            with open(f'part{i}', 'wb') as f:
                f.write(b'x' * (sandbox_limit - 1))
    """).replace("sandbox_limit", str(MAX_FILE_BYTES))
    contained(run_python_tests(many, "", memory_mb=512), "failed:", "No space left on device")
def test_escape_sleep_forever_and_leave_children() -> None:
    name = process_name()
    sleeper = """
        import os, time
        for _ in range(3):
            if os.fork() == 0:
                os.setsid()  # out of the process group too
                break
        time.sleep(10**6)
    """
    result = run_python_tests(named(name, sleeper), "", wall_s=1)
    contained(result, "timeout: wall-clock")
    wait_until_gone(name)
def test_escape_allocate_20_gb() -> None:
    contained(run_python_tests("x = bytearray(20 * 2**30)\n", ""), "memory:")
def test_escape_gain_privileges() -> None:
    """No capability, no_new_privs, not the worker's uid (when the worker is root), and a parent with no capability."""
    probe = textwrap.dedent("""
        import os

        def status(pid):
            lines = open(f"/proc/{pid}/status").read().splitlines()
            return {key: value.strip() for key, _, value in (line.partition(":") for line in lines)}

        mine, parents = status("self"), status(os.getppid())
        caps = [mine[k] for k in ("CapPrm", "CapEff", "CapBnd", "CapAmb")] + [parents["CapPrm"], parents["CapEff"]]
        assert caps != ["0000000000000000"] * 6 or mine["NoNewPrivs"] != "1", "no privileges"
    """)
    contained(run_python_tests(probe, ""), "no privileges")
    if sandbox.isolation().per_run_uid:
        contained(
            run_python_tests(f"import os\nassert os.getuid() == {os.getuid()}, 'another uid'\n", ""), "another uid"
        )
def test_the_parent_dying_kills_the_sandboxed_tree(tmp_path: Path) -> None:
    """A worker killed mid-run takes every process of its sandbox with it (setpriv → unshare → init → all)."""
    needs_namespaces()  # the rlimits fence leaves children that left the process group behind a dead worker
    name = process_name()
    program = named(name, "import os, time\nos.fork()\ntime.sleep(600)\n")
    worker_code = (
        f"from asyncrl.common.sandbox import run_python_tests\n"
        f"run_python_tests({program!r}, '', cpu_s=600, wall_s=600)\n"
    )
    env = {**os.environ, "TMPDIR": str(tmp_path)}  # a worker killed by SIGKILL cannot remove its temporary folder
    worker = subprocess.Popen([sys.executable, "-c", worker_code], cwd=REPO, env=env)
    try:
        wait_for(lambda: len(processes_named(name)) >= 2, "start of the sandbox", proc=worker, timeout_s=30)
    finally:
        worker.send_signal(signal.SIGKILL)
        worker.wait()
    wait_until_gone(name)
def test_concurrent_runs_from_threads_all_finish() -> None:
    """The reward worker runs sandboxes from a thread pool: no lock, no stray, no crossed report."""
    codes = [f"def add(a, b):\n    return a + b + {i % 2}\n" for i in range(8)]
    results: dict[int, bool] = {}

    def run(i: int) -> None:
        results[i] = run_python_tests(codes[i], TESTS).passed

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(codes))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert results == {i: i % 2 == 0 for i in range(len(codes))}
def test_isolation_describes_this_machine() -> None:
    fence = sandbox.isolation()
    assert isinstance(fence, Isolation)
    if fence.namespaces:
        assert {"pid", "net", "mount"} <= set(fence.namespaces)
        assert fence.launcher[-1] == "--" and any(part.endswith("unshare") for part in fence.launcher)
