"""The code sandbox's harness: what the program's process runs, the program and then its tests, and how a run passes.

Stage 2 (:mod:`asyncrl.common.rewards.sandbox_supervisor`) runs this file's text as ``python -I -c <text> <feed fd>
<verdict fd>`` in the program's folder (inside the private root the file itself is not there, hence its text). It
reads the token and the tests from the feed pipe, closes it, then runs the program and the tests as one ``__main__``
module. Everything it uses once the program has run is bound beforehand (the program may rebind any global, builtin
or module attribute), and the token is written only on the path where the tests' code returned; every other way out
(an exception, ``SystemExit``, ``os._exit``, a signal, ``atexit``) leaves without it. Then ``os._exit(0)``: no
``atexit`` handler, finaliser or non-daemon thread of the program runs after the token.

Rule: this file imports the standard library only (``os`` and ``sys``): the program's interpreter cannot import
asyncrl (``tests/unit/test_sandbox.py`` parses the imports to hold this).

The verdict: the tests decide, never the program's exit status. Stage 2 draws a random token per run and hands it,
with the tests, to the harness on a pipe once the program's process has exec'd; the harness runs the program, then
the tests, and writes the token back on a second pipe only after the tests' last statement has run, then exits at
once (``os._exit(0)``). A run passes when the token came back and the process exited with status 0. So exiting early
(``sys.exit()``, ``raise SystemExit(0)``, ``os._exit(0)``, in a ``finally``, an ``atexit`` handler, a signal), killing
itself or its parent, forking a child to carry on, printing or writing anything to any descriptor, rebinding
``AssertionError`` or the builtins (an ``assert`` raises the real ``AssertionError``: CPython 3.9+ loads it directly)
or a trace or profile function left to skip the tests' lines (cleared before the tests) all score 0. The tests are
never in the program's folder, and ``python -O`` does not apply to them (compiled with ``optimize=0``).

Not prevented — the program and the tests share one interpreter, as they must (the tests call the program's
functions and read its objects), and nothing in an interpreter is private from code running in it: a program that
reads the harness's own state — the frames below its own (``sys._getframe``, a signal handler's frame, a
traceback), the garbage collector's objects, or raw memory through ``ctypes`` — can find the token and its
descriptor, and one that rewrites a running frame can skip a test. Nor a program that meets the tests' checks
dishonestly: an object whose ``__eq__`` always says yes, or a name the tests call rebound in the namespace they share.
Tests should compare plain values (``type(x) is int and x == 5``). The defence is against a program that ends or
fakes its run, not against one written against this harness.
"""

import os
import sys


def harness(feed: int, verdict: int) -> None:
    data = bytearray()
    while chunk := os.read(feed, 65536):
        data += chunk
    os.close(feed)
    token, tests = bytes(data[:33]), bytes(data[33:])
    with open("main.py", "rb") as f:
        program = compile(f.read(), os.path.abspath("main.py"), "exec", dont_inherit=True, optimize=0)
    checks = compile(tests, "tests.py", "exec", dont_inherit=True, optimize=0)
    run, write, leave, settrace, setprofile = exec, os.write, os._exit, sys.settrace, sys.setprofile
    monitoring = getattr(sys, "monitoring", None)  # 3.12+: callbacks the program may have left on every line
    get_tool, set_events = (monitoring.get_tool, monitoring.set_events) if monitoring else (None, None)
    tools = tuple(range(6)) if monitoring else ()
    streams = (sys.stdout, sys.stderr)
    module = type(sys)("__main__")
    module.__file__ = program.co_filename
    namespace = module.__dict__
    sys.modules["__main__"], sys.argv[:] = module, ["main.py"]
    run(program, namespace)
    settrace(None)
    setprofile(None)
    for tool in tools:
        if get_tool(tool) is not None:
            set_events(tool, 0)
    run(checks, namespace)
    for stream in streams:  # output beyond its limit fails the run here, before the token
        stream.flush()
    write(verdict, token)
    leave(0)


if __name__ == "__main__":
    harness(int(sys.argv[1]), int(sys.argv[2]))
