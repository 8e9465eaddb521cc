r"""The verifiers for user data files (``exact``, ``choice``, ``math``, ``regex``): hand-written cases, hostile
responses that score 0.0 in bounded time, the judge process's deadline, and how a config selects and checks them.

Times of the hostile cases are printed (``pytest -s``) and bounded only generously: the machine is shared.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from asyncrl.common.config import ConfigError, RewardFunction, load_config
from asyncrl.common.data.tasks import task_label
from asyncrl.common.rewards.answers import chosen_letter, final_answer, normalise
from asyncrl.common.rewards.functions import bind_functions, score
from asyncrl.common.rewards.judge import Judge, judge
from asyncrl.common.rewards.verifiers import MATH_JOB, bind_verifier
from tests.helpers.rollouts import make_group
from tests.helpers.waits import wait_for

ROOT = Path(__file__).resolve().parents[4]
BOUND_S = 30.0  # a hostile call must return at all; its real cost is printed
FAST = {"timeout_s": 0.5}  # the hostile tables wait out fewer seconds than the 1 s default


@pytest.fixture(scope="module", autouse=True)
def _end_the_judge() -> Iterator[None]:
    yield
    judge().close()  # the process's judge child ends with this module, not with the test session


def timed(verify, response: str, answer: str) -> tuple[float, float]:
    start = time.perf_counter()
    result = verify(response, answer)
    return result, time.perf_counter() - start


# --------------------------------------------------------------------------- exact


@pytest.mark.parametrize(
    ("text", "normalised"),
    [
        ('  "The  Eiffel\nTower."  ', "the eiffel tower"),
        ("(B)", "b"),
        ("**Paris**!", "paris"),
        ("$42$", "42"),
        ("-5", "-5"),  # a sign is not punctuation to strip
        ("50%", "50%"),
        ("Straße", "strasse"),  # case-folded, not just lower-cased
        ("«Oui»", "oui"),
    ],
)
def test_normalise(text: str, normalised: str) -> None:
    assert normalise(text) == normalised


@pytest.mark.parametrize(
    ("response", "score"),
    [
        ("Paris", 1.0),
        ("  paris.\n", 1.0),
        ('"PARIS"', 1.0),
        ("paris, france", 0.0),
        ("The answer is Paris", 0.0),  # the whole response is compared, not a part of it
        ("Pari s", 0.0),
        ("", 0.0),
    ],
)
def test_exact(response: str, score: float) -> None:
    assert bind_verifier("exact")(response, "Paris") == score


def test_exact_collapses_inner_whitespace_on_both_sides() -> None:
    assert bind_verifier("exact")("New\n\tYork  City", " new york city ") == 1.0


def test_an_exact_answer_empty_once_normalised_is_a_data_bug() -> None:
    with pytest.raises(ValueError, match="empty once normalised"):
        bind_verifier("exact")("x", " ... ")


# --------------------------------------------------------------------------- choice


@pytest.mark.parametrize(
    ("response", "letter"),
    [
        ("B", "B"),
        ("(B)", "B"),
        ("B.", "B"),
        ("B. Paris", "B"),
        ("(B) Paris", "B"),
        ("B\nbecause the capital is Paris", "B"),
        ("Answer: B", "B"),
        ("answer: **B**", "B"),
        ("the answer is (B)", "B"),
        ("The correct answer is B.", "B"),
        ("I first thought the answer is A. No: the answer is B", "B"),  # the last statement wins
        ("Paris, so \\boxed{B}", "B"),
        ("\\boxed{\\text{(B)}}", "B"),
        ("The answer is (A). Final: \\boxed{C}", "C"),  # a box comes first
        ("A cat sat on the mat", None),  # an article, not a choice
        ("Because", None),
        ("The answer is Because", None),
        ("answers", None),
        ("b", None),  # letters are matched as configured (upper case)
        ("", None),
    ],
)
def test_the_chosen_letter(response: str, letter: str | None) -> None:
    assert chosen_letter(response) == letter


@pytest.mark.parametrize("answer", ["B", "(B)", " b ", "B."])
def test_choice_reads_the_answer_as_a_letter(answer: str) -> None:
    verify = bind_verifier("choice")
    assert verify("The answer is (B).", answer) == 1.0
    assert verify("The answer is (C).", answer) == 0.0


def test_choice_takes_its_letters_from_the_config() -> None:
    verify = bind_verifier("choice", {"letters": "ABCDEFGHIJ"})
    assert verify("Answer: J", "J") == 1.0
    assert bind_verifier("choice")("Answer: J", "E") == 0.0  # J is no choice of the default A–E
    with pytest.raises(ValueError, match="one of the letters"):
        bind_verifier("choice")("Answer: J", "J")  # a reference outside the letters is a data bug


# --------------------------------------------------------------------------- math


@pytest.mark.parametrize(
    ("text", "answer"),
    [
        ("so the total is \\boxed{\\frac{1}{2}}.", "\\frac{1}{2}"),
        ("\\boxed{a} then \\boxed{ {x}^2 }", "{x}^2"),  # the last box, braces balanced
        ("She has 3 + 4 = 7 apples.\n#### 7", "7"),
        ("#### $1,000.", "1000"),
        ("12 eggs at $2 each is $24.", "24"),
        ("The change is -3.5 degrees", "-3.5"),
        ("a ratio of 3/4", "3/4"),
        ("1,234,567 people", "1234567"),
        ("no number here", None),
        ("cut off at \\boxed{12", None),  # an unclosed last box: no answer, not the 12 inside it
        ("", None),
    ],
)
def test_the_final_answer(text: str, answer: str | None) -> None:
    assert final_answer(text) == answer


@pytest.mark.parametrize(
    ("response", "answer", "score"),
    [
        # GSM8K: the reference is "... #### n"; a response may box, hash or just end on the number
        ("She sold 48 + 24 = 72 clips.", "48/2 = 24 in May, 48+24 = 72\n#### 72", 1.0),
        ("#### 72", "Natalia sold 72 clips.\n#### 72", 1.0),
        ("The answer is \\boxed{72}.", "#### 72", 1.0),
        ("So 72.0 in all", "#### 72", 1.0),
        ("#### 1,000", "#### 1000", 1.0),
        ("She sold 71 clips.", "#### 72", 0.0),
        ("72 clips, and 3 left over", "#### 72", 0.0),  # the last number is the answer
        # MATH: the reference is the answer (or a solution with its \boxed{}); equal by value...
        ("\\boxed{0.5}", "\\frac{1}{2}", 1.0),
        ("\\boxed{\\frac12}", "0.5", 1.0),
        ("\\boxed{1/2}", "\\frac{1}{2}", 1.0),
        ("\\boxed{\\dfrac{2}{4}}", "The solution ... is $\\boxed{\\frac{1}{2}}$.", 1.0),
        ("\\boxed{\\frac{\\sqrt{2}}{2}}", "\\frac{1}{\\sqrt{2}}", 1.0),
        ("\\boxed{0.6}", "\\frac{1}{2}", 0.0),
        # ... and symbolically
        ("\\boxed{(x+1)^2}", "x^2+2x+1", 1.0),
        ("\\boxed{x^2+1+2x}", "(x+1)^2", 1.0),
        ("\\boxed{(x+1)^3}", "x^2+2x+1", 0.0),
        ("\\boxed{\\left( 3, \\frac{\\pi}{2} \\right)}", "\\left( 3, \\frac{\\pi}{2} \\right)", 1.0),
        ("no answer at all", "7", 0.0),
        ("", "7", 0.0),
    ],
)
def test_math(response: str, answer: str, score: float) -> None:
    """What is equal; not how long the symbolic check may take (the default 1 s is tight on a busy machine: the time
    limit has tests of its own)."""
    assert bind_verifier("math", {"timeout_s": 30})(response, answer) == score


def test_plain_numbers_are_compared_exactly() -> None:
    verify = bind_verifier("math")
    assert verify("#### 3/4", "0.75") == 1.0
    assert verify("#### 0.333", "1/3") == 0.0  # no rounding between two plain numbers
    assert verify("#### 1/0", "5") == 0.0


@pytest.mark.parametrize("answer", ["", "   ", "$$", "a solution without its end \\boxed{12"])
def test_a_math_reference_without_an_answer_is_a_data_bug(answer: str) -> None:
    with pytest.raises(ValueError, match="no final answer"):
        bind_verifier("math")("\\boxed{12}", answer)


# --------------------------------------------------------------------------- regex


@pytest.mark.parametrize(
    ("response", "score"),
    [
        ("Answer: Paris", 1.0),
        ("thinking... Answer: London. Final Answer: paris!", 1.0),  # the last match, normalised
        ("Answer: London", 0.0),
        ("Paris", 0.0),  # no match
        ("", 0.0),
    ],
)
def test_regex(response: str, score: float) -> None:
    assert bind_verifier("regex", {"pattern": r"Answer:\s*(\w+)"})(response, "Paris") == score


def test_regex_flags_go_inline_and_an_unmatched_group_scores_zero() -> None:
    assert bind_verifier("regex", {"pattern": r"(?i)answer=(\d+)"})("ANSWER=42", "42") == 1.0
    assert bind_verifier("regex", {"pattern": r"x(\d)?"})("x", "1") == 0.0


# --------------------------------------------------------------------------- hostile responses

HUGE_POWER = "\\boxed{10^{10^{10}}}"
HOSTILE_MATH = {
    "10**10**10 as text": "10**10**10",
    "10^{10^{10}} boxed": HUGE_POWER,
    "9^{9^{9^9}} boxed": "\\boxed{9^{9^{9^{9}}}}",
    "a tower minus itself": "\\boxed{10^{10^{10}} - 10^{10^{10}} + 5}",
    "100k digits": "9" * 100_000,
    "100k digits boxed": "\\boxed{" + "9" * 100_000 + "}",
    "100k digits after ####": "#### " + "9" * 100_000,
    "\\boxed{ x 10000, unclosed": "\\boxed{" * 10_000,
    "\\boxed{ x 10000, closed": "\\boxed{" * 10_000 + "}" * 10_000,
    "braces x 10000": "{" * 10_000 + "4" + "}" * 10_000,
    "\\frac nested 90 deep": "\\boxed{" + "\\frac{1}{" * 90 + "2" + "}" * 90 + "}",  # within MAX_ANSWER_CHARS
    "\\sqrt nested 130 deep": "\\boxed{" + "\\sqrt{" * 130 + "2" + "}" * 130 + "}",
    "x^x^x... 200 deep": "\\boxed{" + "x^{" * 200 + "x" + "}" * 200 + "}",
    "1 MB of letters": "x" * 2**20,
    "1 MB of numbers": "7 " * 2**19,
    "1 MB of \\boxed": "\\boxed{7}" * (2**20 // 9),
    "lone surrogate": "\\boxed{\ud800}",
    "NUL": "\\boxed{\x00}",
    "unbalanced LaTeX": "\\boxed{\\left( \\frac{1}{2} \\right] \\begin{matrix} && \\sqrt[}",
}


@pytest.mark.parametrize("name", HOSTILE_MATH)
def test_a_hostile_math_response_scores_zero_in_bounded_time(name: str) -> None:
    result, took = timed(bind_verifier("math", FAST), HOSTILE_MATH[name], "5")
    print(f"math {name}: {result} in {took * 1000:.1f} ms")
    assert result == 0.0
    assert took < BOUND_S


HOSTILE_TEXT = {
    "answer and 100k spaces": "answer" + " " * 100_000 + "x",
    "answer and 50k colons": "answer" + " :" * 50_000,
    "100k answers": "answer " * 100_000,
    "1 MB of spaces": " " * 2**20 + "x",
    "100k brackets": "(" * 100_000,
    "a letter and 100k spaces": "C" + " " * 100_000 + "x",
    "\\boxed{ x 10000": "\\boxed{" * 10_000,
    "1 MB of letters": "C" * 2**20,
}


@pytest.mark.parametrize("verifier", ["exact", "choice"])
@pytest.mark.parametrize("name", HOSTILE_TEXT)
def test_a_hostile_response_scores_zero_in_bounded_time(verifier: str, name: str) -> None:
    result, took = timed(bind_verifier(verifier), HOSTILE_TEXT[name], "B")
    print(f"{verifier} {name}: {result} in {took * 1000:.1f} ms")
    assert result == 0.0
    assert took < BOUND_S


@pytest.mark.parametrize(
    ("pattern", "response"),
    [
        (r"^(a+)+$", "a" * 40 + "!"),  # exponential backtracking
        (r"^(\w+\s?)*$", "word " * 30 + "!"),
        (r"(x+x+)+y", "x" * 5000),
        (r"Answer: (\w+)$", "Answer: " * 2**17),  # 1 MB
    ],
)
def test_backtracking_bait_for_the_regex_verifier_scores_zero_in_bounded_time(pattern: str, response: str) -> None:
    result, took = timed(bind_verifier("regex", {"pattern": pattern, **FAST}), response, "a")
    print(f"regex {pattern!r}: {result} in {took * 1000:.1f} ms")
    assert result == 0.0
    assert took < BOUND_S


def test_after_a_timed_out_check_the_judge_answers_again() -> None:
    verify = bind_verifier("math", FAST)
    assert verify(HUGE_POWER, "5") == 0.0
    assert verify("\\boxed{\\frac{10}{2}}", "5") == 1.0


# --------------------------------------------------------------------------- the judge process


def test_a_judge_child_that_stops_answering_is_killed_and_replaced() -> None:
    """A child stuck where its own timer cannot reach (here: stopped) is killed at timeout_s + grace."""
    own = Judge()
    try:
        assert own.ask(MATH_JOB, ("5", "\\frac{10}{2}"), 5.0) is True
        assert own._process is not None
        stuck = own._process.pid
        os.kill(stuck, signal.SIGSTOP)
        start = time.perf_counter()
        assert own.ask(MATH_JOB, ("5", "5"), 0.2) is False
        print(f"a stuck child answered False after {time.perf_counter() - start:.2f} s")
        assert own.restarts == 1
        with pytest.raises(ProcessLookupError):
            os.kill(stuck, 0)  # killed and reaped
        assert own.ask(MATH_JOB, ("5", "\\frac{10}{2}"), 5.0) is True  # a new child answers
    finally:
        own.close()


def test_the_judge_child_ends_when_its_parent_dies() -> None:
    script = textwrap.dedent(
        """
        import os
        from asyncrl.common.rewards.judge import judge
        from asyncrl.common.rewards.verifiers import REGEX_JOB
        assert judge().ask(REGEX_JOB, ("(a)", "a", "a"), 5.0)
        print(judge()._process.pid, flush=True)
        os._exit(0)  # no clean-up: the child only sees its pipe close
        """
    )
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    child = int(done.stdout.split()[0])
    wait_for(lambda: not _running(child), "end of the orphaned judge child", timeout_s=30)


def _running(pid: int) -> bool:
    """Whether ``pid`` is a live process (not gone, not a zombie waiting for its new parent to reap it)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


