"""The paths CPUs cannot exercise, checked on a machine with CUDA GPUs (on CPUs it runs the same checks with gloo).

    python bench/gpu_check.py [--mb 256]

1. ``learner_ranks``: ``tests/helpers/update_ranks.py`` — PolicyUpdate's steps, a checkpoint and a restore, led by
   rank 0 (learner/ranks.py) — with one rank (ZeRO-2), then with two ranks under ZeRO-2 and ZeRO-3 (NCCL, one GPU
   each; needs 2 GPUs, else gloo on CPU). Two ranks must equal one within 1e-4: loss and grad norm of each step and
   every weight the broadcaster sends (``params()``, ZeRO-3's bucket-by-bucket gather). The helper runs with the
   mismatch guard off (it would drop every row of its random behaviour log-probs, and a step that trains nothing
   compares nothing): ``trained`` says every step of the one-rank reference had a gradient; ``ok`` needs it.
2. ``learner_on_gpu``: the same one-rank GRPO case (ZeRO-2) on the CUDA device (DeepSpeed's ``cuda`` accelerator,
   NCCL with one rank) against one rank on CPU (gloo): the learner's training step on a GPU at all, then its loss and
   grad norm of each step and every weight after step 2 within ``GPU_TOLERANCE`` (1e-3: float32 on both, TF32 off as
   torch's default leaves it — the result says what the device had). Needs one GPU (on CPUs it is ``skipped``); a
   failure there is reported with the learner's error.
3. ``weight_group``: ``WeightGroup`` (``common/weights/group.py``: the learner → actors broadcast) between two
   processes — NCCL when there are 2 GPUs (NCCL refuses two ranks on one GPU), else gloo — sending ``--mb`` MiB of
   sealed buckets; the receiver checks every bucket's digest. Prints GB/s.
4. ``entropy_memory``: the entropy figure every training step reports (``token_entropy_no_grad``, chunked over
   positions) against the differentiable ``token_entropy``, on a Qwen-sized vocabulary (151,936) of bf16 logits on the
   GPU: the values agree, and the chunked one's peak memory above its input stays near one chunk instead of a few
   float32 copies of the logits. Needs one GPU (on CPUs it is ``skipped``).
5. ``gpu_figures``: the learner's ``gpu/*`` step figures (``common/observability/gpu.py``) read on the device: torch's
   allocator figures hold a tensor made for the check, and NVML's utilisation and device memory where
   ``nvidia-ml-py`` is installed. Needs one GPU.
6. ``tensor_parallel``: a vLLM engine with ``rollout.tensor_parallel_size = 2`` whose two workers each join the
   weight group as their own rank; needs vLLM and 2 GPUs (the device image has neither vLLM nor room to carry it),
   so it is reported ``skipped`` with the reason where they are missing.

Expected on a 2-GPU machine: ``"learner_ranks": {"backend": "nccl", "ok": true, "max_weight_diff": <1e-4 …}``,
``"weight_group": {"backend": "nccl", "ok": true, "gbps": …}``; on CPUs the same with ``"backend": "gloo"``. Prints
one JSON object last; exits 1 when a check that ran failed.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ROLLOUT_TESTS = "tests/integration/actors/test_rollout_actor.py"
"""The rollout actor's tests, the tensor-parallel one among them (run where vLLM is installed)."""
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

TOLERANCE = 1e-4
GPU_TOLERANCE = 1e-3  # float32 kernels of another device: other sums' order, not other arithmetic


def _launch(nproc: int, model: Path, out: Path, zero_stage: int, accelerator: str) -> float:
    """``tests/helpers/update_ranks.py``'s GRPO case over ``nproc`` ranks on DeepSpeed's ``accelerator``; seconds."""
    from tests.helpers.torchrun import launcher_env, torchrun_command

    started = time.perf_counter()
    case = f"{zero_stage}:grpo"
    command = torchrun_command(nproc, "tests.helpers.update_ranks", str(model), str(out), "--case", case)
    env = launcher_env(DS_ACCELERATOR=accelerator)
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        raise RuntimeError(
            f"{nproc} rank(s) on {accelerator}, ZeRO-{zero_stage} failed:\n{done.stdout[-3000:]}{done.stderr[-3000:]}"
        )
    return time.perf_counter() - started


def _case(out: Path, zero_stage: int) -> Path:
    """Where ``tests/helpers/update_ranks.py`` wrote the GRPO case of ``zero_stage``."""
    from tests.helpers.update_ranks import case_dir

    return case_dir(out, zero_stage, "grpo")


def _model(work: Path) -> Path:
    """The tiny model every launch trains, written once per run of this script."""
    from asyncrl.common.data.tasks import TASK_ALPHABET
    from asyncrl.common.tiny_models.character import init_model

    if (work / "model" / "config.json").exists():
        return work / "model"
    return init_model(work / "model", alphabet=TASK_ALPHABET, seed=0)


_ONE_RANK: dict[Path, float] = {}  # launched cases' seconds: a second check reads the first one's case


