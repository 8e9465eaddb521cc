"""The wire codec: round trips of every message and dtype, and a decoder that never crashes."""

from __future__ import annotations

import contextlib
import dataclasses

import ml_dtypes
import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from asyncrl.common.tiny_models import synthetic
from asyncrl.common.wire.messages import (
    SCHEMA_VERSION,
    Decoder,
    Heartbeat,
    Limits,
    PromptGroup,
    RolloutGroup,
    ScoredGroup,
    WeightBucket,
    WeightManifest,
    WireError,
    decode_blob,
    encode,
    encode_blob,
    pack_frames,
    unpack_frames,
)


def assert_same(a, b) -> None:
    """Field-by-field equality, arrays compared by dtype and value."""
    assert type(a) is type(b)
    for f in dataclasses.fields(a):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if isinstance(x, np.ndarray):
            assert x.dtype == y.dtype and x.shape == y.shape
            np.testing.assert_array_equal(x.astype(np.float64), y.astype(np.float64))
        elif dataclasses.is_dataclass(x):
            assert_same(x, y)
        else:
            assert x == y, f.name


def roundtrip(msg, limits: Limits | None = None):
    decoded = Decoder(type(msg), limits).decode(encode(msg))
    assert_same(msg, decoded)
    blob_decoded = decode_blob(Decoder(type(msg), limits), encode_blob(msg))
    assert_same(msg, blob_decoded)
    return decoded


def manifest() -> WeightManifest:
    bucket = WeightBucket(dtype="float32", numel=10, names=["a", "b"], shapes=[[2, 3], [4]], offsets=[0, 6])
    return WeightManifest(version=3, world_size=3, members=["x", "y"], buckets=[bucket])


@pytest.mark.parametrize(
    "msg",
    [
        PromptGroup(group_id="g", task="arithmetic", prompt="1+2=", prompt_ids=np.array([1, 2], np.int32)),
        synthetic.rollout_group(4, 16),
        synthetic.rollout_group(4, 16, logprob_dtype="bfloat16"),
        synthetic.scored_group(4, 16),
        manifest(),
        Heartbeat(process_id="actor-1", kind="actor", state="ready", tokens_per_s=12.5),
    ],
    ids=["prompt", "rollout-f32", "rollout-bf16", "scored", "manifest", "heartbeat"],
)
def test_every_message_round_trips(msg) -> None:
    roundtrip(msg)


def test_bf16_travels_as_two_bytes_per_value() -> None:
    group = synthetic.rollout_group(2, 8, logprob_dtype="bfloat16")
    frames = encode(group)
    sizes = sorted(len(memoryview(f)) for f in frames[1:])
    assert 2 * 16 in sizes  # 16 bf16 log-probs: 32 bytes, not upcast to 64
    assert roundtrip(group).logprobs.dtype == ml_dtypes.bfloat16


def test_empty_responses_round_trip() -> None:
    empty = np.zeros(0, np.int32)
    group = RolloutGroup(
        group_id="g",
        task="t",
        prompt="",
        prompt_ids=empty,
        token_ids=empty,
        logprobs=np.zeros(0, np.float32),
        versions=empty,
        lengths=np.zeros(2, np.int32),
        texts=["", ""],
        finish_reasons=["stop", "stop"],
    )
    assert roundtrip(group).response(1)[0].size == 0


def test_non_contiguous_arrays_are_sent_contiguously() -> None:
    base = synthetic.rollout_group(2, 8)
    strided = np.arange(32, dtype=np.int32)[::2]  # a view with stride 8 bytes
    assert not strided.flags.c_contiguous
    group = dataclasses.replace(base, token_ids=strided)
    np.testing.assert_array_equal(roundtrip(group).token_ids, strided)


def test_largest_allowed_message_passes_and_one_byte_more_fails() -> None:
    group = synthetic.rollout_group(8, 4096)
    size = sum(len(memoryview(f)) for f in encode(group))
    roundtrip(group, Limits(max_bytes=size))
    with pytest.raises(WireError) as err:
        Decoder(RolloutGroup, Limits(max_bytes=size - 1)).decode(encode(group))
    assert err.value.field == "size"


