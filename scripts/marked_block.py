"""A page's generated block: the text between its one begin-marker line and its one end-marker line, which a script
writes from result files (README's results table and the docs pages' tables: ``scripts/demo_comparison_docs.py``,
``scripts/moe_speed_table.py``). Imports nothing beyond the standard library, so a table script stays light."""

from __future__ import annotations

from pathlib import Path


class MarkerError(ValueError):
    """A page without exactly one begin marker followed by one end marker."""


def page_block(page: Path, begin: str, end: str, text: str | None = None) -> str:
    """The block between the markers ``begin`` and ``end`` of ``page`` (of ``text``, the page's text, where given)."""
    text = page.read_text(encoding="utf-8") if text is None else text
    if text.count(begin) != 1 or text.count(end) != 1 or text.index(begin) > text.index(end):
        raise MarkerError(f"{page}: expected one {begin} line and then one {end} line around the generated block")
    return text.split(begin)[1].split(end)[0].strip("\n")


def with_block(page: Path, begin: str, end: str, block: str, text: str | None = None) -> str:
    """``page``'s text (or ``text``, the page's text with earlier blocks already written) with ``block`` between its
    markers (checked to be there)."""
    text = page.read_text(encoding="utf-8") if text is None else text
    page_block(page, begin, end, text)
    head, rest = text.split(begin)
    return f"{head}{begin}\n{block}\n{end}{rest.split(end)[1]}"
