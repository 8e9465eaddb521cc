"""The ``code_tests`` reward: the tests decide the score, never the program's exit status.

Every attack runs against tests that cannot pass (their last line is ``assert False``) and must score 0 through the
real sandbox; where the attack is a plain Python trick, a control runs the old scheme (program and tests as one script,
judged by its exit status) unfenced, to show the attack is real. Honest programs still score 1.0 and 0.0.
"""

from __future__ import annotations

import os
import subprocess
import sys
from textwrap import dedent

import numpy as np
import pytest

from asyncrl.common.config import RewardFunction
from asyncrl.common.rewards.functions import code_tests_reward, score
from asyncrl.common.rewards.verifiers import get_verifier, verify_code_tests
from asyncrl.common.sandbox import run_python_tests
from asyncrl.common.sandbox.fences import candidates
from asyncrl.common.sandbox.run import Limits, run_behind
from asyncrl.common.wire.messages import RolloutGroup
from tests.helpers.rollouts import make_group

ADD = "def add(a, b):\n    return a + b\n"
TESTS = "assert add(2, 3) == 5, 'add(2, 3)'\n"
FAILING = TESTS + "assert False, 'these tests never pass'\n"

# name -> the program; each one tries to score on FAILING without passing it.
ATTACKS = {
    "os._exit(0)": "import os\nos._exit(0)\n",
    "raise SystemExit(0)": "raise SystemExit(0)\n",
    "sys.exit()": "import sys\nsys.exit()\n",
    "sys.exit(0) in a finally": "import sys\ntry:\n    pass\nfinally:\n    sys.exit(0)\n",
    "sys.exit(0) in a finally of the tested function": dedent("""
        import sys
        def add(a, b):
            try:
                return a + b
            finally:
                sys.exit(0)
    """),
    "an atexit handler that exits 0": "import atexit, os\natexit.register(os._exit, 0)\n" + ADD,
    "sys.excepthook that exits 0": "import os, sys\nsys.excepthook = lambda *args: os._exit(0)\n" + ADD,
    "AssertionError rebound in builtins": dedent("""
        import builtins
        class Quiet(Exception):
            pass
        builtins.AssertionError = Quiet
        AssertionError = Quiet
    """)
    + ADD,
    "__builtins__ replaced": "__builtins__ = {'AssertionError': StopIteration, 'print': print}\n" + ADD,
    "a fake success marker on stdout and stderr": dedent("""
        import sys
        print("passed")
        print("OK: all tests passed", file=sys.stderr)
        sys.stdout.write("1.0\\n")
    """)
    + ADD,
    "writes to every inherited descriptor": dedent("""
        import os
        for fd in range(64):
            for forged in (b"passed\\n", b"0" * 32 + b"\\n", b"ready\\nexit 0 0.0 1\\n", os.urandom(16).hex().encode()):
                try:
                    os.write(fd, forged)
                except OSError:
                    pass
    """)
    + ADD,
    "kills its parent": "import os\ntry:\n    os.kill(os.getppid(), 9)\nexcept OSError:\n    pass\n" + ADD,
    "kills itself with SIGKILL": "import os\nos.kill(os.getpid(), 9)\n",
    "kills itself with SIGTERM": "import os, signal\nos.kill(os.getpid(), signal.SIGTERM)\n",
    "a SIGALRM handler that exits 0 during the tests": dedent("""
        import os, signal
        signal.signal(signal.SIGALRM, lambda *args: os._exit(0))
        signal.setitimer(signal.ITIMER_REAL, 0.01)
        def add(a, b):
            import time
            time.sleep(1)
            return a + b
    """),
    "a forked child that outlives it and reports success": dedent("""
        import os, sys, time
        if os.fork() == 0:
            time.sleep(0.3)
            print("passed")
            for fd in range(64):
                try:
                    os.write(fd, b"passed\\n")
                except OSError:
                    pass
            os._exit(0)
    """)
    + ADD,
    "the parent exits 0 and a forked child carries on": "import os\nif os.fork():\n    os._exit(0)\n" + ADD,
    "a thread that exits 0 while the tests run": dedent("""
        import os, threading, time
        def leave():
            time.sleep(0.05)
            os._exit(0)
        threading.Thread(target=leave).start()
        def add(a, b):
            time.sleep(1)
            return a + b
    """),
    "a trace function that skips every assert of the tests": dedent("""
        import dis, sys
        def skip(frame, event, arg):
            if event == "line":
                code = dis.get_instructions(frame.f_code)
                asserts = {i.positions.lineno for i in code if i.opname == "LOAD_ASSERTION_ERROR"}
                if frame.f_lineno in asserts:
                    try:
                        frame.f_lineno += 1
                    except ValueError:
                        pass
            return skip
        sys.settrace(skip)
    """)
    + "def add(a, b):\n    return 0\n",
}
# The plain-Python tricks whose control (the old scheme, unfenced) exits 0: each one beat an exit-status verdict.
BEAT_THE_OLD_SCHEME = [
    "os._exit(0)",
    "raise SystemExit(0)",
    "sys.exit()",
    "sys.exit(0) in a finally",
    "sys.exit(0) in a finally of the tested function",
    "an atexit handler that exits 0",
    "sys.excepthook that exits 0",
    "a SIGALRM handler that exits 0 during the tests",
    "the parent exits 0 and a forked child carries on",
    "a thread that exits 0 while the tests run",
]


