"""The code sandbox's harness: the two interpreters of a run, the program's and the tests', and the calls between them.

Stage 2 (:mod:`asyncrl.common.sandbox.supervisor`) runs this file's text twice, as ``python -I -c <text> server
<calls fd> <replies fd>`` (the **program server**) and ``python -I -c <text> runner <feed fd> <verdict fd> <calls fd>
<replies fd>`` (the **test runner**), both in the program's folder (inside the private root the file itself is not
there, hence its text), as the run's uid, with the run's limits.

Why two: a program and tests that share one interpreter share everything — a program can read the harness's token or
the tests from the frames below its own (``sys._getframe(1).f_locals``), from the garbage collector or through
``ctypes``, return an object whose ``__eq__`` always says yes, return the constants of its caller's code, or patch
``unittest.TestCase.assertEqual``; each is a few lines. So the verdict is computed where the program has no frame, no
object and no memory:

- The **test runner** makes itself non-dumpable (``PR_SET_DUMPABLE`` 0: not traceable, its ``/proc/<pid>/mem``,
  ``fd/`` and ``environ`` closed, even to its own uid) before it tells stage 2 it is ready; only then may the program
  start. It then reads the run's token and the tests from the feed pipe, receives the program's top-level names,
  runs the tests in a ``__main__`` of its own, and writes the token on the verdict pipe only once the tests' last
  statement has run, or they raised ``SystemExit`` with a success code (``0``, ``None``, ``False``: what
  ``unittest.main()`` raises when every test passed); then ``os._exit(0)``. An exception, another exit code or the
  program's process ending (the runner then writes ``g`` instead, so stage 2 reports the *program's* exit) fails it.
- The **program server** runs ``main.py`` as ``__main__`` (so ``if __name__ == "__main__":`` blocks run), then
  describes its top-level names to the runner and serves the runner's calls until the runner is gone. It never holds
  the token, the tests, the verdict pipe or a frame of the tests: a function's caller frame is the dispatcher,
  holding that call's arguments only. The program owns this process entirely, and nothing here needs to defend it.

What crosses, on two pipes (a 4-byte length, then JSON; never pickle or marshal, whose readers trust their input):
plain data by value — ``None``, ``bool``, ``int``, ``float``, ``str``, ``bytes``, ``bytearray``, ``list``, ``tuple``,
``dict``, ``set``, ``frozenset`` (subclasses, e.g. ``Counter`` or a named tuple, arrive as their plain base) — and
*handles* to the program's other objects. The runner decodes only those tags into exactly those types, so nothing the
program hands over has methods of the program's. In the runner's namespace:

- a plain top-level value is a copy, taken once when ``main.py`` has run (later changes by the program are not seen);
- a function, class or other object is a handle: calling it, reading or setting an attribute, indexing, ``len``,
  iteration, ``in``, ``str``, ``bool``, arithmetic and ``isinstance(x, ProgramClass)`` run in the program's process
  (arguments by value; the lists, dicts, sets and bytearrays passed are written back in place after the call, so
  in-place functions work); the result comes back by value or as a handle. A handle never compares with a value
  (``==``, ``<`` … raise ``TypeError``: the program's ``__eq__`` never decides a test); two handles are equal when
  they are the same object; ``repr`` is local. Nothing but plain values and handles can be passed to the program (a
  callback from the tests raises ``TypeError``);
- an exception class of the program is a local class with the same name and built-in bases; an exception the program
  raises in a call is raised in the tests as that class (or its built-in type) with the same arguments. ``SystemExit``
  or ``KeyboardInterrupt`` raised in a call, like any exit, ends the program's process and fails the run;
- a module is the runner's own import of the standard-library module of that name; names that shadow a builtin, and
  dunder names, are not copied (the tests keep the real ``print``, ``isinstance``, ``__builtins__`` …);
- what the program prints during a call is written to the tests' ``sys.stdout`` (so ``redirect_stdout`` captures
  it); when the tests have replaced ``sys.stdin``, its unread text is the program's stdin for the call.

Both processes share stdout and stderr (files bounded by ``RLIMIT_FSIZE``) and nothing else: the program can write
there, or kill, stop or re-limit the runner (the same uid), each of which only fails the run. Its tests decide, never
its exit status; exiting early, ``atexit``, ``excepthook``, a trace function, a signal, a forked child, fake tokens on
its descriptors all end or fake only the program's own process. The tests are never in the program's folder, and
``python -O`` does not apply to them (compiled with ``optimize=0``).

Rule: this file imports the standard library only: neither interpreter can import asyncrl (``tests/unit/
test_sandbox.py`` parses the imports to hold this).
"""

