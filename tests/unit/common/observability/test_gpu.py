"""The learner's GPU figures (``common/observability/gpu.py``): none without CUDA, said once; with CUDA, torch's
allocator figures (the peak reset each step) and NVML's utilisation and device memory where ``nvidia-ml-py`` is
installed. Here, on a CPU machine, torch.cuda and pynvml are stand-ins: the real ones were read on a GPU by
``bench/gpu_check.py``."""

from __future__ import annotations

import logging
import sys
import types

import pytest
import torch

from asyncrl.common.observability import gpu

MIB = 2**20


@pytest.fixture(autouse=True)
def _fresh_caches():
    gpu._nvml.cache_clear()
    gpu._say_absent.cache_clear()
    yield
    gpu._nvml.cache_clear()
    gpu._say_absent.cache_clear()


def test_without_cuda_there_are_no_figures_and_the_log_says_so_once(monkeypatch, caplog) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with caplog.at_level(logging.INFO, logger="asyncrl.gpu"):
        assert gpu.gpu_figures() == {} and gpu.gpu_figures() == {}
    said = [r.getMessage() for r in caplog.records if "gpu/* figures are absent" in r.getMessage()]
    assert len(said) == 1, said


class _Cuda:
    """torch.cuda as the figures read it: 300 MiB allocated, 512 reserved, 700 at the peak, 80 GiB on the device."""

    def __init__(self) -> None:
        self.resets = 0

    def install(self, monkeypatch) -> None:
        values = {
            "is_available": lambda: True,
            "current_device": lambda: 0,
            "memory_allocated": lambda device: 300 * MIB,
            "memory_reserved": lambda device: 512 * MIB,
            "max_memory_allocated": lambda device: 700 * MIB,
            "get_device_properties": lambda device: types.SimpleNamespace(total_memory=80 * 1024 * MIB),
            "reset_peak_memory_stats": lambda device: setattr(self, "resets", self.resets + 1),
        }
        for name, value in values.items():
            monkeypatch.setattr(torch.cuda, name, value, raising=False)


def _nvml(monkeypatch, fail: bool = False) -> types.ModuleType:
    module = types.ModuleType("pynvml")

    class NVMLError(Exception):
        pass

    def handle(index: int):
        if fail:
            raise NVMLError("GPU is lost")
        return f"gpu{index}"

    module.NVMLError = NVMLError
    module.nvmlInit = lambda: None
    module.nvmlDeviceGetHandleByIndex = handle
    module.nvmlDeviceGetUtilizationRates = lambda h: types.SimpleNamespace(gpu=37)
    module.nvmlDeviceGetMemoryInfo = lambda h: types.SimpleNamespace(used=2048 * MIB)
    monkeypatch.setitem(sys.modules, "pynvml", module)
    return module


def test_with_cuda_the_allocator_figures_and_nvmls_come_with_the_row(monkeypatch) -> None:
    cuda = _Cuda()
    cuda.install(monkeypatch)
    _nvml(monkeypatch)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    figures = gpu.gpu_figures()
    assert figures == {
        "gpu/memory_allocated_bytes": 300 * MIB,
        "gpu/memory_reserved_bytes": 512 * MIB,
        "gpu/memory_peak_bytes": 700 * MIB,
        "gpu/memory_total_bytes": 80 * 1024 * MIB,
        "gpu/utilization": 0.37,
        "gpu/memory_used_bytes": 2048 * MIB,
    }
    assert cuda.resets == 1  # each step's peak is its own
    assert gpu._physical_index(0) == 3  # NVML counts the machine's GPUs, torch the visible ones


def test_without_nvml_or_when_it_fails_the_allocator_figures_stay(monkeypatch) -> None:
    _Cuda().install(monkeypatch)
    monkeypatch.setitem(sys.modules, "pynvml", None)  # not installed: the import fails
    assert "gpu/utilization" not in gpu.gpu_figures() and "gpu/memory_peak_bytes" in gpu.gpu_figures()
    gpu._nvml.cache_clear()
    _nvml(monkeypatch, fail=True)
    figures = gpu.gpu_figures()
    assert "gpu/utilization" not in figures and figures["gpu/memory_allocated_bytes"] == 300 * MIB
