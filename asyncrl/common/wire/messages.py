"""Wire format: every message that crosses a process boundary, in one place (the codec is
:mod:`asyncrl.common.wire.codec`).

A message is a frozen dataclass; on the wire, a msgpack header and one raw frame per array, never pickled.
Field order is the contract: new fields are appended with a default, never inserted or reordered, and a change
that old readers cannot accept bumps ``SCHEMA_VERSION``. Each message's ``validate`` checks what the schema
alone cannot (cross-field lengths, token ids against the vocabulary, ranges); a decoder raises one
:class:`WireError` naming the field. Nothing else escapes a decoder.
"""

from __future__ import annotations

import itertools
import json
import math
import time
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np

from asyncrl.common.wire.codec import (
    DEFAULT_MAX_MESSAGE_BYTES,
    SCHEMA_VERSION,
    ArraySpec,
    Frames,
    Limits,
    WireError,
    array_field,
    decode_blob,
    encode,
    encode_blob,
    message,
    pack_frames,
    unpack_frames,
)
from asyncrl.common.wire.decoding import Decoder

PROCESS_KINDS = ("actor", "reward", "learner")
"""Who may heartbeat in a run."""

__all__ = [
    "DEFAULT_MAX_MESSAGE_BYTES",
    "PROCESS_KINDS",
    "PURPOSES",
    "SCHEMA_VERSION",
    "ArraySpec",
    "Decoder",
    "Frames",
    "Heartbeat",
    "Limits",
    "PromptGroup",
    "RolloutGroup",
    "ScoredGroup",
    "WeightBucket",
    "WeightManifest",
    "WireError",
    "array_field",
    "decode_blob",
    "encode",
    "encode_blob",
    "extra_fields",
    "message",
    "pack_frames",
    "unpack_frames",
]


EPISODE_FINISH_REASONS = ("stop", "length", "max_turns", "deadline")
"""How a trained episode ended, as its finish reason says: ``stop`` (the environment said done, or the model ended its
turn without a call: the model's choice), ``length`` (the token limit), ``max_turns`` (``environment.max_turns``),
``deadline`` (``environment.episode_timeout_s``). An episode its environment's fault ended (``environment_error``) is
never trained (``actors/faults.py``)."""


@message("prompt")
@dataclass(frozen=True, kw_only=True)
class PromptGroup:
    """One prompt to be answered ``num_samples`` times by one actor (one GRPO group)."""

    TAG: ClassVar[str]
    group_id: str
    task: str
    prompt: str
    prompt_ids: np.ndarray = array_field("int32", min_value=0)
    answer: str = ""
    """Ground truth for the verifier (a JSON document for structured tasks)."""
    num_samples: int = 1
    issued_version: int = 0
    issued_at: float = field(default_factory=time.time)
    extra: str = ""
    """The data row's other fields as a JSON object (``""`` = none), for reward functions (:func:`extra_fields`)."""
    purpose: str = "train"
    """``train``, or ``eval``: a held-out prompt the learner scores and never trains on
    (``common/data/evaluation.py``)."""
    temperature: float = -1.0
    """This group's sampling temperature (0 = greedy); below 0 = ``rollout.temperature`` (every training group)."""
    max_new_tokens: int = 0
    """This group's longest response; 0 = ``rollout.max_new_tokens`` (every training group)."""

    def validate(self, limits: Limits) -> None:
        _check_vocab("prompt_ids", self.prompt_ids, limits)
        _check_range("num_samples", self.num_samples, 1, 4096)
        _check_range("issued_version", self.issued_version, 0, None)
        _check_purpose(self.purpose)
        _check_range("max_new_tokens", self.max_new_tokens, 0, None)