import _json
import builtins
import io
import operator
import os
import select
import sys

_SCALARS = frozenset({type(None), bool, int, float, str})
_MUTABLE = ("l", "d", "s", "y")  # the tags of containers written back after a call, and back-referenced by "@"
_UNSAFE_IMPORTS = frozenset({"antigravity", "this", "__hello__", "__phello__", "idlelib", "tkinter", "turtle"})


class ProtocolError(Exception):
    """A message that is not plain data as this file writes it."""


class _JSON:
    """The settings of ``json``'s C scanner (``json`` itself would import ``re``: milliseconds of every run)."""

    strict, object_hook, object_pairs_hook, parse_float, parse_int, memo = True, None, None, float, int, None
    parse_constant = {"NaN": float("nan"), "Infinity": float("inf"), "-Infinity": float("-inf")}.__getitem__


def _not_json(value):
    raise TypeError(f"{type(value).__name__} is not JSON")


# typeshed types the context as a make_scanner (its own TODO says: any object with these settings).
_scan = _json.make_scanner(_JSON())  # pyright: ignore[reportArgumentType]
_dump = _json.make_encoder(None, _not_json, _json.encode_basestring_ascii, None, ":", ",", False, False, True)


# --------------------------------------------------------------------------- the wire: plain values by value


class Encoder:
    """A value to JSON-ready data: scalars as themselves, containers as ``[tag, *items]``, anything else through
    ``export``. Mutable containers are numbered in the order met (pre-order); one met again is ``["@", k]``, one of
    the request's arguments (``args``: id -> index) is ``["a", j]``."""

    def __init__(self, export, args=None):
        self.export, self.args, self.memo, self.keep = export, args or {}, {}, []

    def __call__(self, v):
        t = type(v)
        if t in _SCALARS:
            return v
        if isinstance(v, (list, dict, set, bytearray)):
            key = id(v)
            if key in self.args:
                return ["a", self.args[key]]
            if key in self.memo:
                return ["@", self.memo[key]]
            self.memo[key] = len(self.keep)
            self.keep.append(v)
            return self.contents(v)
        if isinstance(v, bool):
            return bool(v)
        if isinstance(v, int):
            return int.__int__(v)
        if isinstance(v, float):
            return float.__float__(v)
        if isinstance(v, str):
            return str.__str__(v)
        if isinstance(v, bytes):
            return ["b", bytes.hex(v)]
        if isinstance(v, tuple):
            return ["t", *map(self, tuple.__iter__(v))]
        if isinstance(v, frozenset):
            return ["f", *map(self, frozenset.__iter__(v))]
        return self.export(v)

    def contents(self, v):
        """A mutable container's items under its tag (the container itself is numbered, or known, by the caller)."""
        if isinstance(v, list):
            items = list.copy(v)
            return ["l", *items] if _SCALARS.issuperset(map(type, items)) else ["l", *map(self, items)]
        if isinstance(v, dict):
            return ["d", *(x for pair in dict.items(v) for x in map(self, pair))]
        if isinstance(v, set):
            return ["s", *map(self, set.__iter__(v))]
        return ["y", bytearray.hex(v)]


