"""Wire format: every message that crosses a process boundary, and its one codec.

A message is a frozen dataclass. On the wire it is a list of frames::

    frame 0   msgpack [SCHEMA_VERSION, tag, [field values in declaration order]]
    frame 1.. raw array bytes, referenced from frame 0 by msgpack ext type 1:
              [dtype name, shape, frame index]

Arrays never go through msgpack (no copy into the header, bf16 stays bf16) and nothing is
ever pickled. Field order is the contract: new fields are appended with a default, never
inserted or reordered, and a change that old readers cannot accept bumps ``SCHEMA_VERSION``.

Decoding validates everything a hostile or buggy peer could send — the total size, the
header's structure, every field's type, array dtypes, shapes against frame sizes, finiteness
and value ranges, cross-field lengths, token ids against the vocabulary — and raises one
:class:`WireError` that names the offending field. Nothing else escapes a decoder.
"""

from __future__ import annotations

import dataclasses
import math
import struct
import time
import types
import typing
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import ml_dtypes
import msgpack
import numpy as np

SCHEMA_VERSION = 2
"""2: the weight manifest no longer names a TCPStore (the rendezvous moved into the run's Redis)."""
_ARRAY_EXT = 1
DEFAULT_MAX_MESSAGE_BYTES = 64 * 2**20

_DTYPES: dict[str, np.dtype] = {
    "int32": np.dtype(np.int32),
    "int64": np.dtype(np.int64),
    "float32": np.dtype(np.float32),
    "bfloat16": np.dtype(ml_dtypes.bfloat16),
}
_DTYPE_NAMES = {dt: name for name, dt in _DTYPES.items()}


class WireError(ValueError):
    """A message that cannot be accepted; ``field`` is the dotted path of the first bad field."""

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"{field}: {reason}")
        self.field = field
        self.reason = reason


@dataclass(frozen=True)
class Limits:
    """What a decoder accepts beyond the schema itself."""

    max_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    """Largest message (all frames together) in bytes."""
    vocab_size: int | None = None
    """When known, every token id must lie in [0, vocab_size)."""


@dataclass(frozen=True)
class ArraySpec:
    dtypes: tuple[str, ...]
    ndim: int = 1
    min_value: float | None = None
    max_value: float | None = None


def array_field(*dtypes: str, min_value: float | None = None, max_value: float | None = None) -> Any:
    """Declare a one-dimensional array field of one of ``dtypes`` with an optional value range."""
    return field(metadata={"array": ArraySpec(tuple(dtypes), 1, min_value, max_value)})


def _now() -> float:
    return time.time()


# --------------------------------------------------------------------------- messages

_MESSAGES: dict[str, type] = {}


def message(tag: str):
    """Class decorator: register a frozen dataclass as a wire message under ``tag``."""

    def wrap(cls: type) -> type:
        if tag in _MESSAGES:
            raise ValueError(f"wire tag {tag!r} already used by {_MESSAGES[tag].__name__}")
        cls.TAG = tag
        _MESSAGES[tag] = cls
        return cls

    return wrap


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
    issued_at: float = field(default_factory=_now)

    def validate(self, limits: Limits) -> None:
        _check_vocab("prompt_ids", self.prompt_ids, limits)
        _check_range("num_samples", self.num_samples, 1, 4096)
        _check_range("issued_version", self.issued_version, 0, None)


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

    @property
    def num_samples(self) -> int:
        return len(self.lengths)

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
        k = len(self.lengths)
        for name in ("texts", "finish_reasons"):
            if len(getattr(self, name)) != k:
                raise WireError(name, f"has {len(getattr(self, name))} entries for {k} responses")
        _check_vocab("prompt_ids", self.prompt_ids, limits)
        _check_vocab("token_ids", self.token_ids, limits)
        _check_range("issued_version", self.issued_version, 0, None)


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
    scored_at: float = field(default_factory=_now)

    def validate(self, limits: Limits) -> None:
        self.rollout.validate(limits)
        k = self.rollout.num_samples
        if len(self.rewards) != k:
            raise WireError("rewards", f"has {len(self.rewards)} entries for {k} responses")
        if self.details and len(self.details) != k:
            raise WireError("details", f"has {len(self.details)} entries for {k} responses")


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

    def validate(self, limits: Limits) -> None:
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
    created_at: float = field(default_factory=_now)
    restore: int = 0
    """Bumped by every resume from a checkpoint: the policy went back to ``version``, so an actor that holds a higher
    version from the discarded steps must load these weights too."""

    def validate(self, limits: Limits) -> None:
        _check_range("version", self.version, 0, None)
        _check_range("restore", self.restore, 0, None)
        if self.world_size != len(self.members) + 1:
            raise WireError("world_size", f"{self.world_size} != 1 + {len(self.members)} members")
        for i, bucket in enumerate(self.buckets):
            if bucket.dtype not in ("float32", "bfloat16", "float16"):
                raise WireError(f"buckets[{i}].dtype", f"unsupported dtype {bucket.dtype!r}")
            bucket.validate(limits)