def program(name: str) -> str:
    return ATTACKS[name]


def group(texts: list[str], tests: str) -> RolloutGroup:
    """One group of these responses to ``tests`` (token fields are zeros of the right sizes: the reward reads text)."""
    lengths = np.asarray([len(t) for t in texts], np.int32)
    n = int(lengths.sum())
    return RolloutGroup(
        group_id="harness",
        task="code_tests",
        prompt="write add",
        prompt_ids=np.zeros(9, np.int32),
        answer=tests,
        token_ids=np.zeros(n, np.int32),
        logprobs=np.zeros(n, np.float32),
        versions=np.zeros(n, np.int32),
        lengths=lengths,
        texts=texts,
        finish_reasons=["stop"] * len(texts),
    )


def old_scheme(code: str, tests: str) -> int:
    """The exit status of program and tests as one script, unfenced: what the verdict used to read."""
    return subprocess.run(
        [sys.executable, "-I", "-c", f"{code}\n\n{tests}\n"], capture_output=True, timeout=30
    ).returncode


@pytest.mark.parametrize("name", list(ATTACKS))
def test_every_attack_is_a_valid_program(name: str) -> None:
    """An attack that does not compile would score 0 for the wrong reason."""
    compile(program(name), "main.py", "exec")


@pytest.mark.parametrize("name", list(ATTACKS))
def test_an_attack_scores_zero_against_failing_tests(name: str) -> None:
    assert verify_code_tests(f"```python\n{program(name)}```\n", FAILING) == 0.0
    result = run_python_tests(program(name), FAILING)
    assert not result.passed and result.reason.startswith(("failed:", "timeout:")), result


@pytest.mark.parametrize("name", BEAT_THE_OLD_SCHEME)
def test_the_attack_is_real_against_an_exit_status_verdict(name: str) -> None:
    assert old_scheme(program(name), FAILING) == 0


def test_every_fence_that_starts_here_judges_by_the_tests() -> None:
    """The weaker fences run the harness in the host folder as another uid (or none): the same verdicts there."""
    limits = Limits(cpu_s=2, memory_mb=256, wall_s=5)
    started = 0
    for fence in candidates():
        try:
            honest = run_behind(fence, ADD, TESTS, limits)
        except RuntimeError:  # e.g. the per-run uid cannot reach an interpreter under /root
            continue
        started += 1
        assert honest.passed, (fence, honest)
        for name in (
            "os._exit(0)",
            "the parent exits 0 and a forked child carries on",
            "writes to every inherited descriptor",
        ):
            result = run_behind(fence, program(name), FAILING, limits)
            assert not result.passed, (fence.fence, name, result)
        peek = "import os\nassert 'tests.py' not in os.listdir('.'), os.listdir('.')\n"
        assert run_behind(fence, peek, "", limits).passed, fence
    assert started


def test_an_early_exit_is_named_in_the_reason() -> None:
    result = run_python_tests("import sys\nsys.exit(0)\n", FAILING)
    assert not result.passed and result.reason.startswith("failed: exit status 0 before the tests"), result


def test_the_assert_statement_ignores_a_rebound_assertion_error() -> None:
    """CPython 3.9+ compiles ``assert`` to LOAD_ASSERTION_ERROR: rebinding the name changes nothing, in or out."""
    code = program("AssertionError rebound in builtins")
    result = run_python_tests(code, "assert add(2, 3) == 6, 'caught'\n")
    assert not result.passed and "AssertionError: caught" in result.reason, result


