"""The repository's own promises: README's commands are the ones CI and newcomers run."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def readme_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    quick_start = text.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    return [block.strip() for block in re.findall(r"```bash\n(.*?)```", quick_start, flags=re.S)]


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
