"""A run across hosts, on one machine: four hosts made of Linux network namespaces on one bridge, with addresses
(10.77.0.0/24) that exist only inside them, running the README's "On a cluster" commands as they are written.

The commands are ``cli/deploy.py``'s :func:`~asyncrl.cli.deploy.cluster_steps` of
:data:`~asyncrl.cli.deploy.CLUSTER_EXAMPLE` (the README's block is that text: checked here and in
``tests/unit/cli/test_across_hosts.py``): setup commands run with ``sh -c``, each lasting process from the
:class:`~asyncrl.cli.deploy.Process` its command line renders, inside its host's namespace and in its host's own
folder. Between them the test copies what the README says to copy (``redis-url``, the keys each role needs). On
10.77.0.1 Redis (a password, bound to that address, AOF) and the learner; on 10.77.0.2 a reward worker (CURVE on
``tcp://0.0.0.0``) and an actor; on 10.77.0.3 an actor. Once weights have reached both actors, 10.77.0.3's actor hangs
(SIGSTOP) while its heartbeat still counts it live: the next broadcast gives up on it after ``weight_sync.timeout_s``
and evicts it, and it thaws (SIGCONT). Then 10.77.0.4 joins with an actor and, once that one served a version, 10.77.0.3
leaves (SIGTERM). Once a version sent without 10.77.0.3 has reached the two actors left, the learner is stopped as a
person stops it (SIGTERM: it finishes the step, saves a checkpoint and exits 0). The run must end with every step it
trained once, every group trained once or accounted for (from Redis), and every actor host having loaded every version
sent to it.

The test reaches the run's Redis and the processes' ``/metrics`` from a thread of its own that entered 10.77.0.1's
namespace: nothing of the run is reachable from the machine's own network. Its one addition to the hosts'
environment is what a CPU host sets anyway: ``DS_ACCELERATOR=cpu``, vLLM's thread pinning, ``PATH``.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from asyncrl.cli import deploy
from asyncrl.common.plane.audit_file import entry_line
from asyncrl.common.plane.control import ControlPlane
from asyncrl.common.plane.keys import connect
from asyncrl.common.plane.redis_server import find_redis_server
from tests.helpers.accounting import account_groups
from tests.helpers.hosts import Hosts
from tests.helpers.readme import readme_block
from tests.helpers.stack import BIN, Processes, actor_pid

EXAMPLE = deploy.CLUSTER_EXAMPLE
RUN, LEARNER_HOST = EXAMPLE["run"], EXAMPLE["learner_host"]
B, C, D = EXAMPLE["worker_hosts"]  # D joins mid-run, C leaves
STEPS, GROUPS = 100_000, 4
"""``learner.steps``: more than the run ever reaches. It must outlast the start of the joining host's actor, which
shares two cores with a run in full swing (45 s on an idle machine, 105 s beside this run and other tests' load), and a
version sent after a host left; then the test stops the learner (SIGTERM) instead of waiting for a step count."""
SYNC_TIMEOUT_S = 6
"""``weight_sync.timeout_s``: short, so a broadcast gives up on the hung actor soon; the heartbeat TTL (60 s) is long,
so only that timeout can catch it."""
GROUP_DEADLINE_S = 30
"""``learner.group_deadline_s``: well under the heartbeat TTL. The hung actor may hold groups the next step needs (the
admission bound then keeps the other actor from sampling more): they are re-issued after this deadline, the step and
its broadcast come, and the broadcast meets the hung actor while its heartbeat still counts it live. At 60 s, the TTL,
the heartbeat once expired first: the weight group re-formed without it and no broadcast ever gave up on it."""


@pytest.fixture
def hosts() -> Iterator[Hosts]:
    if shutil.which("ip") is None:
        pytest.fail("this test builds hosts with `ip netns` (iproute2), which is missing; CI has it and runs as root")
    made = Hosts(f"asr{os.getpid()}", [LEARNER_HOST, B, C, D])
    try:
        made.create()
    except OSError as exc:
        made.delete()
        pytest.fail(f"cannot make network namespaces on this machine ({exc}); this test needs root and `ip netns`")
    try:
        yield made
    finally:
        made.delete()


class HostProcesses(Processes):
    """Processes started in the hosts' namespaces, each in its host's folder and the leader of its own session;
    stopped by PID and session (``Processes.stop``), logs in ``root``."""

    def __init__(self, hosts: Hosts, root: Path) -> None:
        super().__init__(root)
        self.hosts = hosts
        redis_bin = Path(find_redis_server()).parent  # the host's Redis, as a person installs it
        self.env = {**os.environ, "PATH": f"{BIN}:{redis_bin}:{os.environ['PATH']}", "DS_ACCELERATOR": "cpu"}

    def folder(self, host: str) -> Path:
        path = self.log_dir / host
        path.mkdir(parents=True, exist_ok=True)
        return path

    def run(self, step: deploy.Step) -> str:
        """A command that runs to completion, typed as the README has it; its output."""
        done = subprocess.run([*self.hosts.exec(step.host), "sh", "-c", step.command], cwd=self.folder(step.host),
                              env=self.env, capture_output=True, text=True, timeout=120)  # fmt: skip
        assert done.returncode == 0, f"{step.command!r} on {step.host}: {done.stderr[-2000:]}"
        return done.stdout

    def start(self, name: str, step: deploy.Step, cpus: set[int] | None = None) -> subprocess.Popen:
        """The README's ``step`` as the process ``name``; on the CPUs ``cpus`` when given (each host's actor its
        own core, as on machines of their own)."""
        assert step.process is not None and deploy.shell(step.process) == step.command
        log = (self.log_dir / f"{name}.log").open("w")
        self.procs[name] = subprocess.Popen(
            [*self.hosts.exec(step.host), *step.process.argv],
            cwd=self.folder(step.host),
            env={**self.env, **step.process.env},
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its children (vLLM's engine, torchrun's rank) share its session
            preexec_fn=(lambda: os.sched_setaffinity(0, cpus)) if cpus else None,
        )
        return self.procs[name]


def _config(model: Path) -> str:
    """run.toml: the demo's task and model, small steps (its ``[run]`` and ports come from the learner's command)."""
    return f"""preset = "grpo"