class Decoder:
    """The inverse of :class:`Encoder`; accepts exactly its tags and builds exactly the plain types (JSON's own
    objects are refused). ``resolve`` turns the other tags (handles) into objects; ``args`` are the containers that
    ``["a", j]`` names; ``seen`` collects the mutable containers built, in the order the encoder numbered them."""

    def __init__(self, resolve, args=()):
        self.resolve, self.args, self.seen = resolve, args, []

    def __call__(self, v):
        if type(v) in _SCALARS:
            return v
        if type(v) is not list or not v or type(v[0]) is not str:
            raise ProtocolError(f"not a tagged value: {type(v).__name__}")
        tag = v[0]
        if tag in _MUTABLE:
            made = {"l": list, "d": dict, "s": set, "y": bytearray}[tag]()
            self.seen.append(made)
            return self.fill(made, v)
        if tag == "t":
            return tuple(map(self, v[1:]))
        if tag == "f":
            return frozenset(map(self, v[1:]))
        if tag == "b" and len(v) == 2 and type(v[1]) is str:
            return bytes.fromhex(v[1])
        if tag in ("@", "a") and len(v) == 2 and type(v[1]) is int and v[1] >= 0:
            return (self.seen if tag == "@" else self.args)[v[1]]
        return self.resolve(v)

    def fill(self, made, v):
        """Replace the contents of ``made`` (a list, dict, set or bytearray) with those of ``v``, in place."""
        tag, items = v[0], v[1:]
        if tag != {list: "l", dict: "d", set: "s", bytearray: "y"}.get(_base(made)):
            raise ProtocolError(f"{tag!r} cannot fill a {type(made).__name__}")
        if tag == "l":
            made[:] = items if _SCALARS.issuperset(map(type, items)) else list(map(self, items))
        elif tag == "d":
            if len(items) % 2:
                raise ProtocolError("a dict of odd length")
            decoded = list(map(self, items))
            made.clear()
            made.update(zip(decoded[::2], decoded[1::2], strict=True))
        elif tag == "s":
            decoded = list(map(self, items))
            made.clear()
            made.update(decoded)
        elif len(items) == 1 and type(items[0]) is str:
            made[:] = bytes.fromhex(items[0])
        else:
            raise ProtocolError("a malformed bytearray")
        return made


def _base(v):
    for base in (list, dict, set, bytearray):
        if isinstance(v, base):
            return base
    return None


class Gone(Exception):
    """The program's process has ended (stage 2 closed ``watch``), whoever else still holds its pipes."""


def _wait(fd, watch, writing=False):
    """Block until ``fd`` is ready (``fd`` non-blocking) or, first, ``watch`` says the other end is gone."""
    if watch is None:
        return
    readable, writable, _ = select.select([] if writing else [fd, watch], [fd] if writing else [], [watch])
    if fd not in readable and fd not in writable:
        raise Gone


def send(fd, value, watch=None):
    data = "".join(_dump(value, 0)).encode()
    view = memoryview(len(data).to_bytes(4, "big") + data)
    while view:
        _wait(fd, watch, writing=True)
        view = view[os.write(fd, view) :]


def receive(fd, watch=None):
    """The next message, or None at end of file."""
    header = _read_exactly(fd, 4, watch)
    data = header and _read_exactly(fd, int.from_bytes(header, "big"), watch)
    if data is None:
        return None
    value, end = _scan(data.decode(), 0)  # StopIteration or ValueError on what is not JSON
    if end != len(data):
        raise ProtocolError("trailing bytes after a message")
    return value


def _read_exactly(fd, n, watch):
    data = bytearray()
    while len(data) < n:
        _wait(fd, watch)
        chunk = os.read(fd, min(n - len(data), 1 << 20))
        if not chunk:
            return None
        data += chunk
    return bytes(data)


# --------------------------------------------------------------------------- the program server

