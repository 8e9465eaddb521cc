"""The data plane's seal (``common/wire/seal.py``) and the decode of what is scored
(``common/rewards/response_text.py``)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from asyncrl.common.rewards.response_text import ResponseTexts
from asyncrl.common.wire.messages import encode
from asyncrl.common.wire.seal import TAG_BYTES, Seal, group_tag, numbered_group_id
from tests.helpers.rollouts import char_tokenizer, make_group

SECRET = bytes(range(32))


def test_a_seal_verifies_only_the_same_frames_on_the_same_channel_under_the_same_secret() -> None:
    frames = encode(make_group(["19", "7"]))
    tag = Seal(SECRET, "rollouts").tag(frames)
    assert len(tag) == TAG_BYTES
    assert Seal(SECRET, "rollouts").tag(frames) == tag  # deterministic: the receiver recomputes it
    assert Seal(bytes(32), "rollouts").tag(frames) != tag  # another run's secret
    assert Seal(SECRET, "weights").tag(frames) != tag  # a message of another channel cannot be replayed here
    flipped = bytearray(frames[1])
    flipped[-1] ^= 1
    changed = [frames[0], bytes(flipped), *frames[2:]]
    assert Seal(SECRET, "rollouts").tag(changed) != tag  # one byte of one array


def test_moving_bytes_between_frames_changes_the_seal() -> None:
    """Lengths are hashed with the bytes, so the same bytes framed otherwise do not share a tag."""
    seal = Seal(SECRET, "c")
    assert seal.tag([b"ab", b"c"]) != seal.tag([b"a", b"bc"]) != seal.tag([b"abc"])
    assert seal.tag([b"abc"]) != seal.tag([b"abc", b""])


def test_sealed_frames_lead_with_the_tag_and_the_secret_is_never_shown() -> None:
    seal = Seal(SECRET, "rollouts")
    sealed = seal.seal([b"header", b"array"])
    assert sealed[0] == seal.tag([b"header", b"array"]) and sealed[1:] == [b"header", b"array"]
    assert seal.verifies(sealed[0], seal.tag(sealed[1:])) and not seal.verifies(b"\x00" * 16, sealed[0])
    assert SECRET.hex() not in repr(seal) and str(SECRET) not in repr(seal)
    with pytest.raises(ValueError, match="at least 16 bytes"):
        Seal(b"short", "rollouts")


def test_group_ids_are_readable_stable_and_unpredictable_without_the_secret() -> None:
    first = numbered_group_id("demo", 41, SECRET)
    assert first.startswith("demo-00000041-") and len(first.rsplit("-", 1)[1]) == 16
    assert numbered_group_id("demo", 41, SECRET) == first  # a restarted learner gives group 41 the same id
    assert numbered_group_id("demo", 41, bytes(32)) != first  # another secret: another id
    assert len({numbered_group_id("demo", n, SECRET) for n in range(1000)}) == 1000
    assert group_tag(SECRET, ("eval", 1, 2)) != group_tag(SECRET, ("eval", 12, ""))  # parts are separated


def test_the_scored_text_is_the_decode_of_the_token_ids() -> None:
    texts = ResponseTexts(char_tokenizer())
    honest = make_group(["19", "7", ""])
    assert texts.decode(honest) == ["19", "7", ""] and texts.mismatch(honest) is None
    assert texts.rewrite(honest) == (honest, 0)  # nothing to replace: the same object
    lying = dataclasses.replace(make_group(["99", "7", ""]), texts=["19", "7", ""])
    assert texts.mismatch(lying) == (
        "the text of response 0 is not the decode of its token ids (scored text differs from trained)"
    )
    rewritten, changed = texts.rewrite(lying)
    assert changed == 1 and rewritten.texts == ["99", "7", ""]
    assert np.array_equal(rewritten.token_ids, lying.token_ids)  # the ids are untouched: they are what is trained


def test_an_end_of_turn_token_stays_in_the_ids_and_out_of_the_text() -> None:
    tokenizer = char_tokenizer()
    ids = [*tokenizer.encode("19", add_special_tokens=False), tokenizer.eos_token_id]
    group = dataclasses.replace(make_group(["19"], lengths=[3]), token_ids=np.asarray(ids, np.int32), texts=["19"])
    assert ResponseTexts(tokenizer).decode(group) == ["19"] and ResponseTexts(tokenizer).mismatch(group) is None


def test_the_run_curve_keys_are_derived_from_the_secret_and_the_channel_and_hide_their_secrets() -> None:
    import zmq

    from asyncrl.common.transport.curve import MemberCurve

    keys = MemberCurve.of(Seal(SECRET, "rollouts"))
    assert MemberCurve.of(Seal(SECRET, "rollouts")) == keys  # every member derives the same pairs
    assert MemberCurve.of(Seal(bytes(32), "rollouts")) != keys  # another run's secret
    assert MemberCurve.of(Seal(SECRET, "environments")).server_public != keys.server_public  # another channel
    assert keys.server_public == zmq.curve_public(keys.server_secret) != keys.client_public
    assert keys.client_public == zmq.curve_public(keys.client_secret)
    assert keys.server_secret.decode() not in repr(keys) and keys.client_secret.decode() not in repr(keys)
