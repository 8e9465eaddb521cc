"""``rl-launch ray``: a run placed on a Ray cluster, as ``rl-launch slurm`` places one in a Slurm job.

Three commands, each a Ray driver of its own in the run's namespace (``asyncrl-<run.name>``):

- ``rl-launch ray CONFIG`` (where you type it, on a node of the cluster or through ``ray://``): reserves one placement
  group for the run's head (``ray.head_cpus``, a GPU per learner rank with ``ray.gpus``, ``ray.head_resources``; one
  node), starts the head in it as a :class:`~asyncrl.cli.ray_cluster.ProcessActor`, shows the run's progress from its
  metrics, and ends with the head's exit code. Ctrl-C stops the head as Ctrl-C stops ``rl-launch run``: the learner
  saves a checkpoint, every process ends, the placement group is given back;
- ``rl-launch ray-head`` (hidden; the head): on its node, what ``rl-launch run`` does on one machine — the embedded
  Redis (bound to the node's address too), the reward workers and the learner (under ``torchrun`` for several ranks)
  — with the rollout actors placed by Ray instead of started beside them;
- ``rl-launch ray-actor`` (hidden; one per rollout actor, a child of the head): asks Ray for one rollout actor
  (``ray.actor_cpus``, ``rollout.tensor_parallel_size`` GPUs with ``ray.gpus``, ``ray.actor_resources``; spread over the
  nodes), and stands for it among the head's children the way ``srun`` stands for a Slurm step: it exits with the
  actor's code, and SIGTERM to it stops the actor. When the actor's node dies, Ray starts it again elsewhere
  (``ray.max_restarts``) and the run counts the old one gone when its heartbeat runs out, as anywhere.
"""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

from asyncrl.cli.ray_cluster import connect, gcs_address, process_actor_class, ray_module
from asyncrl.cli.util import bin_path
from asyncrl.common.config import RunConfig
from asyncrl.common.exit_codes import ExitCode
from asyncrl.common.observability.logs import get_logger

log = get_logger("ray")

HEAD = "head"
"""The name of the run's head among the named actors of its namespace."""
HEAD_READY_S = 300.0
"""How long the head's placement group may wait for a node with its resources (an autoscaler may be adding one)."""
STOP_GRACE_S = 600.0
"""How long a stopped head has to let the learner finish its step, save and stop the others."""


def namespace(run: str) -> str:
    """The Ray namespace of a run: its named actors (the head, ``actor-N``) live there."""
    return f"asyncrl-{run}"


def head_bundle(section: Any) -> dict[str, float]:
    """What the head's node must give: ``ray.head_cpus``, a GPU per learner rank with ``ray.gpus``, and more."""
    bundle = {"CPU": section.head_cpus, **section.head_resources}
    if section.gpus:
        bundle["GPU"] = float(section.learner_ranks)
    return {name: amount for name, amount in bundle.items() if amount > 0}


def launch(config: Path | None, overrides: list[str]) -> int:
    """``rl-launch ray``: the run's head placed and followed until it ends; its exit code."""
    from asyncrl.cli.preflight import check_config
    from asyncrl.cli.util import load

    resolved = load(config, overrides, check=check_config)
    ray = connect(resolved.ray.address, namespace(resolved.run.name))
    address = gcs_address(ray)
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    bundle = head_bundle(resolved.ray)
    group = placement_group([bundle], strategy="STRICT_PACK", name=f"{resolved.run.name}-head")
    try:
        ray.get(group.ready(), timeout=HEAD_READY_S)
    except ray.exceptions.GetTimeoutError:
        remove_placement_group(group)
        log.error(
            "no node gave the run's head its resources", wanted=bundle, waited_s=HEAD_READY_S,
            action="lower ray.head_cpus, or add a node with them (ray status shows what each node has)",
        )  # fmt: skip
        return ExitCode.REFUSED
    head_args = [bin_path("rl-launch"), "ray-head", *([str(config)] if config else [])]
    head_args += [a for o in overrides for a in ("--set", o)] + ["--address", address]
    strategy = PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=0)
    head = process_actor_class().options(
        name=HEAD, num_cpus=bundle.get("CPU", 0), num_gpus=bundle.get("GPU", 0),
        resources={k: v for k, v in bundle.items() if k not in ("CPU", "GPU")}, scheduling_strategy=strategy,
    ).remote(head_args, {}, str(log_file(resolved, "ray-head")), os.getcwd())  # fmt: skip
    where = ray.get(head.where.remote())
    log.info("run placed on the Ray cluster", run=resolved.run.name, cluster=address, head=where)
    try:
        return follow(ray, head, resolved)
    finally:
        stop_actors(ray, list(live_actors(ray).values()))  # those added while it ran (rl-launch ray --actors N)
        remove_placement_group(group)


