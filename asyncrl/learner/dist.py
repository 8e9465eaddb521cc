"""torch.distributed for the learner ranks: accelerator choice, process-group start, small collectives.

One code path for every launch: under ``torchrun``/``deepspeed`` the launcher sets ``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT``; a plain ``python`` process (one rank, tests, the demo) gets
single-rank defaults with a free loopback port. Gloo on CPUs, NCCL on GPUs. DeepSpeed picks its accelerator when it
is first imported, so :func:`configure_accelerator` must run before any ``import deepspeed``; :func:`import_deepspeed`
does both.
"""

from __future__ import annotations

import os
import socket
from datetime import timedelta
from types import ModuleType
from typing import Any, TypeVar

import torch

DEFAULT_TIMEOUT = timedelta(minutes=10)
T = TypeVar("T")


def configure_accelerator() -> str:
    """Tell DeepSpeed which accelerator to use (``cpu`` when there is no CUDA device) and return its name.

    DeepSpeed 0.19 guesses CPU by itself when it finds no GPU, but logs a warning and may pick up a stray GPU
    toolkit; ``DS_ACCELERATOR`` makes the choice explicit. A value the caller already set wins.
    """
    if "DS_ACCELERATOR" not in os.environ:
        os.environ["DS_ACCELERATOR"] = "cuda" if torch.cuda.is_available() else "cpu"
    return os.environ["DS_ACCELERATOR"]


def import_deepspeed() -> ModuleType:
    """``import deepspeed`` after :func:`configure_accelerator` (its accelerator is fixed at first import)."""
    configure_accelerator()
    import deepspeed

    return deepspeed


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _set_single_rank_defaults() -> None:
    """Environment of a one-rank world for a process that no launcher started (launcher values win)."""
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if "MASTER_PORT" not in os.environ:
        os.environ["MASTER_PORT"] = str(_free_port())


def init_distributed(timeout: timedelta = DEFAULT_TIMEOUT) -> str:
    """Start the default process group once per process (gloo on CPU, nccl on GPU); return the backend.

    Idempotent: a second call (a second engine in the same process) reuses the group.
    """
    backend = "gloo" if configure_accelerator() == "cpu" else "nccl"
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_backend()
    _set_single_rank_defaults()
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    if os.environ["WORLD_SIZE"] == "1":
        _init_one_rank(backend, timeout)  # DeepSpeed then wraps this group
    from asyncrl.learner.jit_lock import clear_stale_locks, prefer_environment_ninja

    prefer_environment_ninja()  # one ninja builds the ops (offload's cpu_adam): another's build log would rebuild
    clear_stale_locks()  # a dead build's lock would make the next build wait forever
    deepspeed = import_deepspeed()
    skip_shared_memory_collective(deepspeed)
    deepspeed.init_distributed(dist_backend=backend, timeout=timeout)
    return backend


SHM_OP = "deepspeed_shm_comm"


def skip_shared_memory_collective(deepspeed: ModuleType) -> None:
    """Keep DeepSpeed from compiling its CPU shared-memory all-reduce when its communication backend starts.

    DeepSpeed's torch backend builds that op (``build_shm_op``) whenever its op probe calls it compatible, and uses
    it only in ``inference_all_reduce``, which tensor-parallel inference calls and training never does. Building it
    is a C++ compile of 60-75 s on a fresh machine (the first learner start after an install) and probing for it runs
    the compiler for every op; marking it incompatible skips both. Training's collectives (gradients, ZeRO
    partitions, the weight group) go through torch.distributed as before.
    """
    ops = deepspeed.ops
    known = ops.__dict__.get("__compatible_ops__")  # read lazily by DeepSpeed: reading it here would run the probe
    ops.__compatible_ops__ = {**(known or {}), SHM_OP: False}


def _init_one_rank(backend: str, timeout: timedelta) -> None:
    """The default group of a one-rank world, with nothing that listens beyond loopback.

    ``env://`` would start a TCPStore server on MASTER_PORT, and that server listens on every interface whatever
    MASTER_ADDR says: anyone who reaches the host could read and write its keys. One rank has nobody to meet, so an
    in-process ``HashStore`` does. Gloo's own socket goes on loopback too (it otherwise binds the address the host name
    resolves to); an operator's ``GLOO_SOCKET_IFNAME`` wins. Several ranks (torchrun) use the launcher's store.
    """
    own_ifname = "GLOO_SOCKET_IFNAME" not in os.environ and backend == "gloo"
    if own_ifname:  # read when the group is made; the weight group, made later, chooses its own address
        os.environ["GLOO_SOCKET_IFNAME"] = "lo"  # Linux's loopback interface
    try:
        # torch.distributed imports HashStore from its binding without exporting it (no __all__ lists it).
        store = torch.distributed.HashStore()  # pyright: ignore[reportPrivateImportUsage]
        torch.distributed.init_process_group(backend, store=store, rank=0, world_size=1, timeout=timeout)
    finally:
        if own_ifname:
            del os.environ["GLOO_SOCKET_IFNAME"]


def rank() -> int:
    """This process's global rank (0 before the group exists)."""
    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0


def world_size() -> int:
    """Number of ranks (1 before the group exists)."""
    return torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1


def all_reduce_sum(value: float | torch.Tensor) -> float:
    """Σ over ranks of a scalar (e.g. a token count, so every rank can normalise with the global count).

    Collective: every rank must call it. Summed in float64 so counts stay exact.
    """
    tensor = torch.as_tensor(value, dtype=torch.float64).detach().reshape(1).cpu()
    if world_size() > 1:
        if torch.distributed.get_backend() == "nccl":
            tensor = tensor.cuda()
        torch.distributed.all_reduce(tensor, op=torch.distributed.ReduceOp.SUM)
    return float(tensor.item())


def barrier() -> None:
    """Wait for every rank (a no-op in a one-rank world)."""
    if world_size() > 1:
        torch.distributed.barrier()


def all_gather_object(value: T) -> list[T]:
    """Every rank's ``value``, in rank order (picklable objects of one type; collective)."""
    if world_size() == 1:
        return [value]
    gathered: list[Any] = [None] * world_size()
    torch.distributed.all_gather_object(gathered, value)
    return gathered


def shutdown() -> None:
    """Leave the process group at a normal end, on every rank after its last collective. A gloo group left for the
    interpreter's exit to tear down can abort the process on the way out (``terminate called without an active
    exception``: a thread of the group destroyed while still joinable), turning a finished run into exit -6."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