[model]
path = "{model}"
max_model_len = 64

[task]
name = "arithmetic"
options = {{ ops = "+", max_digits = 1 }}

[rollout]
num_samples = 8
max_new_tokens = 6
max_groups_in_flight = 6
kv_cache_bytes = 67108864
cpu_single_process = true  # the layout that starts fastest; each actor's engine keeps to the core it starts on

[learner]
steps = {STEPS}
groups_per_step = {GROUPS}
micro_batch_size = 32
lr = 3e-4
group_deadline_s = {GROUP_DEADLINE_S}

[staleness]
max_staleness = 1

[transport]
heartbeat_s = 1.0
heartbeat_ttl_s = 60.0

[weight_sync]
timeout_s = {SYNC_TIMEOUT_S}
"""


class Cluster:
    """The run's processes on their hosts, and the test's view of the run's Redis from 10.77.0.1."""

    def __init__(self, hosts: Hosts, root: Path, steps: list[deploy.Step]) -> None:
        self.procs = HostProcesses(hosts, root)
        self.steps = {host: [s for s in steps if s.host == host] for host in (LEARNER_HOST, B, C, D)}
        self.here = self.procs.folder(LEARNER_HOST)
        self.run_dir = self.here / "runs" / RUN
        self.on_a = hosts.thread_in(LEARNER_HOST)
        self.plane: ControlPlane | None = None

    def a(self, fn: Callable, *args):
        """``fn(*args)`` from 10.77.0.1 (the Redis client's sockets are opened there)."""
        return self.on_a.submit(fn, *args).result()

    def start_learner_host(self, model: Path) -> None:
        """run.toml, then the README's commands on 10.77.0.1: keys, password, URL, redis.conf, Redis, the learner."""
        keys, password, url_line, conf, redis, learner = self.steps[LEARNER_HOST]
        (self.here / "run.toml").write_text(_config(model))
        for step in (keys, password, url_line, conf):
            self.procs.run(step)
        assert {oct((self.here / f).stat().st_mode & 0o777) for f in ("password", "redis-url")} == {"0o600"}
        url = (self.here / "redis-url").read_text().strip()
        self.procs.start("redis", redis)
        self.plane = self.a(lambda: ControlPlane(connect(url), RUN))
        self.wait(lambda: self.a(_pings, self.plane), "Redis on 10.77.0.1", 30)
        self.procs.start("learner", learner)
        self.wait(lambda: self.a(self.plane.client.exists, self.plane.keys.config), "the published config", 300)

    def start_workers(self) -> None:
        """The copies, then B: show-config, a reward worker and an actor; C: an actor."""
        _copy_to_workers(self.here, self.procs)
        show, reward, actor_b = self.steps[B]
        assert json.loads(self.procs.run(show))["run"]["name"] == RUN  # B reads the run from A's Redis
        self.procs.start("reward-0", reward)
        self.procs.start("actor-0", actor_b, cpus={0})
        self.procs.start("actor-1", self.steps[C][0], cpus={1})

    def hang_and_thaw(self, actor: str) -> None:
        """``actor`` frozen (SIGSTOP) while its heartbeat still counts it live: the next broadcast includes it, gives
        up after ``weight_sync.timeout_s`` and evicts it; then it thaws (SIGCONT) and the run goes on."""
        frozen = actor_pid(self.procs.log_dir / f"{actor}.log")
        os.kill(frozen, signal.SIGSTOP)
        try:
            self.wait(lambda: any(row.get("sync/failed") for row in self.rows()), "a broadcast giving up on it")
        finally:
            os.kill(frozen, signal.SIGCONT)

    def join_and_leave(self) -> float:
        """D joins with an actor; once it served groups, C's actor is removed by hand as a person at its terminal
        does — Ctrl-C, SIGINT to its whole process group — and leaves cleanly: exit 0, ``process.left`` in the
        audit trail, its engine shut down in order (not killed by the same Ctrl-C). Returns when C was told."""
        self.procs.start("actor-2", self.steps[D][0], cpus={0})
        self.wait(lambda: self.trained_from("actor-2"), "groups of the host that joined")
        assert len(self.metric_steps()) < STEPS, "the run ended before the host that joined served it"
        left_at = time.time()
        actor = self.procs.procs["actor-1"]
        os.killpg(actor.pid, signal.SIGINT)  # its terminal's Ctrl-C: every process of its foreground group
        assert actor.wait(90) == 0, self.procs.log("actor-1")[-3000:]
        said = self.procs.log("actor-1")
        assert "EngineDeadError" not in said, said[-3000:]
        assert any(e["event"] == "process.left" and e["who"]["process"] == "actor-1" for e in self.events())
        assert self.metric_steps()[-1] < STEPS, "the run ended before a host left it"
        return left_at

    def sent_without(self, gone: str, since: float, to: tuple[str, ...]) -> bool:
        """Whether a version published after ``since`` to a formation without ``gone`` was loaded by each of ``to``."""
        events = self.events()
        versions = {
            int(e["version"])
            for e in events
            if e["event"] == "weights.published" and e["unix"] > since and gone not in e["members"]
        }
        loaded = {(e["who"]["process"], int(e["version"])) for e in events if e["event"] == "weights.loaded"}
        return any(all((actor, v) in loaded for actor in to) for v in versions)

    def stop_learner(self) -> int:
        """SIGTERM to the learner's rank (what torchrun passes on to it when its pod is stopped): the step in progress
        finishes, a checkpoint is saved, the rank exits 0 and so does torchrun. Returns the last step trained."""
        torchrun = self.procs.procs["learner"]
        os.kill(_child_running(torchrun.pid, "asyncrl.cli.learner"), signal.SIGTERM)
        assert torchrun.wait(300) == 0, self.procs.log("learner")[-3000:]
        return self.metric_steps()[-1]

    def wait(self, condition: Callable[[], object], what: str, timeout_s: float = 600, watch=("redis", "learner")):
        """The first true value of ``condition()`` (a missing file: not yet), while the ``watch`` processes live."""
        deadline = time.monotonic() + timeout_s
        while True:
            with contextlib.suppress(FileNotFoundError):
                if value := condition():
                    return value
            for name in watch:
                proc = self.procs.procs[name]
                assert proc.poll() is None, f"{what}: {name} exited first ({proc.returncode})"
            assert time.monotonic() < deadline, f"{what}: timed out after {timeout_s:g}s"
            time.sleep(0.5)

    def events(self) -> list[dict]:
        """The run's audit trail, from its stream in Redis (complete after the learner's mirror has stopped)."""
        raw = self.a(self.plane.client.xrange, self.plane.keys.audit)
        return [entry_line(entry_id.decode(), fields) for entry_id, fields in raw]

    def loaded(self, actor: str) -> bool:
        return any(e["event"] == "weights.loaded" and e["who"]["process"] == actor for e in self.events())

    def rows(self) -> list[dict]:
        lines = (self.run_dir / "metrics.jsonl").read_text().splitlines()
        return [json.loads(line) for line in lines if line.endswith("}")]

    def metric_steps(self) -> list[int]:
        return [int(row["step"]) for row in self.rows()]

    def trained_from(self, actor: str) -> bool:
        return any(row.get(f"rollout/groups_from/{actor}") for row in self.rows())

    def close(self) -> None:
        """Every process but Redis told to stop at once (SIGTERM; each waited for, then its session killed), then Redis
        (SIGINT): the actors' engines shut down side by side, not one after another."""
        others = [name for name in self.procs.procs if name != "redis"]
        try:
            with ThreadPoolExecutor(max(len(others), 1)) as pool:
                list(pool.map(self.procs.stop, others))
        finally:
            if "redis" in self.procs.procs:
                self.procs.stop("redis", signal.SIGINT)
            self.on_a.shutdown()


