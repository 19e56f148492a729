"""The rows of a user's own table of images: CSV (a header row), JSON lines, or an LLaVA-style JSON list.

Each row is an object whose ``image`` field is an image path relative to the image folder. The format follows the
file's suffix: ``.csv`` (the header names the fields; a row is ``FILE:LINE``), ``.jsonl`` (one object per line,
``FILE:LINE``) and ``.json`` (a list of objects, ``FILE: record N`` counted from 0). Caption rows hold ``caption``, or
are LLaVA rows: ``conversations: [{from: human, value: "<image>\\n..."}, {from: gpt, value: CAPTION}]`` or the Hub's
``conversation: [{role: user, content}, {role: assistant, content}]``. An LLaVA row with one prompt and one answer is
a caption pair (the answer is the caption); rows with more turns, or without one image path, have no caption to learn
and are skipped and counted by cause (:class:`RowSkips`).
"""

from __future__ import annotations

import csv
import json
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from mmoe.data.converters.common import ConversionError, bounded_text, field, iter_json_lines, load_json
from mmoe.io import json_excerpt

#: The suffixes of the tables a user's own data may come in.
ROW_FORMATS = (".csv", ".jsonl", ".json")
_HUMAN, _ANSWER = {"human", "user"}, {"gpt", "assistant"}


class RowSkips(Counter):
    """Rows left out before their image is read, by cause (``multi-turn``, ``no image``), and the first of each."""

    def __init__(self) -> None:
        super().__init__()
        self.first: dict[str, str] = {}

    def add(self, cause: str, where: str) -> None:
        self[cause] += 1
        self.first.setdefault(cause, where)

    def report(self, source: Path) -> dict[str, Any]:
        """Says on stderr (one line) how many rows were skipped; returns the manifest entry ``skipped_rows``."""
        if self:
            causes = ", ".join(f"{count} {cause} (first: {self.first[cause]})" for cause, count in sorted(self.items()))
            print(f"{source}: skipped rows without a caption pair: {causes}", file=sys.stderr)
        return {"skipped_rows": dict(sorted(self.items()))}


def read_rows(path: str | Path) -> list[tuple[str, dict[str, Any]]]:
    """(``FILE:LINE`` or ``FILE: record N``, the row object) for every row of a CSV, JSON lines or JSON file."""
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix == ".csv":
        rows = list(_csv_rows(path))
    elif suffix == ".jsonl":
        rows = [(f"{path}:{line}", record) for line, record in iter_json_lines(path)]
    elif suffix == ".json":
        records = load_json(path)
        if not isinstance(records, list):
            raise ConversionError(f"{path}: expected a JSON list of records (LLaVA style), got {json_excerpt(records)}")
        rows = [(f"{path}: record {index}", record) for index, record in enumerate(records)]
        for where, record in rows:
            if not isinstance(record, dict):
                raise ConversionError(f"{where}: expected a JSON object, got {json_excerpt(record)}")
    else:
        raise ConversionError(f"{path}: unknown table format {suffix!r}; expected one of {', '.join(ROW_FORMATS)}")
    if not rows:
        raise ConversionError(f"{path}: no rows to convert")
    return rows


def _csv_rows(path: Path) -> Iterator[tuple[str, dict[str, Any]]]:
    """The rows of a CSV file with a header; empty cells read as absent fields."""
    try:
        with open(path, encoding="utf-8-sig", newline="") as file:  # Excel starts a UTF-8 CSV with a byte order mark
            reader = csv.DictReader(file)
            header = reader.fieldnames or []
            if len(set(header)) != len(header):
                raise ConversionError(f"{path}:1: the header names a column twice: {','.join(header)}")
            line = 1
            for row in reader:
                where = f"{path}:{line + 1}"
                line = reader.line_num
                if None in row:
                    raise ConversionError(f"{where}: more cells than the header's {len(header)} columns")
                yield where, {name: value for name, value in row.items() if value not in (None, "")}
    except OSError as error:
        raise ConversionError(f"{path}: cannot read ({error.strerror or error})") from None
    except UnicodeDecodeError as error:
        raise ConversionError(f"{path}: not UTF-8 text (byte {error.start})") from None
    except csv.Error as error:
        raise ConversionError(f"{path}: not valid CSV ({error})") from None


