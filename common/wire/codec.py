"""The codec of :mod:`asyncrl.common.wire.messages`: frames of a message, and the typed decoder that validates every
field.

A message is a frozen dataclass registered with :func:`message`. On the wire it is a list of frames::

    frame 0   msgpack [SCHEMA_VERSION, tag, [field values in declaration order]]
    frame 1.. raw array bytes, referenced from frame 0 by msgpack ext type 1:
              [dtype name, shape, frame index]

Arrays never go through msgpack (no copy into the header, bf16 stays bf16) and nothing is ever pickled. Decoding
validates the total size, the header's structure, every field's type, array dtypes, shapes against frame sizes,
finiteness and value ranges (:class:`ArraySpec`), then the message's own ``validate`` (cross-field lengths, token
ids against the vocabulary), and raises one :class:`WireError` that names the offending field. For Redis, where a
value is one blob, :func:`encode_blob` packs the frames into one.
"""


from __future__ import annotations

import dataclasses
import math
import re
import struct
import types
import typing
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

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


_INDEX = re.compile(r"\[\d+\]")
_MAX_FIELD_CHARS, _MAX_REASON_CHARS = 200, 500


class WireError(ValueError):
    """A message that cannot be accepted.

    ``field`` is the dotted path of the first bad field (``texts[3]``, ``timings.generate``); ``label`` is the same
    path without list indices and map keys (``texts[]``, ``timings{}``), so it takes only as many values as the
    schema has paths: it is what a metric label or a logged-once set may hold, while ``field`` holds whatever key
    a peer sent. Both and ``reason`` are clipped, so a hostile key or tag cannot make a huge log line or
    dead-letter reason.
    """

    def __init__(self, field: str, reason: str) -> None:
        field, reason = _clip(field, _MAX_FIELD_CHARS), _clip(reason, _MAX_REASON_CHARS)
        super().__init__(f"{field}: {reason}")
        self.field = field
        self.reason = reason
        self.label = _INDEX.sub("[]", field) if "[" in field else field


def _clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


@dataclass(frozen=True)
class Limits:
    """What a decoder accepts beyond the schema itself."""

    max_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    """Largest message (all frames together) in bytes."""
    vocab_size: int | None = None
    """When known, every token id must lie in [0, vocab_size)."""
    max_frames: int = 64
    """Most frames (header and arrays) in one message; no message has more than a handful."""


@dataclass(frozen=True)
class ArraySpec:
    dtypes: tuple[str, ...]
    ndim: int = 1
    min_value: float | None = None
    max_value: float | None = None


def array_field(
    *dtypes: str, min_value: float | None = None, max_value: float | None = None, empty_default: bool = False
) -> Any:
    """Declare a one-dimensional array field of one of ``dtypes`` with an optional value range; with
    ``empty_default``, a field a message may leave out (it then holds an empty array of the first dtype)."""
    metadata = {"array": ArraySpec(tuple(dtypes), 1, min_value, max_value)}
    if empty_default:
        return field(default_factory=lambda: np.zeros(0, _DTYPES[dtypes[0]]), metadata=metadata)
    return field(metadata=metadata)


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
        if len(frames) > self.limits.max_frames:
            raise WireError("frames", f"more than {self.limits.max_frames} frames")
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
        try:
            return {k: item(x, f"{path}.{k}", ctx) for k, x in v.items()}
        except WireError as exc:  # the key came from the peer: keep it out of the label (maps hold scalars)
            exc.label = f"{_INDEX.sub('[]', path)}{{}}"
            raise

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