def test_a_trace_function_left_by_the_program_would_skip_the_tests_unfenced() -> None:
    """The control of the trace attack: program then tests in one interpreter, without the harness's clearing, skip
    the failing assertion (one followed by a statement: an ``assert False`` makes what follows dead code, with no line
    to jump to) — so the harness must clear the hook, and does."""
    code, tests = program("a trace function that skips every assert of the tests"), "assert add(2, 3) == 5\nx = 1\n"
    runner = f"code = compile({code!r}, 'main.py', 'exec')\ntests = compile({tests!r}, 'tests.py', 'exec')\n"
    runner += "namespace = {}\nexec(code, namespace)\nexec(tests, namespace)\n"
    assert subprocess.run([sys.executable, "-I", "-c", runner], capture_output=True, timeout=30).returncode == 0
    assert not run_python_tests(code, tests).passed


def test_the_program_cannot_read_its_tests() -> None:
    """The tests are not in the program's folder: it cannot read them to special-case them."""
    result = run_python_tests("import os\nassert 'tests.py' not in os.listdir('.'), 'the tests are here'\n", "")
    assert result.passed, result
    result = run_python_tests(
        "secret = open('main.py').read()\nassert 'NEE' + 'DLE' not in secret, 'read'\n", "x = 'NEEDLE'"
    )
    assert result.passed, result


def test_honest_programs_score_on_their_merits() -> None:
    assert verify_code_tests(f"```python\n{ADD}```\n", TESTS) == 1.0
    assert verify_code_tests("def add(a, b):\n    return a - b\n", TESTS) == 0.0
    main_block = ADD + "if __name__ == '__main__':\n    print(add(1, 2))\n"  # runs, as a script's would
    assert verify_code_tests(main_block, TESTS + "assert __name__ == '__main__'\n") == 1.0
    assert verify_code_tests("import sys\n" + ADD, TESTS + "assert sys.argv == ['main.py'], sys.argv\n") == 1.0
    assert verify_code_tests(ADD, "") == 1.0  # no tests: the program ran to its end


def test_the_reward_scores_each_response_of_a_group() -> None:
    # The marker program defines a correct add: against passing tests it earns its 1.0 honestly.
    responses = [f"```python\n{ADD}```", program("os._exit(0)"), program("a fake success marker on stdout and stderr")]
    responses += ["def add(a, b):\n    return 0\n"]
    assert code_tests_reward(group(responses, TESTS), {"workers": 2}) == [1.0, 0.0, 1.0, 0.0]
    assert code_tests_reward(group(responses, FAILING), {"workers": 2}) == [0.0] * len(responses)


def test_the_registered_reward_and_verifier_run_each_program_in_the_sandbox() -> None:
    """``code_tests`` as a config names it: the reward function and the verifier from their registries."""
    responses = [
        f"```python\n{ADD}```\nexplanation after the block",
        ADD,  # no fence: the whole response is the program
        "def add(a, b):\n    return a - b",
        "def add(a, b) return",  # a syntax error
    ]
    group = make_group(responses, task="code_tests", prompt="write add", answer=TESTS)
    assert score(RewardFunction(name="code_tests", options={"workers": 2}), group) == [1.0, 1.0, 0.0, 0.0]
    verify = get_verifier("code_tests")
    assert [verify(r, TESTS) for r in responses[:3]] == [1.0, 1.0, 0.0]
    assert verify("\ud800", TESTS) == 0.0  # a response that is not valid text scores 0, not a crash


# --------------------------------------------------------------------------- a program written against the harness
# The program and the tests run in two interpreters: the tests' frames, constants, token and modules are in the test
# runner, which the program can neither read nor trace. Each attack below scored 1.0 when both shared one interpreter
# (the control runs them that way, unfenced); each must score 0 now.

