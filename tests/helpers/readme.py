"""The README as the tests read it: the shell block of its "On a cluster" section, which ``common/deploy.py`` builds
(checked in ``tests/unit/test_across_hosts.py``) and ``tests/e2e/test_multi_host.py`` runs."""

from __future__ import annotations

import re

from tests.helpers.stack import ROOT


def readme_block() -> str:
    """The shell block of the README's "On a cluster" section."""
    after = (ROOT / "README.md").read_text().split("\n### On a cluster\n", 1)[1]
    section = re.split(r"\n#{2,3} ", after, maxsplit=1)[0]
    return section.split("```bash\n", 1)[1].split("```", 1)[0]
