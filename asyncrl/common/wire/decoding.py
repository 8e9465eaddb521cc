"""Decoding: frames back into a typed message, every field validated on the way (:class:`Decoder`).

Validates the total size, the header's structure, every field's type, array dtypes, shapes against frame sizes,
finiteness and value ranges (:class:`~asyncrl.common.wire.codec.ArraySpec`), then the message's own ``validate``; a
failure raises one :class:`~asyncrl.common.wire.codec.WireError` that names the offending field. The format is
described in :mod:`asyncrl.common.wire.codec`.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np

from asyncrl.common.wire.codec import (
    ARRAY_EXT,
    INDEX_PART,
    MESSAGES,
    SCHEMA_VERSION,
    ArraySpec,
    Limits,
    WireError,
    frame_view,
    wire_dtype,
)


@dataclass(frozen=True)
class _ArrayRef:
    dtype: str
    shape: list[int]
    frame: int


def _ext_hook(code: int, data: bytes) -> _ArrayRef:
    if code != ARRAY_EXT:
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
        buffers = [frame_view(f) for f in frames]
        size = sum(b.nbytes for b in buffers)
        if size > self.limits.max_bytes:
            raise WireError("size", f"{size} bytes exceeds the limit of {self.limits.max_bytes}")
        version, tag, body = self._header(buffers[0])
        if version != SCHEMA_VERSION:
            raise WireError("schema_version", f"got {version}, this process speaks {SCHEMA_VERSION}")
        cls = MESSAGES.get(tag) if isinstance(tag, str) else None
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
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
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
            exc.label = f"{INDEX_PART.sub('[]', path)}{{}}"
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
    dtype = wire_dtype(v.dtype)  # one of spec.dtypes, all wire dtypes
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
    floating = arr.dtype.kind == "f" or arr.dtype.name == "bfloat16"
    with np.errstate(invalid="ignore"):  # a NaN is reported below as a WireError, not as a warning
        low, high = float(arr.min()), float(arr.max())
    if floating and not (math.isfinite(low) and math.isfinite(high)):
        raise WireError(path, "contains non-finite values")
    if spec.min_value is not None and low < spec.min_value:
        raise WireError(path, f"value {low} below the minimum {spec.min_value}")
    if spec.max_value is not None and high > spec.max_value:
        raise WireError(path, f"value {high} above the maximum {spec.max_value}")
