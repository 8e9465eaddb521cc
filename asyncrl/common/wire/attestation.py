"""What an environment said, signed by the reward worker that ran it: how a run trains an environment that cannot be
replayed (one whose class declares ``replayable = False``: a clock, a web tool, a judge model).

A replayable environment's episode is checked by replaying it (``actors/episode_scoring.py``). One that is not runs
only on the run's reward workers (``environment.isolation = "workers"``), and each of them signs what its environments
say.
A worker makes an Ed25519 key pair when it starts (:class:`Signer`); the private key never leaves that process (not
logged, not in Redis, not on disk), and its public key is advertised in the worker's heartbeat
(``environment_signing_key``). Its answer to each ``step`` of such an environment carries a signature over the step,
its answer to ``score`` one over the score; the actor carries them with the episode (:class:`EpisodeAttestation`,
``RolloutGroup.attestations``), and the reward worker that scores the episode checks each signature, with a key some
reward worker of the run advertised (:class:`KnownSigners`), against the episode's own tokens instead of replaying it.

The signed messages, every part framed by its length (8-byte little-endian) so that no two lists of parts share an
encoding, numbers as fixed-width little-endian (``u64``, IEEE-754 ``f64``, one byte for a bool)::

    frame(p_1 … p_n) = len(p_1) ‖ p_1 ‖ … ‖ len(p_n) ‖ p_n
    step  = frame("asyncrl-observation-v1", run, group_id, u64(index), episode, "step",
                  u64(turn), action, canonical_json(observation), f64(reward), u8(done))
    score = frame("asyncrl-observation-v1", run, group_id, u64(index), episode, "score", u64(turns), f64(value))
    signature = Ed25519(private key, message)   (RFC 8032; 64 bytes, hex on the wire)

``run`` is the run's name; ``group_id`` and ``index`` say which episode of which group the actor made the environment
for (the worker binds them when the environment is made, never taking a step's word for them); ``episode`` is a
random id the worker gives that environment, so that the steps of two environments made for the same episode cannot
be mixed; ``turn`` counts the environment's steps from 1 and ``turns`` is how many it had taken when it was scored;
``action`` is the model's turn as the worker received it; ``canonical_json`` is JSON with sorted keys, no spaces and
UTF-8 text.
"""

from __future__ import annotations

import json
import math
import secrets
import struct
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

PERSON = b"asyncrl-observation-v1"
KEY_HEX, SIGNATURE_HEX, EPISODE_HEX = 64, 128, 32
_U64, _F64 = struct.Struct("<Q"), struct.Struct("<d")


@dataclass(frozen=True)
class EpisodeIdentity:
    """Which environment a signature speaks for: the run, the episode (group id and index) and the worker's own id
    of the environment made for it."""

    run: str
    group_id: str
    index: int
    episode: str


def frame(*parts: bytes) -> bytes:
    """``len(p_1) ‖ p_1 ‖ … ‖ len(p_n) ‖ p_n``, each length 8-byte little-endian."""
    return b"".join(_U64.pack(len(part)) + part for part in parts)


