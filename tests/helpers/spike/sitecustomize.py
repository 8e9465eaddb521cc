"""A planted mismatch spike: with ``$ASYNCRL_SPIKE_VERSIONS`` set (versions, comma-separated), a vLLM worker adds
Gaussian noise of standard deviation ``$ASYNCRL_SPIKE_SIGMA`` (default 0.05) to the weights of those policy versions as
it loads them, so the actor samples them with weights the learner never had: μ drifts far from π_old for the groups
they sample, and only for them (every other version loads clean; each version's noise is drawn from its number).

Python imports ``sitecustomize`` at start-up from the first folder on ``sys.path`` that has one, so a test puts this
folder first on ``PYTHONPATH`` of the processes it starts (every process of a run inherits it, vLLM's worker too); the
patch arms itself only in a process that imports ``actors.weight_receiver`` and only when the variable is set. Nothing
here is imported by asyncrl itself.
"""

from __future__ import annotations

import os

MODULE = "asyncrl.actors.weight_receiver"


def _plant(module) -> None:
    import torch

    versions = {int(v) for v in os.environ["ASYNCRL_SPIKE_VERSIONS"].split(",")}
    sigma = float(os.environ.get("ASYNCRL_SPIKE_SIGMA", "0.05"))
    extension = module.WeightReceiverExtension
    load = extension.asyncrl_load

    def asyncrl_load(self, load_it: bool, adapter: dict | None = None) -> float:
        received = self._asyncrl_received
        if load_it and received is not None and (version := received[0].version) in versions:
            noise = torch.Generator().manual_seed(version)
            for flat in received[1]:
                if flat.is_floating_point():
                    flat.add_(torch.randn(flat.shape, generator=noise, dtype=flat.dtype) * sigma)
            print(f"planted a mismatch spike: version {version} loaded with noise sigma {sigma}", flush=True)
        return load(self, load_it, adapter)

    extension.asyncrl_load = asyncrl_load


if os.environ.get("ASYNCRL_SPIKE_VERSIONS"):
    from tests.helpers.plant_on_import import plant_on_import

    plant_on_import(MODULE, _plant)
