"""GPU figures of this process, for the learner's step rows and metrics: what torch's allocator holds, and, where
NVML is installed (``nvidia-ml-py``), how busy the device is and how much of its memory every process together uses.

On a machine without CUDA there are none: :func:`gpu_figures` returns ``{}`` and says so once in the log, so the rows
and ``/metrics`` simply lack the ``gpu/*`` figures. Nothing here may fail a training step: a figure that cannot be
read is left out.
"""

from __future__ import annotations

import functools
from typing import Any

from asyncrl.common.observability.logs import get_logger

log = get_logger("gpu")


def gpu_figures() -> dict[str, float]:
    """``gpu/memory_allocated_bytes``, ``gpu/memory_reserved_bytes`` and ``gpu/memory_peak_bytes`` (torch's caching
    allocator on this process's device; the peak since the last call, which resets it), ``gpu/memory_total_bytes``;
    with NVML, ``gpu/utilization`` (the share of the last sample period a kernel ran) and ``gpu/memory_used_bytes``
    (the device's, every process together). ``{}`` without CUDA."""
    import torch

    if not torch.cuda.is_available():
        _say_absent("no CUDA device: the gpu/* figures are absent")
        return {}
    device = torch.cuda.current_device()
    figures = {
        "gpu/memory_allocated_bytes": float(torch.cuda.memory_allocated(device)),
        "gpu/memory_reserved_bytes": float(torch.cuda.memory_reserved(device)),
        "gpu/memory_peak_bytes": float(torch.cuda.max_memory_allocated(device)),
        "gpu/memory_total_bytes": float(torch.cuda.get_device_properties(device).total_memory),
    }
    torch.cuda.reset_peak_memory_stats(device)  # the next step's peak is its own
    return figures | _nvml_figures(device)


def _nvml_figures(device: int) -> dict[str, float]:
    nvml = _nvml()
    if nvml is None:
        return {}
    try:
        handle = nvml.nvmlDeviceGetHandleByIndex(_physical_index(device))
        utilization = nvml.nvmlDeviceGetUtilizationRates(handle)
        memory = nvml.nvmlDeviceGetMemoryInfo(handle)
    except nvml.NVMLError as exc:
        _say_absent(f"NVML cannot read the device ({exc}): gpu/utilization and gpu/memory_used_bytes are absent")
        return {}
    return {"gpu/utilization": utilization.gpu / 100.0, "gpu/memory_used_bytes": float(memory.used)}


@functools.cache
def _nvml() -> Any:
    """The initialised ``pynvml`` module of ``nvidia-ml-py``, or None (not installed, or no driver)."""
    try:
        import pynvml  # pyright: ignore[reportMissingImports]  # nvidia-ml-py: installed with vLLM's GPU build only

        pynvml.nvmlInit()
    except Exception as exc:  # ImportError, or NVMLError without a driver
        _say_absent(f"NVML unavailable ({type(exc).__name__}): gpu/utilization is absent; pip install nvidia-ml-py")
        return None
    return pynvml


def _physical_index(device: int) -> int:
    """NVML numbers every GPU of the machine; torch only those ``CUDA_VISIBLE_DEVICES`` shows (numeric lists)."""
    import os

    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "")
    indices = [part for part in visible.split(",") if part.strip().isdigit()]
    return int(indices[device]) if device < len(indices) else device


@functools.cache
def _say_absent(message: str) -> None:
    log.info(message)