# --------------------------------------------------------------------------- options and config


@pytest.mark.parametrize(
    ("name", "options", "message"),
    [
        ("math", {"timeout_sec": 2}, "verifier 'math': unknown option(s) 'timeout_sec'; allowed: timeout_s"),
        ("math", {"timeout_s": 0}, "option 'timeout_s' must be a number of seconds"),
        ("exact", {"letters": "AB"}, "verifier 'exact': unknown option(s) 'letters'; allowed: none"),
        ("regex", {}, "needs option 'pattern'"),
        ("regex", {"pattern": "(unclosed"}, "option 'pattern' '(unclosed' is not a regular expression"),
        ("regex", {"pattern": r"Answer: \w+"}, "has no capture group"),
        ("choice", {"letters": "AB1"}, "option 'letters' must be distinct letters"),
        ("choice", {"letters": "ABA"}, "option 'letters' must be distinct letters"),
    ],
)
def test_a_bad_verifier_option_is_refused_when_bound(name: str, options: dict, message: str) -> None:
    with pytest.raises(ConfigError) as raised:
        bind_verifier(name, options)
    assert message in str(raised.value)


def file_task(*overrides: str):
    return load_config(None, ["task.name='file'", "task.path='prompts.jsonl'", *overrides])


def test_a_file_task_naming_math_is_scored_by_math() -> None:
    from asyncrl.cli.preflight import check_config

    config = file_task("task.options={verifier='math'}")
    check_config(config)  # the file is not read
    [task] = bind_functions(config.reward.functions, task_label(config.task))
    group = make_group(
        ["so \\boxed{\\frac12}", "#### 0.5", "1/3", "", HUGE_POWER], task="math", prompt="half of 1?", answer="1/2"
    )
    assert score(task, group) == [1.0, 1.0, 0.0, 0.0, 0.0]


