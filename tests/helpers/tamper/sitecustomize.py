"""A planted tampering in transit: with ``$ASYNCRL_TAMPER_VERSION`` set, a vLLM worker flips one bit of the first
bucket it receives of that one policy version, after the broadcast and before the bucket is checked against the
manifest's digest, as if the bytes had been altered on the wire. The worker must refuse the version (the digest no
longer matches) and keep serving the weights it had; the next version loads as usual.

Only the first broadcast of that version is altered: a resumed learner may send a version again (its restored
weights), and that copy arrives clean.

Python imports ``sitecustomize`` at start-up from the first folder on ``sys.path`` that has one, so a test puts this
folder first on ``PYTHONPATH`` of the processes it starts (an actor's engine inherits it); the patch arms itself only
in a process that imports ``actors.weight_receiver`` and only when the variable is set, as
``tests/helpers/spike/sitecustomize.py`` does. Nothing here is imported by asyncrl itself.
"""

from __future__ import annotations

import os

MODULE = "asyncrl.actors.weight_receiver"
BIT = 0x10
"""The bit flipped, in the bucket's middle byte."""


def _flip_one_bit(flat) -> int:
    """Flip :data:`BIT` of the middle byte of ``flat`` (a received bucket) in place; returns that byte's index."""
    import torch

    raw = flat.view(torch.uint8)  # a received bucket is one contiguous 1-D tensor
    index = raw.numel() // 2
    raw[index : index + 1].bitwise_xor_(BIT)
    return index


def _plant(module) -> None:
    version = int(os.environ["ASYNCRL_TAMPER_VERSION"])
    extension = module.WeightReceiverExtension
    receive = extension.asyncrl_receive
    done: list[int] = []

    def asyncrl_receive(self, manifest_frames: list[bytes], verify: bool = True):
        manifest = module.Decoder(module.WeightManifest).decode(manifest_frames)
        group = self._asyncrl_group
        if manifest.version != version or done or group is None:
            return receive(self, manifest_frames, verify)
        receive_all = group.receive_all

        def tampered(buckets):
            flats = receive_all(buckets)
            byte = _flip_one_bit(flats[0])
            done.append(version)
            print(
                f"planted a tampering: version {version} bucket 0 ({buckets[0].dtype}) byte {byte} xor {BIT:#x}",
                flush=True,
            )
            return flats

        group.receive_all = tampered  # this one broadcast only: the instance attribute goes right after
        try:
            return receive(self, manifest_frames, verify)
        finally:
            del group.receive_all

    extension.asyncrl_receive = asyncrl_receive


if os.environ.get("ASYNCRL_TAMPER_VERSION"):
    from tests.helpers.plant_on_import import plant_on_import

    plant_on_import(MODULE, _plant)