ACTOR_NAME = re.compile(r"^actor-(\d+)$")


def live_actors(ray: Any) -> dict[str, Any]:
    """The run's rollout actors whose process runs, by name (the namespace is the run's), in index order."""
    found = {}
    for name in sorted(ray.util.list_named_actors(), key=lambda n: int(m[1]) if (m := ACTOR_NAME.match(n)) else -1):
        if not ACTOR_NAME.match(name):
            continue
        try:
            handle = ray.get_actor(name)
            if ray.get(handle.running.remote(), timeout=30):
                found[name] = handle
        except (ValueError, ray.exceptions.RayError):
            continue  # ended meanwhile
    return found


def stop_actors(ray: Any, actors: list[Any]) -> None:
    """Stop rollout actors (SIGTERM: each gives its unfinished groups back) and free their resources."""
    ray.get([actor.stop.remote(60.0) for actor in actors])
    for actor in actors:
        ray.kill(actor)


def scale(config: Path | None, overrides: list[str], actors: int) -> int:
    """``rl-launch ray --actors N --run NAME`` on a live run: start or stop rollout actors until N of them run. Added
    ones are Ray actors of their own (detached: they outlive this command; the run's end stops them); the newest go
    first when there are too many."""
    from asyncrl.cli.util import fail, load

    resolved = load(config, overrides)
    ray = connect(resolved.ray.address, namespace(resolved.run.name))
    try:
        ray.get_actor(HEAD)
    except ValueError:
        fail(f"run.name = {resolved.run.name!r}: no such run is live on this Ray cluster (rl-launch ray starts one)")
    running = live_actors(ray)
    if actors < len(running):
        stop_actors(ray, list(running.values())[actors:])
        log.info("rollout actors stopped", run=resolved.run.name, stopped=len(running) - actors, now=actors)
        return ExitCode.OK
    taken = [int(m[1]) for name in ray.util.list_named_actors() if (m := ACTOR_NAME.match(name))]
    request = actor_request(resolved)
    for index in range(max(taken, default=-1) + 1, max(taken, default=-1) + 1 + actors - len(running)):
        name = f"actor-{index}"
        command = [bin_path("rl-actor"), *run_args(resolved), "--id", name]
        place_actor(name, request, command, str(log_file(resolved, name)), lifetime="detached")
        log.info("rollout actor added", run=resolved.run.name, actor=name)
    return ExitCode.OK


def run_args(resolved: RunConfig) -> list[str]:
    """What a process of the run is started with: the run's Redis URL file (never the URL: it holds the password)."""
    return ["--redis-url-file", str((resolved.run_dir / "redis" / "url").absolute()), "--run", resolved.run.name]


def actor_request(config: RunConfig) -> dict[str, Any]:
    """What one rollout actor asks of Ray: CPUs, GPUs (``rollout.tensor_parallel_size`` with ``ray.gpus``), custom
    resources, restarts."""
    section = config.ray
    request = {"cpus": section.actor_cpus, "resources": section.actor_resources, "restarts": section.max_restarts}
    request["gpus"] = config.rollout.tensor_parallel_size if section.gpus else 0
    return request


def place_actor(name: str, request: dict[str, Any], command: list[str], log_path: str, lifetime: str | None = None):
    """Ask Ray for the rollout actor ``name`` (:func:`actor_request`'s resources, spread over the nodes, started again
    elsewhere when its node dies) running ``command`` in this folder; its handle."""
    return process_actor_class().options(
        name=name, lifetime=lifetime, num_cpus=request["cpus"], num_gpus=request["gpus"],
        resources=request["resources"], max_restarts=request["restarts"], scheduling_strategy="SPREAD",
    ).remote(command, {}, log_path, os.getcwd())  # fmt: skip


def log_file(resolved: RunConfig, name: str) -> Path:
    """Where a process the launcher places writes its output: the run's logs folder, on the shared filesystem."""
    from asyncrl.common.private import private_dir

    return (private_dir(resolved.run_dir / "logs") / f"{name}.log").absolute()


