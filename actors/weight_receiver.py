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

from actors.lifeline import follow_actor
from common.weights import GroupAddress, WeightGroup, digest_mismatch, unpack_bucket
from common.wire import Decoder, WeightManifest


class WeightReceiverExtension:
    """Methods added to each vLLM worker; state lives on the worker object itself."""

    _asyncrl_group: WeightGroup | None = None

    def asyncrl_join(self, address: dict[str, Any]) -> float:
        """Form (or re-form) the weight group as ``address['rank']``; returns the self-check seconds."""
        self.asyncrl_leave()
        self._asyncrl_group = WeightGroup(GroupAddress(**address))
        return self._asyncrl_group.self_check()

    def asyncrl_receive(self, manifest_frames: list[bytes]) -> dict[str, Any]:
        """Receive every bucket of the manifest, verify it, then load them; returns timings and the bytes received.

        All buckets arrive before the first weight is loaded: vLLM's in-place reload takes the model's weights
        apart while it loads (on CPUs it repacks them), so a transfer that failed halfway — a learner killed
        mid-broadcast — would leave a model that cannot run and kill the engine. Received first, a failed
        transfer leaves the old weights serving. The cost is one copy of the weights in memory during a sync.

        Every bucket is checked against its digest in the manifest before any is loaded; on a mismatch nothing is
        loaded, the old weights keep serving, and the result says why under ``refused`` (the transfer itself
        succeeded, so the worker stays in the group for the next version).
        """
        if self._asyncrl_group is None:
            raise RuntimeError("asyncrl_receive before asyncrl_join: this worker is not in a weight group")
        manifest: WeightManifest = Decoder(WeightManifest).decode(manifest_frames)
        start = time.perf_counter()
        flats = self._asyncrl_group.receive_all(manifest.buckets)
        received = time.perf_counter()
        figures: dict[str, Any] = {
            "receive_s": received - start,
            "bytes": float(sum(f.numel() * f.element_size() for f in flats)),
        }
        if refused := digest_mismatch(manifest.buckets, flats):
            return figures | {"verify_s": time.perf_counter() - received, "refused": refused}
        verified = time.perf_counter()
        pairs = zip(manifest.buckets, flats, strict=True)
        weights = (pair for bucket, flat in pairs for pair in unpack_bucket(bucket, flat))
        self.model_runner.reload_weights(weights_iterator=weights, is_checkpoint_format=True)
        return figures | {"verify_s": verified - received, "load_s": time.perf_counter() - verified}

    def asyncrl_leave(self) -> None:
        """Drop the current group and close its store connection."""
        if self._asyncrl_group is not None:
            self._asyncrl_group.close()
        self._asyncrl_group = None


# vLLM imports this module in every process that hosts one of its workers: from here on, that process ends when the
# rollout actor that started the engine does (actors/lifeline.py), even if the actor was killed with -9.
follow_actor()
