"""Child processes of ``rl-launch``: started with their logs in the run folder, stopped by PID, always.

The launcher is a *child subreaper* (``prctl(PR_SET_CHILD_SUBREAPER)``): a process that a child started and then
lost — a vLLM engine under an actor that died, a sandboxed program that left its session — is re-parented to the
launcher instead of to init, so :meth:`Children.stop_all` can find it, end it and reap it, whatever session or
process group it moved to. Only processes adopted that way are touched, never one the launcher did not lead to.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path
from typing import TextIO

import redis.exceptions as redis_errors

from asyncrl.common.config.training import cpu_list
from asyncrl.common.observability.logs import get_logger
from asyncrl.common.observability.procs import child_pids, ended
from asyncrl.common.plane.control import ControlPlane
from asyncrl.common.plane.keys import connect
from asyncrl.common.private import PRIVATE_UMASK, open_private, private_dir

log = get_logger("launch")
_PR_SET_CHILD_SUBREAPER = 36  # <linux/prctl.h>


PIN_ROLES = ("learner", "actors", "rewards")


def parse_pins(values: list[str], allowed: set[int] | None = None) -> dict[str, str]:
    """``ROLE=CPUS`` settings (``rl-launch run --pin``) → {role: CPU list}; ``ValueError`` names a bad one. A CPU
    list is taskset's: ``0``, ``1-3``, ``0,2-3``; every CPU must be one this process may run on."""
    allowed = set(os.sched_getaffinity(0)) if allowed is None else allowed
    pins: dict[str, str] = {}
    for value in values:
        role, sep, cpus = value.partition("=")
        if not sep or role not in PIN_ROLES:
            raise ValueError(f"--pin {value!r}: expected ROLE=CPUS with ROLE one of {', '.join(PIN_ROLES)}")
        wanted = cpu_list(cpus)
        if not wanted or not wanted <= allowed:
            raise ValueError(
                f"--pin {value!r}: CPUs {sorted(wanted - allowed) or cpus!r} are not among this machine's "
                f"{_ranges(allowed)}"
            )
        pins[role] = cpus
    return pins


def _ranges(cpus: set[int]) -> str:
    return ",".join(str(c) for c in sorted(cpus))


def pinned(cmd: list[str], cpus: str | None) -> list[str]:
    """``cmd`` run on ``cpus`` (through ``taskset``), or as it is."""
    return ["taskset", "--cpu-list", cpus, *cmd] if cpus else cmd


ADOPTED_GRACE_S = 5.0
"""How long the launcher lets orphaned descendants end by themselves before it kills them: an actor's sweeper stops
2 s after its last find (``actors/lifeline.py``: ``SWEEP_QUIET_S``)."""


