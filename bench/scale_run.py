"""One asyncrl run of ``bench/scale.py``, its processes pinned as ``bench/peer.py`` pins them, watched while it runs.

The processes a person starts on a cluster, here on one machine (:func:`run_asyncrl`): embedded Redis, a reward
worker, one rollout actor (vLLM, one-process engine) and the learner, each pinned with ``taskset`` to its cores of
``bench.peer.SPLIT`` (DESIGN.md, "Measuring on a 2-core machine"): the learner (one torch thread) and the reward
worker on core 0, the actor's engine alone on core 1, the actor's own process moved to core 0 once its engine is up
(``rollout.frontend_cpus``). Everything it starts is stopped by PID when it returns, also on failure.

While the run goes, :class:`Watcher` records:

- the resident memory (``VmRSS`` of ``/proc/<pid>/status``) of the learner, the reward worker (with its children),
  the actor's own process and its vLLM engine (the actor's descendants): every second and at each new step row of
  ``metrics.jsonl``, with the steps done at that moment;
- snapshots of the actor's engine, each the CPU seconds of its processes so far (and of the actor's own process), the
  response tokens the actor has counted and the groups it holds (``asyncrl_actor_generated_tokens_total``,
  ``asyncrl_actor_running_groups`` from its ``/metrics``): as the actor leaves ``starting`` (engine up, nothing
  generated yet); the last moment before the last step's row that it held no group (polled four times a second: then
  every token it generated is counted, none half made); and as that row appears. Between two of them, the engine's
  CPU seconds are its busy time on a core of its own: with OpenMP's passive waits, an engine with no request costs no
  CPU.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.peer import BIN, SPLIT, pinned, start

if TYPE_CHECKING:
    from asyncrl.common.plane.control import ControlPlane

TOKENS, RUNNING = "asyncrl_actor_generated_tokens_total", "asyncrl_actor_running_groups"
ENV = {"OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE", "DS_ACCELERATOR": "cpu"}
"""Every process of the comparison: one torch thread per process, OpenMP threads that sleep while they wait."""


@dataclass(frozen=True)
class EngineSnapshot:
    at: float
    """Unix time of the snapshot."""
    cpu_s: float
    """CPU seconds of the actor's engine processes so far."""
    frontend_cpu_s: float
    """CPU seconds of the actor's own process so far (vLLM's frontend, the actor's loop)."""
    tokens: float
    """Response tokens the actor has generated so far."""
    running: float
    """Groups the actor holds now (0: every token it generated is counted)."""


@dataclass
class Watch:
    """What :class:`Watcher` saw."""

    memory: list[tuple[float, int, dict[str, int]]] = field(default_factory=list)
    """(unix time, steps done, role → resident bytes) of each sample."""
    start: EngineSnapshot | None = None
    """The actor's engine as it left ``starting``."""
    idle: EngineSnapshot | None = None
    """The last time before the last step's row that the actor held no group, having generated some."""
    last: EngineSnapshot | None = None
    """As the last step's row appeared (the actor may be generating then)."""


def rss_bytes(pid: int) -> int:
    """``VmRSS`` of ``pid`` (0 when it is gone)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return 0
    line = next((x for x in status.splitlines() if x.startswith("VmRSS:")), "VmRSS: 0 kB")
    return int(line.split()[1]) * 1024


def descendants(pid: int) -> list[int]:
    import psutil

    try:
        return [child.pid for child in psutil.Process(pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def cpu_seconds(pids: list[int]) -> float:
    """User + system CPU seconds of ``pids`` (``/proc/<pid>/stat``; a gone process counts 0)."""
    tick, total = os.sysconf("SC_CLK_TCK"), 0.0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / tick  # utime, stime (fields 14, 15 of stat)
    return total


def actor_counters(url: str) -> dict[str, float]:
    """The actor's generated tokens and running groups from its Prometheus text (those two metrics alone: a scrape
    costs the actor next to nothing, several a second)."""
    with urllib.request.urlopen(f"{url}?name[]={TOKENS}&name[]={RUNNING}", timeout=5) as reply:
        text = reply.read().decode()
    values = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name in (TOKENS, RUNNING):
            values[name] = float(value)
    return values


class Watcher(threading.Thread):
    """Samples memory and the actor's engine of a run until :meth:`finish` (see the module docstring)."""

    def __init__(self, plane: ControlPlane, metrics: Path, steps: int) -> None:
        super().__init__(daemon=True)
        self.plane, self.metrics, self.steps = plane, metrics, steps
        self.pids: dict[str, int] = {}
        self.watch = Watch()
        self.error: BaseException | None = None
        self._done = threading.Event()
        self._rows = 0
        self._sampled = 0.0

    def follow(self, pids: dict[str, int]) -> None:
        """Start watching the processes ``pids`` (``learner``, ``actor``, ``reward``)."""
        self.pids = pids
        self.start()

    def finish(self) -> None:
        """Stop watching; what it saw is :attr:`watch`, and an error it met :attr:`error`."""
        self._done.set()
        if self.ident is not None:
            self.join(60)

    def run(self) -> None:
        try:
            url = self._wait_for_engine()
            if url:
                self.watch.start = self._snapshot(url)
                self._follow_steps(url)
            while not self._done.wait(1.0):
                self._sample()
        except BaseException as exc:  # reaches the caller through finish()
            self.error = exc

    def _wait_for_engine(self) -> str:
        """The actor's metrics URL once it has left ``starting`` ('' if the run ends first)."""
        while not self._done.is_set():
            actor = next((h for h in self.plane.registry.processes()[0] if h.kind == "actor"), None)
            if actor is not None and actor.state != "starting" and actor.metrics_url:
                return actor.metrics_url
            self._tick(0.1)
        return ""

    def _follow_steps(self, url: str) -> None:
        """Samples, and the engine's snapshots, until the last step's row: every quarter second while the actor holds no
        group (:attr:`Watch.idle`), and once as the row appears (:attr:`Watch.last`)."""
        first = self.watch.start.tokens if self.watch.start else 0.0
        while not self._done.is_set() and self._rows < self.steps:
            self._tick(0.25)
            snapshot = self._snapshot(url)
            if snapshot.running == 0 and snapshot.tokens > first and self._rows < self.steps:
                self.watch.idle = snapshot
        if not self._done.is_set():
            self.watch.last = self._snapshot(url)

    def _tick(self, seconds: float) -> None:
        """Wait ``seconds``; sample when a step row arrived or a second has passed."""
        self._done.wait(seconds)
        rows = self._step_rows()
        if rows != self._rows or time.monotonic() - self._sampled >= 1.0:
            self._rows = rows
            self._sample()

    def _step_rows(self) -> int:
        try:
            return sum('"eval/step"' not in line for line in self.metrics.read_text().splitlines() if line)
        except OSError:
            return 0

    def _engine_pids(self) -> list[int]:
        return descendants(self.pids["actor"])

    def _snapshot(self, url: str) -> EngineSnapshot:
        counters = actor_counters(url)  # first: the CPU seconds then hold every counted token's
        engine, frontend = cpu_seconds(self._engine_pids()), cpu_seconds([self.pids["actor"]])
        return EngineSnapshot(time.time(), engine, frontend, counters.get(TOKENS, 0.0), counters.get(RUNNING, 0.0))

    def _sample(self) -> None:
        self._sampled = time.monotonic()
        memory = {
            "learner": rss_bytes(self.pids["learner"]),
            "reward": sum(rss_bytes(p) for p in [self.pids["reward"], *descendants(self.pids["reward"])]),
            "actor": rss_bytes(self.pids["actor"]),
            "engine": sum(rss_bytes(p) for p in self._engine_pids()),
        }
        self.watch.memory.append((time.time(), self._rows, memory))