def test_verifier_options_come_from_the_task_function() -> None:
    config = file_task(
        "task.options={verifier='regex'}", "reward.functions=[{name='task', options={pattern='Answer: (\\w+)'}}]"
    )
    [task] = bind_functions(config.reward.functions, task_label(config.task))
    assert task.options == {"verifier": "regex", "pattern": r"Answer: (\w+)"}
    assert score(task, make_group(["Answer: Paris", "Answer: Rome"], answer="paris")) == [1.0, 0.0]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["task.options={verifier='math'}", "reward.functions=[{name='task', options={timeout_sec=2}}]"],
            "verifier 'math': unknown option(s) 'timeout_sec'; allowed: timeout_s",
        ),
        (["task.options={verifier='regex'}"], "verifier 'regex': needs option 'pattern'"),
        (
            ["reward.functions=[{name='task', options={verifier='regex', pattern='(a'}}]"],
            "verifier 'regex': option 'pattern' '(a' is not a regular expression",
        ),
        (["task.options={verifier='mathh'}"], "unknown verifier 'mathh'"),
    ],
)
def test_a_verifier_typo_is_refused_at_config_check(overrides: list[str], message: str) -> None:
    from asyncrl.cli.preflight import check_config

    with pytest.raises(ValueError) as raised:
        check_config(file_task(*overrides))
    assert message in str(raised.value)


def test_the_task_function_refuses_an_unknown_verifier_option_at_bind_time() -> None:
    with pytest.raises(ConfigError, match="unknown option"):
        bind_functions([RewardFunction(name="task", options={"verifier": "exact", "pattern": "x"})], "file")
