"""The Python snippets of the how-to guides run as written: each page's fenced ``python`` blocks, in page order, in
one namespace (a later block goes on from an earlier one), in a fresh working folder. A guide whose code no longer
matches mmoe's API fails here."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.tutorial_commands import FENCED_BLOCK

HOW_TO = Path(__file__).resolve().parents[1] / "docs" / "how-to"

#: The guides whose Python blocks are run, each with the number of blocks it holds (a block dropped from a page, or
#: one whose fence lost its language, fails too).
PAGES = {"add_a_router.md": 2, "add_a_task.md": 2, "export_weights.md": 1, "timm_vision_tower.md": 1}


def python_blocks(page: Path) -> list[str]:
    """The bodies of the page's fenced ``python`` blocks, in page order."""
    text = page.read_text(encoding="utf-8")
    return [block["body"] for block in FENCED_BLOCK.finditer(text) if block["language"].strip() == "python"]


@pytest.mark.parametrize("name", sorted(PAGES))
def test_python_blocks_run(name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    blocks = python_blocks(HOW_TO / name)
    assert len(blocks) == PAGES[name], f"{name}: {len(blocks)} python blocks, expected {PAGES[name]}"
    monkeypatch.chdir(tmp_path)
    namespace: dict = {"__name__": f"howto_{Path(name).stem}"}
    for index, body in enumerate(blocks):
        code = compile(body, f"{name} (python block {index + 1})", "exec")
        exec(code, namespace)  # the page's own code, as a reader runs it


def test_a_stale_snippet_fails(tmp_path: Path) -> None:
    """The runner reports a block that no longer runs: a name mmoe does not have."""
    page = tmp_path / "page.md"
    page.write_text("text\n\n```python\nfrom mmoe.moe import NoSuchRouter\n```\n", encoding="utf-8")
    (body,) = python_blocks(page)
    with pytest.raises(ImportError, match="NoSuchRouter"):
        exec(compile(body, "page.md", "exec"), {})