def test_a_run_across_hosts_serves_every_actor_host(tmp_path: Path, model_dir: Path, hosts: Hosts) -> None:
    started = time.monotonic()
    steps = deploy.cluster_steps(**EXAMPLE)
    assert readme_block() == deploy.cluster_doc(steps), "docs/cluster.md's block differs from cli/deploy.py"
    assert "10.77.0." not in subprocess.run(["ip", "-o", "addr"], capture_output=True, text=True).stdout
    run = Cluster(hosts, tmp_path / "hosts", steps)
    try:
        run.start_learner_host(model_dir)
        run.start_workers()
        run.wait(lambda: run.loaded("actor-0") and run.loaded("actor-1"), "weights on B and C")
        _check_endpoints(run, {"actor-0": B, "actor-1": C, "reward-0": B, "learner": LEARNER_HOST})
        run.hang_and_thaw("actor-1")
        left_at = run.join_and_leave()
        left_after = run.metric_steps()[-1]
        run.wait(lambda: run.sent_without("actor-1", left_at, ("actor-0", "actor-2")), "a version sent without C")
        last = run.stop_learner()

        assert run.metric_steps() == list(range(1, last + 1))  # every step trained, once
        # the actor that left by hand left the weight group too: no later sync fails for want of it
        assert not [r["step"] for r in run.rows() if r["step"] > left_after + 1 and r.get("sync/failed")]
        # a broadcast waits at most one timeout for the group to form and one for a transfer, the hung actor's too
        assert max(r["sync/seconds"] for r in run.rows() if "sync/seconds" in r) <= 2 * SYNC_TIMEOUT_S + 15
        figures = run.a(account_groups, run.plane, last, GROUPS)
        served = run.wait(
            lambda: _versions_served(run, left={"actor-1": left_at}), "every version loaded", 60, ("redis",)
        )
        spans = {actor: f"{len(v)} versions {v[0]}-{v[-1]}" for actor, v in served.items()}
        print(f"\nmulti-host run: groups {figures}; steps {last} (C left after {left_after}); loaded {spans}")
        print(f"run's broadcasts: {json.dumps(_run_sync(run))}; test wall time {time.monotonic() - started:.0f}s")
    finally:
        run.close()


