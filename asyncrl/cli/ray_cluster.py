"""What asyncrl asks of Ray: a connection, and a Ray actor that runs one of asyncrl's own processes where Ray placed it.

Ray is the placer only. Each process of a run is the same ``rl-learner`` / ``rl-actor`` / ``rl-launch`` command line
as anywhere else, started by a :class:`ProcessActor` on the node Ray chose and followed until it exits: logs, metrics,
``rl-top``, checkpoints and the run folder are what they are without Ray. The run's secrets never pass through Ray:
a command names the run's files (``--redis-url-file``, the CURVE key files), which are 0600 in the run folder on the
filesystem the nodes share, so Ray's dashboard, its job logs, actor names and runtime environments show paths only.
"""

from __future__ import annotations

import ctypes
import functools
import os
import signal
import socket
import subprocess
from pathlib import Path
from typing import Any

from asyncrl.cli.util import fail
from asyncrl.common.net import ADVERTISE_HOST_ENV
from asyncrl.common.private import PRIVATE_UMASK, open_private

PR_SET_PDEATHSIG = 1


def ray_module() -> Any:
    """The ``ray`` package, or exit 2 naming the extra that installs it."""
    try:
        import ray
    except ImportError:
        fail("rl-launch ray needs Ray on every node: pip install 'asyncrl[ray]' (or 'ray>=2.40')")
    return ray


def connect(address: str, namespace: str) -> Any:
    """``ray`` connected to the cluster at ``address`` (``auto``, ``HOST:PORT`` or ``ray://…``) in ``namespace``, where
    the run's named actors live; exit 2 with Ray's reason when there is no cluster there."""
    ray = ray_module()
    if (unreachable := unreachable_cluster(address)) is not None:
        fail(f"ray.address = {address!r}: {unreachable}; start a cluster there (ray start --head) or name its head")
    try:
        ray.init(address=address, namespace=namespace, log_to_driver=False, logging_level="WARNING")
    except (ConnectionError, RuntimeError, ValueError) as exc:
        fail(f"ray.address = {address!r}: no Ray cluster answered ({exc}); start one (ray start --head) or name it")
    return ray


def unreachable_cluster(address: str, timeout_s: float = 5.0) -> str | None:
    """Why nothing answers at ``address`` (``HOST:PORT`` or ``ray://HOST:PORT``) within ``timeout_s``, or None when
    something does (or the address is ``auto``, which Ray looks up itself). Ray's own connection retries for
    minutes before it gives up."""
    host, _, port = address.removeprefix("ray://").rpartition(":")
    if address == "auto" or not host or not port.isdigit():
        return None
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s).close()
    except OSError as exc:
        return f"nothing answers at {host}:{port} ({exc.strerror or exc})"
    return None


def gcs_address(ray: Any) -> str:
    """The connected cluster's address as ``HOST:PORT``, for the run's processes on other nodes to connect to."""
    return ray.get_runtime_context().gcs_address


def _stop_with_parent() -> None:
    """In the child before exec: SIGTERM when the Ray worker that started it dies (``ray.kill``, its driver gone), on
    which an asyncrl process stops as after Ctrl-C: the head stops the run's processes, an actor gives its groups
    back."""
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)


class ProcessActor:
    """One asyncrl process on the node Ray placed this actor: started when the actor is (again, after a restart on
    another node) in ``cwd`` (the folder the run was launched from, on the filesystem the nodes share: the config's
    relative paths mean the same there), its output appended to ``log_path``, advertised at the node's address. A Ray
    actor with two threads, so that :meth:`stop` can be called while :meth:`wait` waits."""

    def __init__(self, argv: list[str], env: dict[str, str], log_path: str, cwd: str) -> None:
        import ray

        self.node = ray.util.get_node_ip_address()
        environment = {**os.environ, **env, ADVERTISE_HOST_ENV: self.node}
        with open_private(Path(log_path), "ab") as log_file:
            self.process = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                env=environment,
                cwd=cwd,
                umask=PRIVATE_UMASK,
                preexec_fn=_stop_with_parent,  # Ray's worker runs this on its main thread, which lives as long as it
            )

    def where(self) -> str:
        """The address of the node the process runs on."""
        return self.node

    def running(self) -> bool:
        """Whether the process has not exited yet."""
        return self.process.poll() is None

    def wait(self) -> int:
        """The process's exit code, once it exits."""
        return self.process.wait()

    def stop(self, grace_s: float) -> int:
        """SIGTERM (the process saves and leaves as after Ctrl-C), SIGKILL after ``grace_s``; its exit code."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                return self.process.wait(grace_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
        return self.process.wait()


@functools.cache
def process_actor_class() -> Any:
    """:class:`ProcessActor` as a Ray actor class (made on first use: Ray is an optional extra)."""
    return ray_module().remote(max_concurrency=2)(ProcessActor)