_OPS = {
    "call": lambda f, args, kwargs: f(*args, **kwargs),
    "getattr": getattr, "setattr": setattr, "delattr": delattr,
    "getitem": operator.getitem, "setitem": operator.setitem, "delitem": operator.delitem,
    "len": len, "iter": iter, "next": next, "bool": bool, "str": str, "contains": operator.contains,
    "isinstance": isinstance, "int": int, "float": float, "index": operator.index,
    "neg": operator.neg, "pos": operator.pos, "abs": abs, "invert": operator.invert,
    **{name: getattr(operator, name) for name in (
        "add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "matmul", "and_", "or_", "xor", "lshift", "rshift")},
}  # fmt: skip


class Server:
    """The program's side: a table of the objects handed out as handles, and one call at a time."""

    def __init__(self, replies):
        self.replies, self.objects, self.ids = replies, [], {}

    def handle(self, obj):
        key = id(obj)
        if key not in self.ids:
            self.ids[key] = len(self.objects)
            self.objects.append(obj)  # held for the run: an id is never reused
        return self.ids[key]

    def export(self, obj):
        if isinstance(obj, type) and issubclass(obj, BaseException):
            return self.exception_class(obj)
        if isinstance(obj, type):
            label = f"class {obj.__qualname__}"
        elif callable(obj) and isinstance(getattr(obj, "__qualname__", None), str):
            label = f"function {obj.__qualname__}"
        else:
            label = f"{type(obj).__qualname__} object"
        return ["r", self.handle(obj), label]

    def exception_class(self, cls):
        """A built-in exception by name; the program's as ``["x", handle, name, [its bases]]``."""
        if cls.__module__ == "builtins" and getattr(builtins, cls.__name__, None) is cls:
            return cls.__name__
        bases = [self.exception_class(b) for b in cls.__bases__ if issubclass(b, BaseException)]
        return ["x", self.handle(cls), str(cls.__name__), bases]

    def resolve(self, v):
        if v[0] == "r" and len(v) == 2 and type(v[1]) is int:
            return self.objects[v[1]]
        raise ProtocolError(f"unknown tag {v[0]!r}")

    def names(self, namespace):
        """Every top-level name but the dunders: a plain value by value, a module by name, anything else a handle."""
        entries = []
        for name, value in list(namespace.items()):
            if name.startswith("__") and name.endswith("__"):
                continue
            if isinstance(value, type(sys)):
                entries.append([name, ["m", str(value.__name__)]])
                continue
            try:
                entries.append([name, Encoder(self.export)(value)])
            except Exception:  # e.g. too deep to encode: the tests get a handle
                entries.append([name, self.export(value)])
        return entries

    def serve(self, request):
        """One call: decode, run with the call's stdout captured (and stdin given), encode the outcome."""
        op, operands, stdin = request
        decoder = Decoder(self.resolve)
        out, feed = io.StringIO(), None if stdin is None else io.StringIO(stdin)
        saved = sys.stdout, sys.stdin
        try:
            values = [decoder(x) for x in operands]
            sys.stdout, sys.stdin = out, feed if feed is not None else sys.stdin
            kind, result = "ok", _OPS[op](*values)
        except Exception as error:
            kind, result = "raise", error
        finally:
            sys.stdout, sys.stdin = saved
        rest = None if feed is None else feed.read()
        return self.outcome(kind, result, decoder.seen, out.getvalue(), rest)

    def outcome(self, kind, result, args, out, rest):
        encoder = Encoder(self.export, {id(c): j for j, c in enumerate(args)})
        try:
            value = encoder(result) if kind == "ok" else self.exception(result, encoder)
            return [kind, value, [encoder.contents(c) for c in args], out, rest]
        except Exception as error:  # the result cannot be encoded (too deep): the call raises that
            return ["raise", [type(error).__name__, None, str(error)], [], out, rest]

    def exception(self, error, encoder):
        try:
            args = [encoder(a) for a in error.args]
        except Exception:
            args = None
        return [self.exception_class(type(error)), args, str(error)]


def server(calls, replies, go):
    """Run ``main.py`` as ``__main__`` once stage 2 says so, describe its names, then answer calls until the runner
    is gone."""
    for fd in (calls, replies):
        os.set_inheritable(fd, False)
    sys.set_int_max_str_digits(0)
    run, leave, streams = exec, os._exit, (sys.stdout, sys.stderr)
    with open("main.py", "rb") as f:
        program = compile(f.read(), os.path.abspath("main.py"), "exec", dont_inherit=True, optimize=0)
    module = type(sys)("__main__")
    module.__file__ = program.co_filename
    sys.modules["__main__"], sys.argv[:] = module, ["main.py"]
    state = Server(replies)
    if os.read(go, 1) != b"g":  # the runner did not become unreachable: no program runs
        leave(1)
    os.close(go)
    run(program, module.__dict__)  # an exception or an exit here ends this process: the runner sees it
    for stream in streams:  # output beyond its limit fails the run here
        stream.flush()
    send(replies, ["ready", state.names(module.__dict__)])
    while (request := receive(calls)) is not None:
        send(replies, state.serve(request))
        for stream in streams:
            stream.flush()
    leave(0)


# --------------------------------------------------------------------------- the test runner


class Remote:
    """A handle to one of the program's objects (the module docstring says what it forwards and what it refuses)."""

    __slots__ = ("_Remote__label", "_Remote__ref")
    __label: str  # read here, not through __getattr__ (which forwards to the program)
    __ref: int

    def __init__(self, ref, label):
        object.__setattr__(self, "_Remote__ref", ref)
        object.__setattr__(self, "_Remote__label", label)

    def __repr__(self):
        return f"<the program's {self.__label[:80]} #{self.__ref}>"

    def __eq__(self, other):
        if type(other) is Remote:
            return self.__ref == other.__ref
        raise TypeError(
            f"{self!r} compared with {type(other).__name__}: the program's objects do not compare with "
            "values; compare plain values (e.g. an attribute, or a list the program returns)"
        )

    def __ne__(self, other):
        return not self == other

    def __lt__(self, other):
        raise TypeError(f"{self!r} is not ordered: the program's objects do not compare; compare plain values")

    __le__ = __gt__ = __ge__ = __lt__

    def __hash__(self):
        return hash(("remote", self.__ref))

    def __getattr__(self, name):
        return _call("getattr", self, name)

    def __setattr__(self, name, value):
        _call("setattr", self, name, value)

    def __delattr__(self, name):
        _call("delattr", self, name)

    def __call__(self, *args, **kwargs):
        return _call("call", self, list(args), kwargs)

    def __instancecheck__(self, obj):
        return _call("isinstance", obj, self)

    def __iter__(self):
        return _call("iter", self)

    def __contains__(self, item):
        return _call("contains", self, item)

    def __setitem__(self, key, value):
        _call("setitem", self, key, value)


def _forward(op, arity):
    if arity == 1:
        return lambda self: _call(op, self)
    if arity == 2:
        return lambda self, other: _call(op, self, other)
    return lambda self, other: _call(op, other, self)  # reflected: other <op> self


for _name, _op, _arity in [
    ("__len__", "len", 1), ("__next__", "next", 1), ("__bool__", "bool", 1), ("__str__", "str", 1),
    ("__int__", "int", 1), ("__float__", "float", 1), ("__index__", "index", 1), ("__neg__", "neg", 1),
    ("__pos__", "pos", 1), ("__abs__", "abs", 1), ("__invert__", "invert", 1), ("__getitem__", "getitem", 2),
    ("__delitem__", "delitem", 2),
    *((f"__{n.rstrip('_')}__", n, 2) for n in ("add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "matmul",
                                                "and_", "or_", "xor", "lshift", "rshift")),
    *((f"__r{n.rstrip('_')}__", n, 3) for n in ("add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "matmul",
                                                 "and_", "or_", "xor", "lshift", "rshift")),
]:  # fmt: skip
    setattr(Remote, _name, _forward(_op, _arity))


class ProgramError(Exception):
    """An exception of the program's that cannot be rebuilt here as its own class."""


class _Runner:
    """The runner's end of the pipes, and the local classes of the program's exceptions."""

    def __init__(self, calls, replies, verdict, watch):
        self.calls, self.replies, self.verdict, self.watch, self.classes = calls, replies, verdict, watch, {}
        for fd in (calls, replies):  # waits go through select: a stray of the program may hold the other end
            os.set_blocking(fd, False)

    def gone(self):
        """The program's process ended (or closed its pipe): stage 2 then reports its exit, not this one's."""
        os.write(self.verdict, b"g")
        os._exit(1)

    def broken(self, error):
        sys.stderr.write(f"the program broke the call protocol: {error}\n")
        sys.stderr.flush()
        os._exit(1)

    def resolve(self, v):
        tag = v[0]
        if tag == "r" and len(v) == 3 and type(v[1]) is int and type(v[2]) is str:
            return Remote(v[1], v[2])
        if tag == "x":
            return self.exception_class(v)
        raise ProtocolError(f"unknown tag {tag!r}")

    def exception_class(self, v):
        """A local exception class for the program's ``["x", handle, name, bases]`` (built-in bases by name),
        only ever a subclass of ``Exception``: nothing the program raises can exit the tests."""
        if type(v) is str:
            cls = getattr(builtins, v, None)
            return cls if isinstance(cls, type) and issubclass(cls, Exception) else Exception
        if not (type(v) is list and len(v) == 4 and type(v[1]) is int and type(v[2]) is str and type(v[3]) is list):
            raise ProtocolError("a malformed exception class")
        if v[1] not in self.classes:
            bases = tuple(dict.fromkeys(self.exception_class(b) for b in v[3])) or (Exception,)
            try:
                self.classes[v[1]] = type(v[2], bases, {"__module__": "__main__"})
            except TypeError:  # bases whose layouts conflict
                self.classes[v[1]] = type(v[2], bases[:1], {"__module__": "__main__"})
        return self.classes[v[1]]

    def exception(self, decoder, value):
        """The exception to raise for the program's ``[class, args or None, message]``."""
        if not (
            type(value) is list and len(value) == 3 and type(value[1]) in (list, type(None)) and type(value[2]) is str
        ):
            raise ProtocolError("a malformed exception")
        cls = self.exception_class(value[0])
        args = None if value[1] is None else decoder(["t", *value[1]])
        try:
            return cls(*args) if args is not None else cls(value[2])
        except Exception:
            return ProgramError(f"{cls.__name__}: {value[2]}")

    def call(self, op, operands):
        stdin = None
        if op == "call" and sys.stdin is not sys.__stdin__ and sys.stdin is not None:
            stdin = sys.stdin.read()
        encoder = Encoder(_refuse)
        request = [op, [encoder(x) for x in operands], stdin]  # a TypeError here is the tests' own
        try:
            send(self.calls, request, self.watch)
            reply = receive(self.replies, self.watch)
            if reply is None:
                self.gone()
            kind, result = self.outcome(reply, encoder.keep)
        except (Gone, BrokenPipeError):
            self.gone()
        except _BROKEN as error:
            self.broken(error)
        if kind == "raise":
            assert isinstance(result, BaseException)  # outcome() decoded the program's exception
            raise result  # the program's exception, as the tests' class
        return result

    def outcome(self, reply, args):
        if not (type(reply) is list and len(reply) == 5 and reply[0] in ("ok", "raise")):
            raise ProtocolError("a malformed reply")
        kind, value, written, out, rest = reply
        decoder = Decoder(self.resolve, args)
        result = decoder(value) if kind == "ok" else self.exception(decoder, value)
        if type(written) is not list or len(written) not in (0, len(args)):
            raise ProtocolError("a malformed write-back")
        for made, contents in zip(args, written, strict=True) if written else ():
            decoder.fill(made, contents)
        if type(out) is not str or not (rest is None or type(rest) is str):
            raise ProtocolError("malformed output")
        if out:
            sys.stdout.write(out)
        if rest is not None:
            sys.stdin = io.StringIO(rest)
        return kind, result

    def names(self, namespace):
        """Wait for the program to have run, then bind its names (see the module docstring for which, and how)."""
        try:
            message = receive(self.replies, self.watch)
            if message is None:
                self.gone()
            if not (type(message) is list and len(message) == 2 and message[0] == "ready" and type(message[1]) is list):
                raise ProtocolError("a malformed description of the program's names")
            reserved = set(dir(builtins))
            for name, value in message[1]:
                if type(name) is not str or not name.isidentifier() or name in reserved or name.startswith("__"):
                    continue
                module = _module(value)
                if module is not None:
                    namespace[name] = module
                elif not (type(value) is list and value and value[0] == "m"):
                    namespace[name] = Decoder(self.resolve)(value)
        except Gone:
            self.gone()
        except _BROKEN as error:
            self.broken(error)


# what a forged message raises
_BROKEN = (ProtocolError, ValueError, TypeError, IndexError, KeyError, RecursionError, StopIteration)
_RUNNER: "_Runner | None" = None


def _call(op, *operands):
    assert _RUNNER is not None  # runner() makes it before the first handle exists
    return _RUNNER.call(op, operands)


def _refuse(v):
    if type(v) is Remote:
        return ["r", object.__getattribute__(v, "_Remote__ref")]
    raise TypeError(
        f"only plain values (None, bool, int, float, str, bytes, list, tuple, dict, set) and the "
        f"program's own objects can be passed to the program, not {type(v).__name__}"
    )


def _module(value):
    """The runner's own import of a standard-library module the program bound to a name; None for any other."""
    if not (type(value) is list and len(value) == 2 and value[0] == "m" and type(value[1]) is str):
        return None
    name = value[1]
    top = name.partition(".")[0]
    if top not in sys.stdlib_module_names or top in _UNSAFE_IMPORTS:
        return None
    if not all(part.isidentifier() for part in name.split(".")):
        return None
    try:
        import importlib

        return importlib.import_module(name)
    except Exception:
        return None


def _not_dumpable():
    """Not traceable, ``/proc/<pid>/mem`` and ``fd/`` closed, even to the program's uid (reset by every exec).
    Through ``_ctypes`` as ``ctypes`` itself calls a C function (``import ctypes`` costs milliseconds of every run)."""
    import _ctypes

    class Int(_ctypes._SimpleCData):
        _type_ = "i"

    class Function(_ctypes.CFuncPtr):
        _flags_, _restype_ = _ctypes.FUNCFLAG_CDECL | _ctypes.FUNCFLAG_USE_ERRNO, Int

    # typeshed's stubs take a path only (None is the program itself, as for ctypes.CDLL(None)) and a CDLL only (any
    # object with a _handle serves).
    class Libc:
        _handle = _ctypes.dlopen(None, os.RTLD_NOW)  # pyright: ignore[reportArgumentType]

    prctl = Function(("prctl", Libc()))  # pyright: ignore[reportArgumentType, reportCallIssue]
    if prctl(4, 0, 0, 0, 0) != 0 or prctl(3, 0, 0, 0, 0) != 0:  # PR_SET_DUMPABLE 0, then PR_GET_DUMPABLE
        raise OSError(_ctypes.get_errno(), "prctl(PR_SET_DUMPABLE, 0) failed")


def runner(feed, verdict, calls, replies, watch, *site):
    """Run the tests against the program's names; the token goes back only when they ran to their end.

    Started with ``-S`` (no ``site``: tens of milliseconds of every run, most of it ``.pth`` files): the
    interpreter's site-packages folders ``site`` are put on ``sys.path`` as they are, and ``exit`` is ``sys.exit``."""
    global _RUNNER
    for fd in (verdict, calls, replies, watch):
        os.set_inheritable(fd, False)
    _not_dumpable()
    os.write(verdict, b"r")  # stage 2 lets the program start only now
    data = bytearray()
    while chunk := os.read(feed, 65536):
        data += chunk
    os.close(feed)
    token, tests = bytes(data[:33]), bytes(data[33:])
    sys.path.extend(site)
    builtins.exit = builtins.quit = sys.exit
    sys.set_int_max_str_digits(0)
    checks = compile(tests, "tests.py", "exec", dont_inherit=True, optimize=0)
    module = type(sys)("__main__")
    module.__file__ = os.path.abspath("main.py")
    sys.modules["__main__"], sys.argv[:] = module, ["main.py"]
    _RUNNER = _Runner(calls, replies, verdict, watch)
    _RUNNER.names(module.__dict__)
    try:
        exec(checks, module.__dict__)
    except SystemExit as stop:  # unittest.main(): the tests' own exit; a success code passes
        if not (stop.code is None or (type(stop.code) in (int, bool) and stop.code == 0)):
            raise
    for stream in (sys.stdout, sys.stderr):  # output beyond its limit fails the run here, before the token
        stream.flush()
    os.write(verdict, token)
    os._exit(0)


if __name__ == "__main__":
    if sys.argv[1] == "server":
        server(*map(int, sys.argv[2:5]))
    else:
        runner(*map(int, sys.argv[2:7]), *sys.argv[7:])