SECRET = "assert secret(12345) == 9876501234, 'secret(12345)'\n"  # no program computes this: it can only steal it
FIND_THE_TOKEN = dedent("""
    import os, re, sys

    def steal(candidates):
        for token in candidates:
            for fd in range(3, 64):
                try:
                    os.write(fd, token)
                except OSError:
                    pass
        os._exit(0)
""")
ANSWER_STEALERS = {
    "the token read from the caller frames' locals": FIND_THE_TOKEN + dedent("""
        def secret(x):
            frame, found = sys._getframe(1), []
            while frame is not None:
                values = [v for v in frame.f_locals.values() if isinstance(v, bytes)]
                found += [v for v in values if re.fullmatch(rb"[0-9a-f]{32}\\n", v)]
                frame = frame.f_back
            steal(found)
    """),
    "the token read from the process's own memory (what gc and ctypes reach)": FIND_THE_TOKEN + dedent("""
        def secret(x):
            found = {}
            with open("/proc/self/maps") as maps, open("/proc/self/mem", "rb", buffering=0) as mem:
                for line in maps:
                    span, perms = line.split()[:2]
                    if "rw" not in perms:
                        continue
                    start, end = (int(p, 16) for p in span.split("-"))
                    try:
                        mem.seek(start)
                        chunk = mem.read(end - start)
                    except (OSError, ValueError, OverflowError):
                        continue
                    for token in re.findall(rb"(?<![0-9a-f])[0-9a-f]{32}\\n", chunk):
                        found[token] = found.get(token, 0) + 1
            steal(sorted(found, key=found.get, reverse=True)[:1])
    """),
    "the tests read from a caller frame": dedent("""
        import re, sys
        def secret(x):
            frame = sys._getframe(1)
            while frame is not None:
                for value in frame.f_locals.values():
                    text = value.decode() if isinstance(value, bytes) else value
                    if isinstance(text, str) and (m := re.search(rf"secret\\({x}\\) == (\\d+)", text)):
                        return int(m.group(1))
                frame = frame.f_back
    """),
    "the constants of the caller's code": dedent("""
        import sys
        def secret(x):
            consts = sys._getframe(1).f_code.co_consts
            return next(c for c in consts if type(c) is int and c != x)
    """),
    "an object whose __eq__ always says yes": dedent("""
        class Yes:
            def __eq__(self, other):
                return True
        def secret(x):
            return Yes()
    """),
    "an int whose __eq__ always says yes": dedent("""
        class Yes(int):
            def __eq__(self, other):
                return True
            __hash__ = int.__hash__
        def secret(x):
            return Yes(0)
    """),
    "unittest's assertEqual patched": dedent("""
        import unittest
        unittest.TestCase.assertEqual = lambda self, first, second, msg=None: None
        def secret(x):
            return 0
    """),
}
UNITTEST_SECRET = "import unittest\nunittest.TestCase().assertEqual(secret(12345), 9876501234)\n"


def stealer_tests(name: str) -> str:
    return UNITTEST_SECRET if "unittest" in name else SECRET