def _one_rank(work: Path, accelerator: str) -> tuple[Path, float]:
    """Where the ZeRO-2 case of one rank on ``accelerator`` was written, launched once per run; its seconds."""
    out = work / f"one-{accelerator}"
    if out not in _ONE_RANK:
        _ONE_RANK[out] = _launch(1, _model(work), out, 2, accelerator)
    return out, _ONE_RANK[out]


def _compare(out: Path, zero_stage: int, reference: Path) -> dict:
    """Every weight after step 2 and each step's loss and grad norm of ``out`` against the one-rank ``reference``."""
    from safetensors.torch import load_file

    weights = load_file(_case(out, zero_stage) / "step2.safetensors")
    weights_ref = load_file(_case(reference, 2) / "step2.safetensors")
    diff = max((weights[n].float() - t.float()).abs().max().item() for n, t in weights_ref.items())
    stats = json.loads((_case(out, zero_stage) / "stats.json").read_text())
    stats_ref = json.loads((_case(reference, 2) / "stats.json").read_text())
    steps = max(abs(a[k] - b[k]) for a, b in zip(stats["steps"], stats_ref["steps"], strict=True) for k in a)
    return {"max_weight_diff": diff, "max_loss_or_norm_diff": steps}


def _trained(reference: Path) -> bool:
    """Whether every step of the one-rank ``reference`` had a gradient: a step that trains nothing compares nothing."""
    stats = json.loads((_case(reference, 2) / "stats.json").read_text())
    return all(step["grad_norm"] > 0 for step in stats["steps"])


def check_learner_ranks(work: Path) -> dict:
    gpus = torch.cuda.device_count()
    accelerator = "cuda" if gpus >= 2 else "cpu"  # NCCL refuses two ranks on one GPU: gloo on CPU instead
    result: dict = {"backend": "nccl" if gpus >= 2 else "gloo", "gpus": gpus}
    one, result["one_rank_s"] = _one_rank(work, accelerator)
    result["trained"] = ok = _trained(one)
    for zero_stage in (2, 3):
        out = work / f"two-zero{zero_stage}"
        seconds = _launch(2, _model(work), out, zero_stage, accelerator)
        diffs = _compare(out, zero_stage, one)
        result[f"zero{zero_stage}"] = {"seconds": seconds, **diffs}
        ok &= max(diffs.values()) <= TOLERANCE
    result["ok"] = ok
    return result


def check_learner_on_gpu(work: Path) -> dict:
    if not torch.cuda.is_available():
        return {"skipped": "no GPU"}
    result: dict = {
        "device": torch.cuda.get_device_name(0),
        "allow_tf32": torch.backends.cuda.matmul.allow_tf32,
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
    }
    cpu, result["cpu_s"] = _one_rank(work, "cpu")
    gpu, result["gpu_s"] = _one_rank(work, "cuda")
    diffs = _compare(gpu, 2, cpu)
    result.update(diffs, trained=_trained(cpu))
    result["ok"] = result["trained"] and max(diffs.values()) <= GPU_TOLERANCE
    return result


