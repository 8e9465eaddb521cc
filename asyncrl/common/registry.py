"""One registry type for everything chosen by name in a config: tasks, verifiers, reward functions, algorithms.

A registry maps names to objects of one kind (all with the same signature). ``register`` is a
decorator that refuses a name already claimed by a different object, so two plug-ins cannot
silently shadow each other; ``get`` also accepts an import path ``package.module:attribute``, so a
user can plug in their own without touching this code. What an import path names is checked against the
registry's :class:`Contract` (the call asyncrl will make) when it is resolved, so a config that names
``os:system`` as a reward function is refused when it is checked, not called on every group. Tests use
``snapshot()`` to register temporary entries and restore the real registry afterwards, never clearing it.

An installed package adds names through Python entry points: a registry made with ``group="environments"`` also
knows each entry point of the group ``asyncrl.environments`` that any installed distribution declares
(``[project.entry-points."asyncrl.environments"] guess = "my_pkg.envs:Guess"``), imported on first use like a
built-in's path. So a registered name means the same in every process of a run — the learner that checks the config,
the actors and reward workers that use it — without importing the user's module anywhere first. A plug-in cannot take
a name asyncrl already has: the built-in wins, and :meth:`Registry.get` of an unknown name lists the plug-ins' names
too.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import importlib.metadata
import inspect
import threading
from collections.abc import Callable, Iterator
from typing import Any, Generic, TypeVar, cast

T = TypeVar("T")
_IMPORTED: dict[str, Any] = {}
_FULFILLED: set[tuple[str, Contract]] = set()  # (path, contract) checked: a reward function is got for every group
_IMPORT_LOCK = threading.RLock()  # a module imported here may resolve another path


@dataclasses.dataclass(frozen=True)
class Contract:
    """How asyncrl calls a registry's entries, checked on whatever an import path names (:func:`_resolve`).

    ``shape`` shows the call to a person (``f(group, options) -> one score per response``); ``args`` positional
    arguments and ``kwargs`` keyword arguments by name are what the call passes, bound to the entry's signature with
    placeholders (``inspect.Signature.bind``); with ``methods``, an entry is a class whose instances have them.
    """

    shape: str
    args: int = 0
    kwargs: tuple[str, ...] = ()
    methods: tuple[str, ...] = ()

    def problem(self, target: Any) -> str | None:
        """Why ``target`` cannot be called as this contract says, or None when it can."""
        if self.methods and not isinstance(target, type):
            return f"it is a {type(target).__name__}, not a class"
        if not self.methods and isinstance(target, type):
            return f"it is a class ({target.__qualname__}), not a function"
        missing = [method for method in self.methods if not callable(getattr(target, method, None))]
        if missing:
            return f"class {target.__qualname__} has no {' or '.join(missing)} method"
        if inspect.isbuiltin(target) or inspect.ismethoddescriptor(target):
            return f"it is one of Python's builtins ({_describe(target)}), which was not written for this call"
        try:
            signature = inspect.signature(target)
        except (TypeError, ValueError):
            return "Python cannot read its signature"
        try:
            signature.bind(*[None] * self.args, **dict.fromkeys(self.kwargs))
        except TypeError as exc:
            bare = signature.replace(
                parameters=[p.replace(annotation=p.empty) for p in signature.parameters.values()],
                return_annotation=signature.empty,
            )
            return f"its signature {bare} cannot take that call ({exc})"
        return None


class Registry(Generic[T]):
    """Named objects of one kind, e.g. ``Registry[Verifier]("verifier", Contract("f(response, answer)", args=2))``."""

    def __init__(self, kind: str, contract: Contract | None = None, group: str | None = None) -> None:
        self.kind = kind
        self.contract = contract
        self.group = f"{ENTRY_POINT_PREFIX}{group}" if group else None
        """The entry-point group whose names this registry also knows (module docstring)."""
        self._entries: dict[str, T | _Deferred] = {}  # a _Deferred: registered by path (register_path)

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

    def get(self, name: str, setting: str = "") -> T:
        """The entry registered as ``name``, or the object at import path ``package.module:attribute`` (checked
        against the :class:`Contract`). ``ValueError`` otherwise, naming ``setting`` (``reward.functions[0].name``)
        where it is given."""
        try:
            if ":" in name:
                return _import(name, self.kind, self.contract)
            entry = self._entries[name] if name in self._entries else self._plugins().get(name)
            if entry is None:
                raise ValueError(f"unknown {self.kind} {name!r}; registered: {', '.join(self.names())}")
            if isinstance(entry, _Deferred):
                return _import(entry.path, self.kind, self.contract)
            return cast(T, entry)  # registered as a T (a type checker cannot rule out a T that is a _Deferred)
        except ValueError as exc:
            if setting:
                raise ValueError(f"{setting} = {name!r}: {exc}") from None
            if isinstance(exc, _Unfulfilled):
                raise ValueError(f"{self.kind} import path {exc.path!r}: {exc}") from None
            raise

    def loaded(self, name: str) -> T | None:
        """The entry registered as ``name`` by its object, which needs no import; None for a name registered by
        path, installed by a package or unknown. What a check may look at without loading anything."""
        entry = self._entries.get(name)
        return None if entry is None or isinstance(entry, _Deferred) else cast(T, entry)

    def names(self) -> list[str]:
        return sorted(self._entries.keys() | self._plugins().keys())

    def __contains__(self, name: str) -> bool:
        return name in self._entries or name in self._plugins()

    def _plugins(self) -> dict[str, _Deferred]:
        """The names installed packages give this registry's entry-point group (none where it has no group), each
        by its import path; a name asyncrl itself registered is left out (the built-in wins)."""
        if self.group is None:
            return {}
        declared = installed_entry_points().get(self.group, {})
        return {name: _Deferred(path) for name, path in declared.items() if name not in self._entries}

    @contextlib.contextmanager
    def snapshot(self) -> Iterator[Registry[T]]:
        """Within the block, registrations are temporary: the entries are restored on exit."""
        saved = dict(self._entries)
        try:
            yield self
        finally:
            self._entries = saved


ENTRY_POINT_PREFIX = "asyncrl."
"""A registry's entry-point group is this prefix and its ``group`` (``asyncrl.environments``)."""


