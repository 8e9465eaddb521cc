"""Rule verifiers on correct, wrong, malformed and adversarial responses, and the code verifier."""

from __future__ import annotations

import json
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncrl.common.data.tasks import task_names
from asyncrl.common.rewards import verifiers
from asyncrl.common.rewards.verifiers import get_verifier, register_verifier, verifier_names

CD = json.dumps({"numbers": [3, 5, 7], "target": 22})
RULE_VERIFIERS = ["arithmetic", "reverse", "countdown"]
ADVERSARIAL = [
    "",
    " ",
    "\n19",  # the answer only after the first newline
    "9" * 10000,
    "-" + "9" * 300,
    "2**99999",
    "9**9**9**9",
    "__import__('os').system('echo hacked')",
    "().__class__.__bases__[0].__subclasses__()",
    "lambda: 1",
    "１９",  # fullwidth digits: int() would accept them
    "١٩",  # Arabic-Indic digits
    "19\u200b",  # zero-width space
    "\ud800",  # lone surrogate
    "\x00",
    "(" * 150 + "3" + ")" * 150,
    "(" * 1000,
    "3" + "+3" * 100,
    "1e309",
    "nan",
    "0x13",
    "1_9",
    "ǅ",
]


def test_every_generated_task_has_a_verifier_of_its_name() -> None:
    """But ``textarena``, whose games score themselves (the ``environment`` reward function)."""
    assert set(task_names()) - {"file", "textarena"} <= set(verifier_names())
    task_verifiers = {"arithmetic", "reverse", "copy", "count", "countdown", "code_tests", "reasoning_gym"}
    file_verifiers = {"exact", "choice", "math", "regex", "prefix"}
    assert set(verifier_names()) == task_verifiers | file_verifiers


@pytest.mark.parametrize(
    ("response", "score"),
    [
        ("17 18 19 20", 1.0),  # exact
        ("17 18 19 20\nmore", 1.0),  # the first line is what counts
        ("17 18", 0.5),  # stopped early: the share written
        ("17 18 19 20 21 22 23 24", 0.5),  # ran on past the end: less the further it runs
        ("17 18 29 20", 0.5),  # a slip: what follows it earns nothing
        ("", 0.0),
        ("17  18 19 20", 0.2),  # a double space is a wrong word
        ("x" * 100_000, 0.0),
    ],
)
def test_prefix_gives_the_share_of_words_right_from_the_start(response: str, score: float) -> None:
    assert get_verifier("prefix")(response, "17 18 19 20") == score


def test_prefix_refuses_an_answer_that_is_not_single_spaced_words() -> None:
    with pytest.raises(ValueError, match="single spaces"):
        get_verifier("prefix")("1 2", "1  2")


@pytest.mark.parametrize(
    ("response", "score"),
    [
        ("19", 1.0),
        ("19\nbecause 12+7 is 19, or 20", 1.0),  # text after the first newline is ignored
        ("  19 ", 1.0),
        ("019", 1.0),  # the same integer
        ("20", 0.0),
        ("19 20", 0.0),
        ("+19", 0.0),
        ("19.0", 0.0),
        ("twelve", 0.0),
    ],
)
def test_arithmetic(response: str, score: float) -> None:
    assert get_verifier("arithmetic")(response, "19") == score


def test_arithmetic_negative_answers() -> None:
    assert get_verifier("arithmetic")("-9", "-9") == 1.0
    assert get_verifier("arithmetic")("9", "-9") == 0.0


@pytest.mark.parametrize(
    ("response", "score"), [("edcba", 1.0), ("edcba\nmore", 1.0), (" edcba", 1.0), ("abcde", 0.0), ("edcb", 0.0)]
)
def test_reverse(response: str, score: float) -> None:
    assert get_verifier("reverse")(response, "edcba") == score


@pytest.mark.parametrize(
    ("response", "score"),
    [
        ("3*5+7", 1.0),  # 15 + 7 = 22
        ("(3*5)+7\nthat is 22", 1.0),
        ("7+5*3", 1.0),
        ("(5+7)*3-14", 0.0),  # 14 is not given
        ("3*5+7+0", 0.0),  # 0 is not given
        ("3*5+7*1", 0.0),
        ("7*3+5-5+1", 0.0),  # 5 used twice, 1 not given
        ("7+7+5+3", 0.0),  # 7 used twice
        ("3*5+8", 0.0),
        ("22", 0.0),  # the target itself is not a given number
        ("3*7", 0.0),  # 21
        ("(3+5/5)*5", 0.0),
        ("-3+25", 0.0),  # no unary minus, 25 not given
        ("3//5", 0.0),
        ("3*5+7=22", 0.0),
        ("7/(5-5)+3", 0.0),  # division by zero
    ],
)
def test_countdown(response: str, score: float) -> None:
    assert get_verifier("countdown")(response, CD) == score


def test_countdown_repeated_numbers_may_each_be_used_once() -> None:
    two_twos = json.dumps({"numbers": [2, 2, 5], "target": 20})
    assert get_verifier("countdown")("2*2*5", two_twos) == 1.0
    assert get_verifier("countdown")("2*2*5", json.dumps({"numbers": [2, 5], "target": 20})) == 0.0


def test_countdown_fractions_in_between_are_exact() -> None:
    # 7/2 = 3.5, then 3.5 * 4 = 14: exact over rationals, no float rounding.
    assert get_verifier("countdown")("(7/2)*4", json.dumps({"numbers": [7, 2, 4], "target": 14})) == 1.0
    assert get_verifier("countdown")("(1/3)*3", json.dumps({"numbers": [1, 3, 3], "target": 1})) == 1.0


def test_countdown_rejects_a_malformed_answer_loudly() -> None:
    for answer in ["", "{}", '{"numbers": "3,5", "target": 8}', '{"numbers": [3], "target": 2.5}', "[1, 2]"]:
        with pytest.raises(ValueError, match="countdown answer"):
            get_verifier("countdown")("3+5", answer)


@pytest.mark.parametrize("name", RULE_VERIFIERS)
@pytest.mark.parametrize("response", ADVERSARIAL)
def test_adversarial_responses_score_zero_without_raising(name: str, response: str) -> None:
    answer = {"arithmetic": "19", "reverse": "19", "countdown": CD}[name]
    start = time.perf_counter()
    assert get_verifier(name)(response, answer) == 0.0
    assert time.perf_counter() - start < 0.5


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=300), st.sampled_from(RULE_VERIFIERS))
def test_any_text_scores_in_the_unit_interval(response: str, name: str) -> None:
    answer = {"arithmetic": "19", "reverse": "edcba", "countdown": CD}[name]
    assert get_verifier(name)(response, answer) in (0.0, 1.0)


@settings(max_examples=200, deadline=None)
@given(st.text(alphabet="0123456789+-*/() ", max_size=60))
def test_countdown_on_expression_like_text_never_raises(response: str) -> None:
    assert get_verifier("countdown")(response, CD) in (0.0, 1.0)


def test_registry_refuses_a_second_function_under_a_taken_name() -> None:
    with verifiers.VERIFIERS.snapshot():  # registrations here are undone afterwards

        def other(response: str, answer: str) -> float:
            return 0.5

        with pytest.raises(ValueError, match="'arithmetic' already registered by verify_arithmetic"):
            register_verifier("arithmetic")(other)
        assert register_verifier("other")(other) is other
        assert register_verifier("other")(other) is other  # the same function again is fine
        assert get_verifier("other")("x", "y") == 0.5
        with pytest.raises(ValueError, match="unknown verifier 'nope'"):
            get_verifier("nope")
