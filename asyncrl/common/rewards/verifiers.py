r"""Rule verifiers: score a model's response against a task's ground truth.

Every verifier has one signature, ``verify(response, answer) -> float`` with a result in [0, 1],
and is registered under a name: a generated task's own (``common/data/tasks.py``), or one a ``file`` task names
in ``task.options.verifier``::

    get_verifier("arithmetic")("19\nand then", "19")   # 1.0
    bind_verifier("regex", {"pattern": r"Answer: (\w+)"})("Answer: Paris", "paris")   # 1.0

``response`` is the model's raw continuation after the prompt. ``arithmetic``, ``reverse`` and ``countdown``
judge its first line with surrounding whitespace stripped, so text after a newline is ignored; ``exact``,
``choice``, ``math`` and ``regex`` read the whole response. A verifier may declare options as keyword-only
parameters (``regex``'s ``pattern``); :func:`bind_verifier` checks and binds them (an unknown option or a bad
value raises ``ValueError`` when the config is checked). A response is hostile input: a malformed, empty,
unicode, very long or huge-number one scores 0.0, never raises, and is judged in bounded time (``math`` and
``regex`` run in a child process with a deadline: ``common/rewards/judge.py``). A malformed ``answer`` is a bug in
the data, not the model's fault, and raises ``ValueError``.

Verifiers for user data files (scores are 0.0 or 1.0, no partial credit):

==========  =================================================  ===================================  ===============
verifier    what it takes from the response                    how it compares with ``answer``      options
==========  =================================================  ===================================  ===============
``exact``   the whole response                                 equal once both are normalised       none
``choice``  a letter: the last ``\boxed{B}``, else the last    equal to the answer's letter         ``letters``
            ``answer is (B)``, else one opening the response   (``B`` or ``(B)``, any case)
``math``    the last ``\boxed{}``, else GSM8K's ``#### n``,    two plain numbers exactly, else     ``timeout_s``
            else the last number                               math-verify (value, symbolic)
``regex``   group 1 of the pattern's last match                equal once both are normalised       ``pattern``,
                                                                                                    ``timeout_s``
==========  =================================================  ===================================  ===============

``prefix`` gives partial credit to a space-separated answer (the words right from the start, over the longer of
the two): a shaped reward for long answers, 1.0 only when exact.

Normalised (:func:`normalise`): case-folded, surrounding whitespace, punctuation and ``$`` stripped, inner
whitespace collapsed. Details in :func:`chosen_letter`, :func:`final_answer` and each verifier's docstring.
"""

from __future__ import annotations

import ast
import functools
import inspect
import json
import re
from collections import Counter
from collections.abc import Callable, Mapping
from fractions import Fraction
from typing import Any

from asyncrl.common.config import ConfigError
from asyncrl.common.registry import Contract, Registry
from asyncrl.common.rewards.answers import GROUPED_NUMBER, PLAIN_NUMBER, chosen_letter, final_answer, normalise
from asyncrl.common.rewards.judge import judge
from asyncrl.common.sandbox import run_python_tests

Verifier = Callable[[str, str], float]
"""``verify(response, answer) -> score in [0, 1]``."""

MAX_RESPONSE_CHARS = 200
"""Longer first lines score 0.0 without being parsed (no task's answer is that long)."""


VERIFIERS: Registry[Verifier] = Registry(
    "verifier", Contract("f(response, answer, *, option=default) -> score", args=2), group="verifiers"
)
"""Rule verifiers by task name."""
register_verifier = VERIFIERS.register
get_verifier = VERIFIERS.get
verifier_names = VERIFIERS.names
# Needs reasoning-gym: imported when used.
VERIFIERS.register_path("reasoning_gym", "asyncrl.common.data.gyms:verify_reasoning_gym")

_OPTION_CHECKS: dict[Callable[..., float], Callable[..., None]] = {}


def checks_options(check: Callable[..., None]) -> Callable[[Callable[..., float]], Callable[..., float]]:
    """Decorator: ``check(**options)`` validates a verifier's option values (raising ``ValueError``) when bound."""

    def wrap(verify: Callable[..., float]) -> Callable[..., float]:
        _OPTION_CHECKS[verify] = check
        return verify

    return wrap


