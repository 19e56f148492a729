"""Reading the benchmarks' annotation and prediction files, with errors that name the file, the entry and the field.

The official evaluation scripts fail on bad input with a ``KeyError`` or a bare ``assert``; mmoe raises
:class:`EvalInputError` instead, whose message says which file, which entry and what was expected.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import mmoe.io
from mmoe.io import parse_json


class EvalInputError(ValueError):
    """A predictions or annotations file (or in-memory equivalent) that cannot be scored as it is."""


def read_json(path: str | Path) -> Any:
    """Parses a whole JSON file.

    Raises:
        EvalInputError: the file cannot be read or is not valid JSON (the message gives line and column).
    """
    text = read_text(path)
    try:
        return parse_json(text)
    except json.JSONDecodeError as error:
        raise EvalInputError(
            f"{path}: malformed JSON at line {error.lineno}, column {error.colno}: {error.msg}"
        ) from None


def read_json_lines(path: str | Path) -> Iterator[tuple[int, Any]]:
    """Yields ``(line_number, object)`` for every non-blank line of a JSON-lines file (1-based line numbers).

    Raises:
        EvalInputError: the file cannot be read or a line is not valid JSON.
    """
    # Split at "\n" only (read_text reads \r\n and \r as "\n"): str.splitlines() also splits at U+2028, U+0085 and
    # others, which a JSON string may hold as they are.
    for number, line in enumerate(read_text(path).split("\n"), start=1):
        if not line.strip():
            continue
        try:
            yield number, parse_json(line)
        except json.JSONDecodeError as error:
            raise EvalInputError(
                f"{path}, line {number}: malformed JSON ({error.msg}); expected one object per line"
            ) from None


def read_text(path: str | Path) -> str:
    """Reads a UTF-8 text file (a leading byte order mark, which Excel writes, dropped), turning a missing or
    unreadable file into :class:`EvalInputError`."""
    try:
        return Path(path).read_text(encoding="utf-8-sig")
    except FileNotFoundError:
        raise EvalInputError(f"{path}: no such file") from None
    except (OSError, UnicodeDecodeError) as error:
        raise EvalInputError(f"{path}: cannot be read ({error})") from None


def require_list(value: Any, where: str, what: str) -> list[Any]:
    """Returns ``value`` if it is a JSON array, else raises naming ``where`` and ``what`` it should hold."""
    if not isinstance(value, list):
        raise EvalInputError(f"{where}: expected a JSON array of {what}, got {type(value).__name__}")
    return value


def require_field(entry: Any, field: str, kind: type | tuple[type, ...], where: str) -> Any:
    """Returns ``entry[field]``, checking that ``entry`` is an object and that the field has the expected type
    (:func:`mmoe.io.require_field`; types named as JSON names them: ``a string``, ``an integer``).

    Args:
        entry: one decoded JSON value.
        field: the key it must have.
        kind: accepted Python type(s) of the value (``bool`` never passes as ``int``).
        where: what to name in the error, e.g. ``"results.json, entry 3"``.

    Raises:
        EvalInputError: ``entry`` is not an object, lacks ``field``, or holds a value of another type.
    """
    return mmoe.io.require_field(entry, field, kind, where, error=EvalInputError, kind_names=_JSON_NAMES)


_JSON_NAMES = {str: "a string", int: "an integer", list: "an array", dict: "an object", float: "a number"}
