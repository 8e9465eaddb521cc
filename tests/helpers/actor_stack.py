"""Rollout actors under test: starting and stopping them, feeding and reading them, broadcasting weights to them, and
one long-lived actor (:class:`SharedActor`) that many tests use in turn.

The test process plays an actor's two neighbours with the project's own parts: it feeds the prompt queue and, as the
learner does, broadcasts weights over a real gloo group; and it receives rollout groups on a real PULL socket
registered like a reward worker's.
"""

from __future__ import annotations

import itertools
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path

import numpy as np
import torch

from asyncrl.common.data.tasks import get_task, prompt_group
from asyncrl.common.openmp import WAIT_POLICY
from asyncrl.common.plane.control import ControlPlane
from asyncrl.common.plane.run_secret import run_seal
from asyncrl.common.transport.channel import PullChannel
from asyncrl.common.weights.group import GroupAddress, SealedWeights, WeightGroup, pack_sealed
from asyncrl.common.weights.rendezvous import RedisStore
from asyncrl.common.wire.messages import Heartbeat, PromptGroup, RolloutGroup, WeightManifest
from tests.helpers import waits
from tests.helpers.scrape import metric

ACTOR = str(Path(sys.executable).parent / "rl-actor")
LOGPROB_TOLERANCE = 1e-4
POLL_S = 0.1
"""How often a wait looks again (a Redis read or a /metrics scrape: each costs the actor a little)."""


def start_actor(url: str, run: str, actor_id: str, core: str | None = None, temp: Path | None = None):
    """``rl-actor`` as users start it (from an environment without the suite's OpenMP wait policy: the actor sets its
    own); ``core``: vLLM's CPU binding (``VLLM_CPU_OMP_THREADS_BIND``) when the run's config sets none; ``temp``: its
    ``TMPDIR`` (where vLLM's IPC sockets go)."""
    env = {
        **{k: v for k, v in os.environ.items() if k != WAIT_POLICY},
        **({"VLLM_CPU_OMP_THREADS_BIND": core} if core else {}),
        **({"TMPDIR": str(temp)} if temp else {}),
    }
    return subprocess.Popen([ACTOR, "--redis", url, "--run", run, "--id", actor_id], env=env)


def register_collector(plane: ControlPlane) -> PullChannel:
    """A PULL socket registered as a reward worker, so actors push their groups here."""
    pull = PullChannel("rollouts", RolloutGroup, seal=run_seal(plane.client, plane.keys, "rollouts"))
    endpoint = pull.bind("tcp://127.0.0.1:0")
    plane.registry.beat(Heartbeat(process_id="collector", kind="reward", state="ready", endpoint=endpoint), ttl_s=3600)
    return pull