class Children:
    """The processes one launcher started; ``stop_all`` ends them (SIGTERM, then SIGKILL) and only them."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = private_dir(log_dir)
        self.procs: dict[str, subprocess.Popen] = {}
        self.subreaper = _become_subreaper()
        self._others = set(child_pids(os.getpid()))  # started before us (the embedded Redis): never adopted strays

    def start(
        self, name: str, cmd: list[str], env: dict[str, str] | None = None, cpus: str | None = None
    ) -> subprocess.Popen:
        """Start ``cmd`` as ``name``; with ``cpus`` (a CPU list such as ``1-3,5``) pinned to those cores from its
        first instruction (``taskset`` execs it), so every thread and process it starts later stays on them."""
        with open_private(self.log_dir / f"{name}.log", "ab") as log_file:  # the child has its own copy
            proc = subprocess.Popen(
                pinned(cmd, cpus),
                stdout=log_file,
                stderr=subprocess.STDOUT,
                env={**os.environ, **(env or {})},
                start_new_session=True,  # our Ctrl-C is handled here, and then passed on as SIGTERM
                umask=PRIVATE_UMASK,  # what it writes under the run folder is the run's user's only
            )
        self.procs[name] = proc
        log.info("started", process=name, pid=proc.pid, log=self.log_dir / f"{name}.log", cpus=cpus or "any")
        return proc

    def keep(self, pid: int) -> None:
        """A process of ours started outside :meth:`start` (the embedded Redis, started again): :meth:`stop_all`
        never ends it as a stray."""
        self._others.add(pid)

    def failed_all(self) -> set[str]:
        """The names of the children that exited with an error."""
        return {n for n, p in self.procs.items() if p.poll() not in (None, 0)}

    def log_path(self, name: str) -> Path:
        return self.log_dir / f"{name}.log"

    def stop_all(self, timeout_s: float = 60.0, first: tuple[str, ...] = ()) -> None:
        """SIGTERM each child, wait, then SIGKILL its whole session (its own children, e.g. vLLM engine
        processes, live in the session the child leads: the group id is the child's PID, ours to end). The children
        named in ``first`` are stopped before the others (the learner, whose last weight sync and checkpoint need the
        actors still there), each within ``timeout_s``."""
        self._stop([n for n in first if n in self.procs], timeout_s)
        self._stop([n for n in self.procs if n not in first], timeout_s)
        self._end_adopted()

    def _stop(self, names: list[str], timeout_s: float) -> None:
        for name in names:
            if self.procs[name].poll() is None:
                self.procs[name].send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout_s  # one deadline for all: a stuck child does not delay the others
        for name in names:
            proc = self.procs[name]
            try:
                proc.wait(max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                log.warning("did not stop on SIGTERM; killing", process=name, pid=proc.pid)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)  # stragglers of a child that died or hung
            proc.wait()

    def _end_adopted(self, grace_s: float = ADOPTED_GRACE_S) -> None:
        """Reap every descendant that was re-parented to us (see the module docstring), until none is left: those that
        end by themselves within ``grace_s`` (an actor's sweeper finishing its sweep, an engine process following its
        actor) quietly; the others then SIGKILLed and named (one may have started another before it died)."""
        mine = {proc.pid for proc in self.procs.values()} | self._others
        deadline = time.monotonic() + grace_s
        while adopted := [pid for pid in child_pids(os.getpid()) if pid not in mine]:
            running = [pid for pid in adopted if not ended(pid)]  # the others only wait to be reaped
            if running and time.monotonic() < deadline:
                _reap([pid for pid in adopted if pid not in running])
                time.sleep(0.1)
                continue
            for pid in running:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            _reap(adopted)
            if running:
                log.warning("ended processes our children left behind", pids=",".join(map(str, running)))


def _reap(pids: list[int]) -> None:
    for pid in pids:
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, 0)


def _become_subreaper() -> bool:
    """Make this process the reaper of its orphaned descendants (Linux ≥ 3.4); False where that is not possible."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


class ActorsGone:
    """Whether a run that nothing restarts actors for has none left: every rollout actor the launcher started has
    exited, the run did not finish (its actors exit when it does), and no actor started elsewhere (``rl-actor`` by
    hand) still heartbeats. Redis is only asked once the launched actors are all gone."""

    def __init__(self, procs: dict[str, subprocess.Popen], actors: int, redis_url: str, run: str) -> None:
        self.procs, self.names = procs, [f"actor-{i}" for i in range(actors)]
        """The launcher's children by name (:attr:`Children.procs`), the actors among them ``actor-<i>``."""
        self.redis_url, self.run = redis_url, run
        self._plane: ControlPlane | None = None

    def all_gone(self) -> bool:
        if not self.names or any(self.procs[name].poll() is None for name in self.names):
            return False
        if self._plane is None:  # asked every second from the launcher's loop, which also restarts a dead Redis:
            self._plane = ControlPlane(connect(self.redis_url, outage_s=2.0), self.run)  # never wait long on it
        plane = self._plane
        try:
            if plane.run.finished() is not None:
                return False
            live, _ = plane.registry.processes()
        except redis_errors.RedisError:
            return False  # Redis restarting: asked again in a second
        return not any(b.kind == "actor" and b.process_id not in self.names for b in live)


ERROR_LINE = re.compile(r"\b\w*(Error|Exception)\b: \S|\bERROR\b|^error: ")
"""A line that says something failed; ``error: …`` is a command's own last word (``cli/util.py``: fail, crash)."""
FOLLOW_UPS = ("root cause above", "stack trace (above)", "See the traceback above")
"""Error lines that only point back at the real one (vLLM's frontend after its engine died, for one)."""
RANK_PREFIX = re.compile(r"^\[rank\d+\]: ?")
"""What ``torch.distributed`` puts before every line its excepthook prints (``[rank0]: ``): not part of the cause."""
MAX_CAUSE_CHARS = 2000
"""The longest cause line shown whole: a checkpoint refused by a full disk is said in about 500 characters."""


def why_it_failed(returncode: int, log: Path) -> str:
    """What to tell a person about a child that exited with ``returncode``: killed by a signal, that signal (its log
    ends mid-work and says nothing of it: a line from it would mislead); else the :func:`root_cause` line of its
    log."""
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        return f"killed by {name}, from outside the run (a person, the kernel's OOM killer, the node); its log: {log}"
    return root_cause(log)


def root_cause(log: Path, tail_bytes: int = 256 * 1024) -> str:
    """The line of a child's log most likely to say why it failed (:func:`cause_line`), whole (up to
    :data:`MAX_CAUSE_CHARS`), with the log's path."""
    try:
        with log.open("rb") as f:
            f.seek(max(0, f.seek(0, 2) - tail_bytes))
            text = f.read().decode(errors="replace")
    except OSError:
        return f"(no log at {log})"
    line = cause_line(text)
    if line == "(empty log)":
        return line
    shown = line if len(line) <= MAX_CAUSE_CHARS else f"{line[:MAX_CAUSE_CHARS]} …"
    return f"{shown} (the whole log: {log})"


def cause_line(text: str) -> str:
    """The last exception or error line of ``text`` that is not a pointer back to an earlier one (else its last
    line), without the ``[rank0]: `` and ``error: `` in front of it."""
    lines = [RANK_PREFIX.sub("", line).strip() for line in text.splitlines()]
    lines = [line for line in lines if line]
    errors = [line for line in lines if ERROR_LINE.search(line) and not any(f in line for f in FOLLOW_UPS)]
    return (errors or lines or ["(empty log)"])[-1].removeprefix("error: ")


def tail_metrics(path: Path) -> dict | None:
    """The last complete step line of metrics.jsonl (not an eval round's), or None."""
    try:
        lines = path.read_text().splitlines()
    except FileNotFoundError:
        return None
    for line in reversed(lines):
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line being written
        if "eval/step" not in row:
            return row
    return None


def progress_line(m: dict, steps: int) -> str:
    tokens_s = m.get("rollout/tokens", 0.0) / max(m.get("step/seconds", 1e-9), 1e-9)
    return (
        f"step {int(m['step']):>4}/{steps}  reward {m['rollout/reward_mean']:.3f}  "
        f"kl {m.get('train/loss/kl_ref', 0.0):.4f}  mismatch {m.get('train/offpolicy/mismatch_kl', 0.0):.2e}  "
        f"staleness {m['rollout/staleness_max']:.0f}  tokens/s {tokens_s:,.0f}  step {m['step/seconds']:.1f}s"
    )


class Progress:
    """The launcher's progress: on a terminal one line redrawn in place each step; elsewhere (a log file, a CI
    capture) a plain line every ``steps // PLAIN_LINES`` steps and at the last, so a captured log stays readable."""

    PLAIN_LINES = 20

    def __init__(self, steps: int, stream: TextIO) -> None:
        self.steps, self.stream = steps, stream
        self.live = stream.isatty()
        self.every = max(1, steps // self.PLAIN_LINES)
        self.shown: float | None = None

    def show(self, row: dict) -> None:
        """Show a metrics.jsonl step row once."""
        if row["step"] == self.shown:
            return
        self.shown = row["step"]
        if self.live:
            self.stream.write("\r" + progress_line(row, self.steps))
        elif int(row["step"]) % self.every == 0 or int(row["step"]) >= self.steps:
            self.stream.write(progress_line(row, self.steps) + "\n")
        self.stream.flush()

    def say(self, text: str) -> None:
        """A line of its own (off the redrawn line on a terminal)."""
        self.stream.write(("\n" if self.live else "") + text + "\n")
        self.stream.flush()

    def end(self) -> None:
        if self.live:
            self.stream.write("\n")
            self.stream.flush()