@message("heartbeat")
@dataclass(frozen=True, kw_only=True)
class Heartbeat:
    """What an actor or reward worker says about itself every few seconds."""

    TAG: ClassVar[str]
    process_id: str
    kind: str
    """``actor`` or ``reward``."""
    state: str
    """e.g. ``starting``, ``ready``, ``generating``, ``syncing``, ``draining``."""
    version: int = 0
    tokens_per_s: float = 0.0
    host: str = ""
    pid: int = 0
    metrics_url: str = ""
    sent_at: float = field(default_factory=_now)
    endpoint: str = ""
    """Where a reward worker's PULL socket is bound (actors PUSH rollouts to every live one)."""

    def validate(self, limits: Limits) -> None:
        if self.kind not in ("actor", "reward"):
            raise WireError("kind", f"must be 'actor' or 'reward', got {self.kind!r}")
        _check_range("tokens_per_s", self.tokens_per_s, 0, None)


def _check_range(name: str, value: float, low: float | None, high: float | None) -> None:
    if (low is not None and value < low) or (high is not None and value > high):
        raise WireError(name, f"{value} outside [{low}, {high}]")


def _check_vocab(name: str, ids: np.ndarray, limits: Limits) -> None:
    if limits.vocab_size is not None and len(ids) and int(ids.max()) >= limits.vocab_size:
        raise WireError(name, f"token id {int(ids.max())} >= vocabulary size {limits.vocab_size}")


# --------------------------------------------------------------------------- encoding

Frames = list[Any]  # bytes, memoryview or zmq.Frame


def encode(msg: Any) -> Frames:
    """Frames for ``msg``: the msgpack header, then one raw frame per array (no copies of arrays)."""
    arrays: list[np.ndarray] = []
    body = _to_plain(msg, arrays)
    header = msgpack.packb([SCHEMA_VERSION, type(msg).TAG, body], use_bin_type=True)
    return [header, *(memoryview(a).cast("B") for a in arrays)]


_SCALARS = (str, int, float, bool, type(None))
_FIELD_NAMES: dict[type, tuple[str, ...]] = {}


def _to_plain(value: Any, arrays: list[np.ndarray]) -> Any:
    if type(value) in _SCALARS:
        return value
    if isinstance(value, np.ndarray):
        return _array_ref(value, arrays)
    if isinstance(value, list | tuple):
        if all(type(v) in _SCALARS for v in value):
            return value  # msgpack packs it as is: skip the per-item walk
        return [_to_plain(v, arrays) for v in value]
    if isinstance(value, dict):
        return {k: _to_plain(v, arrays) for k, v in value.items()}
    names = _FIELD_NAMES.get(type(value))
    if names is None:
        if not dataclasses.is_dataclass(value):
            raise TypeError(f"{type(value).__name__} is not part of the wire format")
        names = _FIELD_NAMES[type(value)] = tuple(f.name for f in dataclasses.fields(value))
    return [_to_plain(getattr(value, name), arrays) for name in names]


