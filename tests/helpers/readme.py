"""The user docs as the tests read them: README.md and every docs/*.md, and the shell block of docs/cluster.md's
"On a cluster" section, which ``cli/deploy.py`` builds (checked in ``tests/unit/cli/test_across_hosts.py``) and
``tests/e2e/test_multi_host.py`` runs."""

from __future__ import annotations

import re
from pathlib import Path

from tests.helpers.stack import ROOT

README = ROOT / "README.md"
DOCS = ROOT / "docs"


def doc_files() -> list[Path]:
    """README.md, then every docs/*.md in name order."""
    return [README, *sorted(DOCS.glob("*.md"))]


def docs_text() -> str:
    """The text of README.md and every docs/*.md, one after another."""
    return "\n".join(path.read_text() for path in doc_files())


def shell_blocks(text: str) -> list[str]:
    """The contents of the ```bash (or ```sh) blocks of a Markdown text."""
    return re.findall(r"^```(?:bash|sh)\n(.*?)^```", text, flags=re.DOTALL | re.MULTILINE)


def readme_block() -> str:
    """The shell block of the "On a cluster" section of docs/cluster.md."""
    after = (DOCS / "cluster.md").read_text().split("\n## On a cluster\n", 1)[1]
    section = after.split("\n## ", 1)[0]  # up to the next section ("# on 10.77.0.1" inside the block is a comment)
    return section.split("```bash\n", 1)[1].split("```", 1)[0]