def _pings(plane: ControlPlane) -> bool:
    with contextlib.suppress(Exception):
        return bool(plane.client.ping())
    return False


def _copy_to_workers(here: Path, procs: HostProcesses) -> None:
    """What the README says to copy: ``redis-url`` to every worker host, the reward worker's keys to B, the actors'
    client key to B, C and D; nothing else of the learner's folder."""
    for host in (B, C, D):
        folder = procs.folder(host)
        (folder / "keys").mkdir(mode=0o700)
        for name in ("redis-url", "keys/client.key_secret"):
            shutil.copy2(here / name, folder / name)
    shutil.copy2(here / "keys/server.key_secret", procs.folder(B) / "keys")
    shutil.copytree(here / "keys/authorized", procs.folder(B) / "keys/authorized")


def _check_endpoints(run: Cluster, hosts: dict[str, str]) -> None:
    """Every process's heartbeat carries its host's address, the reward worker advertises its wildcard bind at B's
    address with a CURVE key, and each ``/metrics`` answers at its advertised URL from A."""
    import urllib.request

    live, _ = run.a(run.plane.registry.processes)
    beats = {beat.process_id: beat for beat in live}
    for process, host in hosts.items():
        assert beats[process].host == host, beats[process]
        url = beats[process].metrics_url
        assert url.startswith(f"http://{host}:"), url
        assert b"asyncrl_" in run.a(lambda u=url: urllib.request.urlopen(u, timeout=10).read()), process
    reward = beats["reward-0"]
    assert reward.endpoint == f"tcp://{B}:5555" and reward.curve_public_key, reward


