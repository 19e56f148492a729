"""Atomic file writes: every file mmoe writes (checkpoints, shards' manifests, results, figures) goes through here.

Files get the permissions ``open()`` would give them: an existing file keeps its mode, a new one gets
``0o666 & ~umask`` (``tempfile.mkstemp`` alone would leave every written file private, 0600).
"""

from __future__ import annotations

import json
import os
import stat
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
    try:
        os.fchmod(handle, file_mode(path))
    finally:
        os.close(handle)
    try:
        write(Path(temporary))
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
    return path


def file_mode(path: Path) -> int:
    """The permission bits ``open(path, "w")`` leaves ``path`` with: its own if it exists, else ``0o666 & ~umask``."""
    try:
        return stat.S_IMODE(path.stat().st_mode)
    except FileNotFoundError:
        return 0o666 & ~current_umask()


def current_umask() -> int:
    """The process umask, read from ``/proc/self/status`` where Linux has it (``os.umask`` can only be read by
    setting it, which races with files other threads create meanwhile)."""
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o077)
    os.umask(mask)
    return mask


def write_text_atomic(path: str | os.PathLike, text: str) -> Path:
    """Writes UTF-8 ``text`` to ``path`` atomically (:func:`atomic_write`)."""
    return atomic_write(path, lambda temporary: temporary.write_text(text, encoding="utf-8"))


def write_json_atomic(path: str | os.PathLike, value: Any, indent: int | None = 2) -> Path:
    """Writes ``value`` as JSON (indented unless ``indent`` is None; non-ASCII kept, trailing newline) to ``path``
    atomically."""
    return write_text_atomic(path, json.dumps(value, indent=indent, ensure_ascii=False) + "\n")
