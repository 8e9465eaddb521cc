"""The user docs hold together: README.md is a front door (at most 250 lines) and docs/*.md hold the depth; every
relative link in them reaches a file; none cites an issue number; and every ``rl-learner``, ``rl-actor``,
``rl-launch`` and ``rl-top`` command line in their ```bash blocks parses against the real command-line apps — its
subcommand exists, its options are the command's, its values convert — without running anything (Click's
``make_context`` only parses; Typer builds its apps on its own copy of Click, so they are read through duck typing
and Typer's ``UsageError``)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path
from typing import Any

import pytest
import typer

from tests.helpers.readme import DOCS, README, doc_files, shell_blocks
from tests.helpers.stack import ROOT

README_MAX_LINES = 250
APPS = {
    "rl-learner": "asyncrl.cli.learner",
    "rl-actor": "asyncrl.cli.actor",
    "rl-launch": "asyncrl.cli.launch",
    "rl-top": "asyncrl.cli.top",
}
SHELL_OPERATORS = set("();<>|&")
FENCED = re.compile(r"^```.*?^```", flags=re.DOTALL | re.MULTILINE)
INLINE_CODE = re.compile(r"`[^`\n]*`")
INLINE_LINK = re.compile(r"\[[^\]\n]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE_LINK = re.compile(r"^\s{0,3}\[[^\]\n]+\]:\s*<?(\S+?)>?(?:\s.*)?$", flags=re.MULTILINE)
SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")
ISSUE = re.compile(r"\b(?:issues?|pr|pull request)\s*(?:#|no\.?\s*)?\d+|(?<![\w&#/])#\d+\b", flags=re.IGNORECASE)
# Typer parses with its own copy of Click: the error every bad command line raises is BadParameter's base.
UsageError = next(base for base in typer.BadParameter.__mro__ if base.__name__ == "UsageError")
DOC_IDS = [str(path.relative_to(ROOT)) for path in doc_files()]


def test_there_are_docs_beside_the_readme() -> None:
    assert {path.name for path in DOCS.glob("*.md")} >= {
        "algorithms.md",
        "benchmarks.md",
        "cluster.md",
        "configuration.md",
        "development.md",
        "environments.md",
        "operations.md",
        "security.md",
    }


def test_the_readme_is_a_front_door() -> None:
    lines = len(README.read_text().splitlines())
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines: move the depth into docs/"


def relative_links(text: str) -> list[str]:
    """The targets of the text's Markdown links that point into the repository (no scheme, not only an anchor),
    without their anchors; links shown inside code are not links."""
    prose = INLINE_CODE.sub("", FENCED.sub("", text))
    targets = INLINE_LINK.findall(prose) + REFERENCE_LINK.findall(prose)
    return [target.split("#", 1)[0] for target in targets if not SCHEME.match(target) and not target.startswith("#")]


def test_relative_links_are_found() -> None:
    text = "[a](docs/a.md) [b](https://x.org/b.md) [c](#c) [d](../d.md#e) `[e](e.md)`\n\n[f]: f.md\n"
    assert relative_links(text) == ["docs/a.md", "../d.md", "f.md"]


@pytest.mark.parametrize("path", doc_files(), ids=DOC_IDS)
def test_every_relative_link_reaches_a_file(path: Path) -> None:
    links = relative_links(path.read_text())
    missing = [target for target in links if not (path.parent / target).exists()]
    assert not missing, f"{path.relative_to(ROOT)} links to files that do not exist: {missing}"


def test_the_readme_links_every_doc() -> None:
    linked = {(README.parent / target).resolve() for target in relative_links(README.read_text())}
    assert not [path.name for path in DOCS.glob("*.md") if path.resolve() not in linked]


@pytest.mark.parametrize("path", doc_files(), ids=DOC_IDS)
def test_no_issue_numbers(path: Path) -> None:
    cited = [match.group(0) for match in ISSUE.finditer(path.read_text())]
    assert not cited, f"{path.relative_to(ROOT)} cites issues: {cited}"


def test_issue_numbers_are_recognised() -> None:
    for text in ("see issue #12", "Issue 11.2", "(#7)", "PR #3", "issues 4 and 5"):
        assert ISSUE.search(text), text
    for text in ("the issue record of each group", "#### 72", "`step-<N>`", "asyncrl:<run>:prompts"):
        assert not ISSUE.search(text), text


def command_lines(text: str) -> list[tuple[str, str, list[str]]]:
    """(line, command, its arguments) for every rl-* command in the text's shell blocks: continuation lines joined,
    comments dropped, the arguments up to the first shell operator."""
    found = []
    for block in shell_blocks(text):
        for line in block.replace("\\\n", " ").splitlines():
            if not any(re.search(rf"(?<![\w.-]){name}(?![\w-])", line) for name in APPS):
                continue
            lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
            lexer.whitespace_split = True
            words = list(lexer)
            for at, word in enumerate(words):
                if word in APPS:
                    args = words[at + 1 :]
                    ends = [i for i, arg in enumerate(args) if set(arg) <= SHELL_OPERATORS]
                    found.append((line.strip(), word, args[: ends[0]] if ends else args))
    return found


def test_command_lines_are_found() -> None:
    text = (
        "```bash\nFOO=1 rl-actor reward --run x  # a comment\ntorchrun --no-python rl-learner train a.toml \\\n"
        "    --set a.b=1 && rl-top --once\nkubectl exec asyncrl-learner-0 -- rl-top --run m\n```\n"
        "```toml\nrl-launch = 1\n```\n"
    )
    assert [(command, args) for _, command, args in command_lines(text)] == [
        ("rl-actor", ["reward", "--run", "x"]),
        ("rl-learner", ["train", "a.toml", "--set", "a.b=1"]),
        ("rl-top", ["--once"]),
        ("rl-top", ["--run", "m"]),
    ]


def subcommand_at(group: Any, args: list[str]) -> int | None:
    """Where the group's subcommand is among ``args`` (after the group's own options), or None."""
    at = 0
    while at < len(args):
        word = args[at]
        if word == "--":
            return at + 1 if at + 1 < len(args) else None
        if not word.startswith("-"):
            return at
        name = word.split("=", 1)[0]
        option = next((p for p in group.params if name in (*p.opts, *p.secondary_opts)), None)
        flag = option is None or getattr(option, "is_flag", False) or getattr(option, "count", False)
        takes_value = not flag and "=" not in word
        at += 2 if takes_value else 1
    return None


def parse(command: Any, name: str, args: list[str]) -> None:
    """Parse ``args`` as ``name`` would, down to its subcommand; raises UsageError where they do not fit.
    ``make_context`` parses and converts, it never invokes a command."""
    if isinstance(getattr(command, "commands", None), dict):  # a group of subcommands
        at = subcommand_at(command, args)
        if at is not None:
            own, sub, rest = args[:at], args[at], args[at + 1 :]
            if sub not in command.commands:
                raise UsageError(f"no command {sub!r} (there are {sorted(command.commands)})")
            if own:
                command.make_context(name, own)
            parse(command.commands[sub], f"{name} {sub}", rest)
            return
    command.make_context(name, list(args))


@pytest.fixture(scope="module")
def apps() -> dict[str, Any]:
    return {name: typer.main.get_command(__import__(module, fromlist=["app"]).app) for name, module in APPS.items()}


def test_parse_refuses_what_the_commands_would(apps: dict[str, Any]) -> None:
    parse(apps["rl-learner"], "rl-learner", ["train", "a.toml", "--resume", "latest", "--set", "a.b=1"])
    parse(apps["rl-actor"], "rl-actor", ["--run", "x", "--id", "actor-0"])
    parse(apps["rl-top"], "rl-top", ["--run", "x", "--once"])
    for name, args in [
        ("rl-learner", ["trian", "a.toml"]),  # no such subcommand
        ("rl-learner", ["train", "a.toml", "--resum", "latest"]),  # no such option
        ("rl-learner", ["init-model", "a.toml", "--warm-steps", "many"]),  # not an int
        ("rl-launch", ["run", "a.toml", "--actors"]),  # option without its value
        ("rl-actor", ["--rnu", "x"]),  # no such option of the group
        ("rl-top", ["status"]),  # rl-top takes no argument
    ]:
        with pytest.raises(UsageError):
            parse(apps[name], name, args)


@pytest.mark.parametrize("path", doc_files(), ids=DOC_IDS)
def test_every_command_line_shown_parses(path: Path, apps: dict[str, Any]) -> None:
    wrong = []
    for line, name, args in command_lines(path.read_text()):
        try:
            parse(apps[name], name, args)
        except UsageError as exc:
            wrong.append(f"{line}\n    {exc.format_message()}")
    assert not wrong, f"{path.relative_to(ROOT)}:\n" + "\n".join(wrong)


def test_every_command_is_shown_somewhere() -> None:
    shown = {name for path in doc_files() for _, name, _ in command_lines(path.read_text())}
    assert shown == set(APPS)
    assert {name for _, name, _ in command_lines(README.read_text())} == set(APPS)  # the front door shows each