def _array_ref(value: np.ndarray, arrays: list[np.ndarray]) -> msgpack.ExtType:
    name = _DTYPE_NAMES.get(value.dtype)
    if name is None:
        raise TypeError(f"arrays of dtype {value.dtype} are not part of the wire format")
    arrays.append(np.ascontiguousarray(value).view(np.uint8).reshape(-1))
    return msgpack.ExtType(_ARRAY_EXT, msgpack.packb([name, list(value.shape), len(arrays)]))


# --------------------------------------------------------------------------- decoding


@dataclass(frozen=True)
class _ArrayRef:
    dtype: str
    shape: list[int]
    frame: int


def _ext_hook(code: int, data: bytes) -> _ArrayRef:
    if code != _ARRAY_EXT:
        raise WireError("header", f"unknown msgpack extension type {code}")
    try:
        dtype, shape, frame = msgpack.unpackb(data)
    except Exception as exc:  # any malformed ref is the peer's fault, not ours
        raise WireError("header", f"bad array reference: {exc}") from None
    if not (isinstance(dtype, str) and isinstance(shape, list) and type(frame) is int):
        raise WireError("header", "array reference is not [dtype, shape, frame]")
    if not all(type(d) is int and d >= 0 for d in shape):
        raise WireError("header", f"bad array shape {shape!r}")
    return _ArrayRef(dtype, shape, frame)


def _buffer(frame: Any) -> memoryview:
    buf = getattr(frame, "buffer", frame)  # zmq.Frame exposes .buffer; bytes/memoryview as is
    return memoryview(buf).cast("B") if not isinstance(buf, memoryview) or buf.format != "B" else buf


class Decoder:
    """Decodes frames into one expected message type (or any registered one) under ``limits``."""

    def __init__(self, expected: type | None = None, limits: Limits | None = None) -> None:
        self.expected = expected
        self.limits = limits or Limits()

    def decode(self, frames: Sequence[Any]) -> Any:
        """The message in ``frames``; raises :class:`WireError` for anything unacceptable."""
        if not frames:
            raise WireError("frames", "empty message")
        buffers = [_buffer(f) for f in frames]
        size = sum(b.nbytes for b in buffers)
        if size > self.limits.max_bytes:
            raise WireError("size", f"{size} bytes exceeds the limit of {self.limits.max_bytes}")
        version, tag, body = self._header(buffers[0])
        if version != SCHEMA_VERSION:
            raise WireError("schema_version", f"got {version}, this process speaks {SCHEMA_VERSION}")
        cls = _MESSAGES.get(tag) if isinstance(tag, str) else None
        if cls is None:
            raise WireError("tag", f"unknown message type {tag!r}")
        if self.expected is not None and cls is not self.expected:
            raise WireError("tag", f"expected {self.expected.TAG!r}, got {tag!r}")
        ctx = _Ctx(buffers)
        msg = _from_plain(cls, body, "", ctx)
        if len(ctx.used) != len(buffers) - 1:
            raise WireError("frames", f"{len(buffers) - 1 - len(ctx.used)} array frames are not referenced")
        msg.validate(self.limits)
        return msg

    @staticmethod
    def _header(buf: memoryview) -> tuple[Any, Any, Any]:
        try:
            header = msgpack.unpackb(buf, ext_hook=_ext_hook, raw=False, strict_map_key=True)
        except WireError:
            raise
        except Exception as exc:
            raise WireError("header", f"not valid msgpack: {type(exc).__name__}: {exc}") from None
        if not (isinstance(header, list) and len(header) == 3):
            raise WireError("header", "is not [schema_version, tag, body]")
        return header[0], header[1], header[2]


class _Ctx:
    """Per-decode state: the frames and which of them an array has claimed."""

    __slots__ = ("buffers", "used")

    def __init__(self, buffers: list[memoryview]) -> None:
        self.buffers = buffers
        self.used: set[int] = set()


_Check = typing.Callable[[Any, str, _Ctx], Any]
_CHECKS: dict[Any, _Check] = {}


def _from_plain(cls: type, value: Any, path: str, ctx: _Ctx) -> Any:
    return _checker(cls)(value, path, ctx)


def _checker(hint: Any) -> _Check:
    """A validating converter for one type hint, built once per type and cached."""
    if hint not in _CHECKS:
        _CHECKS[hint] = _build_checker(hint)
    return _CHECKS[hint]


