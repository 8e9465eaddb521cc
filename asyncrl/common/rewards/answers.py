"""Finding the answer in a response: the last ``\\boxed{}``, a GSM8K ``####`` line or the last number
(:func:`final_answer`), the letter of a multiple-choice answer (:func:`chosen_letter`), and the normal form exact
answers are compared in (:func:`normalise`). Every function is linear in the length of the text and bounded by
:data:`MAX_ANSWER_CHARS`: responses are hostile input. The verifiers that use them are ``common/rewards/verifiers.py``.
"""

from __future__ import annotations

import functools
import re

MAX_ANSWER_CHARS = 1000
"""A final answer (``math``'s ``\\boxed{}`` content, number or ``####`` line) longer than this scores 0.0 unparsed."""


# Surrounding characters normalise() strips: whitespace, sentence punctuation, quotes, brackets, markdown emphasis
# and `$`. Not `-`, `+` or `%`, which change what an answer says ("-5" is not "5").
_SURROUNDING = " \t\n\r\f\v.,;:!?'\"`()[]{}*_$“”‘’«»"


def normalise(text: str) -> str:
    """``text`` case-folded (``str.casefold``), with surrounding whitespace, ``. , ; : ! ? ' " ` ( ) [ ] { } * _ $``
    and typographic quotes stripped from both ends, and each inner run of whitespace collapsed to one space.

    ``normalise('  "The  Eiffel\\nTower."  ') == "the eiffel tower"``; ``normalise("(B)") == "b"``.
    """
    return " ".join(text.casefold().strip(_SURROUNDING).split())


_BOX = re.compile(r"\\(?:boxed|fbox)\s*\{")


def last_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` (or ``\\fbox{...}``) in ``text``, braces balanced, stripped.

    None when there is none, or when the last one is not closed within :data:`MAX_ANSWER_CHARS` characters (a
    cut-off final answer is no answer: an earlier box is not searched for). Linear in ``len(text)``.
    """
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    opened = _BOX.match(text, start) if start >= 0 else None
    if opened is None:
        return None
    depth = 1
    for i in range(opened.end(), min(len(text), opened.end() + MAX_ANSWER_CHARS + 1)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[opened.end() : i].strip()
    return None


_TEXT = re.compile(r"\\(?:text|mathrm|textbf)\s*\{")


@functools.lru_cache(maxsize=64)
def _choice_patterns(letters: str) -> tuple[re.Pattern[str], re.Pattern[str]]:
    """``(after "answer", opening the response)``. No two repeats that can match the same text are adjacent
    (``\\s*:?\\s*`` would take quadratic time on ``answer`` and 100k spaces), so both take linear time on any text."""
    one = f"[{re.escape(letters)}]"
    stated = re.compile(rf"(?i:answer)(?:\s+(?i:is))?\s*(?::\s*)?[*_]{{0,2}}[(\[]?({one})[)\]]?[*_]{{0,2}}(?!\w)")
    opening = re.compile(rf"\s*(?:[(\[]({one})[)\]]|({one})[.):](?=\s|$)|({one})[^\S\n]*(?:\n|$))")
    return stated, opening


def chosen_letter(response: str, letters: str = "ABCDE") -> str | None:
    """The letter a response chooses, or None; ``letters`` are matched case-sensitively.

    In order: the content of the last ``\\boxed{}`` when it is one letter (``\\boxed{B}``, ``\\boxed{(B)}``,
    ``\\boxed{\\text{B}}``); else the last ``answer`` (any case), optionally ``is`` and ``:``, then the letter alone
    (``Answer: B``, ``the answer is (B).``, ``answer: **B**``); else a letter opening the response, alone on its line or
    bracketed or followed by ``.``, ``)`` or ``:`` (``B``, ``(B) Paris``, ``B. Paris``; not ``A cat``).
    """
    stated, opening = _choice_patterns(letters)
    boxed = last_boxed(response)
    if boxed is not None and len(inside := _TEXT.sub("", boxed).strip(" ()[]{}.")) == 1 and inside in letters:
        return inside
    last = None
    for last in stated.finditer(response):  # noqa: B007 (the last match is wanted)
        pass
    if last is not None:
        return last.group(1)
    first = opening.match(response)
    return next(g for g in first.groups() if g) if first else None


GROUPED_NUMBER = re.compile(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?")  # 1,234,567.5: thousands separators


_NUMBER = re.compile(rf"{GROUPED_NUMBER.pattern}|-?\d+(?:\.\d+)?(?:/\d+)?")  # the last number of a response


PLAIN_NUMBER = re.compile(r"-?\d+(?:\.\d+)?(?:/\d+)?")  # compared exactly, without math-verify


_DIGIT = re.compile(r"\d")


def final_answer(text: str) -> str | None:
    """The final answer a response states, as text, or None; at most :data:`MAX_ANSWER_CHARS` characters.

    In order: the content of the last ``\\boxed{...}`` (:func:`last_boxed`; a response with an unclosed last box has
    no answer); else what follows the last ``####`` on its line (GSM8K's format); else the last number (``-``,
    digits, an optional ``.`` and decimals or ``/`` and a denominator; ``1,234`` with thousands separators). Any
    ``$`` is dropped and thousands separators are removed. Linear in ``len(text)``.
    """
    if "\\boxed" in text or "\\fbox" in text:
        answer = last_boxed(text)
    elif (hashes := text.rfind("####")) >= 0:
        answer = text[hashes + 4 :].split("\n", 1)[0][: MAX_ANSWER_CHARS + 1]
    else:
        answer = _last_number(text)
    if answer is None:
        return None
    answer = answer.replace("\\$", "").replace("$", "").strip().rstrip(".").strip()
    if GROUPED_NUMBER.fullmatch(answer):
        answer = answer.replace(",", "")
    return answer if 0 < len(answer) <= MAX_ANSWER_CHARS else None


def _last_number(text: str) -> str | None:
    """The last number in ``text``, found from its last digit backwards (a regex scan from the start of 1 MB of
    numbers would make a match object for each); None when it is longer than :data:`MAX_ANSWER_CHARS`."""
    last_digit = _DIGIT.search(text[::-1])
    if last_digit is None:
        return None
    end = len(text) - last_digit.start()
    start = max(0, end - MAX_ANSWER_CHARS - 1)
    number = None
    for number in _NUMBER.finditer(text, start, end):  # noqa: B007 (the last match is wanted)
        pass
    if number is None or (number.start() == start and start > 0):  # it may begin before the window: too long
        return None
    return number.group()
