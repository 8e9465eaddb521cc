"""What ``rl-learner check-data`` makes of a data check: the verdicts (failures, warnings, the exit code) and the
report as text or JSON. The checks themselves are ``cli/data_check.py``."""

from __future__ import annotations

import math
from typing import Any

from asyncrl.cli.data_check import MAX_LISTED, Report, SelfCheck, row_number


def failures(report: Report, strict: bool = False) -> list[str]:
    """Why check-data exits 1 (none: 0); with ``strict`` every warning is one too."""
    out = []
    if report.refused_rows < len(report.refused):
        out.append("the run cannot read the file")
    if report.refused_rows:
        out.append(f"{_rows(report.refused_rows)} refused: the run refuses the file at the first")
    if report.too_long and report.overlong == "refuse":
        out.append(f'{_rows(len(report.too_long))} too long to serve, and task.overlong = "refuse"')
    if not report.refused and not report.servable:
        out.append("no row the run can serve")
    for check in report.checks:
        if check.raised:
            out.append(f"verifier {check.verifier!r} raises on {len(check.raised)} reference answer(s)")
    return out + (warnings(report) if strict else [])


def warnings(report: Report) -> list[str]:
    """What is worth a look but does not stop the run."""
    out = []
    if report.too_long and report.overlong == "skip":
        out.append(f'{_rows(len(report.too_long))} too long to serve (task.overlong = "skip" leaves them out)')
    if report.duplicates:
        out.append(f"{_rows(sum(len(g) - 1 for g in report.duplicates))} repeat an earlier row's prompt")
    if report.empty_answers:
        out.append(f"{_rows(len(report.empty_answers))} with an empty answer")
    if report.long_answers:
        out.append(f"{_rows(len(report.long_answers))} with an answer longer than rollout.max_new_tokens")
    if report.no_second_turn:
        out.append(f"{_rows(len(report.no_second_turn))} whose first observation leaves no room for a second turn")
    for check in report.checks:
        if check.below:
            out.append(f"verifier {check.verifier!r} scores {len(check.below)} reference answer(s) below 1.0")
    return out


def exit_code(report: Report, strict: bool = False) -> int:
    return 1 if failures(report, strict) else 0


def _rows(n: int) -> str:
    return f"{n} row{'' if n == 1 else 's'}"


def spread(values: list[int]) -> dict[str, int] | None:
    """``min``, ``median``, ``p95`` and ``max`` of ``values`` by nearest rank (each is one of the values)."""
    if not values:
        return None
    ordered = sorted(values)

    def rank(q: float) -> int:
        return ordered[max(0, math.ceil(q * len(ordered)) - 1)]

    return {"min": ordered[0], "median": rank(0.5), "p95": rank(0.95), "max": ordered[-1]}


# --------------------------------------------------------------------------- output


def as_json(report: Report, strict: bool = False) -> dict[str, Any]:
    """The report as one JSON object (``--json``), every row named."""
    return {
        "file": report.file,
        "model": report.model,
        "chat": report.chat,
        "rows": {
            "read": report.read,
            "checked": report.checked,
            "refused": report.refused_rows,
            "servable": report.servable,
        },
        "refused": [{"row": where, "reason": reason} for _, where, reason in report.refused],
        "prompt_tokens": spread(report.prompt_tokens),
        "answer_tokens": spread(report.answer_tokens),
        "limit_tokens": report.limit_tokens,
        "overlong": report.overlong,
        "too_long": [{"row": where, "tokens": n} for where, n in report.too_long],
        "long_answers": [{"row": where, "tokens": n} for where, n in report.long_answers],
        "no_second_turn": [{"row": where, "tokens": n} for where, n in report.no_second_turn],
        "duplicates": [
            {"rows": [where for where, _ in group], "same_answer": len({a for _, a in group}) == 1}
            for group in report.duplicates
        ],
        "empty_answers": report.empty_answers,
        "unknown_characters": [
            {"char": char, "codepoint": f"U+{ord(char):04X}", "rows": rows}
            for char, rows in sorted(report.unknown.items())
        ],
        "self_check": [_check_json(check) for check in report.checks],
        "warnings": warnings(report),
        "failures": failures(report, strict),
        "exit": exit_code(report, strict),
    }