def bind_verifier(name: str, options: Mapping[str, Any] | None = None) -> Verifier:
    """Verifier ``name`` (a registered name or an import path) with ``options`` bound: ``verify(response, answer)``.

    A verifier declares its options as keyword-only parameters with defaults (``verify_regex(response, answer, *,
    pattern="", timeout_s=1.0)``). An option it does not declare, or a value its check refuses (:func:`checks_options`),
    raises :class:`~asyncrl.common.config.ConfigError` (a ``ValueError``) naming it — so a config is refused when it is
    checked, not on every group.
    """
    verify = get_verifier(name)
    options = dict(options or {})
    declared = [
        p.name for p in inspect.signature(verify).parameters.values() if p.kind is inspect.Parameter.KEYWORD_ONLY
    ]
    unknown = sorted(set(options) - set(declared))
    if unknown:
        raise ConfigError(
            f"verifier {name!r}: unknown option(s) {', '.join(map(repr, unknown))}; "
            f"allowed: {', '.join(declared) or 'none'}"
        )
    check = _OPTION_CHECKS.get(verify)
    if check is not None:
        try:
            check(**options)
        except (TypeError, ValueError) as e:
            raise ConfigError(f"verifier {name!r}: {e}") from None
    return functools.partial(verify, **options) if options else verify


def first_line(response: str) -> str:
    """The response up to its first newline, without surrounding whitespace: what rule verifiers judge."""
    return response.split("\n", 1)[0].strip()


# --------------------------------------------------------------------------- exact answers

_INTEGER = re.compile(r"-?[0-9]{1,200}")  # ASCII digits only: int() would also accept "١٢" or "１２"


@register_verifier("arithmetic")
def verify_arithmetic(response: str, answer: str) -> float:
    """1.0 when the first line is exactly an integer (ASCII digits, optional ``-``) equal to ``answer``."""
    text = first_line(response)
    if not _INTEGER.fullmatch(text):
        return 0.0
    return 1.0 if int(text) == int(answer) else 0.0


@register_verifier("count")
@register_verifier("copy")
@register_verifier("reverse")
def verify_reverse(response: str, answer: str) -> float:
    """1.0 when the first line equals ``answer`` exactly."""
    return 1.0 if first_line(response) == answer else 0.0


@register_verifier("prefix")
def verify_prefix(response: str, answer: str) -> float:
    """Partial credit for a space-separated answer: the words the first line gets right from the start, over the
    longer of the two,

        r = LCP(w(response), w(answer)) / max(|w(response)|, |w(answer)|),

    where ``w`` splits on single spaces and LCP is the length of the common prefix in words. 1.0 only for the exact
    answer (so an eval with ``success_threshold = 1`` counts exact answers); stopping early scores the share written,
    running on past the end scores less the further it runs. For ``count``: a policy that cannot yet stop where the
    answer ends still learns where, rather than that short answers are the only ones it gets right.
    """
    expected = answer.split(" ")
    if not answer or "" in expected:
        raise ValueError(f"prefix answer must be words separated by single spaces: {answer[:100]!r}")
    written = first_line(response).split(" ")
    common = 0
    for mine, theirs in zip(written, expected, strict=False):
        if mine != theirs:
            break
        common += 1
    return common / max(len(written), len(expected))


# --------------------------------------------------------------------------- countdown

_EXPRESSION_CHARS = frozenset("0123456789+-*/() ")
_OPERATORS: dict[type[ast.operator], Callable[[Fraction, Fraction], Fraction]] = {
    ast.Add: lambda a, b: a + b,
    ast.Sub: lambda a, b: a - b,
    ast.Mult: lambda a, b: a * b,
    ast.Div: lambda a, b: a / b,
}
_MAX_BITS = 1024  # no legitimate intermediate comes near; bounds the work any expression can cause


class _Rejected(Exception):
    """An expression outside the allowed grammar or range."""


@register_verifier("countdown")
def verify_countdown(response: str, answer: str) -> float:
    """1.0 when the first line is an expression over the given numbers that equals the target.

    ``answer`` is the task's JSON ``{"numbers": [...], "target": N, ...}``. The expression may use
    ``+ - * /`` and parentheses; each given number at most once (repeats as often as given), no other
    number, no unary minus. It is evaluated exactly over rationals (so ``(7/2)*4`` is 14): parsed with
    ``ast`` and walked through a whitelist, never ``eval``-ed.
    """
    numbers, target = _countdown_answer(answer)
    text = first_line(response)
    if not text or len(text) > MAX_RESPONSE_CHARS or not set(text) <= _EXPRESSION_CHARS:
        return 0.0
    used: list[int] = []
    try:
        value = _evaluate(ast.parse(text, mode="eval").body, used)
    except (_Rejected, SyntaxError, ValueError, ZeroDivisionError, RecursionError, MemoryError):
        return 0.0
    if Counter(used) - Counter(numbers):  # a number not given, or used more often than given
        return 0.0
    return 1.0 if value == target else 0.0


