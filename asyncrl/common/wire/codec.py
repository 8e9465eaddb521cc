"""The codec of :mod:`asyncrl.common.wire.messages`: frames of a message, and their single-blob form (the typed decoder
that validates every field is :mod:`asyncrl.common.wire.decoding`).

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
import functools
import re
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, TypeVar

import msgpack
import numpy as np

if TYPE_CHECKING:
    from asyncrl.common.wire.decoding import Decoder

SCHEMA_VERSION = 2
"""2: the weight manifest no longer names a TCPStore (the rendezvous moved into the run's Redis)."""
ARRAY_EXT = 1
DEFAULT_MAX_MESSAGE_BYTES = 64 * 2**20

WIRE_DTYPES = ("int32", "int64", "float32", "bfloat16")
"""The dtypes an array on the wire may have, by numpy's name for them (``bfloat16``: ml_dtypes')."""


@functools.cache
def wire_dtype(name: str) -> np.dtype:
    """The numpy dtype of one of :data:`WIRE_DTYPES`. ml_dtypes is imported with the first bf16 array, not with this
    module: its import takes about a second of CPU, which every process of a run paid at start-up."""
    if name not in WIRE_DTYPES:
        raise KeyError(name)
    if name == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


INDEX_PART = re.compile(r"\[\d+\]")
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
        self.label = INDEX_PART.sub("[]", field) if "[" in field else field


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
        return field(default_factory=lambda: np.zeros(0, wire_dtype(dtypes[0])), metadata=metadata)
    return field(metadata=metadata)


# --------------------------------------------------------------------------- messages

MESSAGES: dict[str, type] = {}


class _Tagged(Protocol):
    TAG: ClassVar[str]


M = TypeVar("M", bound=_Tagged)


def message(tag: str) -> Callable[[type[M]], type[M]]:
    """Class decorator: register a frozen dataclass as a wire message under ``tag`` (it declares ``TAG:
    ClassVar[str]``, which this sets); the class is returned as it is, its type too."""

    def wrap(cls: type[M]) -> type[M]:
        if tag in MESSAGES:
            raise ValueError(f"wire tag {tag!r} already used by {MESSAGES[tag].__name__}")
        cls.TAG = tag
        MESSAGES[tag] = cls
        return cls

    return wrap


# --------------------------------------------------------------------------- encoding

Frames = list[Any]  # bytes, memoryview or zmq.Frame


def encode(msg: Any) -> Frames:
    """Frames for ``msg``: the msgpack header, then one raw frame per array (no copies of arrays)."""
    arrays: list[np.ndarray] = []
    body = _to_plain(msg, arrays)
    header = msgpack.packb([SCHEMA_VERSION, type(msg).TAG, body], use_bin_type=True)
    return [header, *(a.data.cast("B") for a in arrays)]


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
    name = value.dtype.name  # a bf16 array exists only once ml_dtypes is imported: its name is enough
    if name not in WIRE_DTYPES or value.dtype != wire_dtype(name):
        raise TypeError(f"arrays of dtype {value.dtype} are not part of the wire format")
    arrays.append(np.ascontiguousarray(value).view(np.uint8).reshape(-1))
    return msgpack.ExtType(ARRAY_EXT, msgpack.packb([name, list(value.shape), len(arrays)]))


# --------------------------------------------------------------------------- single-blob form


def frame_view(frame: Any) -> memoryview:
    """A frame's bytes, without a copy (a ``zmq.Frame``, ``bytes`` or ``memoryview``)."""
    buf = getattr(frame, "buffer", frame)  # zmq.Frame exposes .buffer; bytes/memoryview as is
    return memoryview(buf).cast("B") if not isinstance(buf, memoryview) or buf.format != "B" else buf


_BLOB_MAGIC = b"ARL\x01"


def pack_frames(frames: Sequence[Any]) -> bytes:
    """Frames joined into one blob (for a Redis value): magic, count, lengths, 8-byte-aligned data."""
    buffers = [frame_view(f) for f in frames]
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
