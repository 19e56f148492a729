"""Reading JSON files and reporting bad input the same way in every ``mmoe`` command.

* :func:`parse_json`: JSON text from a user, its arrays and objects nested at most :data:`MAX_JSON_DEPTH` deep (a
  deeper one is a ``json.JSONDecodeError`` at the bracket past the bound, not a ``RecursionError`` from the parser or
  from whatever walks the value after it).
* :func:`read_json`: a whole JSON file, or one error naming the file and what is wrong with it (missing, unreadable,
  malformed at line and column), raised as the caller's error type.
* :func:`write_json`: a JSON file written whole or not at all (:mod:`mmoe.atomic`).
* :func:`require_field`: one field of a decoded JSON object, checked to be of the expected type, or one error naming
  where it is, the field and the value, raised as the caller's error type.
* :func:`one_line` and :func:`report_error`: every command ends on bad input with one line on stderr,
  ``mmoe <command>: error: <message>``, and exit code 2 (:data:`INPUT_ERROR_EXIT`).
* :func:`positive_int`: an option's value that must be a whole number of at least 1; :func:`capped_jobs`: a ``--jobs``
  value capped at the CPU cores the command may use, said in one line.
* :func:`check_output_path` and :func:`writing_output`: an output file that cannot be written is named (the user's
  path, never the hidden temporary file) before a command starts its work, and again if writing it fails after.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from mmoe.atomic import write_json_atomic

#: Exit code of a command given bad input (argparse's too).
INPUT_ERROR_EXIT = 2

#: Writes a value as indented JSON atomically (the file is whole or absent).
write_json = write_json_atomic

#: The deepest nesting of arrays and objects mmoe reads from a JSON input (its own files nest fewer than 10 deep).
MAX_JSON_DEPTH = 100

# A JSON string (brackets inside it do not nest) or one bracket.
_STRING_OR_BRACKET = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"|[\[\]{}]')
# The bytes that count for nesting once strings are gone: braces read as brackets, every other byte dropped.
_NESTING = bytes.maketrans(b"{}", b"[]")
_NOT_STRUCTURAL = bytes(byte for byte in range(256) if byte not in b'"[]{}')


def parse_json(text: str | bytes) -> Any:
    """The JSON value of ``text`` (``json.loads``), refused when its arrays and objects nest deeper than
    :data:`MAX_JSON_DEPTH`.

    Raises:
        json.JSONDecodeError: malformed, or nested too deep (its position the first bracket past the bound).
    """
    try:
        value = json.loads(text)
    except RecursionError:
        too_deep = True
    else:
        too_deep = _nests_deeper(text)
    if too_deep:
        text = text.decode(json.detect_encoding(text), "replace") if isinstance(text, bytes) else text
        message = f"arrays and objects nested more than {MAX_JSON_DEPTH} deep"
        raise json.JSONDecodeError(message, text, _past_depth_bound(text))
    return value


def _nests_deeper(text: str | bytes) -> bool:
    """Whether valid JSON ``text`` nests deeper than :data:`MAX_JSON_DEPTH`: its strings dropped, then one level of
    innermost bracket pairs removed per pass (bytes operations, a fraction of the parse's time)."""
    if isinstance(text, bytes):
        text = text.decode(json.detect_encoding(text), "surrogatepass")  # as json.loads read it
    data = text.encode("utf-8", "surrogatepass")
    if data.count(b"[") + data.count(b"{") <= MAX_JSON_DEPTH:
        return False
    # Escaped backslashes first, then escaped quotes: what is left of an escape cannot end a string.
    data = data.replace(b"\\\\", b"").replace(b'\\"', b"").translate(_NESTING, _NOT_STRUCTURAL)
    # Outside the strings: an empty string gone (or two strings joined) first, which leaves few pieces to split.
    data = b"".join(data.replace(b'""', b"").split(b'"')[::2])
    for _ in range(MAX_JSON_DEPTH):
        if not data:
            return False
        data = data.replace(b"[]", b"")  # the innermost level (the result is not scanned again)
    return bool(data)


def _past_depth_bound(text: str) -> int:
    """The offset of the first bracket in ``text`` that opens a level deeper than :data:`MAX_JSON_DEPTH`."""
    depth = 0
    for match in _STRING_OR_BRACKET.finditer(text):
        token = match.group()
        depth += 1 if token in ("[", "{") else -1 if token in ("]", "}") else 0
        if depth > MAX_JSON_DEPTH:
            return match.start()
    return 0


def positive_int(text: str) -> int:
    """A command-line option's value that must be a whole number of at least 1 (an argparse ``type``: a bad value
    ends the command with argparse's one-line usage error)."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is below 1")
    return value


def usable_cores() -> int:
    """The CPU cores this process may run on (its affinity where the system has one)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def capped_jobs(jobs: int, command: str) -> int:
    """A ``--jobs`` value (processes run at once), at most :func:`usable_cores`; a larger one is capped, said in one
    line on stderr (each process is a whole training: more than the cores only queue for them, in memory)."""
    cores = usable_cores()
    if jobs <= cores:
        return jobs
    print(f"mmoe {command}: --jobs {jobs} capped at {cores}, the CPU cores this command may use", file=sys.stderr)
    return cores


def one_line(error: BaseException | str) -> str:
    """The message of ``error`` on one line (white space folded)."""
    return " ".join(str(error).split())


def report_error(command: str, error: BaseException | str) -> int:
    """Prints ``mmoe <command>: error: <message>`` on stderr (one line) and returns :data:`INPUT_ERROR_EXIT`."""
    print(f"mmoe {command}: error: {one_line(error)}", file=sys.stderr)
    return INPUT_ERROR_EXIT


def read_json(
    path: str | os.PathLike, what: str = "", error: type[Exception] = ValueError, written_by: str = ""
) -> Any:
    """The JSON value of the file at ``path``.

    Args:
        path: the file.
        what: what the file is (``"answer vocabulary"``), put before the path in errors.
        error: the exception type raised for a missing, unreadable or malformed file (a command's own input error);
            ``FileNotFoundError`` is raised as such when ``error`` is the default ``ValueError``.
        written_by: what writes the file, named when it is missing.

    Raises:
        error: ``<what> <path> does not exist (<written_by>)`` / ``<what> <path>: cannot be read (...)`` /
            ``<what> <path>: malformed JSON at line L, column C: ...``.
    """
    path = Path(path)
    named = f"{what} {path}" if what else str(path)
    try:
        text = path.read_text(encoding="utf-8-sig")  # a leading byte order mark (Windows editors write one) dropped
    except FileNotFoundError:
        missing = FileNotFoundError if error is ValueError else error
        hint = f" ({written_by})" if written_by else ""
        raise missing(f"{named} does not exist{hint}") from None
    except (OSError, UnicodeDecodeError) as cause:
        raise error(f"{named}: cannot be read ({one_line(cause)})") from None
    try:
        return parse_json(text)
    except json.JSONDecodeError as cause:
        raise error(f"{named}: malformed JSON at line {cause.lineno}, column {cause.colno}: {cause.msg}") from None


def require_field(
    record: Any,
    name: str,
    kind: type | tuple[type, ...],
    where: str,
    error: type[Exception] = ValueError,
    kind_names: Mapping[type, str] | None = None,
) -> Any:
    """``record[name]``, checked to be of ``kind`` (``bool`` never passes as ``int``).

    Args:
        record: one decoded JSON value, which must be an object.
        name: the field it must have.
        kind: the accepted Python type(s) of the field's value.
        where: what to name in the error, e.g. ``"results.json, entry 3"``.
        error: the exception type raised (a command's own input error).
        kind_names: how the error names each accepted type (``{str: "a string"}``); Python's names otherwise.

    Raises:
        error: ``<where>: expected a JSON object, got <record>`` / ``<where>: missing field '<name>'`` /
            ``<where>: field '<name>' must be <kind>, got <value>``.
    """
    if not isinstance(record, Mapping):
        raise error(f"{where}: expected a JSON object, got {json_excerpt(record)}")
    if name not in record:
        raise error(f"{where}: missing field {name!r}")
    value = record[name]
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
        expected = " or ".join((kind_names or {}).get(k, k.__name__) for k in kinds)
        raise error(f"{where}: field {name!r} must be {expected}, got {json_excerpt(value)}")
    return value


def json_excerpt(value: Any, limit: int = 80) -> str:
    """``value`` as JSON (non-ASCII kept) for an error message, cut to ``limit`` characters with ``...``."""
    text = json.dumps(value, ensure_ascii=False) if not isinstance(value, bytes) else repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


class OutputPathError(ValueError):
    """An output file that cannot be written; the message names the option and the user's path."""


def check_output_path(path: str | os.PathLike, option: str = "--out") -> Path:
    """``path`` if a command can write its output there: not a folder, and its parent folder creatable and writable
    (checked by creating and removing a file in the nearest existing folder: permission bits alone do not stop root,
    a read-only file system does). Call it before the work whose result it will hold.

    Raises:
        OutputPathError: ``<option> <path> ...`` saying what is in the way.
    """
    path = Path(path)
    if path.is_dir():
        raise OutputPathError(f"{option} {path} is a folder; expected the path of a file to write")
    folder = path.parent
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    if not folder.is_dir():
        raise OutputPathError(f"{option} {path} cannot be written: {folder} is a file, not a folder")
    try:
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as error:
        raise OutputPathError(f"{option} {path} cannot be written: {folder}: {error.strerror or error}") from None
    return path


@contextmanager
def writing_output(path: str | os.PathLike, option: str = "--out") -> Iterator[None]:
    """Within, an ``OSError`` (a full disk, a folder made read-only meanwhile) becomes an :class:`OutputPathError`
    naming ``option`` and the user's ``path``, not the temporary file the atomic write was filling."""
    try:
        yield
    except OSError as error:
        raise OutputPathError(f"{option} {path} cannot be written: {error.strerror or one_line(error)}") from None
