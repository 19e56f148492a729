"""The commands of a tutorial page, as its reader types them: each fenced ```bash block of a markdown page, its
``\\`` continuations joined and its ``#`` comments (whole-line and trailing) dropped, one argv list per command.

The tutorial tests run these lists, so a page is tested as written, never through a copy of its commands.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

#: The tutorial pages, one walk-through each.
TUTORIALS = Path(__file__).resolve().parents[1] / "docs" / "tutorials"

#: How a tutorial calls mmoe: the command ``bash scripts/setup.sh`` installs, from the repository root.
MMOE = ".venv/bin/mmoe"

#: A fenced block: its opening fence (indented as a list item's may be), language and body up to the closing fence.
FENCED_BLOCK = re.compile(
    r"^(?P<indent>[ \t]*)```(?P<language>[^\n`]*)\n(?P<body>.*?)^(?P=indent)```[ \t]*$", re.M | re.S
)


def bash_blocks(markdown: str) -> list[str]:
    """The bodies of the page's fenced ``bash`` blocks, in page order (blocks of other languages left out)."""
    return [block["body"] for block in FENCED_BLOCK.finditer(markdown) if block["language"].strip() == "bash"]


def block_commands(body: str) -> list[list[str]]:
    """One block's commands: lines ending in ``\\`` joined to the next, then each line split as the shell would
    (quotes kept together, ``#`` comments dropped); lines left empty are skipped."""
    joined = re.sub(r"\\\n", " ", body)
    return [argv for line in joined.splitlines() if (argv := shlex.split(line, comments=True))]


def page_commands(page: Path) -> list[list[str]]:
    """Every command of the page's ``bash`` blocks, in the order a reader runs them."""
    return [argv for body in bash_blocks(page.read_text(encoding="utf-8")) for argv in block_commands(body)]


def mmoe_arguments(argv: list[str]) -> list[str] | None:
    """The arguments of an ``mmoe`` command (what :func:`mmoe.cli.main` takes), or None for another program."""
    return argv[1:] if argv[0] == MMOE else None


def tutorial_demo_argv() -> list[str]:
    """The arguments of the one ``mmoe demo`` command of docs/tutorials/demo.md."""
    (demo,) = [
        args for argv in page_commands(TUTORIALS / "demo.md") if (args := mmoe_arguments(argv)) and args[0] == "demo"
    ]
    return demo
