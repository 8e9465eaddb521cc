"""One registry type for everything chosen by name in a config: tasks, verifiers, reward functions, algorithms.

A registry maps names to objects of one kind (all with the same signature). ``register`` is a
decorator that refuses a name already claimed by a different object, so two plug-ins cannot
silently shadow each other; ``get`` also accepts an import path ``package.module:attribute``, so a
user can plug in their own without touching this code. Tests use ``snapshot()`` to register
temporary entries and restore the real registry afterwards, never clearing it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import threading
from collections.abc import Callable, Iterator
from typing import Any, Generic, TypeVar

T = TypeVar("T")
_IMPORTED: dict[str, Any] = {}
_IMPORT_LOCK = threading.RLock()  # a module imported here may resolve another path


class Registry(Generic[T]):
    """Named objects of one kind, e.g. ``Registry[Verifier]("verifier")``."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._entries: dict[str, T] = {}

    def register(self, name: str) -> Callable[[T], T]:
        """Decorator: register the decorated object as ``name``; a different object claiming it raises."""
        if not name or ":" in name:
            raise ValueError(f"{self.kind} name {name!r} must be non-empty and contain no ':' (import paths)")

        def wrap(obj: T) -> T:
            taken = self._entries.get(name)
            if taken is not None and taken is not obj and not (isinstance(obj, _Deferred) and taken == obj):
                raise ValueError(f"{self.kind} name {name!r} already registered by {_describe(taken)}")
            self._entries[name] = obj
            return obj

        return wrap

    def register_path(self, name: str, path: str) -> None:
        """Register ``name`` for the object at import path ``path``, imported on first :meth:`get`: for entries whose
        module needs an optional package, or would import this registry's module back."""
        self.register(name)(_Deferred(path))  # type: ignore[arg-type]

    def get(self, name: str) -> T:
        """The entry registered as ``name``, or the object at import path ``package.module:attribute``."""
        if ":" in name:
            return _import(name, self.kind)
        try:
            entry = self._entries[name]
        except KeyError:
            raise ValueError(f"unknown {self.kind} {name!r}; registered: {', '.join(self.names())}") from None
        return _import(entry.path, self.kind) if isinstance(entry, _Deferred) else entry

    def names(self) -> list[str]:
        return sorted(self._entries)

    def __contains__(self, name: str) -> bool:
        return name in self._entries

    @contextlib.contextmanager
    def snapshot(self) -> Iterator[Registry[T]]:
        """Within the block, registrations are temporary: the entries are restored on exit."""
        saved = dict(self._entries)
        try:
            yield self
        finally:
            self._entries = saved


@dataclasses.dataclass(frozen=True, repr=False)
class _Deferred:
    """An entry known by its import path until it is first used (the same path twice is the same entry)."""

    path: str

    def __repr__(self) -> str:
        return self.path


def _describe(obj: object) -> str:
    return getattr(obj, "__qualname__", repr(obj))


def _import(path: str, kind: str) -> Any:
    """Resolve ``package.module:attr[.attr]`` once per process (then cached; thread-safe)."""
    with _IMPORT_LOCK:  # resolving is rare (start-up, then cached): one lock for every path
        if path not in _IMPORTED:
            _IMPORTED[path] = _resolve(path, kind)
        return _IMPORTED[path]


def _resolve(path: str, kind: str) -> Any:
    module_name, _, attrs = path.partition(":")
    if not module_name or not attrs:
        raise ValueError(f"{kind} import path {path!r} is not of the form package.module:attribute")
    try:
        target: Any = importlib.import_module(module_name)
        for attr in attrs.split("."):
            target = getattr(target, attr)
    except Exception as exc:  # a missing module or name, or an error while the module runs
        raise ValueError(f"{kind} import path {path!r} cannot be resolved: {type(exc).__name__}: {exc}") from None
    if not callable(target):
        raise ValueError(f"{kind} import path {path!r} names a {type(target).__name__}, not something callable")
    return target