def text_field(row: dict[str, Any], name: str, where: str) -> str:
    """A non-empty text field of at most :data:`~mmoe.data.converters.common.MAX_TEXT_CHARS` characters
    (surrounding spaces stripped)."""
    value = bounded_text(field(row, name, str, where), where, f"field {name!r}").strip()
    if not value:
        raise ConversionError(f"{where}: field {name!r} is empty")
    return value


def optional_int(row: dict[str, Any], name: str, where: str) -> int | None:
    """An integer field that may be absent; a CSV cell holds its digits."""
    value = row.get(name)
    if value is None:
        return None
    if isinstance(value, str) and value.strip().lstrip("-").isdigit():
        return int(value)
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    raise ConversionError(f"{where}: field {name!r} must be an integer, got {json_excerpt(value)}")


def caption_of(row: dict[str, Any], where: str, skips: RowSkips) -> str | None:
    """The caption of a row: its ``caption`` field, or an LLaVA row's single answer; None for a row that is skipped
    (counted in ``skips``: more than one prompt and answer, or no image path)."""
    turns_field = next((name for name in ("conversations", "conversation") if name in row), None)
    if turns_field is None:
        return text_field(row, "caption", where)
    if not isinstance(row.get("image"), str):
        skips.add("no image", where)  # text-only rows, or several images
        return None
    turns = field(row, turns_field, list, where)
    if len(turns) != 2:
        skips.add("multi-turn", where)
        return None
    speakers = [_turn(turn, f"{where}: {turns_field}[{index}]") for index, turn in enumerate(turns)]
    if speakers[0][0] not in _HUMAN or speakers[1][0] not in _ANSWER:
        raise ConversionError(
            f"{where}: field {turns_field!r}: expected a human prompt then an answer, got "
            f"{speakers[0][0]!r} then {speakers[1][0]!r}"
        )
    caption = bounded_text(speakers[1][1], where, f"{turns_field}[1]").strip()
    if not caption:
        raise ConversionError(f"{where}: {turns_field}[1]: the answer is empty")
    return caption


def _turn(turn: Any, where: str) -> tuple[str, str]:
    """(speaker, text) of one turn: LLaVA's ``{from, value}`` or the Hub's ``{role, content}`` (content a string or a
    list of ``{type: text, text}`` and ``{type: image}`` items)."""
    if isinstance(turn, dict) and "from" in turn:
        return field(turn, "from", str, where), field(turn, "value", str, where)
    role = field(turn, "role", str, where)
    content = field(turn, "content", (str, list), where)
    if isinstance(content, str):
        return role, content
    texts = []
    for index, item in enumerate(content):
        kind = field(item, "type", str, f"{where}: content[{index}]")
        if kind == "text":
            texts.append(field(item, "text", str, f"{where}: content[{index}]"))
    return role, "\n".join(texts)


def row_format(path: str | Path) -> str:
    """The table format of ``path`` by its suffix, for the manifest's split rule."""
    return {".csv": "CSV", ".jsonl": "JSON lines", ".json": "JSON list"}.get(Path(path).suffix.lower(), "table")


def answers_of(row: dict[str, Any], where: str) -> list[str] | None:
    """The human answers of a VQA row: a JSON list of strings, or a CSV cell of answers separated by ``|``; None
    when the row has none (a test split)."""
    value = row.get("answers")
    if value is None:
        return None
    if isinstance(value, str):
        value = [answer.strip() for answer in value.split("|")]
    if not isinstance(value, list) or not all(isinstance(answer, str) for answer in value):
        raise ConversionError(f"{where}: field 'answers' must be a list of strings, got {json_excerpt(value)}")
    if not value or not all(answer.strip() for answer in value):
        raise ConversionError(f"{where}: field 'answers' holds an empty answer: {json.dumps(value)[:80]}")
    return value
