"""Atomic file writes: every file mmoe writes (checkpoints, shards' manifests, results, figures) goes through here."""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any


def atomic_write(path: str | os.PathLike, write: Callable[[Path], object]) -> Path:
    """Call ``write(temporary)`` on a temporary file beside ``path``, then rename it over ``path``.

    A reader never sees a partial file, and an interrupted write leaves the previous file (if any) in place.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    os.close(handle)
    try:
        write(Path(temporary))
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
    return path


def write_text_atomic(path: str | os.PathLike, text: str) -> Path:
    """Writes UTF-8 ``text`` to ``path`` atomically (:func:`atomic_write`)."""
    return atomic_write(path, lambda temporary: temporary.write_text(text, encoding="utf-8"))


def write_json_atomic(path: str | os.PathLike, value: Any, indent: int | None = 2) -> Path:
    """Writes ``value`` as JSON (indented unless ``indent`` is None; non-ASCII kept, trailing newline) to ``path``
    atomically."""
    return write_text_atomic(path, json.dumps(value, indent=indent, ensure_ascii=False) + "\n")