def follow(ray: Any, head: Any, resolved: RunConfig) -> int:
    """Progress from the run's metrics until the head ends (its code); Ctrl-C or SIGTERM stops it first."""
    from asyncrl.cli.children import Progress, tail_metrics

    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    progress = Progress(resolved.learner.steps, sys.stderr)
    ended = head.wait.remote()
    while not ray.wait([ended], timeout=1.0)[0]:
        if stop.is_set():
            progress.say("stopping the run: the learner saves a checkpoint, then every process ends")
            ray.get(head.stop.remote(STOP_GRACE_S))
            break
        if (row := tail_metrics(resolved.run_dir / "metrics.jsonl")) is not None:
            progress.show(row)
    progress.end()
    code = ray.get(ended)
    return ExitCode.INTERRUPTED if stop.is_set() else code


def head_main(config: Path | None, overrides: list[str], address: str, run_redis, run_children) -> int:
    """``rl-launch ray-head``: the run on this node, its rollout actors placed by Ray; the learner's exit code.
    ``run_redis`` and ``run_children`` are ``rl-launch run``'s own (``cli/launch.py``)."""
    from asyncrl.cli.slurm_job import JOB_OVERRIDES, learner_prefix, resume_args, run_here
    from asyncrl.common.net import ADVERTISE_HOST_ENV, advertise_host

    advertise = advertise_host()  # the node's address: the ProcessActor that runs this set it
    os.environ[ADVERTISE_HOST_ENV] = advertise
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    with run_redis(config, [*overrides, *JOB_OVERRIDES], curve=True, check_model=True, binds_here=True,
                   advertise=advertise) as (resolved, server, in_force):  # fmt: skip
        log.info("ray head started", run=resolved.run.name, node=advertise, cluster=address)
        placement = RayActors(resolved, address, learner_prefix(resolved.ray.learner_ranks))
        started = (resolved, server, config, in_force)
        code, learner_code = run_here(
            run_children, started, resolved.ray.rewards, resume_args(resolved), placement, stop
        )
    return learner_code if code == ExitCode.INTERRUPTED else code


class RayActors:
    """Rollout actors placed by Ray: each an ``rl-launch ray-actor`` child of the head (the placement that
    ``rl-launch run``'s ``_run_children`` takes, as a Slurm job's ``srun`` steps)."""

    def __init__(self, config: RunConfig, address: str, learner_prefix: list[str]) -> None:
        self.config, self.address, self.learner_prefix = config, address, learner_prefix

    def start_actors(self, children, run_args: list[str]) -> int:
        for i in range(self.config.ray.actors):
            name = f"actor-{i}"
            command = [bin_path("rl-actor"), *run_args, "--id", name]
            children.start(name, self.proxy(name, command))
        log.info("rollout actors asked of Ray", actors=self.config.ray.actors, cluster=self.address)
        return self.config.ray.actors

    def proxy(self, name: str, command: list[str]) -> list[str]:
        """``rl-launch ray-actor`` for the rollout actor ``name`` running ``command``."""
        request = actor_request(self.config)
        proxy = [bin_path("rl-launch"), "ray-actor", "--address", self.address, "--run", self.config.run.name]
        proxy += ["--name", name, "--request", json.dumps(request), "--log", str(log_file(self.config, name))]
        return [*proxy, "--", *command]


def actor_main(address: str, run: str, name: str, request: dict[str, Any], log_path: str, command: list[str]) -> int:
    """``rl-launch ray-actor``: one rollout actor placed by Ray and followed; its exit code. SIGTERM stops it (it
    gives its unfinished groups back). Its node dying is survived while Ray restarts it elsewhere."""
    from asyncrl.common.observability.logs import configure

    configure()
    ray = connect(address, namespace(run))
    actor = place_actor(name, request, command, log_path)
    log.info("rollout actor placed by Ray", actor=name, node=ray.get(actor.where.remote()))
    stopping = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stopping.set())
    signal.signal(signal.SIGINT, lambda *_: stopping.set())
    restarts = 0
    while True:
        ended = actor.wait.remote()
        try:
            while not ray.wait([ended], timeout=1.0)[0]:
                if stopping.is_set():
                    return ray.get(actor.stop.remote(60.0))
            return ray.get(ended)
        except ray_module().exceptions.RayActorError as exc:
            restarts += 1
            if restarts > request["restarts"] or stopping.is_set():
                log.error("rollout actor lost", actor=name, reason=str(exc).splitlines()[0], restarts=restarts - 1)
                return ExitCode.FAILED
            log.warning("rollout actor's node lost; Ray starts it again", actor=name, restart=restarts)
            time.sleep(2.0)
