"""What a reward worker signs for an environment that cannot be replayed (``common/wire/attestation.py``): the signed
bytes bind the run, the episode, the turn, the model's action and the environment's whole answer, so a change to any
of them, or a key of someone else's, does not verify; the record an actor carries reads back as written and refuses
anything malformed; the keys a worker trusts are those the run's reward workers advertised since it started; and a run
may declare such an environment only with ``environment.isolation = "workers"``, whose reward workers alone can score
its episodes."""

from __future__ import annotations

import dataclasses
import json

import msgpack
import numpy as np
import pytest

from asyncrl.actors.episode_scoring import environment_reward
from asyncrl.actors.evaluate import check_scored_offline
from asyncrl.cli.preflight import check_config
from asyncrl.common.config import load_config
from asyncrl.common.environments.protocol import is_replayable
from asyncrl.common.rewards.functions import episode_options
from asyncrl.common.tiny_models import synthetic
from asyncrl.common.wire.attestation import (
    AttestedStep,
    EpisodeAttestation,
    EpisodeIdentity,
    KnownSigners,
    Signer,
    canonical_json,
    frame,
    new_episode_id,
    score_message,
    step_message,
    verifies,
)
from asyncrl.common.wire.messages import Decoder, Heartbeat, RolloutGroup, WireError, encode

DICE = "tests.helpers.unreplayable:Dice"
IDENTITY = EpisodeIdentity(run="r", group_id="r-00000001-abc", index=1, episode=new_episode_id())
OBSERVATION = [{"role": "user", "content": "The die shows 4."}]
STEP = {"turn": 2, "action": "roll", "observation": OBSERVATION, "reward": 0.25, "done": False}


def test_a_signed_step_verifies_and_any_change_to_what_it_binds_does_not() -> None:
    signer = Signer()
    signature = signer.sign(step_message(IDENTITY, **STEP))
    assert verifies(signer.public_hex, step_message(IDENTITY, **STEP), signature)
    flipped_steps = [
        {"observation": [{"role": "user", "content": "The die shows 5."}]},
        {"observation": [*OBSERVATION, {"role": "user", "content": ""}]},
        {"action": "roll!"},
        {"reward": 0.2500001},
        {"done": True},
        {"turn": 3},
    ]
    for change in flipped_steps:
        assert not verifies(signer.public_hex, step_message(IDENTITY, **{**STEP, **change}), signature), change
    for change in ({"index": 0}, {"group_id": "r-00000002-abc"}, {"run": "s"}, {"episode": new_episode_id()}):
        other = dataclasses.replace(IDENTITY, **change)
        assert not verifies(signer.public_hex, step_message(other, **STEP), signature), change
    assert not verifies(Signer().public_hex, step_message(IDENTITY, **STEP), signature)  # a key of someone else's
    foreign = Signer()  # signs the same step well, but is not the worker's key
    assert not verifies(signer.public_hex, step_message(IDENTITY, **STEP), foreign.sign(step_message(IDENTITY, **STEP)))
    for key, sig in (("zz", signature), (signer.public_hex, "00" * 64), (signer.public_hex, "not hex")):
        assert not verifies(key, step_message(IDENTITY, **STEP), sig)


def test_a_signed_score_binds_its_value_its_episode_and_the_steps_taken_before_it() -> None:
    signer = Signer()
    signature = signer.sign(score_message(IDENTITY, 2, 1.5))
    assert verifies(signer.public_hex, score_message(IDENTITY, 2, 1.5), signature)
    assert not verifies(signer.public_hex, score_message(IDENTITY, 2, 1.25), signature)
    assert not verifies(signer.public_hex, score_message(IDENTITY, 1, 1.5), signature)  # scored after another turn
    assert not verifies(signer.public_hex, score_message(dataclasses.replace(IDENTITY, index=2), 2, 1.5), signature)
    # a score is never a step: the kinds are framed parts of their own
    assert score_message(IDENTITY, 2, 1.5) != step_message(IDENTITY, 2, "", [], 1.5, False)


def test_the_framing_gives_no_two_lists_of_parts_one_encoding() -> None:
    # len 2 "ab", len 1 "c"  vs  len 1 "a", len 2 "bc": the lengths tell them apart
    assert frame(b"ab", b"c") != frame(b"a", b"bc")
    assert frame(b"ab", b"c") == b"\x02" + b"\0" * 7 + b"ab" + b"\x01" + b"\0" * 7 + b"c"
    assert canonical_json({"role": "user", "content": "é"}) == '{"content":"é","role":"user"}'.encode()