def stop(proc: subprocess.Popen) -> int:
    """SIGTERM, then the exit status (``kill -9`` after 90 s)."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            return proc.wait(90)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode


def collect(pull: PullChannel, until, timeout_s: float = 300, prefix: str = "") -> list[RolloutGroup]:
    """Rollout groups whose id starts with ``prefix`` (others are dropped) until ``until(got)`` holds."""
    got: list[RolloutGroup] = []
    deadline = time.monotonic() + timeout_s
    while not until(got):
        assert time.monotonic() < deadline, f"only {len(got)} rollout groups arrived"
        if (group := pull.recv(timeout_s=1.0)) is not None and group.group_id.startswith(prefix):
            got.append(group)
    return got


def wait_for(check: Callable, what: str, timeout_s: float = 120):
    """:func:`tests.helpers.waits.wait_for` every :data:`POLL_S`; the value ``check()`` returned."""
    return waits.wait_for(check, what, timeout_s=timeout_s, poll_s=POLL_S)


def heartbeat_of(plane: ControlPlane, actor_id: str) -> Heartbeat | None:
    return next((h for h in plane.registry.processes()[0] if h.process_id == actor_id), None)


def wait_until_generating(plane: ControlPlane, actor_id: str, timeout_s: float = 60) -> None:
    """Until the actor's /metrics says requests are running: its groups run in waves (all of one length), and an
    update that lands between two waves spans no response."""

    def running() -> bool:
        beat = heartbeat_of(plane, actor_id)
        return beat is not None and bool(beat.metrics_url) and metric(beat, "asyncrl_actor_running_groups") > 0

    wait_for(running, f"{actor_id} ran a request", timeout_s)


def prompt_groups(model_dir: Path, n: int, prefix: str = "g") -> list[PromptGroup]:
    from transformers import AutoTokenizer

    encode = AutoTokenizer.from_pretrained(model_dir)
    task, rng = get_task("arithmetic"), random.Random(0)
    return [
        prompt_group(f"{prefix}{i}", "arithmetic", task.sample(rng), lambda s: encode(s)["input_ids"], 4)
        for i in range(n)
    ]


def issue(plane: ControlPlane, groups: list[PromptGroup]) -> None:
    """As the dispatcher does: record the groups as issued and queue them."""
    plane.prompts.record_issued(groups)
    plane.prompts.push_prompts(groups)


def transformers_logprobs(model, prompt_ids: np.ndarray, response_ids: np.ndarray) -> np.ndarray:
    """log π(token_t | prefix) of every response token, from one forward pass (temperature 1)."""
    ids = torch.tensor(np.concatenate([prompt_ids, response_ids]), dtype=torch.long)[None]
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt_ids) - 1 : -1].float()
    chosen = torch.log_softmax(logits, -1).gather(-1, torch.tensor(response_ids, dtype=torch.long)[:, None])
    return chosen[:, 0].numpy()


def assert_served_by(model, groups: list[RolloutGroup]) -> None:
    """Every response's log-probs are ``model``'s (a transformers forward)."""
    for group in groups:
        for i in range(group.num_samples):
            ids, logprobs, _ = group.response(i)
            if len(ids):
                np.testing.assert_allclose(
                    logprobs, transformers_logprobs(model, group.prompt_ids, ids), atol=LOGPROB_TOLERANCE
                )


def load_model(model_dir: Path, params: Mapping[str, torch.Tensor] | None = None):
    """The model folder's model in float32, with ``params`` in place of its weights when given."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    if params is not None:
        model.load_state_dict(params, strict=False)
    return model


def perturbed(model, seed: int = 1) -> dict[str, torch.Tensor]:
    """Add noise to ``model``'s weights in place; a copy of them."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=generator))
    return {name: p.detach().clone() for name, p in model.named_parameters()}


class WeightRoot:
    """The learner's side of one formation (``epoch``) of the weight group: announces versions to ``members`` and
    broadcasts their buckets; forms the group on the first :meth:`publish`."""

    def __init__(self, plane: ControlPlane, epoch: int, members: list[str], world_size: int, member_ranks=()) -> None:
        self.plane, self.epoch, self.members, self.world_size = plane, epoch, members, world_size
        self.member_ranks = list(member_ranks)
        self.group: WeightGroup | None = None
        self.published = 0  # manifests so far: the next one's place in the formation

    def manifest(self, version: int, sealed: SealedWeights) -> WeightManifest:
        return WeightManifest(
            version=version,
            world_size=self.world_size,
            members=self.members,
            member_ranks=self.member_ranks,
            buckets=sealed.buckets,
            group_epoch=self.epoch,
            digest=sealed.digest,
        )

    def publish(self, version: int, sealed: SealedWeights, flats: list[torch.Tensor] | None = None) -> None:
        """The manifest of ``sealed`` as ``version``, then the buckets (``flats``, by default the sealed ones), then
        the run's version."""
        self.plane.run.publish_manifest(self.manifest(version, sealed), self.published)
        self.published += 1
        if self.group is None:
            store = RedisStore(self.plane.client, self.plane.keys.run, 120)
            run, size = self.plane.keys.run, self.world_size
            address = GroupAddress("", run, epoch=self.epoch, rank=0, world_size=size, timeout_s=120)
            self.group = WeightGroup(address, store)
            self.group.self_check()
        self.group.send_packed(sealed.flats if flats is None else flats)
        self.plane.run.set_version(version)

    def close(self) -> None:
        if self.group is not None:
            self.group.close()


