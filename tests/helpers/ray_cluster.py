"""A real Ray cluster on one machine, for the tests: a head node and worker nodes, each a host of its own
(:class:`tests.helpers.hosts.Hosts`: a network namespace with its own address), started with Ray's own ``ray start``.

Each node runs ``ray start --block`` in the foreground of a process the test owns: its GCS (on the head), raylet and
workers are that process's children, so :meth:`RayCluster.stop` ends a node by the PID it started (SIGTERM makes
``ray start --block`` stop everything it started) and nothing of another Ray on the machine is touched. No GPU here:
the nodes declare custom resources (``asyncrl_head`` on the head, ``rollout_node`` on the workers) that the run asks for
instead, which is how a GPU cluster's ``num_gpus`` requests are placed too.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from tests.helpers.hosts import Hosts
from tests.helpers.waits import wait_for

HEAD = "10.79.0.1"
GCS_PORT = 6390


def ray_program() -> str:
    return str(Path(sys.executable).parent / "ray")


class RayCluster:
    """A head node and ``workers`` worker nodes, each in a network namespace of its own."""

    def __init__(self, root: Path, workers: int = 1, cpus: int = 2) -> None:
        self.root, self.cpus = root, cpus
        # Ray's sockets live under its temp folder, and a socket's path must fit 107 bytes: a short folder of its own
        self.temp = Path(tempfile.mkdtemp(prefix="ray-", dir="/tmp"))
        self.addresses = [HEAD, *(f"10.79.0.{2 + n}" for n in range(workers))]
        self.hosts = Hosts("ray", self.addresses)
        self.nodes: dict[str, subprocess.Popen] = {}
        self.env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "RAY_DISABLE_DOCKER_CPU_WARNING": "1",
                    "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0"}  # nothing to drain: stop at once

    @property
    def address(self) -> str:
        return f"{HEAD}:{GCS_PORT}"

    def start(self) -> None:
        self.hosts.create()
        head = ["--head", f"--port={GCS_PORT}", "--include-dashboard=false", f"--temp-dir={self.temp}"]
        self._start(HEAD, [*head, "--resources", json.dumps({"asyncrl_head": 1})])
        for address in self.addresses[1:]:
            self._start(address, [f"--address={self.address}", "--resources", json.dumps({"rollout_node": 2})])
        wait_for(lambda: self.alive_nodes() == len(self.addresses), "every Ray node up", timeout_s=180, poll_s=1)

    def _start(self, address: str, args: Sequence[str]) -> None:
        log = open(self.root / f"node-{address}.log", "ab")  # noqa: SIM115 - the node writes it while it lives
        argv = [ray_program(), "start", "--block", f"--node-ip-address={address}", f"--num-cpus={self.cpus}",
                "--disable-usage-stats", *args]  # fmt: skip
        self.nodes[address] = subprocess.Popen(
            [*self.hosts.exec(address), *argv], stdout=log, stderr=subprocess.STDOUT, env=self.env,
            start_new_session=True,
        )  # fmt: skip

    def command(self, argv: Sequence[str | Path], address: str = HEAD, **kwargs) -> subprocess.CompletedProcess:
        """``argv`` on the host at ``address`` (the head by default), as a user types it there."""
        kwargs.setdefault("timeout", 120)
        env = {**self.env, **kwargs.pop("env", {})}
        return subprocess.run([*self.hosts.exec(address), *map(str, argv)], capture_output=True, text=True, env=env,
                              **kwargs)  # fmt: skip

    def popen(self, argv: Sequence[str | Path], env: dict[str, str], **kwargs) -> subprocess.Popen:
        """``argv`` started on the head node, as a user starts it in a terminal there (``ip netns exec`` execs it, so
        the PID is the command's own)."""
        return subprocess.Popen([*self.hosts.exec(HEAD), *map(str, argv)], env={**self.env, **env}, **kwargs)

    def query(self, expression: str) -> object:
        """``expression`` (Python, with ``ray`` connected to the cluster) evaluated by a driver on the head node, as
        JSON: what Ray's control store says, without the dashboard these nodes do not run."""
        connect = f"import json, ray; ray.init(address={self.address!r}, logging_level='ERROR')"
        code = f"{connect}; print(json.dumps({expression}))"
        done = self.command([sys.executable, "-c", code])
        assert done.returncode == 0, done.stderr[-2000:]
        return json.loads(done.stdout.strip().splitlines()[-1])

    def alive_nodes(self) -> int:
        return int(self.query("sum(node['Alive'] for node in ray.nodes())"))  # type: ignore[arg-type]

    def stop(self) -> None:
        """Worker nodes first, then the head (a node drains through the head's GCS as it stops): SIGTERM, on which
        ``ray start --block`` stops what it started; SIGKILL to its session after a minute."""
        for address in sorted(self.nodes, key=lambda a: a == HEAD):
            node = self.nodes[address]
            if node.poll() is None:
                os.killpg(node.pid, signal.SIGTERM)
            try:
                node.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(node.pid, signal.SIGKILL)
                node.wait()
        self.nodes.clear()
        self.hosts.delete()
        shutil.rmtree(self.temp, ignore_errors=True)
