"""The repository's own promises: README's commands are the ones CI and newcomers run."""

from __future__ import annotations

import re
from pathlib import Path

from tests.tutorial_commands import bash_blocks

ROOT = Path(__file__).resolve().parents[1]


def readme_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    quick_start = text.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    return [block.strip() for block in bash_blocks(quick_start)]


def test_readme_has_two_newcomer_commands_starting_with_setup():
    commands = readme_commands()
    assert len(commands) == 2
    assert all(command.startswith("bash scripts/setup.sh && .venv/bin/") for command in commands)


def test_ci_runs_the_readme_test_command():
    test_command = readme_commands()[1]
    assert test_command in (ROOT / ".ci" / "run").read_text().splitlines()


def test_readme_first_command_runs_an_mmoe_subcommand_that_exists():
    """The newcomer's command is the console script the package declares, with a subcommand it has."""
    import tomllib

    from mmoe.cli import COMMANDS

    first = readme_commands()[0].split("&&", 1)[1].split()
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert first[0] == ".venv/bin/mmoe" and scripts["mmoe"] == "mmoe.cli:main"
    assert first[1] in COMMANDS


def test_ci_fails_when_pytest_collects_nothing():
    """pytest's exit code 5 (no tests collected) is a failure of CI, not a pass."""
    ci = (ROOT / ".ci" / "run").read_text()
    assert "exit 0" not in ci and "-eq 5" not in ci


#: README is the front page: what mmoe is, the newcomer's commands and where to read on; the rest lives in docs/.
README_MAX_LINES = 300


def test_readme_stays_a_front_page():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines; move sections into docs/"


def heading_anchors(markdown: str) -> set[str]:
    """The ids Python-Markdown's ``toc`` (GitHub's rule agrees for plain words) gives the headings outside code."""
    prose = re.sub(r"```.*?```", "", markdown, flags=re.S)
    anchors = set()
    for heading in re.findall(r"^#{1,6} (.+)$", prose, flags=re.M):
        words = re.sub(r"[^\w\s-]", "", heading.replace("`", "")).strip().lower()
        anchors.add(re.sub(r"[-\s]+", "-", words))
    return anchors


def relative_links(markdown: str) -> list[str]:
    """Targets of ``[text](target)`` and ``![alt](target)`` outside code, other than web addresses."""
    prose = re.sub(r"`[^`\n]*`", "", re.sub(r"```.*?```", "", markdown, flags=re.S))
    targets = re.findall(r"\]\(([^)\s]+)\)", prose)
    return [target for target in targets if not re.match(r"[a-z][a-z0-9+.-]*:", target)]


def test_every_relative_link_in_the_readme_reaches_a_file_and_its_heading():
    links = relative_links((ROOT / "README.md").read_text())
    assert links, "README.md links into docs/"
    for link in links:
        path, _, anchor = link.partition("#")
        target = ROOT / path if path else ROOT / "README.md"
        assert target.is_file(), f"README.md links to {link}, which is not a file of the repository"
        if anchor and target.suffix == ".md":
            assert anchor in heading_anchors(target.read_text()), f"README.md links to {link}: no such heading"


def test_link_checks_see_broken_links_and_anchors():
    """The helpers above find what a broken README would hold (a test of the test's parsing)."""
    text = "See [a](docs/x.md#part) and ![b](docs/y.png), not `[c](z.md)` or [d](https://e.org).\n## A `code` part\n"
    assert relative_links(text) == ["docs/x.md#part", "docs/y.png"]
    assert heading_anchors(text + "```\n# not a heading\n```\n") == {"a-code-part"}