def test_the_record_an_actor_carries_reads_back_and_refuses_what_is_malformed() -> None:
    signature = "ab" * 64
    record = EpisodeAttestation(
        Signer().public_hex, new_episode_id(), (AttestedStep(OBSERVATION, 0.25, False, signature),), 1.0, signature
    )
    assert EpisodeAttestation.from_json(record.to_json()) == record
    assert (
        EpisodeAttestation.from_json(dataclasses.replace(record, score=None, score_signature="").to_json()).score
        is None
    )
    good = json.loads(record.to_json())
    malformed = [
        ("[1]", "not an object"),
        ("{", "not JSON"),
        (json.dumps({**good, "extra": 1}), "not an object of signer"),
        (json.dumps({**good, "signer": "AB" * 32}), "signer is not 64"),
        (json.dumps({**good, "steps": [[OBSERVATION, 0.25, False]]}), r"step 1 is not \[observation"),
        (json.dumps({**good, "steps": [[OBSERVATION, True, False, signature]]}), "its reward not a number"),
        (json.dumps({**good, "steps": [[OBSERVATION, 1e400, False, signature]]}), "its reward not a number"),
        (json.dumps({**good, "steps": [[OBSERVATION, 10**400, False, signature]]}), "its reward not a number"),
        (json.dumps({**good, "steps": [[OBSERVATION, 0.5, False, "ab"]]}), "signature is not 128"),
        (json.dumps({**good, "score": [1.0]}), "its score is not"),
    ]
    for text, why in malformed:
        with pytest.raises(ValueError, match=why):
            EpisodeAttestation.from_json(text)


def test_a_worker_trusts_the_keys_advertised_since_it_started_and_reads_again_for_one_it_does_not_know() -> None:
    own, first, later = Signer().public_hex, Signer().public_hex, Signer().public_hex
    advertised = [[first, ""], [], [later]]  # what the run's heartbeats say at each read
    reads: list[list[str]] = []

    def read() -> list[str]:
        reads.append(advertised[min(len(reads), len(advertised) - 1)])
        return reads[-1]

    signers = KnownSigners(read, [own])
    assert signers.knows(own) and not reads  # its own key: no read
    signers.refresh()
    assert signers.knows(first)
    assert not signers.knows(Signer().public_hex) and len(reads) == 2  # unknown: read again, still unknown
    assert signers.knows(first)  # its worker left: still trusted
    assert signers.knows(later) and len(reads) == 3  # joined since: read when first asked about
    assert not signers.knows("")


def test_the_heartbeat_and_the_rollout_carry_them_and_old_messages_still_decode() -> None:
    key = Signer().public_hex
    sent = Heartbeat(process_id="rw", kind="reward", state="ready", environment_signing_key=key)
    beat = Decoder(Heartbeat).decode(encode(sent))
    assert beat.environment_signing_key == key
    header = msgpack.unpackb(encode(beat)[0])
    header[2] = header[2][:-1]  # a worker from before the field
    assert Decoder(Heartbeat).decode([msgpack.packb(header)]).environment_signing_key == ""
    with pytest.raises(WireError) as err:
        Decoder(Heartbeat).decode(encode(dataclasses.replace(beat, environment_signing_key="xy" * 32)))
    assert err.value.field == "environment_signing_key"

    group = synthetic.rollout_group(2, 3)
    assert Decoder(RolloutGroup).decode(encode(group)).attestations == []
    carried = Decoder(RolloutGroup).decode(encode(dataclasses.replace(group, attestations=["{}", ""])))
    assert carried.attestations == ["{}", ""]
    with pytest.raises(WireError) as err:
        Decoder(RolloutGroup).decode(encode(dataclasses.replace(group, attestations=["{}"])))
    assert err.value.field == "attestations"
    assert np.array_equal(carried.token_ids, group.token_ids)


def test_an_environment_that_cannot_be_replayed_runs_only_on_the_reward_workers() -> None:
    assert not is_replayable(DICE) and is_replayable("calculator")
    settings = ["rollout.workflow=multi_turn", f"environment.name={DICE}"]
    for isolation in ("process", "thread"):
        with pytest.raises(ValueError) as refused:
            check_config(load_config(None, [*settings, f"environment.isolation={isolation}"]))
        message = str(refused.value)
        assert "\n" not in message and f"environment.isolation = {isolation!r}" in message, message
        assert "cannot be replayed" in message and "set environment.isolation = 'workers'" in message, message
    config = load_config(None, [*settings, "environment.isolation=workers"])
    check_config(config)
    # Only a reward worker holds the keys its episodes are checked against: neither a bare call nor rl-actor eval
    with pytest.raises(ValueError, match="cannot be replayed: its episodes are scored from what the run's reward"):
        environment_reward(synthetic.rollout_group(1, 2), episode_options(config))
    with pytest.raises(ValueError, match=r"rl-actor eval runs none; evaluate it in the run \(eval\.every\)"):
        check_scored_offline(config)
    check_scored_offline(load_config(None, ["rollout.workflow=multi_turn", "environment.name=calculator"]))