def _build_checker(hint: Any) -> _Check:
    if dataclasses.is_dataclass(hint):
        return _dataclass_checker(hint)
    origin = typing.get_origin(hint)
    if origin is list:
        return _list_checker(_checker(typing.get_args(hint)[0]), typing.get_args(hint)[0])
    if origin is dict:
        return _dict_checker(_checker(typing.get_args(hint)[1]))
    if origin in (typing.Union, types.UnionType):
        options = [_checker(h) for h in typing.get_args(hint)]
        return lambda v, path, ctx: _first_accepting(options, v, path, ctx)
    return _scalar_checker(hint)


def _dataclass_checker(cls: type) -> _Check:
    fields = [f for f in dataclasses.fields(cls) if f.init]
    hints = typing.get_type_hints(cls)
    required = sum(f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING for f in fields)
    checks = [
        (f.name, _array_checker(f.metadata["array"]) if "array" in f.metadata else _checker(hints[f.name]))
        for f in fields
    ]

    def check(value: Any, path: str, ctx: _Ctx) -> Any:
        if not isinstance(value, list):
            raise WireError(path or "body", f"expected a list of {len(fields)} fields, got {type(value).__name__}")
        if not required <= len(value) <= len(fields):
            raise WireError(path or "body", f"has {len(value)} fields, expected {required} to {len(fields)}")
        # Missing trailing fields take their defaults: that is how the format grows append-only.
        return cls(
            **{
                name: chk(v, f"{path}.{name}" if path else name, ctx)
                for (name, chk), v in zip(checks, value, strict=False)
            }
        )

    return check


def _list_checker(item: _Check, item_hint: Any) -> _Check:
    scalar = item_hint if item_hint in (str, int) else None

    def check(v: Any, path: str, ctx: _Ctx) -> list:
        if not isinstance(v, list):
            raise WireError(path, f"expected a list, got {type(v).__name__}")
        if scalar is not None and all(type(x) is scalar for x in v):
            return v  # fast path for the common list[str] / list[int]
        return [item(x, f"{path}[{i}]", ctx) for i, x in enumerate(v)]

    return check


def _dict_checker(item: _Check) -> _Check:
    def check(v: Any, path: str, ctx: _Ctx) -> dict:
        if not isinstance(v, dict) or not all(isinstance(k, str) for k in v):
            raise WireError(path, "expected a map with string keys")
        return {k: item(x, f"{path}.{k}", ctx) for k, x in v.items()}

    return check


def _first_accepting(options: list[_Check], v: Any, path: str, ctx: _Ctx) -> Any:
    for option in options:
        try:
            return option(v, path, ctx)
        except WireError:
            continue
    raise WireError(path, f"{type(v).__name__} is not an accepted type")


def _scalar_checker(hint: Any) -> _Check:
    if hint is float:

        def check_float(v: Any, path: str, ctx: _Ctx) -> float:
            if type(v) not in (int, float):
                raise WireError(path, f"expected float, got {type(v).__name__}")
            if not math.isfinite(v):
                raise WireError(path, f"is not finite ({v})")
            return float(v)

        return check_float
    accepted = {int: (int,), str: (str,), bool: (bool,), type(None): (type(None),)}.get(hint)
    if accepted is None:
        raise TypeError(f"unsupported wire field type {hint}")
    name = getattr(hint, "__name__", str(hint))

    def check(v: Any, path: str, ctx: _Ctx) -> Any:
        if type(v) not in accepted:  # exact types: bool is not an int on the wire
            raise WireError(path, f"expected {name}, got {type(v).__name__}")
        return v

    return check


def _array_checker(spec: ArraySpec) -> _Check:
    return lambda v, path, ctx: _array(v, spec, path, ctx)