def _countdown_answer(answer: str) -> tuple[list[int], int]:
    """``(numbers, target)`` from a countdown answer; raises ``ValueError`` on a malformed one."""
    try:
        data = json.loads(answer)
        numbers, target = data["numbers"], data["target"]
    except (json.JSONDecodeError, TypeError, KeyError) as e:
        raise ValueError(f"countdown answer must be JSON with 'numbers' and 'target': {answer[:100]!r}") from e
    if not (isinstance(numbers, list) and all(type(n) is int for n in numbers) and type(target) is int):
        raise ValueError(f"countdown answer needs integer 'numbers' and 'target': {answer[:100]!r}")
    return numbers, target


def _evaluate(node: ast.expr, used: list[int]) -> Fraction:
    """The exact value of a whitelisted expression tree; appends every integer constant to ``used``."""
    if isinstance(node, ast.Constant) and type(node.value) is int:
        used.append(node.value)
        return Fraction(node.value)
    if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
        left, right = _evaluate(node.left, used), _evaluate(node.right, used)
        value = _OPERATORS[type(node.op)](left, right)
        if max(abs(value.numerator).bit_length(), value.denominator.bit_length()) > _MAX_BITS:
            raise _Rejected("value out of range")
        return value
    raise _Rejected(f"{type(node).__name__} is not allowed")


# --------------------------------------------------------------------------- code

_FENCED = re.compile(r"```[^\n]*\n(.*?)```", re.DOTALL)


@register_verifier("code_tests")
def verify_code_tests(response: str, answer: str) -> float:
    """1.0 when the response's program passes ``answer`` (test source) in the sandbox (``common/sandbox/``).

    The program is the response's first fenced block (opened by a line starting with three backticks)
    when there is one, else the whole response. The tests decide: a program that exits early, with any status,
    scores 0 (the sandbox's module docstring gives the threat model: what a program can and cannot fake).
    A sandbox that cannot start raises: that is the worker's failure, to be retried, not a zero score.
    """
    block = _FENCED.search(response)
    code = block.group(1) if block else response
    return 1.0 if run_python_tests(code, answer).passed else 0.0


# --------------------------------------------------------------------------- exact strings


@register_verifier("exact")
def verify_exact(response: str, answer: str) -> float:
    """1.0 when the whole response equals ``answer`` once both are :func:`normalise`-d; an answer that normalises to
    nothing raises ``ValueError``."""
    expected = normalise(answer)
    if not expected:
        raise ValueError(f"exact answer is empty once normalised: {answer[:100]!r}")
    return 1.0 if normalise(response) == expected else 0.0


# --------------------------------------------------------------------------- boxed answers


# --------------------------------------------------------------------------- multiple choice


def _check_letters(letters: str = "ABCDE") -> None:
    if not (isinstance(letters, str) and letters.isalpha() and len(set(letters)) == len(letters)):
        raise ValueError(f"option 'letters' must be distinct letters, e.g. 'ABCD', got {letters!r}")


@register_verifier("choice")
@checks_options(_check_letters)
def verify_choice(response: str, answer: str, *, letters: str = "ABCDE") -> float:
    """1.0 when the letter the response chooses (:func:`chosen_letter`) is ``answer``'s (``B`` or ``(B)``, any case).

    Option ``letters``: the choices (default ``"ABCDE"``). An answer that is not one of them raises ``ValueError``.
    """
    expected = answer.strip().strip("().[] ").upper()
    if len(expected) != 1 or expected not in letters.upper():
        raise ValueError(f"choice answer must be one of the letters {letters!r}: {answer[:100]!r}")
    chosen = chosen_letter(response, letters)
    return 1.0 if chosen is not None and chosen.upper() == expected else 0.0


# --------------------------------------------------------------------------- math


def _check_timeout(timeout_s: float = 1.0) -> None:
    if isinstance(timeout_s, bool) or not (isinstance(timeout_s, int | float) and 0 < timeout_s <= 60):
        raise ValueError(f"option 'timeout_s' must be a number of seconds in (0, 60], got {timeout_s!r}")