def _versions_served(run: Cluster, left: dict[str, float]) -> dict[str, list[int]] | None:
    """The versions each actor loaded, once each loaded every version published to it (it was a member of the
    formation) whose transfer went through; the one that left may miss those published after it was told to stop.
    None while one is missing (an actor records a load after the learner's last step)."""
    events = run.events()
    failed = {int(r["sync/version"]) for r in run.rows() if r.get("sync/failed") and "sync/version" in r}
    failed |= {int(e["version"]) for e in events if e["event"] == "weights.failed"}  # a stop may beat its row
    assert not [e for e in events if e["event"] == "weights.refused"]
    published: dict[str, set[int]] = {}
    loaded: dict[str, set[int]] = {}
    for e in events:
        if e["event"] == "weights.published":
            for member in e["members"]:
                if e["unix"] < left.get(member, float("inf")):
                    published.setdefault(member, set()).add(int(e["version"]))
        elif e["event"] == "weights.loaded":
            loaded.setdefault(e["who"]["process"], set()).add(int(e["version"]))
    assert set(published) == {"actor-0", "actor-1", "actor-2"}, published
    if any(versions - failed - loaded.get(actor, set()) for actor, versions in published.items()):
        return None
    return {actor: sorted(versions) for actor, versions in sorted(loaded.items())}


def _run_sync(run: Cluster) -> dict[str, float]:
    """The median ``sync/seconds`` (packing, digests and the transfer) of the steps that sent to at least two actor
    hosts without failing or re-forming the group, and the bytes sent. Timings of a bare broadcast across hosts
    against loopback: ``bench/broadcast_hosts.py``."""
    rows = [r for r in run.rows() if r.get("sync/members", 0) >= 2 and not r.get("sync/failed")]
    assert rows, "no version reached two actor hosts in one broadcast"
    plain = [r for r in rows if not r.get("sync/self_check_s")] or rows
    return {
        "run_sync_s": statistics.median(r["sync/seconds"] for r in plain),
        "model_bytes": int(statistics.median(r["sync/bytes"] for r in plain)),
    }


def _child_running(parent: int, module: str) -> int:
    """The PID of ``parent``'s child whose command line names ``module`` (torchrun's rank)."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError):
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            if ppid == parent and module.encode() in (stat.parent / "cmdline").read_bytes():
                return int(stat.parent.name)
    raise AssertionError(f"no child of {parent} runs {module}")
