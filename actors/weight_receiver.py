"""A vLLM worker extension that joins the learner's weight group and loads broadcast weights in place.

vLLM mixes this class into its worker (``worker_extension_cls``); the actor calls its methods
through ``AsyncLLM.collective_rpc``, so they run inside the worker process that owns the model.
Buckets are received lazily, one at a time, while ``reload_weights`` consumes them — the peak
extra memory is one bucket, not a second copy of the model. ``model.load_weights`` is not used:
on CPUs vLLM repacks weights after loading and only ``reload_weights`` handles that
(DESIGN.md, facts measured here).
"""

from __future__ import annotations

import time
from typing import Any

from common.weights import GroupAddress, WeightGroup
from common.wire import Decoder, WeightManifest


class WeightReceiverExtension:
    """Methods added to each vLLM worker; state lives on the worker object itself."""

    _asyncrl_group: WeightGroup | None = None

    def asyncrl_join(self, address: dict[str, Any]) -> float:
        """Form (or re-form) the weight group as ``address['rank']``; returns the self-check seconds."""
        self.asyncrl_leave()
        self._asyncrl_group = WeightGroup(GroupAddress(**address))
        return self._asyncrl_group.self_check()

    def asyncrl_receive(self, manifest_frames: list[bytes]) -> dict[str, float]:
        """Receive every bucket of the manifest and load it; returns timings and the bytes received."""
        if self._asyncrl_group is None:
            raise RuntimeError("asyncrl_receive before asyncrl_join: this worker is not in a weight group")
        manifest: WeightManifest = Decoder(WeightManifest).decode(manifest_frames)
        start = time.perf_counter()
        received = 0

        def weights():
            nonlocal received
            for name, tensor in self._asyncrl_group.receive(manifest.buckets):
                received += tensor.numel() * tensor.element_size()
                yield name, tensor

        self.model_runner.reload_weights(weights_iterator=weights(), is_checkpoint_format=True)
        return {"load_s": time.perf_counter() - start, "bytes": float(received)}

    def asyncrl_leave(self) -> None:
        """Drop the current group (its store connection closes with it)."""
        self._asyncrl_group = None