def wait_for_learner(procs: dict[str, subprocess.Popen], logs: Path, timeout_s: float) -> int:
    """The learner's exit code; raises as soon as another process of the run fails (the learner would wait for
    actors for ``learner.no_actors_s`` first), or after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while (code := procs["learner"].poll()) is None:
        failed = [role for role, proc in procs.items() if proc.poll()]
        if failed:
            tail = (logs / f"{failed[0]}.log").read_text(errors="replace")[-3000:]
            raise RuntimeError(f"the {failed[0]} exited with {procs[failed[0]].returncode}:\n{tail}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"the learner did not finish within {timeout_s:.0f} s")
        time.sleep(1.0)
    return code


def run_asyncrl(run_dir: Path, config_file: Path, overrides: list[str], timeout_s: float = 7200) -> Watch:
    """The run in ``run_dir`` (its name the folder's), the learner's ``--set`` ``overrides`` on ``config_file``; raises
    when the learner fails. What :class:`Watcher` saw."""
    from asyncrl.common.config import load_config
    from asyncrl.common.plane.control import ControlPlane
    from asyncrl.common.plane.keys import connect
    from asyncrl.common.plane.redis_server import EmbeddedRedis
    from bench.rollout import stop

    name = run_dir.name
    overrides = [
        f"run.root={run_dir.parent}",
        f"run.name={name}",
        f"rollout.frontend_cpus={SPLIT['frontend']}",
        *overrides,
    ]
    config = load_config(config_file, overrides)
    logs = run_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, **ENV, "VLLM_CPU_OMP_THREADS_BIND": SPLIT["actor"]}
    procs: dict[str, subprocess.Popen] = {}
    with EmbeddedRedis(run_dir / "redis") as redis:
        ControlPlane(connect(redis.url), name).run.publish_config(config)
        env["ASYNCRL_REDIS_URL"] = redis.url  # not in argv: the URL carries the password
        actor, run = str(BIN / "rl-actor"), ["--run", name]
        learner = [str(BIN / "rl-learner"), "train", str(config_file), *(a for o in overrides for a in ("--set", o))]
        watcher = Watcher(ControlPlane(connect(redis.url), name), run_dir / "metrics.jsonl", config.learner.steps)
        try:
            procs["reward"] = start(logs / "reward.log", pinned(SPLIT["reward"], [actor, "reward", *run]), env)
            procs["actor"] = start(logs / "actor.log", pinned(SPLIT["actor"], [actor, *run, "--id", "a0"]), env)
            procs["learner"] = start(logs / "learner.log", pinned(SPLIT["learner"], learner), env)
            watcher.follow({role: proc.pid for role, proc in procs.items()})
            code = wait_for_learner(procs, logs, timeout_s)
        finally:
            watcher.finish()
            stop(list(procs.values()))
    if code:
        tail = (logs / "learner.log").read_text(errors="replace")[-3000:]
        raise RuntimeError(f"the learner of {name} exited with {code}:\n{tail}")
    if watcher.error is not None:
        raise RuntimeError(f"watching {name} failed: {watcher.error!r}") from watcher.error
    return watcher.watch
