"""Rule verifiers: score a model's response against a task's ground truth.

Every verifier has one signature, ``verify(response, answer) -> float`` with a result in [0, 1],
and is registered under the name of the task whose answers it reads (``common/tasks.py``)::

    get_verifier("arithmetic")("19\\nand then", "19")   # 1.0

``response`` is the model's raw continuation after the prompt; the rule verifiers judge its first
line with surrounding whitespace stripped, so text after a newline is ignored. A response is
hostile input: a malformed, empty, unicode, very long or huge-number one scores 0.0 and never
raises. A malformed ``answer`` is a bug in the data, not the model's fault, and raises ``ValueError``.
"""

from __future__ import annotations

import ast
import json
import re
from collections import Counter
from collections.abc import Callable
from fractions import Fraction

from actors.sandbox import run_python_tests
from common.registry import Registry

Verifier = Callable[[str, str], float]
"""``verify(response, answer) -> score in [0, 1]``."""

MAX_RESPONSE_CHARS = 200
"""Longer first lines score 0.0 without being parsed (no task's answer is that long)."""

VERIFIERS: Registry[Verifier] = Registry("verifier")
"""Rule verifiers by task name."""
register_verifier = VERIFIERS.register
get_verifier = VERIFIERS.get
verifier_names = VERIFIERS.names


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


@register_verifier("reverse")
def verify_reverse(response: str, answer: str) -> float:
    """1.0 when the first line equals ``answer`` exactly."""
    return 1.0 if first_line(response) == answer else 0.0


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
    """1.0 when the response's program passes ``answer`` (test source) in the sandbox (``actors/sandbox.py``).

    The program is the response's first fenced block (opened by a line starting with three backticks)
    when there is one, else the whole response.
    A sandbox that cannot start raises: that is the worker's failure, to be retried, not a zero score.
    """
    block = _FENCED.search(response)
    code = block.group(1) if block else response
    return 1.0 if run_python_tests(code, answer).passed else 0.0