def test_the_loss_mask_says_which_tokens_of_each_response_are_trained() -> None:
    group = synthetic.rollout_group(2, 3)
    assert roundtrip(group).loss_mask.size == 0 and roundtrip(group).trained(1).tolist() == [True] * 3  # all
    masked = dataclasses.replace(group, loss_mask=np.array([1, 0, 1, 1, 1, 0], np.int32))
    back = roundtrip(masked)
    assert back.trained(0).tolist() == [True, False, True] and back.trained(1).tolist() == [True, True, False]


def test_turn_rewards_travel_one_per_model_turn() -> None:
    """A scored group's turn rewards: one per model turn of each response (a run of 1 in its loss mask; a single-turn
    response has one), or none at all."""
    rollout = dataclasses.replace(synthetic.rollout_group(2, 3), loss_mask=np.array([1, 0, 1, 1, 1, 0], np.int32))
    scored = ScoredGroup(rollout=rollout, rewards=np.array([1.5, 2.0], np.float32))
    with_turns = dataclasses.replace(scored, turn_rewards=np.array([0.5, 1.0, 2.0], np.float32))
    back = roundtrip(with_turns)
    assert [shares.tolist() for shares in back.turn_shares()] == [[0.5, 1.0], [2.0]]
    assert [len(shares) for shares in roundtrip(scored).turn_shares()] == [0, 0]
    for wrong, why in [([0.5, 1.0], "has 2 entries for 3 model turns"), ([0.5, np.inf, 1.0], "not finite")]:
        with pytest.raises(WireError, match=why):
            dataclasses.replace(scored, turn_rewards=np.array(wrong, np.float32)).validate(Limits())


def test_response_view_splits_packed_arrays() -> None:
    group = synthetic.rollout_group(3, 5)
    ids, logprobs, versions = group.response(2)
    np.testing.assert_array_equal(ids, group.token_ids[10:15])
    assert logprobs.shape == versions.shape == (5,)


# --------------------------------------------------------------------------- refusals name the field


def _tamper(msg, **changes):
    """Encode ``msg`` with fields replaced *after* construction, as a buggy peer would send it."""
    return encode(dataclasses.replace(msg, **changes))


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"logprobs": np.zeros(3, np.float32)}, "logprobs"),
        ({"logprobs": np.full(32, np.nan, np.float32)}, "logprobs"),
        ({"logprobs": np.full(32, 0.5, np.float32)}, "logprobs"),
        ({"token_ids": np.full(32, -1, np.int32)}, "token_ids"),
        ({"token_ids": np.zeros(32, np.int64)}, "token_ids"),
        ({"texts": ["a"]}, "texts"),
        ({"timings": {"generate": float("inf")}}, "timings.generate"),
        ({"issued_version": -1}, "issued_version"),
        ({"actor_id": 7}, "actor_id"),
        ({"loss_mask": np.ones(31, np.int32)}, "loss_mask"),
        ({"loss_mask": np.full(32, 2, np.int32)}, "loss_mask"),
    ],
)
def test_bad_fields_are_named(changes, field) -> None:
    frames = _tamper(synthetic.rollout_group(4, 8), **changes)
    with pytest.raises(WireError) as err:
        Decoder(RolloutGroup).decode(frames)
    assert err.value.field == field


def test_token_ids_are_checked_against_the_vocabulary() -> None:
    group = synthetic.rollout_group(2, 4, vocab_size=100)
    Decoder(RolloutGroup, Limits(vocab_size=100)).decode(encode(group))
    with pytest.raises(WireError, match="vocabulary") as err:
        Decoder(RolloutGroup, Limits(vocab_size=10)).decode(encode(group))
    assert err.value.field in ("prompt_ids", "token_ids")


def test_nested_fields_are_named_with_their_path() -> None:
    scored = synthetic.scored_group(2, 4)
    bad = dataclasses.replace(scored, rollout=dataclasses.replace(scored.rollout, finish_reasons=[1, 2]))
    with pytest.raises(WireError) as err:
        Decoder(ScoredGroup).decode(encode(bad))
    assert err.value.field == "rollout.finish_reasons[0]"


