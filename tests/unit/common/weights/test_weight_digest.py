"""Per-version weight digests: every bucket sealed by the learner, verified by the member before anything loads."""

from __future__ import annotations

import dataclasses

import blake3
import pytest
import torch

from asyncrl.cli.top import unexpected_weights
from asyncrl.common.weights.group import bucket_digest, digest_mismatch, pack_sealed, version_digest
from asyncrl.common.wire.codec import WireError, encode
from asyncrl.common.wire.decoding import Decoder
from asyncrl.common.wire.messages import Heartbeat, WeightManifest


def params() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {
        "embed": torch.randn(40, 8, generator=gen),
        "norm": torch.randn(8, generator=gen).to(torch.bfloat16),
        "head": torch.randn(40, 8, generator=gen),
    }


def test_a_bucket_digest_is_64_bit_blake3_of_its_bytes() -> None:
    flat = torch.tensor([1.0, -2.0, 3.5], dtype=torch.float32)
    assert bucket_digest(flat) == blake3.blake3(flat.numpy().tobytes()).hexdigest(8)
    assert len(bucket_digest(flat)) == 16
    half = torch.tensor([1.0, 2.0], dtype=torch.bfloat16)  # numpy has no bfloat16: hashed as raw bytes
    assert bucket_digest(half) == blake3.blake3(half.view(torch.uint8).numpy().tobytes()).hexdigest(8)


def test_sealed_weights_verify_and_any_changed_byte_is_named() -> None:
    sealed = pack_sealed(params(), bucket_bytes=40 * 8 * 4)  # one float32 tensor per bucket, plus the bf16 one
    assert len(sealed.buckets) == 3 and all(b.digest for b in sealed.buckets)
    assert sealed.digest == version_digest([b.digest for b in sealed.buckets])
    assert digest_mismatch(sealed.buckets, sealed.flats) == ""

    assert [b.dtype for b in sealed.buckets] == ["float32", "float32", "bfloat16"]  # grouped by dtype
    tampered = [flat.clone() for flat in sealed.flats]
    tampered[2].view(torch.uint8)[0] ^= 1  # one bit of the bf16 bucket
    reason = digest_mismatch(sealed.buckets, tampered)
    assert reason.startswith("bucket 2 (bfloat16, 1 tensors): digest ") and sealed.buckets[2].digest in reason


def test_an_unsealed_bucket_is_refused() -> None:
    sealed = pack_sealed(params(), bucket_bytes=2**20)
    unsealed = [dataclasses.replace(b, digest="") for b in sealed.buckets]
    assert "manifest ''" in digest_mismatch(unsealed, sealed.flats)


def test_the_version_digest_changes_with_any_bucket_and_with_their_order() -> None:
    a, b = "0123456789abcdef", "fedcba9876543210"
    assert len({version_digest([a, b]), version_digest([b, a]), version_digest([a, a])}) == 3


def test_the_manifest_carries_digests_and_the_decoder_refuses_malformed_ones() -> None:
    sealed = pack_sealed(params(), bucket_bytes=2**20)
    manifest = WeightManifest(version=3, world_size=1, buckets=sealed.buckets, digest=sealed.digest)
    decoded = Decoder(WeightManifest).decode(encode(manifest))
    assert decoded.digest == sealed.digest and [b.digest for b in decoded.buckets] == [b.digest for b in sealed.buckets]
    bad = WeightManifest(version=3, world_size=1, buckets=sealed.buckets, digest="not-hex-at-all!!")
    with pytest.raises(WireError, match=r"^digest: expected 16 lowercase hex digits"):
        Decoder(WeightManifest).decode(encode(bad))


def beat(process_id: str, version: int, digest: str, kind: str = "actor") -> Heartbeat:
    return Heartbeat(process_id=process_id, kind=kind, state="generating", version=version, weights_digest=digest)


def test_rl_top_flags_an_actor_serving_a_digest_the_learner_did_not_send_for_its_version() -> None:
    sent = {1: "1111111111111111", 2: "2222222222222222"}
    processes = [
        beat("good", 2, "2222222222222222"),
        beat("fresh", 0, ""),  # the model folder's weights: nothing to compare
        beat("unknown-version", 7, "7777777777777777"),  # sent before digests existed
        beat("wrong", 1, "3333333333333333"),
    ]
    assert unexpected_weights(processes, sent) == [
        "wrong: version 1 digest 3333333333333333, expected 1111111111111111"
    ]
