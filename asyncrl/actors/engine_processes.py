"""Where a rollout actor's vLLM processes run and how its engine core starts.

On CPUs with one rank the model's worker runs inside vLLM's engine-core process (``rollout.cpu_single_process``,
:func:`use_single_process`), pinned to ``rollout.cpu_threads``; otherwise vLLM's multiprocess executor starts a worker
of its own, bound by ``VLLM_CPU_OMP_THREADS_BIND``. Either way the engine core is a process of its own under the actor:
with the worker inside it, it is forked from the actor (:func:`start_engine`), otherwise spawned. Every one of these
processes ends with the actor, even on ``kill -9`` (``actors/lifeline.py``).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from asyncrl.actors.lifeline import export_actor_pid, follow_forked_engine, start_sweeper
from asyncrl.common.config import RolloutSection
from asyncrl.common.config.training import cpu_list

if TYPE_CHECKING:
    from vllm.v1.engine.async_llm import AsyncLLM


def lay_out_processes(rollout: RolloutSection, has_gpu: bool) -> bool:
    """Set this process up for its engine as ``[rollout]`` asks, before vLLM runs its plugins here (``AsyncEngineArgs``
    does; they act in an actor's processes only): the layout, the actor's PID exported and its sweeper started.
    Returns whether the engine core is to be forked: the worker inside it, and no start method the user set. On CPUs
    in eager mode nothing is compiled (:func:`compile_nothing`)."""
    compile_nothing(rollout, has_gpu)
    one_process = single_process(rollout, has_gpu)
    if one_process:
        use_single_process(rollout.cpu_threads)
    elif rollout.cpu_threads:
        # Read by vLLM's CPU worker when it starts: keeps engines on one machine off each other's cores.
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = rollout.cpu_threads
    fork = one_process and "VLLM_WORKER_MULTIPROC_METHOD" not in os.environ
    export_actor_pid()
    start_sweeper()
    return fork


def compile_nothing(rollout: RolloutSection, has_gpu: bool) -> None:
    """On CPUs with ``rollout.enforce_eager``, no ``torch.compile`` in this process or the engine's: vLLM compiles two
    sampling helpers with Inductor even in eager mode (the rank of each sampled token among the logits, which every
    request with log-probs needs, and a random sample), and their first call in each engine costs about 2 s of CPU and
    a C++ compiler on the host (``bench/engine_start.py``); run as written they are the same tensor operations. torch
    reads the setting where vLLM's modules are imported, so it is set before vLLM loads them here."""
    if rollout.enforce_eager and not has_gpu:
        os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")


def single_process(rollout: RolloutSection, has_gpu: bool) -> bool:
    """Whether vLLM's worker runs inside its engine-core process (``rollout.cpu_single_process``, CPUs, one rank)."""
    return rollout.cpu_single_process and not has_gpu and rollout.tensor_parallel_size == 1


def use_single_process(cpu_threads: str) -> None:
    """Keep vLLM's ``uni`` executor on CPUs, and pin the engine to ``cpu_threads`` (e.g. ``1`` or ``0-3``).

    vLLM's CPU platform swaps ``uni`` for its multiprocess executor unless ``VLLM_ENABLE_V1_MULTIPROCESSING`` is 0
    (``vllm/platforms/cpu.py``: its per-thread OpenMP binding needs a fresh worker process); ``AsyncLLM`` runs its
    engine core in a process of its own either way, so the variable changes only that choice. Without vLLM's
    binding, the engine-core process inherits this thread's CPU affinity, and torch sizes its threads to it.
    """
    if cpu_threads:  # a valid list: the config checked it
        os.sched_setaffinity(0, cpu_list(cpu_threads))
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"


def start_engine(args: Any, fork: bool) -> AsyncLLM:
    """vLLM's ``AsyncLLM`` for ``args``; with ``fork`` (the worker inside the engine core, on CPUs), its engine-core
    process is forked from this one instead of spawned.

    vLLM's CPU platform asks for ``spawn`` whatever the layout (``vllm/platforms/cpu.py``: its multiprocess
    executor binds each worker's OpenMP threads in a fresh process). A spawned engine core imports vLLM and torch
    again before it can load the model, where a fork of this process holds them already (``bench/engine_start.py``:
    2.3 s against 10.4 s on a 2-core machine). With the worker inside the engine core there is no executor to bind,
    and this process has run no OpenMP region before the fork (its frontend runs no torch op), so the engine core's
    threads start as fresh as a spawned one's. The forked engine core follows this actor from its first instruction
    (``actors/lifeline.py: follow_forked_engine``), since it carries no marker the sweeper could find."""
    from vllm.usage.usage_lib import UsageContext
    from vllm.v1.engine.async_llm import AsyncLLM

    vllm_config = args.create_engine_config(UsageContext.ENGINE_CONTEXT)  # where the CPU platform asks for spawn
    if fork:
        os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "fork"
        follow_forked_engine(_load_plugins_again)
    return AsyncLLM.from_vllm_config(
        vllm_config, enable_log_requests=args.enable_log_requests, disable_log_stats=args.disable_log_stats
    )


def _load_plugins_again() -> None:
    """In a forked engine core: vLLM runs its general plugins once per process (``vllm.plugins.plugins_loaded``), and
    a fork inherits them as run. Cleared, the engine core runs them at its start as a spawned one does — after it has
    configured its own logging, whose new handlers the routine-line filter must be on (``actors/vllm_logs.py``)."""
    import vllm.plugins

    vllm.plugins.plugins_loaded = False