@register_verifier("math")
@checks_options(_check_timeout)
def verify_math(response: str, answer: str, *, timeout_s: float = 1.0) -> float:
    """1.0 when the response's :func:`final_answer` equals ``answer``'s by value or symbolically.

    ``answer`` is the reference: a GSM8K solution (``... #### 72``: what follows ``####``), a MATH one (the content
    of its last ``\\boxed{}``), or else the whole string (``\\frac{1}{2}``); an empty one raises ``ValueError``. Two
    plain numbers (``72``, ``-0.5``, ``3/4``) are compared exactly here (``72.0`` equals ``72``, ``0.333`` is not
    ``1/3``); anything else goes to math-verify (``parse`` of each as ``$...$``, then ``verify(gold, pred)``: ``0.5``,
    ``1/2`` and ``\\frac12`` are equal, and so are ``x^2+2x+1`` and ``(x+1)^2``), run by the judge process within
    ``timeout_s`` seconds (option, default 1.0); a call past it scores 0.0.
    """
    expected = _reference(answer)
    got = final_answer(response)
    if got is None:
        return 0.0
    if got == expected:
        return 1.0
    if PLAIN_NUMBER.fullmatch(got) and PLAIN_NUMBER.fullmatch(expected):
        return 1.0 if _exact_number(got) == _exact_number(expected) else 0.0
    return 1.0 if judge().ask(MATH_JOB, (expected, got), timeout_s) else 0.0


def _reference(answer: str) -> str:
    """The answer part of a reference solution (see :func:`verify_math`); raises ``ValueError`` when there is none."""
    if "\\boxed" in answer or "\\fbox" in answer or "####" in answer:
        expected = final_answer(answer)
    else:
        expected = answer.replace("$", "").strip()
        expected = expected.replace(",", "") if GROUPED_NUMBER.fullmatch(expected) else expected
    if not expected:
        raise ValueError(f"math answer has no final answer: {answer[:100]!r}")
    return expected


def _exact_number(text: str) -> Fraction | None:
    try:
        return Fraction(text)
    except (ValueError, ZeroDivisionError):  # 1/0
        return None


def _math_equal(gold: str, pred: str) -> bool:
    """math-verify's verdict on two final answers (run in the judge process)."""
    from math_verify import parse, verify

    # parsing_timeout=None (no alarm: the judge process has its own limit) is documented; math-verify annotates int.
    answer = parse(f"${pred}$", parsing_timeout=None)  # pyright: ignore[reportArgumentType]
    return bool(verify(_parsed(gold), answer, timeout_seconds=None))


@functools.lru_cache(maxsize=256)
def _parsed(gold: str) -> list[Any]:
    from math_verify import parse

    # the K responses of a group share one reference; parsing_timeout=None as in _math_equal
    return parse(f"${gold}$", parsing_timeout=None)  # pyright: ignore[reportArgumentType]


# --------------------------------------------------------------------------- regex


def _check_pattern(pattern: str = "", timeout_s: float = 1.0) -> None:
    if not (isinstance(pattern, str) and pattern):
        raise ValueError("needs option 'pattern': a regular expression whose group 1 is the answer")
    try:
        groups = re.compile(pattern).groups
    except re.error as e:
        raise ValueError(f"option 'pattern' {pattern!r} is not a regular expression: {e}") from None
    if groups < 1:
        raise ValueError(f"option 'pattern' {pattern!r} has no capture group: group 1 is the answer")
    _check_timeout(timeout_s)


@register_verifier("regex")
@checks_options(_check_pattern)
def verify_regex(response: str, answer: str, *, pattern: str = "", timeout_s: float = 1.0) -> float:
    """1.0 when group 1 of the last match of ``pattern`` in the response equals ``answer``, both :func:`normalise`-d.

    Options: ``pattern`` (required; a Python regular expression with at least one group, e.g.
    ``'Answer:\\s*(\\S+)'``; flags inline, ``(?i)``), ``timeout_s`` (default 1.0). The pattern comes from the config,
    but the response is hostile: a pattern can backtrack for ever on some text (``(a+)+$`` on ``aaa…b``), so the
    search runs in the judge process and a search past ``timeout_s`` scores 0.0.
    """
    if not pattern:
        raise ValueError("regex needs options.pattern (bind_verifier checks it)")
    expected = normalise(answer)
    if not expected:
        raise ValueError(f"regex answer is empty once normalised: {answer[:100]!r}")
    return 1.0 if judge().ask(REGEX_JOB, (pattern, response, expected), timeout_s) else 0.0


def _regex_equal(pattern: str, response: str, expected: str) -> bool:
    """Whether group 1 of the last match, normalised, is ``expected`` (run in the judge process)."""
    last = None
    for last in re.finditer(pattern, response):  # noqa: B007 (the last match is wanted)
        pass
    return last is not None and last.group(1) is not None and normalise(last.group(1)) == expected


MATH_JOB = f"{__name__}:_math_equal"
REGEX_JOB = f"{__name__}:_regex_equal"
"""The checks the judge process runs for :func:`verify_math` and :func:`verify_regex` (``common/rewards/judge.py``)."""
