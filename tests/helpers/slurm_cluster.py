"""A real Slurm cluster on one machine, for the tests: Debian's ``slurmctld``, ``slurmd`` and ``munged``.

The controller and each compute node are hosts of their own (:class:`tests.helpers.hosts.Hosts`): a network namespace
with its own address and, through a UTS namespace, its own hostname, which is how a ``slurmd`` finds its node in
``slurm.conf``. One ``munged`` serves them all: its socket is a file, and every host sees the same filesystem (as a
cluster's shared filesystem). Everything the cluster writes (its config, the munge key, spool and state folders,
logs, the job-completion log) lives in one folder; :meth:`SlurmCluster.stop` ends every daemon by PID and removes the
namespaces. Accounting needs ``slurmdbd`` and a database, which this cluster does not run: ``sacct --completion``
reads a finished job's state and exit code from the job-completion log (``jobcomp/filetxt``) instead. A requeued job
waits ``cred_expire`` seconds before it may start again: 10 here, 120 by Slurm's default.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path

from tests.helpers.hosts import Hosts
from tests.helpers.waits import wait_for

DAEMONS = ("munged", "slurmctld", "slurmd", "sbatch", "srun", "scontrol", "squeue", "scancel")
CONTROLLER = "10.78.0.1"


def _pids() -> list[int]:
    return [int(entry.name) for entry in Path("/proc").iterdir() if entry.name.isdigit()]


def _netns_inode(pid: int) -> int:
    """The inode of ``pid``'s network namespace (0 once it is gone)."""
    try:
        return os.stat(f"/proc/{pid}/ns/net").st_ino
    except OSError:
        return 0


def missing_programs() -> list[str]:
    return [name for name in DAEMONS if shutil.which(name) is None and not Path("/usr/sbin", name).exists()]


def _program(name: str) -> str:
    return shutil.which(name) or str(Path("/usr/sbin", name))