class SharedActor:
    """One actor ``a1`` that the tests of a module use in turn, each as if it were its own.

    A test begins with :meth:`begin`: its groups get ids of their own (``prefix``; :meth:`collect` keeps only those,
    so a group a previous test left in flight never reaches it), its versions are higher than any published before,
    and its broadcasts form a new weight group (``epoch``). :attr:`version` and :meth:`serving_model` are what the
    actor serves when the test begins: the last version that loaded (0, the model folder, at first). :meth:`end`
    empties the prompt queue, so that the actor goes idle.
    """

    def __init__(
        self, plane: ControlPlane, rollouts: PullChannel, proc: subprocess.Popen, model_dir: Path, url: str
    ) -> None:
        self.plane, self.rollouts, self.proc, self.model_dir, self.url = plane, rollouts, proc, model_dir, url
        self.actor_id = "a1"
        self.version, self.digest = 0, ""
        self._params: dict[str, dict[str, torch.Tensor]] = {}  # by version digest: what a loaded version holds
        self._published = 0
        self._tests = itertools.count(1)
        self.prefix = ""
        self.root: WeightRoot | None = None

    def begin(self) -> None:
        """A fresh prefix and epoch, once the actor is up and stamps the version it last loaded."""
        number = next(self._tests)
        self.prefix = f"t{number}-"
        self.root = WeightRoot(self.plane, number, [self.actor_id], world_size=2)
        self.plane.client.delete(self.plane.keys.prompts)

        def settled() -> bool:
            beat = heartbeat_of(self.plane, self.actor_id)
            up = beat is not None and beat.state != "starting"
            return up and (beat.version, beat.weights_digest) == (self.version, self.digest)

        assert self.proc.poll() is None, f"the shared actor exited with {self.proc.returncode}"
        wait_for(settled, f"the shared actor up at version {self.version}", 300)

    def end(self) -> None:
        self.plane.client.delete(self.plane.keys.prompts)
        if self.root is not None:
            self.root.close()
            self.root = None

    def heartbeat(self) -> Heartbeat:
        beat = heartbeat_of(self.plane, self.actor_id)
        assert beat is not None, "the shared actor has no heartbeat"
        return beat

    def groups(self, n: int) -> list[PromptGroup]:
        """``n`` prompt groups with this test's ids (not issued)."""
        return prompt_groups(self.model_dir, n, self.prefix)

    def issue(self, n: int) -> list[PromptGroup]:
        """``n`` prompt groups with this test's ids, issued and queued."""
        groups = self.groups(n)
        issue(self.plane, groups)
        return groups

    def collect(self, until, timeout_s: float = 300) -> list[RolloutGroup]:
        return collect(self.rollouts, until, timeout_s, self.prefix)

    def serving_model(self):
        """A transformers model with the weights the actor served when the test began."""
        return load_model(self.model_dir, self._params.get(self.digest))

    def seal(self, params: Mapping[str, torch.Tensor]) -> SealedWeights:
        sealed = pack_sealed(params, bucket_bytes=256 * 1024)
        self._params[sealed.digest] = dict(params)
        return sealed

    def publish(self, sealed: SealedWeights, flats: list[torch.Tensor] | None = None) -> int:
        """Broadcast ``sealed`` (made by :meth:`seal`) to the actor as a new version; returns the version. Buckets
        sent as they were sealed are what the actor serves from then on (the next test waits for it to)."""
        assert self.root is not None, "publish outside a test"
        self._published += 1
        self.root.publish(self._published, sealed, flats)
        if flats is None:
            self.version, self.digest = self._published, sealed.digest
        return self._published