def _check_json(check: SelfCheck) -> dict[str, Any]:
    return {
        "verifier": check.verifier,
        "checked": check.checked,
        "passed": check.passed,
        "below": [{"row": where, "score": score} for where, score in check.below],
        "raised": [{"row": where, "error": error} for where, error in check.raised],
        "note": check.note,
    }


def render(report: Report, strict: bool = False) -> str:
    """The report for a person: every finding with its first :data:`MAX_LISTED` rows, then the verdict."""
    lines = [
        f"check-data: {report.file}",
        f"  model {report.model} ({'its chat template' if report.chat else 'no chat template'})",
        f"  prompts of at most {report.limit_tokens} tokens (model.max_model_len {report.max_model_len} - "
        f"rollout.max_new_tokens {report.max_new_tokens})",
        f"rows: {report.read} read, {report.checked} checked, {report.refused_rows} refused, "
        f"{report.servable} ready to serve",
    ]
    if report.refused:
        lines.append("refused (the run stops at the first):")
        lines += [f"  {where}: {reason}" for _, where, reason in report.refused[:MAX_LISTED]]
        lines += _more(len(report.refused))
    lines += _token_lines(report) + _finding_lines(report) + _check_lines(report)
    verdict = failures(report, strict)
    lines.append(f"exit 1: {'; '.join(verdict)}" if verdict else f"exit 0: {len(warnings(report))} warning(s)")
    return "\n".join(lines)


def _token_lines(report: Report) -> list[str]:
    lines = ["tokens (min / median / p95 / max):"]
    for name, values in (("prompt", report.prompt_tokens), ("answer", report.answer_tokens)):
        figures = spread(values)
        shown = " / ".join(str(v) for v in figures.values()) if figures else "no rows"
        lines.append(f"  {name:<8}{shown}")
    return lines


def _finding_lines(report: Report) -> list[str]:
    action = "the run refuses the file" if report.overlong == "refuse" else "the run leaves them out"
    findings = [
        (f"too long to serve (task.overlong = {report.overlong!r}: {action})", _named(report.too_long, "tokens")),
        ("answers longer than rollout.max_new_tokens", _named(report.long_answers, "tokens")),
        (
            "no room for a second turn after a first one of rollout.max_new_tokens (model.max_model_len, "
            "environment.max_episode_tokens): the episode ends after the model's first turn",
            _named(report.no_second_turn, "tokens"),
        ),
        ("duplicate prompts", [_duplicate(group) for group in report.duplicates]),
        ("empty answers", report.empty_answers),
        *(
            (f"unknown to the tokenizer: {char!r} (U+{ord(char):04X})", rows)
            for char, rows in sorted(report.unknown.items())
        ),
    ]
    lines = []
    for title, rows in findings:
        if rows:
            lines.append(f"{title}: {len(rows)}")
            lines += [f"  {row}" for row in rows[:MAX_LISTED]] + _more(len(rows))
    return lines


def _check_lines(report: Report) -> list[str]:
    if not report.checks:
        return ["verifier self-check: no 'task' reward function"]
    lines = []
    for check in report.checks:
        head = f"verifier self-check ({check.verifier}): {check.passed} of {check.checked} reference answers score 1.0"
        lines.append(head + (f" ({check.note})" if check.note else ""))
        found = [(where, f"scores {score:g}") for where, score in check.below]
        found += [(where, f"raises {error}") for where, error in check.raised]
        found.sort(key=lambda pair: row_number(pair[0]))
        lines += [f"  {where}: {said}" for where, said in found[:MAX_LISTED]] + _more(len(found))
    return lines


def _named(pairs: list[tuple[str, Any]], unit: str) -> list[str]:
    return [f"{where}: {value:g} {unit}" for where, value in pairs]


def _duplicate(group: list[tuple[str, str]]) -> str:
    (first, _), *rest = group
    same = len({answer for _, answer in group}) == 1
    return f"{first}: repeated at {', '.join(where for where, _ in rest)}" + ("" if same else " (different answers)")


def _more(n: int) -> list[str]:
    return [f"  ... and {n - MAX_LISTED} more (--json lists all)"] if n > MAX_LISTED else []