@message("rollout")
@dataclass(frozen=True, kw_only=True)
class RolloutGroup:
    """The K responses an actor sampled for one prompt group.

    Responses are packed: ``token_ids``, ``logprobs`` and ``versions`` hold all K responses
    back to back, ``lengths[i]`` tokens each (use :meth:`response`). ``logprobs`` are the
    behaviour policy's log-probabilities of the sampled tokens; ``versions`` the policy
    version that produced each token (a response can span a weight update).
    """

    TAG: ClassVar[str]
    group_id: str
    task: str
    prompt: str
    prompt_ids: np.ndarray = array_field("int32", min_value=0)
    answer: str = ""
    token_ids: np.ndarray = array_field("int32", min_value=0)
    logprobs: np.ndarray = array_field("float32", "bfloat16", max_value=1e-3)
    versions: np.ndarray = array_field("int32", min_value=0)
    lengths: np.ndarray = array_field("int32", min_value=0)
    texts: list[str] = field(default_factory=list)
    finish_reasons: list[str] = field(default_factory=list)
    actor_id: str = ""
    issued_version: int = 0
    timings: dict[str, float] = field(default_factory=dict)
    """Seconds per phase, e.g. ``queued``, ``generate``."""
    extra: str = ""
    """The prompt group's ``extra``, copied as issued."""
    purpose: str = "train"
    """The prompt group's ``purpose``, copied as issued (``eval`` groups are never trained on)."""
    loss_mask: np.ndarray = array_field("int32", min_value=0, max_value=1, empty_default=True)
    """Per token (packed like ``token_ids``): 1 = trained, 0 = not — a token the model did not sample, such as an
    environment's or a tool's reply inside a multi-turn episode: no gradient, no KL, no entropy. Empty = every
    token is trained (a single-turn rollout)."""
    attestations: list[str] = field(default_factory=list)
    """Per response, what the reward workers that ran its episode's environment signed, as JSON
    (``common/wire/attestation.py: EpisodeAttestation``; ``""`` for none): an environment that cannot be replayed is
    scored from these. Empty = none at all."""
    row_starts: np.ndarray = array_field("int32", min_value=0, max_value=1, empty_default=True)
    """Per token (packed like ``token_ids``): 1 where a new training row of its response starts. A multi-turn episode
    of a chat template that rewrites past turns (a thinking model's, which drops past reasoning) is kept as rows, each
    a context the model was served after the prompt (loss mask 0) and the turns it then wrote
    (``common/environments/turns.py``): the learner trains each row as its own sequence, prompt first. Empty = each
    response is one row."""

    @property
    def num_samples(self) -> int:
        return len(self.lengths)

    def trained(self, i: int) -> np.ndarray:
        """Which tokens of response ``i`` are trained (``loss_mask``; all of them when it is empty), as booleans."""
        if not len(self.loss_mask):
            return np.ones(int(self.lengths[i]), bool)
        start = int(self.lengths[:i].sum())
        return self.loss_mask[start : start + int(self.lengths[i])].astype(bool)

    def segments(self, i: int) -> list[tuple[int, int, bool]]:
        """``(start, end, trained)`` of each run of response ``i``: the model's turns and what the environment said
        between them (one run, trained, for a single-turn response)."""
        return segments(self.trained(i))

    def rows(self, i: int) -> list[tuple[int, int]]:
        """``(start, end)`` of each training row of response ``i``, in its own token positions (one row, the whole
        response, when :attr:`row_starts` is empty)."""
        length = int(self.lengths[i])
        if not len(self.row_starts):
            return [(0, length)]
        start = int(self.lengths[:i].sum())
        cuts = [0, *(np.flatnonzero(self.row_starts[start + 1 : start + length]) + 1).tolist(), length]
        return list(itertools.pairwise(cuts))

    def longest_row(self) -> int:
        """The most tokens any training row of any response holds (:meth:`rows`)."""
        if not len(self.row_starts):
            return int(self.lengths.max(initial=0))
        return max((end - start for i in range(self.num_samples) for start, end in self.rows(i)), default=0)

    def extra_fields(self) -> dict[str, Any]:
        """The data row's other fields (``{}`` for a generated task): what a reward function reads beyond the answer."""
        return extra_fields(self.extra)

    def response(self, i: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Token ids, behaviour log-probs and versions of response ``i``."""
        start = int(self.lengths[:i].sum())
        end = start + int(self.lengths[i])
        return self.token_ids[start:end], self.logprobs[start:end], self.versions[start:end]

    def validate(self, limits: Limits) -> None:
        total = int(self.lengths.sum(dtype=np.int64))
        for name in ("token_ids", "logprobs", "versions"):
            n = len(getattr(self, name))
            if n != total:
                raise WireError(name, f"has {n} entries but lengths sum to {total}")
        if len(self.loss_mask) not in (0, total):
            raise WireError("loss_mask", f"has {len(self.loss_mask)} entries but lengths sum to {total} (or 0: all)")
        self._check_row_starts(total)
        k = len(self.lengths)
        for name in ("texts", "finish_reasons"):
            if len(getattr(self, name)) != k:
                raise WireError(name, f"has {len(getattr(self, name))} entries for {k} responses")
        if len(self.attestations) not in (0, k):
            raise WireError("attestations", f"has {len(self.attestations)} entries for {k} responses (or 0: none)")
        _check_vocab("prompt_ids", self.prompt_ids, limits)
        _check_vocab("token_ids", self.token_ids, limits)
        _check_range("issued_version", self.issued_version, 0, None)
        _check_purpose(self.purpose)

    def _check_row_starts(self, total: int) -> None:
        """A row starts only with a context: a token the model did not sample."""
        if not len(self.row_starts):
            return
        if len(self.row_starts) != total:
            raise WireError("row_starts", f"has {len(self.row_starts)} entries but lengths sum to {total} (or 0: none)")
        starts = self.row_starts.astype(bool)
        if len(self.loss_mask) != total or (starts & self.loss_mask.astype(bool)).any():
            raise WireError("row_starts", "marks a row that starts with a token the model sampled, not a context")


@message("scored")
@dataclass(frozen=True, kw_only=True)
class ScoredGroup:
    """A rollout group with one scalar reward per response and the parts it was made of."""

    TAG: ClassVar[str]
    rollout: RolloutGroup
    rewards: np.ndarray = array_field("float32")
    details: list[dict[str, float]] = field(default_factory=list)
    """Per response, the score of each reward function before weighting."""
    scorer_id: str = ""
    scored_at: float = field(default_factory=time.time)
    turn_rewards: np.ndarray = array_field("float32", empty_default=True)
    """Per model turn of each multi-turn response (the runs of 1 in its loss mask), in order, response after
    response: the weighted part of its reward that reward functions gave that turn (an environment's reward for the
    turn's step, its final score on the last turn). Empty when no function scores turns. A response's reward is still
    ``rewards[i]``; estimators that work per token put each turn's share at the turn's last token and the rest at the
    response's last token."""

    def validate(self, limits: Limits) -> None:
        self.rollout.validate(limits)
        k = self.rollout.num_samples
        if len(self.rewards) != k:
            raise WireError("rewards", f"has {len(self.rewards)} entries for {k} responses")
        if self.details and len(self.details) != k:
            raise WireError("details", f"has {len(self.details)} entries for {k} responses")
        if len(self.turn_rewards):
            turns = sum(model_turns(self.rollout.trained(i)) for i in range(k))
            if len(self.turn_rewards) != turns:
                raise WireError("turn_rewards", f"has {len(self.turn_rewards)} entries for {turns} model turns")
            if not np.isfinite(self.turn_rewards).all():
                raise WireError("turn_rewards", "holds a value that is not finite")

    def turn_shares(self) -> list[np.ndarray]:
        """Each response's entries of :attr:`turn_rewards` (empty arrays when there are none)."""
        if not len(self.turn_rewards):
            return [self.turn_rewards] * self.rollout.num_samples
        ends = np.cumsum([model_turns(self.rollout.trained(i)) for i in range(self.rollout.num_samples)])
        return np.split(self.turn_rewards, ends[:-1])


def segments(trained: np.ndarray) -> list[tuple[int, int, bool]]:
    """``(start, end, trained)`` of each maximal run of equal values in a response's loss mask, in order."""
    mask = np.asarray(trained, dtype=bool)
    if not len(mask):
        return []
    edges = np.flatnonzero(np.diff(mask.astype(np.int8))) + 1
    starts = [0, *edges.tolist()]
    ends = [*edges.tolist(), len(mask)]
    return [(s, e, bool(mask[s])) for s, e in zip(starts, ends, strict=True)]


def model_turns(trained: np.ndarray) -> int:
    """The model's turns in a response's loss mask (its runs of 1)."""
    mask = np.asarray(trained, dtype=np.int8)
    return int(np.count_nonzero(np.diff(mask, prepend=0) == 1))


@message("bucket")
@dataclass(frozen=True, kw_only=True)
class WeightBucket:
    """One flat tensor of a single dtype holding several parameters back to back."""

    TAG: ClassVar[str]
    dtype: str
    numel: int
    names: list[str] = field(default_factory=list)
    shapes: list[list[int]] = field(default_factory=list)
    offsets: list[int] = field(default_factory=list)
    digest: str = ""
    """64-bit BLAKE3 of the packed bucket in hex (``common/weights/group.py: bucket_digest``); members verify it."""

    def validate(self, limits: Limits) -> None:
        _check_digest("digest", self.digest)
        if not (len(self.names) == len(self.shapes) == len(self.offsets)):
            raise WireError("names", "names, shapes and offsets differ in length")
        _check_range("numel", self.numel, 0, None)
        for i, (shape, offset) in enumerate(zip(self.shapes, self.offsets, strict=True)):
            if any(d < 0 for d in shape):
                raise WireError(f"shapes[{i}]", f"negative dimension in {shape}")
            if offset < 0 or offset + math.prod(shape) > self.numel:
                raise WireError(f"offsets[{i}]", f"parameter at {offset} overruns bucket of {self.numel}")


@message("manifest")
@dataclass(frozen=True, kw_only=True)
class WeightManifest:
    """Announces policy ``version``: who forms the group (rendezvous in the run's Redis) and how the buckets that
    follow are laid out."""

    TAG: ClassVar[str]
    version: int
    world_size: int
    members: list[str] = field(default_factory=list)
    """Actor ids in rank order; rank 0 is the learner."""
    buckets: list[WeightBucket] = field(default_factory=list)
    group_epoch: int = 0
    """Bumped whenever the weight group is re-formed (membership changed)."""
    created_at: float = field(default_factory=time.time)
    restore: int = 0
    """Bumped by every resume from a checkpoint: the policy went back to ``version``, so an actor that holds a higher
    version from the discarded steps must load these weights too."""
    digest: str = ""
    """The version digest over the buckets' digests (``common/weights/group.py: version_digest``)."""
    member_ranks: list[int] = field(default_factory=list)
    """How many weight-group ranks each member takes, in ``members`` order — an actor's vLLM workers, one per GPU of
    its tensor-parallel engine; empty = one each. Rank 0 is the learner, then each member's ranks back to back."""

    def rank_counts(self) -> list[int]:
        return list(self.member_ranks) or [1] * len(self.members)

    def ranks_of(self, member: str) -> range:
        """The weight-group ranks of ``member`` (its first worker takes the first)."""
        counts = self.rank_counts()
        index = self.members.index(member)
        first = 1 + sum(counts[:index])
        return range(first, first + counts[index])

    def owner_of(self, rank: int) -> str:
        """The member that takes weight-group ``rank`` (≥ 1)."""
        return next(member for member in self.members if rank in self.ranks_of(member))

    def validate(self, limits: Limits) -> None:
        _check_digest("digest", self.digest)
        _check_range("version", self.version, 0, None)
        _check_range("restore", self.restore, 0, None)
        if self.member_ranks and (len(self.member_ranks) != len(self.members) or min(self.member_ranks) < 1):
            raise WireError("member_ranks", f"needs one count >= 1 per member ({len(self.members)} members)")
        if self.world_size != 1 + sum(self.rank_counts()):
            raise WireError("world_size", f"{self.world_size} != 1 + the members' {sum(self.rank_counts())} ranks")
        for i, bucket in enumerate(self.buckets):
            if bucket.dtype not in ("float32", "bfloat16", "float16"):
                raise WireError(f"buckets[{i}].dtype", f"unsupported dtype {bucket.dtype!r}")
            bucket.validate(limits)


@message("heartbeat")
@dataclass(frozen=True, kw_only=True)
class Heartbeat:
    """What a process of the run says about itself every few seconds (its liveness, and where it serves /metrics)."""

    TAG: ClassVar[str]
    process_id: str
    kind: str
    """``actor``, ``reward`` or ``learner``."""
    state: str
    """e.g. ``starting``, ``ready``, ``generating``, ``syncing``, ``draining``."""
    version: int = 0
    tokens_per_s: float = 0.0
    host: str = ""
    pid: int = 0
    metrics_url: str = ""
    sent_at: float = field(default_factory=time.time)
    endpoint: str = ""
    """Where a reward worker's PULL socket is bound (actors PUSH rollouts to every live one)."""
    curve_public_key: str = ""
    """A reward worker's CURVE server public key (Z85) when its socket requires CURVE; actors connect with it."""
    weights_digest: str = ""
    """An actor's: the version digest of the weights it serves (``""`` before the first load)."""
    weight_ranks: int = 1
    """An actor's: the weight-group ranks it takes (its vLLM engine's workers: ``rollout.tensor_parallel_size``)."""
    environment_endpoint: str = ""
    """A reward worker's: where it serves environments to actors (``environment.isolation = "workers"``)."""
    environment_signing_key: str = ""
    """A reward worker's that serves environments: the Ed25519 public key (raw 32 bytes, hex) it signs what they say
    with (``common/wire/attestation.py``)."""

    def validate(self, limits: Limits) -> None:
        if self.kind not in PROCESS_KINDS:
            raise WireError("kind", f"must be one of {', '.join(PROCESS_KINDS)}, got {self.kind!r}")
        _check_range("tokens_per_s", self.tokens_per_s, 0, None)
        _check_range("weight_ranks", self.weight_ranks, 1, 64)
        _check_digest("weights_digest", self.weights_digest)
        _check_hex("environment_signing_key", self.environment_signing_key, 64)


def extra_fields(extra: str) -> dict[str, Any]:
    """A message's ``extra`` JSON text as a dict (``{}`` when empty, or when it is not a JSON object)."""
    if not extra:
        return {}
    try:
        value = json.loads(extra)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


PURPOSES = ("train", "eval")
"""What a prompt group is for (``PromptGroup.purpose``)."""


def _check_purpose(value: str) -> None:
    if value not in PURPOSES:
        raise WireError("purpose", f"must be one of {', '.join(PURPOSES)}, got {value[:40]!r}")


def _check_digest(name: str, value: str) -> None:
    _check_hex(name, value, 16)


def _check_hex(name: str, value: str, digits: int) -> None:
    """``value`` is empty or ``digits`` lowercase hex digits."""
    if value and (len(value) != digits or any(c not in "0123456789abcdef" for c in value)):
        raise WireError(name, f"expected {digits} lowercase hex digits, got {value[:40]!r}")


def _check_range(name: str, value: float, low: float | None, high: float | None) -> None:
    if (low is not None and value < low) or (high is not None and value > high):
        raise WireError(name, f"{value} outside [{low}, {high}]")


def _check_vocab(name: str, ids: np.ndarray, limits: Limits) -> None:
    if limits.vocab_size is not None and len(ids) and int(ids.max()) >= limits.vocab_size:
        raise WireError(name, f"token id {int(ids.max())} >= vocabulary size {limits.vocab_size}")