@functools.cache
def installed_entry_points() -> dict[str, dict[str, str]]:
    """Every ``asyncrl.*`` entry point of the installed distributions, by group: {group: {name: import path}}. Read
    once per process, when a registry is first asked for a name it does not hold (reading every distribution's
    metadata costs a tenth of a second, which a lookup of a built-in name never pays)."""
    found: dict[str, dict[str, str]] = {}
    for distribution in importlib.metadata.distributions():
        for entry in distribution.entry_points:
            if entry.group.startswith(ENTRY_POINT_PREFIX) and entry.attr:  # an object in a module, not a module
                found.setdefault(entry.group, {}).setdefault(entry.name, f"{entry.module}:{entry.attr}")
    return found


class _Unfulfilled(ValueError):
    """What import path ``path`` names does not fulfil its registry's :class:`Contract` (the message says how)."""

    def __init__(self, path: str, message: str) -> None:
        super().__init__(message)
        self.path = path


@dataclasses.dataclass(frozen=True, repr=False)
class _Deferred:
    """An entry known by its import path until it is first used (the same path twice is the same entry)."""

    path: str

    def __repr__(self) -> str:
        return self.path


def _describe(obj: object) -> str:
    return getattr(obj, "__qualname__", repr(obj))


def _import(path: str, kind: str, contract: Contract | None = None) -> Any:
    """Resolve ``package.module:attr[.attr]`` once per process (then cached; thread-safe)."""
    with _IMPORT_LOCK:  # resolving is rare (start-up, then cached): one lock for every path
        if path not in _IMPORTED:
            _IMPORTED[path] = _resolve(path, kind)
        target = _IMPORTED[path]
        if contract is None or (path, contract) in _FULFILLED:
            return target
        problem = contract.problem(target)
        if problem is not None:
            article = "an" if kind[:1] in "aeiou" else "a"
            raise _Unfulfilled(path, f"not {article} {kind} (expects {contract.shape}): {problem}")
        _FULFILLED.add((path, contract))
        return target


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