def _array(v: Any, spec: ArraySpec, path: str, ctx: _Ctx) -> np.ndarray:
    if not isinstance(v, _ArrayRef):
        raise WireError(path, f"expected an array reference, got {type(v).__name__}")
    if v.dtype not in spec.dtypes:
        raise WireError(path, f"dtype {v.dtype!r} not allowed (allowed: {', '.join(spec.dtypes)})")
    if len(v.shape) != spec.ndim:
        raise WireError(path, f"has {len(v.shape)} dimensions, expected {spec.ndim}")
    if not 1 <= v.frame < len(ctx.buffers) or v.frame in ctx.used:
        raise WireError(path, f"refers to frame {v.frame}, which is missing or already used")
    ctx.used.add(v.frame)
    dtype = _DTYPES[v.dtype]
    buf = ctx.buffers[v.frame]
    if buf.nbytes != math.prod(v.shape) * dtype.itemsize:
        raise WireError(
            path,
            f"frame has {buf.nbytes} bytes, shape {v.shape} of {v.dtype} needs {math.prod(v.shape) * dtype.itemsize}",
        )
    arr = np.frombuffer(buf, dtype=dtype).reshape(v.shape)
    _check_values(arr, spec, path)
    return arr


def _check_values(arr: np.ndarray, spec: ArraySpec, path: str) -> None:
    """Finite (floats) and within the spec's range, from one min and one max pass over the array.

    NaN propagates through min/max and ±inf lands in one of them, so a finite min and max prove
    every value finite without a boolean temporary per array.
    """
    if arr.size == 0:
        return
    floating = arr.dtype.kind == "f" or arr.dtype == _DTYPES["bfloat16"]
    with np.errstate(invalid="ignore"):  # a NaN is reported below as a WireError, not as a warning
        low, high = float(arr.min()), float(arr.max())
    if floating and not (math.isfinite(low) and math.isfinite(high)):
        raise WireError(path, "contains non-finite values")
    if spec.min_value is not None and low < spec.min_value:
        raise WireError(path, f"value {low} below the minimum {spec.min_value}")
    if spec.max_value is not None and high > spec.max_value:
        raise WireError(path, f"value {high} above the maximum {spec.max_value}")


# --------------------------------------------------------------------------- single-blob form

_BLOB_MAGIC = b"ARL\x01"


def pack_frames(frames: Sequence[Any]) -> bytes:
    """Frames joined into one blob (for a Redis value): magic, count, lengths, 8-byte-aligned data."""
    buffers = [_buffer(f) for f in frames]
    head = _BLOB_MAGIC + struct.pack(f"<I{len(buffers)}Q", len(buffers), *(b.nbytes for b in buffers))
    parts: list[Any] = [head]
    offset = len(head)
    for b in buffers:
        pad = -offset % 8
        parts += [b"\0" * pad, b]
        offset += pad + b.nbytes
    return b"".join(parts)


def unpack_frames(blob: bytes | memoryview, max_frames: int = 4096) -> list[memoryview]:
    """The frames of a blob made by :func:`pack_frames` (views, no copies)."""
    view = memoryview(blob).cast("B") if isinstance(blob, memoryview) else memoryview(blob)
    if view[:4] != _BLOB_MAGIC or view.nbytes < 8:
        raise WireError("frames", "blob does not start with the asyncrl frame header")
    (count,) = struct.unpack_from("<I", view, 4)
    if count > max_frames or 8 + 8 * count > view.nbytes:
        raise WireError("frames", f"blob claims {count} frames but is {view.nbytes} bytes")
    lengths = struct.unpack_from(f"<{count}Q", view, 8)
    offset = 8 + 8 * count
    frames = []
    for n in lengths:
        offset += -offset % 8
        if offset + n > view.nbytes:
            raise WireError("frames", "blob is truncated")
        frames.append(view[offset : offset + n])
        offset += n
    return frames


def encode_blob(msg: Any) -> bytes:
    return pack_frames(encode(msg))


def decode_blob(decoder: Decoder, blob: bytes | memoryview) -> Any:
    """Decode a blob, checking its size against the decoder's limit before splitting it."""
    if len(blob) > decoder.limits.max_bytes + 8 * 4097 + 8:
        raise WireError("size", f"{len(blob)} bytes exceeds the limit of {decoder.limits.max_bytes}")
    return decoder.decode(unpack_frames(blob))