def canonical_json(value: Any) -> bytes:
    """``value`` as JSON with sorted keys, no spaces and UTF-8 text: one encoding for equal values."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def _head(identity: EpisodeIdentity, kind: bytes) -> tuple[bytes, ...]:
    ids = (identity.run.encode(), identity.group_id.encode(), _U64.pack(identity.index), identity.episode.encode())
    return (PERSON, *ids, kind)


def step_message(
    identity: EpisodeIdentity, turn: int, action: str, observation: list[Any], reward: float, done: bool
) -> bytes:
    """The bytes signed for step ``turn`` (module docstring: ``step``)."""
    body = (_U64.pack(turn), action.encode(), canonical_json(observation), _F64.pack(float(reward)), bytes([done]))
    return frame(*_head(identity, b"step"), *body)


def score_message(identity: EpisodeIdentity, turns: int, value: float) -> bytes:
    """The bytes signed for the score after ``turns`` steps (module docstring: ``score``)."""
    return frame(*_head(identity, b"score"), _U64.pack(turns), _F64.pack(float(value)))


def new_episode_id() -> str:
    """A worker's random id for one environment it makes (16 bytes, hex)."""
    return secrets.token_hex(EPISODE_HEX // 2)


class Signer:
    """An Ed25519 key pair made in this process; the private key stays in it (nothing here returns it)."""

    def __init__(self) -> None:
        self._key = Ed25519PrivateKey.generate()
        self.public_hex = self._key.public_key().public_bytes_raw().hex()
        """The public key, its raw 32 bytes in hex: what the worker's heartbeat advertises."""

    def __repr__(self) -> str:  # never the private key
        return f"Signer(public={self.public_hex})"

    def sign(self, message: bytes) -> str:
        """The Ed25519 signature of ``message``, in hex."""
        return self._key.sign(message).hex()


def verifies(public_hex: str, message: bytes, signature_hex: str) -> bool:
    """Whether ``signature_hex`` is ``public_hex``'s Ed25519 signature of ``message`` (False for a malformed key or
    signature too)."""
    try:
        key = Ed25519PublicKey.from_public_bytes(bytes.fromhex(public_hex))
        key.verify(bytes.fromhex(signature_hex), message)
    except (InvalidSignature, ValueError):
        return False
    return True


class KnownSigners:
    """The signing keys this process has seen advertised by the run's reward workers since it started: a key stays
    known after its worker leaves, so an episode it served a moment before is still scored. ``advertised()`` reads the
    keys advertised now (the run's live heartbeats); it is read again whenever an unknown key is asked about, and
    :meth:`refresh` reads it whenever the owner likes (a worker that came and went between two episodes)."""

    def __init__(self, advertised: Callable[[], Iterable[str]], own: Iterable[str] = ()) -> None:
        self._advertised = advertised
        self._seen = frozenset(own)
        self._lock = threading.Lock()

    def refresh(self) -> None:
        found = frozenset(key for key in self._advertised() if key)
        with self._lock:
            self._seen |= found

    def knows(self, public_hex: str) -> bool:
        if public_hex not in self._seen:
            self.refresh()
        return public_hex in self._seen


# --------------------------------------------------------------------------- what the actor carries


@dataclass(frozen=True)
class AttestedStep:
    """One step's answer as its worker signed it (:func:`step_message`)."""

    observation: list[Any]
    reward: float
    done: bool
    signature: str


@dataclass(frozen=True)
class EpisodeAttestation:
    """What an actor carries for one episode of an environment that cannot be replayed: the signer's public key, the
    worker's id of the environment, each step's signed answer in order, and the signed score (``None`` before it)."""

    signer: str
    episode: str
    steps: tuple[AttestedStep, ...] = ()
    score: float | None = None
    score_signature: str = ""

    def to_json(self) -> str:
        """Compact JSON: ``{"signer": hex, "episode": hex, "steps": [[observation, reward, done, signature], …],
        "score": [value, signature] | null}``."""
        steps = [[s.observation, s.reward, s.done, s.signature] for s in self.steps]
        score = None if self.score is None else [self.score, self.score_signature]
        record = {"signer": self.signer, "episode": self.episode, "steps": steps, "score": score}
        return json.dumps(record, separators=(",", ":"), ensure_ascii=False)

    @classmethod
    def from_json(cls, text: str) -> EpisodeAttestation:
        """The record in ``text`` (:meth:`to_json`'s form); ``ValueError`` saying what is wrong with it."""
        try:
            record = json.loads(text)
        except (ValueError, RecursionError):
            raise ValueError("it is not JSON") from None
        if not isinstance(record, dict) or set(record) != {"signer", "episode", "steps", "score"}:
            raise ValueError("it is not an object of signer, episode, steps and score")
        signer, episode, steps = record["signer"], record["episode"], record["steps"]
        if not _is_hex(signer, KEY_HEX) or not _is_hex(episode, EPISODE_HEX):
            raise ValueError(f"its signer is not {KEY_HEX} or its episode not {EPISODE_HEX} hex digits")
        if not isinstance(steps, list):
            raise ValueError("its steps are not a list")
        attested = tuple(_attested_step(step, turn) for turn, step in enumerate(steps, 1))
        return cls(signer, episode, attested, *_signed_score(record["score"]))


def _attested_step(value: Any, turn: int) -> AttestedStep:
    if not (isinstance(value, list) and len(value) == 4):
        raise ValueError(f"step {turn} is not [observation, reward, done, signature]")
    observation, reward, done, signature = value
    if not isinstance(observation, list) or not _is_number(reward) or not isinstance(done, bool):
        raise ValueError(f"step {turn}'s observation is not a list, its reward not a number or its done not a bool")
    if not _is_hex(signature, SIGNATURE_HEX):
        raise ValueError(f"step {turn}'s signature is not {SIGNATURE_HEX} hex digits")
    return AttestedStep(observation, float(reward), done, signature)


def _signed_score(value: Any) -> tuple[float | None, str]:
    if value is None:
        return None, ""
    if not (isinstance(value, list) and len(value) == 2 and _is_number(value[0]) and _is_hex(value[1], SIGNATURE_HEX)):
        raise ValueError(f"its score is not [number, {SIGNATURE_HEX} hex digits]")
    return float(value[0]), value[1]


def _is_number(value: Any) -> bool:
    """A finite float, or an int a float holds exactly (JSON may write a whole reward as one)."""
    if isinstance(value, float):
        return math.isfinite(value)
    return isinstance(value, int) and not isinstance(value, bool) and abs(value) <= 2**53


def _is_hex(value: Any, digits: int) -> bool:
    return isinstance(value, str) and len(value) == digits and all(c in "0123456789abcdef" for c in value)