class SlurmCluster:
    """``nodes`` compute nodes (``node1``…) of ``cpus`` CPUs each and a controller (``slurmctl``), in ``root``.

    ``local``: node name → a folder that node does not share: its ``slurmd`` and every job step on the node see an
    empty tmpfs there (a node-local disk where the others see the shared filesystem)."""

    def __init__(
        self, root: Path, nodes: int = 3, cpus: int = 2, prefix: str | None = None, local: dict[str, Path] | None = None
    ) -> None:
        self.root = root
        self.local = local or {}
        self.addresses = {CONTROLLER: "slurmctl"} | {f"10.78.0.{n + 2}": f"node{n + 1}" for n in range(nodes)}
        self.nodes = [name for name in self.addresses.values() if name != "slurmctl"]
        self.cpus = cpus
        self.hosts = Hosts(prefix or f"asl{os.getpid()}", list(self.addresses), self.addresses)
        self.procs: dict[str, subprocess.Popen] = {}
        self.conf = root / "slurm.conf"
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}

    # ------------------------------------------------------------------ life

    def start(self) -> None:
        for folder in ("munge", "state", "spool", "log"):
            (self.root / folder).mkdir(parents=True, exist_ok=True)
        (self.root / "munge").chmod(0o700)
        for name in self.nodes:
            (self.root / "spool" / name).mkdir(exist_ok=True)
        self.hosts.create()
        self._start_munge()
        self.conf.write_text(self._slurm_conf())
        self._start("slurmctld", CONTROLLER, [_program("slurmctld"), "-D", "-i", "-f", str(self.conf)])
        for name in self.nodes:
            self.power_on(name)
        wait_for(self._all_nodes_idle, "every Slurm node idle", timeout_s=60, poll_s=0.5)

    def stop(self) -> None:
        """Every job cancelled and waited for (a test that failed half-way leaves no job step running), then every
        daemon by its PID (SIGTERM, then SIGKILL), then the namespaces."""
        if "slurmctld" in self.procs and self.procs["slurmctld"].poll() is None:
            self.command(["scancel", "--user=root"])
            deadline = time.monotonic() + 90  # KillWait (20 s) after SIGTERM, then SIGKILL
            while self.command(["squeue", "--noheader"]).stdout.strip() and time.monotonic() < deadline:
                time.sleep(0.5)
        for proc in reversed(list(self.procs.values())):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + 15
        for proc in self.procs.values():
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(5)
        self.hosts.delete()

    def power_off(self, name: str) -> None:
        """Node ``name`` dies as a host whose power fails: its ``slurmd`` and every process on it (each in its network
        namespace: the job steps, their tasks) killed at once with SIGKILL, nothing of them cleaning up."""
        node = os.stat(f"/run/netns/{self.hosts.names[self._address(name)]}").st_ino
        for _ in range(20):  # a process may fork while the others die: until none is left
            found = [pid for pid in _pids() if _netns_inode(pid) == node]
            if not found:
                break
            for pid in found:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.1)
        self.procs[f"slurmd-{name}"].wait(10)

    def power_on(self, name: str) -> None:
        """Node ``name`` back: its ``slurmd`` started again, registering with the controller (``ReturnToService=2``
        returns it to service)."""
        argv = [*self._node_local(name), _program("slurmd"), "-D", "-f", str(self.conf)]
        self._start(f"slurmd-{name}", self._address(name), argv)

    def _address(self, name: str) -> str:
        return next(address for address, host in self.addresses.items() if host == name)

    def _node_local(self, name: str) -> list[str]:
        """The prefix that mounts an empty tmpfs over the node's :attr:`local` folder (in the node's own mount
        namespace, which :meth:`Hosts.exec_named` made private) before its ``slurmd`` starts; none for other nodes."""
        if name not in self.local:
            return []
        self.local[name].mkdir(parents=True, exist_ok=True)
        return ["sh", "-c", 'mount -t tmpfs -o size=1m node-local "$0" && exec "$@"', str(self.local[name])]

    def _start_munge(self) -> None:
        munge = self.root / "munge"
        subprocess.run([_program("mungekey"), "--create", f"--keyfile={munge / 'munge.key'}"], check=True,
                       capture_output=True)  # fmt: skip
        command = [
            _program("munged"), "--foreground", "--force", f"--key-file={munge / 'munge.key'}",
            f"--socket={self.munge_socket}", f"--pid-file={munge / 'munged.pid'}", f"--log-file={munge / 'munged.log'}",
            f"--seed-file={munge / 'munged.seed'}",
        ]  # fmt: skip
        self._start("munged", None, command)
        wait_for(self.munge_socket.exists, "munged's socket", timeout_s=15, poll_s=0.1)

    def _start(self, name: str, address: str | None, argv: Sequence[str]) -> None:
        prefix = self.hosts.exec_named(address) if address else []
        log = (self.root / "log" / f"{name}.out").open("w")
        self.procs[name] = subprocess.Popen([*prefix, *argv], env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                            start_new_session=True)  # fmt: skip

    # ------------------------------------------------------------------ commands

    def command(self, argv: Sequence[str | Path], host: str = CONTROLLER, **kwargs) -> subprocess.CompletedProcess:
        """``argv`` on ``host`` (the controller: the cluster's login node), with this cluster's ``SLURM_CONF``."""
        kwargs.setdefault("env", self.env)
        kwargs.setdefault("capture_output", True)
        kwargs.setdefault("text", True)
        kwargs.setdefault("timeout", 60)
        return subprocess.run([*self.hosts.exec_named(host), *map(str, argv)], **kwargs)

    def _all_nodes_idle(self) -> bool:
        for name, proc in self.procs.items():
            if proc.poll() is not None:
                log = (self.root / "log" / f"{name}.out").read_text()[-2000:]
                raise RuntimeError(f"{name} exited with {proc.returncode}:\n{log}")
        done = self.command(["sinfo", "--noheader", "--format=%T", "--Node"])
        states = done.stdout.split()
        return done.returncode == 0 and len(states) == len(self.nodes) and set(states) == {"idle"}

    def job_state(self, job_id: str) -> dict[str, str]:
        """``scontrol show job`` of ``job_id`` as fields (``JobState``, ``ExitCode``, …)."""
        done = self.command(["scontrol", "show", "job", "--oneliner", job_id])
        return dict(f.split("=", 1) for f in done.stdout.split() if "=" in f)

    def accounting(self, job_id: str) -> list[dict[str, str]]:
        """``sacct``'s rows for ``job_id``, oldest first, as a user reads them: from the job-completion log
        (``sacct --completion``), since this cluster keeps no accounting database. A requeued job has a row per end."""
        fields = ("JobID", "JobName", "State", "ExitCode", "NodeList")
        shown = self.command(["sacct", "--completion", "-j", job_id, "--parsable2", "--noheader",
                              "--format", ",".join(fields)])  # fmt: skip
        assert shown.returncode == 0, shown.stderr
        return [dict(zip(fields, line.split("|"), strict=True)) for line in shown.stdout.splitlines() if line]

    # ------------------------------------------------------------------ config

    @property
    def munge_socket(self) -> Path:
        return self.root / "munge" / "munge.socket"

    def _slurm_conf(self) -> str:
        r = self.root
        nodes = "\n".join(
            f"NodeName={name} NodeAddr={address} CPUs={self.cpus} RealMemory=8000 State=UNKNOWN"
            for address, name in self.addresses.items()
            if name != "slurmctl"
        )
        return f"""ClusterName=asyncrl
SlurmctldHost=slurmctl({CONTROLLER})
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={self.munge_socket},cred_expire=10
CredType=cred/munge
StateSaveLocation={r}/state
SlurmdSpoolDir={r}/spool/%n
SlurmctldPidFile={r}/slurmctld.pid
SlurmdPidFile={r}/slurmd.%n.pid
SlurmctldLogFile={r}/log/slurmctld.log
SlurmdLogFile={r}/log/slurmd.%n.log
ProctrackType=proctrack/pgid
TaskPlugin=task/none
MpiDefault=none
SchedulerType=sched/backfill
# a requeued job is started by a backfill pass (every 30 s by default): every 2 s here, as the test waits on it
SchedulerParameters=bf_interval=2
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
SlurmdParameters=config_overrides
JobCompType=jobcomp/filetxt
JobCompLoc={r}/jobcomp.log
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
MinJobAge=3600
KillWait=20
SlurmctldTimeout=30
SlurmdTimeout=30
InactiveLimit=0
{nodes}
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""