def _weight_group_member(rank: int, port: int, backend: str, mb: int, queue) -> None:
    from asyncrl.common.weights.group import GroupAddress, WeightGroup, digest_mismatch, pack_sealed

    if backend == "nccl":
        torch.cuda.set_device(rank)
    store = torch.distributed.TCPStore("127.0.0.1", port, 2, rank == 0, timedelta(seconds=120))
    group = WeightGroup(GroupAddress("", "check", 1, rank, 2, 120.0, backend), store)
    generator = torch.Generator().manual_seed(0)
    params = {f"layer{i}.weight": torch.randn(mb * 2**20 // 4 // 8, generator=generator) for i in range(8)}
    sealed = pack_sealed(params, 64 * 2**20, "cuda" if backend == "nccl" else "cpu")
    group.self_check()
    started = time.perf_counter()
    if rank == 0:
        sent = group.send_packed(sealed.flats)
        seconds = time.perf_counter() - started
        queue.put({"bytes": sent, "seconds": seconds, "gbps": sent / seconds / 1e9})
    else:
        received = group.receive_all(sealed.buckets)
        queue.put({"mismatch": digest_mismatch(sealed.buckets, [f.cpu() for f in received])})


def _reports(queue, members: list, timeout_s: float) -> list[dict]:
    """One report per member; a member that exits before it reported (an import that fails there, a crash) ends the
    wait at once with its exit code, instead of the whole timeout."""
    import queue as queues

    reports: list[dict] = []
    deadline = time.monotonic() + timeout_s
    while len(reports) < len(members):
        try:
            reports.append(queue.get(timeout=1))
        except queues.Empty:
            dead = [m.exitcode for m in members if m.exitcode not in (None, 0)]
            if dead:
                raise RuntimeError(f"a weight-group member exited with {dead[0]} before reporting") from None
            if time.monotonic() > deadline:
                raise TimeoutError(f"the weight-group members did not report within {timeout_s:g} s") from None
    return reports


def check_weight_group(mb: int) -> dict:
    from asyncrl.common.plane.redis_server import free_port

    backend = "nccl" if torch.cuda.device_count() >= 2 else "gloo"
    context = mp.get_context("spawn")
    queue = context.Queue()
    port = free_port()
    members = [context.Process(target=_weight_group_member, args=(r, port, backend, mb, queue)) for r in (0, 1)]
    for member in members:
        member.start()
    reports = _reports(queue, members, timeout_s=600)
    for member in members:
        member.join(60)
    sender = next(r for r in reports if "gbps" in r)
    receiver = next(r for r in reports if "mismatch" in r)
    return {"backend": backend, **sender, "ok": not receiver["mismatch"], "mismatch": receiver["mismatch"]}


def _entropy_module():
    """``learner/algorithms/entropy.py`` alone (it needs only torch): the device image has none of the learner's other
    dependencies."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("entropy", ROOT / "asyncrl" / "learner" / "algorithms" / "entropy.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def check_entropy_memory(batch: int = 4, positions: int = 1024, vocabulary: int = 151_936) -> dict:
    if not torch.cuda.is_available():
        return {"skipped": "no GPU"}
    entropy = _entropy_module()
    logits = torch.randn(batch, positions, vocabulary, device="cuda", dtype=torch.bfloat16)

    def peak_above_input(fn) -> tuple[torch.Tensor, int, float]:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        started = time.perf_counter()
        out = fn(logits)
        torch.cuda.synchronize()
        return out, torch.cuda.max_memory_allocated() - base, time.perf_counter() - started

    whole, whole_bytes, whole_s = peak_above_input(lambda z: entropy.token_entropy(z).detach())
    chunked, chunked_bytes, chunked_s = peak_above_input(entropy.token_entropy_no_grad)
    diff = (whole - chunked).abs().max().item()
    logits_bytes = logits.numel() * logits.element_size()
    return {
        "logits_mib": logits_bytes / 2**20,
        "whole_peak_mib": whole_bytes / 2**20,
        "chunked_peak_mib": chunked_bytes / 2**20,
        "whole_s": whole_s,
        "chunked_s": chunked_s,
        "max_abs_diff": diff,
        "ok": diff <= 1e-3 and chunked_bytes < logits_bytes,
    }


def check_gpu_figures() -> dict:
    if not torch.cuda.is_available():
        return {"skipped": "no GPU"}
    from asyncrl.common.observability.gpu import gpu_figures

    held = torch.empty(256 * 2**20, dtype=torch.uint8, device="cuda")  # 256 MiB
    figures = gpu_figures()
    after = gpu_figures()  # the peak was reset: now what is held
    ok = figures["gpu/memory_allocated_bytes"] >= held.numel() <= after["gpu/memory_peak_bytes"]
    ok &= figures["gpu/memory_reserved_bytes"] >= figures["gpu/memory_allocated_bytes"]
    if "gpu/utilization" in figures:
        ok &= 0.0 <= figures["gpu/utilization"] <= 1.0
        ok &= figures["gpu/memory_used_bytes"] >= figures["gpu/memory_allocated_bytes"]
    return {**figures, "ok": bool(ok), "nvml": "gpu/utilization" in figures}


def check_tensor_parallel() -> dict:
    try:
        import vllm  # noqa: F401
    except ImportError:
        return {"skipped": f"vLLM is not installed here (run {ROLLOUT_TESTS} where it is)"}
    if torch.cuda.device_count() < 2:
        return {"skipped": f"{torch.cuda.device_count()} GPU(s): tensor_parallel_size = 2 needs 2"}
    command = [sys.executable, "-m", "pytest", "-q", ROLLOUT_TESTS, "-k", "tensor_parallel"]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=1800)
    return {"ok": done.returncode == 0, "output": done.stdout[-1500:]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, default=256, help="MiB the weight-group check sends")
    args = parser.parse_args()
    figures: dict = {"cuda": torch.cuda.is_available(), "gpus": torch.cuda.device_count(), "torch": torch.__version__}
    with tempfile.TemporaryDirectory(prefix="asyncrl-gpu-check-") as work:
        for name, check in (
            ("learner_on_gpu", lambda: check_learner_on_gpu(Path(work))),
            ("learner_ranks", lambda: check_learner_ranks(Path(work))),
            ("weight_group", lambda: check_weight_group(args.mb)),
            ("entropy_memory", check_entropy_memory),
            ("gpu_figures", check_gpu_figures),
            ("tensor_parallel", check_tensor_parallel),
        ):
            try:
                figures[name] = check()
            except Exception as exc:  # one failed check must not hide the others' figures
                figures[name] = {"ok": False, "error": str(exc)[-2000:]}
            print(f"{name}: {json.dumps(figures[name])}", file=sys.stderr, flush=True)
    print(json.dumps(figures))
    sys.exit(1 if any(isinstance(v, dict) and v.get("ok") is False for v in figures.values()) else 0)


if __name__ == "__main__":
    main()