def test_labels_leave_out_what_the_peer_chose_and_reasons_are_clipped() -> None:
    """``label`` (a metric label, a logged-once key) has one value per schema path, however many map keys
    and list positions a flood chooses; ``field`` keeps them for the message, clipped like the reason."""
    group = synthetic.rollout_group(2, 4)
    cases = [
        ({"timings": {"k" * 5000: float("nan")}}, "timings{}", "timings." + "k" * 100),
        ({"texts": ["a", 7]}, "texts[]", "texts[1]"),
        ({"timings": {"generate": "slow"}}, "timings{}", "timings.generate"),
    ]
    for changes, label, field in cases:
        with pytest.raises(WireError) as err:
            Decoder(RolloutGroup).decode(_tamper(group, **changes))
        assert err.value.label == label and err.value.field.startswith(field)
        assert len(str(err.value)) < 1000
    scored = synthetic.scored_group(2, 4)
    bad = dataclasses.replace(scored, details=[{"task": 1.0}, {"x" * 99: "no"}])
    with pytest.raises(WireError) as err:
        Decoder(ScoredGroup).decode(encode(bad))
    assert err.value.label == "details[]{}" and err.value.field == "details[1]." + "x" * 99
    header = msgpack.packb([SCHEMA_VERSION, "t" * 10**6, []])
    with pytest.raises(WireError, match=r"\.\.\. \(1000023 characters\)$") as err:
        Decoder().decode([header])
    assert err.value.label == "tag"


def test_more_frames_than_any_message_has_are_refused_first() -> None:
    frames = encode(synthetic.rollout_group(2, 4))
    with pytest.raises(WireError, match="more than 64 frames") as err:
        Decoder(RolloutGroup).decode([*frames, *([b""] * 64)])
    assert err.value.field == "frames"


def test_wrong_type_schema_and_frame_count_are_refused() -> None:
    frames = encode(synthetic.rollout_group(2, 4))
    with pytest.raises(WireError, match="expected 'scored'"):
        Decoder(ScoredGroup).decode(frames)
    with pytest.raises(WireError, match="missing or already used"):
        Decoder(RolloutGroup).decode(frames[:-1])
    with pytest.raises(WireError, match="not referenced"):
        Decoder(RolloutGroup).decode([*frames, b"extra"])
    header = msgpack.packb([SCHEMA_VERSION + 1, "rollout", []])
    with pytest.raises(WireError) as err:
        Decoder().decode([header])
    assert err.value.field == "schema_version"


def test_an_old_reader_accepts_a_message_without_trailing_optional_fields() -> None:
    hb = Heartbeat(process_id="p", kind="reward", state="ready")
    header = msgpack.unpackb(encode(hb)[0])
    header[2] = header[2][:3]  # only the required fields, as a peer from before the others existed
    decoded = Decoder(Heartbeat).decode([msgpack.packb(header)])
    assert decoded.process_id == "p" and decoded.tokens_per_s == 0.0


# --------------------------------------------------------------------------- fuzz

FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
_VALID_FRAMES = [bytes(memoryview(f)) for f in encode(synthetic.scored_group(3, 4))]


@FUZZ
@given(st.lists(st.binary(max_size=256), min_size=0, max_size=6))
def test_random_frames_raise_only_wire_error(frames) -> None:
    with pytest.raises(WireError):
        Decoder().decode(frames)


@FUZZ
@given(st.integers(0, len(_VALID_FRAMES[0]) - 1), st.integers(0, len(_VALID_FRAMES) - 1))
def test_truncated_messages_raise_only_wire_error(cut, drop) -> None:
    frames = [_VALID_FRAMES[0][:cut], *(_VALID_FRAMES[1:])]
    with pytest.raises(WireError):
        Decoder(ScoredGroup).decode(frames)
    with pytest.raises(WireError):
        Decoder(ScoredGroup).decode(_VALID_FRAMES[:drop] + _VALID_FRAMES[drop + 1 :])


@FUZZ
@given(st.data())
def test_flipped_bytes_decode_or_raise_wire_error(data) -> None:
    frames = list(_VALID_FRAMES)
    i = data.draw(st.integers(0, len(frames) - 1))
    if not frames[i]:
        return
    pos = data.draw(st.integers(0, len(frames[i]) - 1))
    flipped = bytearray(frames[i])
    flipped[pos] ^= data.draw(st.integers(1, 255))
    frames[i] = bytes(flipped)
    with contextlib.suppress(WireError):  # the only exception a decoder may raise
        Decoder(ScoredGroup).decode(frames)


@FUZZ
@given(st.binary(max_size=512))
def test_random_blobs_raise_only_wire_error(blob) -> None:
    with pytest.raises(WireError):
        decode_blob(Decoder(), blob)


def test_blob_frames_round_trip_with_alignment() -> None:
    frames = [b"abc", b"", b"x" * 13]
    assert [bytes(f) for f in unpack_frames(pack_frames(frames))] == frames
