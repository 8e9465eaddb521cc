"""A test of what only some machines can do is skipped where the machine cannot and fails where it must (CI); no test
skips any other way, and none skips for a missing dependency (a declared one is imported, and fails if absent)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.helpers.machine import REQUIRE_ENV, unavailable

ROOT = Path(__file__).resolve().parents[2]


def test_a_machine_that_cannot_skips_and_one_that_must_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(REQUIRE_ENV, raising=False)
    with pytest.raises(pytest.skip.Exception, match="no namespaces here"):
        unavailable("no namespaces here")
    monkeypatch.setenv(REQUIRE_ENV, "1")
    with pytest.raises(pytest.fail.Exception, match="no namespaces here; this machine is expected to"):
        unavailable("no namespaces here")


def test_ci_requires_what_its_machine_can_do() -> None:
    assert f"export {REQUIRE_ENV}=1" in (ROOT / ".ci/run").read_text()


def test_no_test_skips_but_through_the_machine_check() -> None:
    skipping = re.compile(r"pytest\.(skip|importorskip)\(|@pytest\.mark\.skip")
    helper = ROOT / "tests/helpers/machine.py"
    found = [
        f"{path.relative_to(ROOT)}:{n}"
        for path in sorted((ROOT / "tests").rglob("*.py"))
        if path not in (helper, Path(__file__).resolve())
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if skipping.search(line)
    ]
    assert not found, found
