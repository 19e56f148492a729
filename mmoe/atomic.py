"""Atomic file writes: every file mmoe writes (checkpoints, shards' manifests, results, figures) goes through here.

Files get the permissions ``open()`` would give them: an existing file keeps its mode, a new one gets
``0o666 & ~umask`` (``tempfile.mkstemp`` alone would leave every written file private, 0600).
"""

from __future__ import annotations

import json
import os
import re
import stat
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any


def atomic_write(path: str | os.PathLike, write: Callable[[Path], object]) -> Path:
    """Call ``write(temporary)`` on a temporary file beside ``path``, then rename it over ``path``.

    A reader never sees a partial file, and an interrupted write leaves the previous file (if any) in place.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(prefix=temporary_prefix(path), dir=path.parent)
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


def temporary_prefix(path: Path) -> str:
    """How the names of :func:`atomic_write`'s temporary files for ``path`` start (``last.ckpt`` -> ``.last.ckpt.``;
    ``tempfile.mkstemp`` adds 8 random characters)."""
    return f".{path.name}."


def remove_stale_temporaries(path: str | os.PathLike, older_than_s: float) -> list[Path]:
    """Removes the temporary files of :func:`atomic_write` for ``path`` that a killed process left beside it (a
    SIGKILL or a power cut runs no clean-up), those untouched for more than ``older_than_s`` seconds: a younger one
    may be another writer's, still growing. Returns the files removed."""
    path = Path(path)
    pattern = re.compile(re.escape(temporary_prefix(path)) + r"[a-z0-9_]{8}")
    removed = []
    now = time.time()
    for candidate in path.parent.glob(temporary_prefix(path) + "*"):
        try:
            stale = pattern.fullmatch(candidate.name) and now - candidate.stat().st_mtime > older_than_s
            if stale:
                candidate.unlink()
                removed.append(candidate)
        except FileNotFoundError:  # its writer renamed or removed it meanwhile
            continue
    return removed


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
    atomically. A string holding a lone surrogate (a file name that is not UTF-8, as ``os.fsdecode`` gives it) has
    no UTF-8 form: the whole value is then written with ``\\u`` escapes, which JSON readers turn back into it."""
    text = json.dumps(value, indent=indent, ensure_ascii=False)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        text = json.dumps(value, indent=indent)
    return write_text_atomic(path, text + "\n")
