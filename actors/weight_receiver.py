"""A vLLM worker extension that joins the learner's weight group and loads broadcast weights in place.

vLLM mixes this class into its worker (``worker_extension_cls``); the actor calls its methods
through ``AsyncLLM.collective_rpc``, so they run inside the worker process that owns the model.
Every bucket is received before ``reload_weights`` starts (see :meth:`WeightReceiverExtension.asyncrl_receive`
for why), so a failed transfer never leaves a half-loaded model. ``model.load_weights`` is not used:
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
        """Receive every bucket of the manifest, then load them; returns timings and the bytes received.

        All buckets arrive before the first weight is loaded: vLLM's in-place reload takes the model's weights
        apart while it loads (on CPUs it repacks them), so a transfer that failed halfway — a learner killed
        mid-broadcast — would leave a model that cannot run and kill the engine. Received first, a failed
        transfer leaves the old weights serving. The cost is one copy of the weights in memory during a sync.
        """
        if self._asyncrl_group is None:
            raise RuntimeError("asyncrl_receive before asyncrl_join: this worker is not in a weight group")
        manifest: WeightManifest = Decoder(WeightManifest).decode(manifest_frames)
        start = time.perf_counter()
        weights = list(self._asyncrl_group.receive(manifest.buckets))
        received = time.perf_counter()
        self.model_runner.reload_weights(weights_iterator=iter(weights), is_checkpoint_format=True)
        return {
            "receive_s": received - start,
            "load_s": time.perf_counter() - received,
            "bytes": float(sum(t.numel() * t.element_size() for _, t in weights)),
        }

    def asyncrl_leave(self) -> None:
        """Drop the current group and close its store connection."""
        if self._asyncrl_group is not None:
            self._asyncrl_group.close()
        self._asyncrl_group = None