def one_interpreter(code: str, tests: str) -> bool:
    """The control: the program, then the tests, in one interpreter under a harness that writes a token to a pipe
    when the tests' last line has run — the scheme before the tests had an interpreter of their own — unfenced."""
    harness = dedent(f"""
        import os, sys
        def harness(verdict):
            token = os.urandom(16).hex().encode() + b"\\n"
            tests = {tests.encode()!r}
            namespace = {{"__name__": "__main__"}}
            exec(compile({code!r}, "main.py", "exec"), namespace)
            exec(compile(tests, "tests.py", "exec"), namespace)
            os.write(verdict, token)
            os._exit(0)
        harness(int(sys.argv[1]))
    """)
    read, write = os.pipe()
    try:
        done = subprocess.run([sys.executable, "-I", "-c", harness, str(write)], pass_fds=(write,),
                              capture_output=True, timeout=30)
        os.close(write)
        data = os.read(read, 4096)
    finally:
        os.close(read)
    return done.returncode == 0 and bool(data) and data == data[:33] * (len(data) // 33)


@pytest.mark.parametrize("name", list(ANSWER_STEALERS))
def test_a_program_that_reaches_for_the_tests_scores_zero(name: str) -> None:
    result = run_python_tests(ANSWER_STEALERS[name], stealer_tests(name))
    assert not result.passed and result.reason.startswith("failed:"), result


@pytest.mark.parametrize("name", list(ANSWER_STEALERS))
def test_the_attack_is_real_in_one_interpreter(name: str) -> None:
    assert one_interpreter(ANSWER_STEALERS[name], stealer_tests(name))


def test_a_handle_never_compares_with_a_value() -> None:
    """The reason names the rule: the tests compare plain values, never ask the program's ``__eq__``."""
    result = run_python_tests(ANSWER_STEALERS["an object whose __eq__ always says yes"], SECRET)
    assert "TypeError" in result.reason and "compare plain values" in result.reason, result


def test_the_runner_is_out_of_the_programs_reach() -> None:
    """The test runner is not dumpable: its memory cannot be read nor the process traced, even by its own uid."""
    reach = dedent("""
        import ctypes, os
        libc = ctypes.CDLL(None, use_errno=True)
        reached = []
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                if b"runner" not in open(f"/proc/{pid}/cmdline", "rb").read().split(b"\\0"):
                    continue
            except OSError:
                continue
            try:
                with open(f"/proc/{pid}/mem", "rb") as mem:
                    reached.append(("mem", pid))
            except OSError:
                pass
            if libc.ptrace(16, int(pid), None, None) == 0:  # PTRACE_ATTACH
                reached.append(("ptrace", pid))
        assert reached, "the runner is out of reach"
    """)
    result = run_python_tests(reach, "")
    assert not result.passed and "the runner is out of reach" in result.reason, result


# --------------------------------------------------------------------------- honest programs, two interpreters

HONEST = {
    "unittest.main()": (ADD, dedent("""
        import unittest
        class TestAdd(unittest.TestCase):
            def test_add(self):
                self.assertEqual(add(2, 3), 5)
        unittest.main()
    """)),
    "a class of the program": (dedent("""
        class Solution:
            def two_sum(self, nums, target):
                seen = {}
                for i, n in enumerate(nums):
                    if target - n in seen:
                        return [seen[target - n], i]
                    seen[n] = i
    """), "assert Solution().two_sum([2, 7, 11, 15], 9) == [0, 1]\n"),
    "an object's state through its methods and attributes": (dedent("""
        class Stack:
            def __init__(self):
                self.items = []
            def push(self, x):
                self.items.append(x)
            def pop(self):
                return self.items.pop()
            def __len__(self):
                return len(self.items)
    """), "s = Stack()\ns.push(1)\ns.push((2, 'b'))\nassert len(s) == 2 and s.items == [1, (2, 'b')]\n"
          "assert s.pop() == (2, 'b') and s and s == s and s != Stack()\n"),
    "a linked list built by the tests with the program's class": (dedent("""
        class Node:
            def __init__(self, val, next=None):
                self.val, self.next = val, next
        def reverse(head):
            prev = None
            while head:
                head.next, prev, head = prev, head, head.next
            return prev
    """), dedent("""
        node = reverse(Node(1, Node(2, Node(3))))
        values = []
        while node is not None:
            values.append(node.val)
            node = node.next
        assert values == [3, 2, 1], values
    """)),
    "an in-place function": ("def rotate(nums, k):\n    nums[:] = nums[-k:] + nums[:-k]\n",
                             "nums = [1, 2, 3, 4]\nalias = nums\nrotate(nums, 1)\nassert alias == [4, 1, 2, 3]\n"),
    "the program's exceptions": (dedent("""
        class InvalidInput(ValueError):
            pass
        def check(x):
            if x < 0:
                raise InvalidInput(f"negative: {x}")
            return {1: "a"}[x]
    """), dedent("""
        for exc in (InvalidInput, ValueError):
            try:
                check(-1)
                raise AssertionError("no exception")
            except exc as error:
                assert str(error) == "negative: -1"
        try:
            check(2)
        except KeyError as error:
            assert error.args == (2,)
    """)),
    "a generator, plain values and modules of the program": (dedent("""
        import math
        from collections import Counter
        LIMIT = [1, 2.5, None, (True, b"x"), {"k": {3}}]
        def squares(n):
            yield from (i * i for i in range(n))
        def counts(text):
            return Counter(text)
    """), dedent("""
        assert list(squares(4)) == [0, 1, 4, 9] and sum(squares(3)) == 5
        assert LIMIT == [1, 2.5, None, (True, b"x"), {"k": {3}}]
        assert counts("aab") == {"a": 2, "b": 1} and type(counts("a")) is dict
        assert math.isclose(math.pi, 3.14159, rel_tol=1e-5)
    """)),
    "what the program prints and reads during a call": (dedent("""
        def main():
            a, b = map(int, input().split())
            print(a + b)
    """), dedent("""
        import contextlib, io, sys
        sys.stdin = io.StringIO("2 3\\n")
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            main()
        assert out.getvalue() == "5\\n", out.getvalue()
    """)),
}


@pytest.mark.parametrize("name", list(HONEST))
def test_honest_programs_pass_across_the_two_interpreters(name: str) -> None:
    code, tests = HONEST[name]
    result = run_python_tests(code, tests)
    assert result.passed, result


def test_unittest_main_decides_by_its_tests() -> None:
    failing = HONEST["unittest.main()"][1].replace("add(2, 3), 5", "add(2, 3), 6")
    result = run_python_tests(ADD, failing)
    assert not result.passed and "FAILED (failures=1)" in result.reason, result


def test_what_the_tests_hand_the_program_is_plain_data() -> None:
    """A callback of the tests cannot cross: the program would call back into the runner."""
    result = run_python_tests("def apply(f, x):\n    return f(x)\n", "assert apply(lambda v: v + 1, 1) == 2\n")
    assert not result.passed and "only plain values" in result.reason, result
