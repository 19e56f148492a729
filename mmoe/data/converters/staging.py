"""A split folder is always one whole conversion: the new split is written into a staging folder beside ``OUT`` and
swapped in at the end.

The staging folder is the hidden sibling ``.<outname>.staging-<pid>`` (same parent, so the same filesystem). On Linux
the swap is one ``renameat2(RENAME_EXCHANGE)``: at every instant ``OUT`` holds the complete old split or the complete
new one, and the old split, now at the staging path, is removed afterwards. Where the system cannot exchange two
folders (another OS, a filesystem without ``RENAME_EXCHANGE`` such as NFS) the swap is two renames, ``OUT`` ->
``.<outname>.replaced-<pid>`` and staging -> ``OUT``: between them ``OUT`` is briefly absent, never mixed, and a run
killed right there leaves the old split at the ``replaced`` path, which the next conversion puts back first.

A conversion replaces ``OUT`` as a whole, so it refuses an ``OUT`` that holds anything a conversion of the same split
did not write (another split's manifest, folders, other files): a mistyped ``--out`` must not delete data.
Leftovers of killed runs (staging and replaced folders whose process is gone) are removed by the next conversion into
the same ``OUT``; readers never look at them (they are hidden siblings, not ``OUT``).
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import re
import shutil
import stat
import sys
from pathlib import Path

from mmoe.data.shards import MANIFEST
from mmoe.io import parse_json

_AT_FDCWD = -100
_RENAME_EXCHANGE = 2
#: errno values saying the system or the filesystem cannot exchange two paths atomically.
_NO_EXCHANGE = {errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP}


class OutputFolderError(ValueError):
    """``OUT`` cannot take a conversion: a file, another split's folder, or a folder holding other data."""


def output_folder(out: str | os.PathLike) -> Path:
    """``OUT`` as the folder the swap replaces: a symbolic link named as ``OUT`` is followed (the split goes where it
    points, and the staging folder beside the target, on its filesystem)."""
    if not os.fspath(out):
        raise OutputFolderError("--out: give a folder")
    out = Path(os.path.abspath(out))
    if out.is_symlink():
        out = Path(os.path.realpath(out))
    if out == out.parent:
        raise OutputFolderError(f"--out {out}: a split needs a folder of its own, not the filesystem root")
    if out.exists() and not out.is_dir():
        raise OutputFolderError(f"--out {out}: is a file, not a folder")
    for parent in out.parents:
        if parent.exists():
            if not parent.is_dir():
                raise OutputFolderError(f"--out {out}: {parent} is a file, not a folder")
            break
    return out


def staging_folder(out: Path) -> Path:
    """Where this process writes the split before swapping it into ``out``."""
    return out.parent / f".{out.name}.staging-{os.getpid()}"


def _replaced_folder(out: Path) -> Path:
    return out.parent / f".{out.name}.replaced-{os.getpid()}"


def _leftovers(out: Path, kind: str) -> list[Path]:
    """Staging or replaced folders of ``out`` left by processes that are gone (or by an earlier process with this
    process's id)."""
    pattern = re.compile(rf"\.{re.escape(out.name)}\.{kind}-(\d+)")
    if not out.parent.is_dir():
        return []
    found = []
    for path in sorted(out.parent.iterdir()):
        match = pattern.fullmatch(path.name)
        if match and not _running(int(match.group(1))):
            found.append(path)
    return found


def _running(pid: int) -> bool:
    if pid == os.getpid():
        return False  # this process has not staged anything yet: a folder with its id is an earlier run's
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    except (OverflowError, OSError):
        return False
    return True


def clean_leftovers(out: Path) -> None:
    """Puts back an old split a killed two-rename swap left aside (when ``out`` is absent), and removes the staging
    and replaced folders of killed conversions into ``out``."""
    replaced = _leftovers(out, "replaced")
    if replaced and not os.path.lexists(out):
        os.rename(replaced.pop(), out)
    for path in replaced + _leftovers(out, "staging"):
        shutil.rmtree(path, ignore_errors=True)


def check_replaceable(out: Path, name: str) -> None:
    """Refuses an ``out`` that a conversion of ``name`` must not replace: one holding another split's manifest, a
    folder, or a file that no conversion of ``name`` wrote. Without a manifest only ``<name>-*.tar`` shards and hidden
    files (temporary files of interrupted writes) may be there."""
    if not out.is_dir():
        return
    manifest = _previous_manifest(out)
    if manifest is not None and manifest.get("name") != name:
        raise OutputFolderError(
            f"{out} already holds shards of {manifest.get('name')!r}; write {name!r} to its own --out folder"
        )
    shard = re.compile(rf"{re.escape(name)}-\d+\.tar")
    for entry in sorted(out.iterdir()):
        if not stat.S_ISREG(entry.lstat().st_mode):
            raise OutputFolderError(_foreign(out, entry, name, "a folder or link"))
        if entry.name.startswith(".") or entry.name == MANIFEST or shard.fullmatch(entry.name):
            continue
        if manifest is not None and _written_by_conversion(entry.name, manifest):
            continue
        raise OutputFolderError(_foreign(out, entry, name, "a file"))


def _previous_manifest(out: Path) -> dict | None:
    """The manifest ``out`` holds (``{}`` when it is not readable JSON), or None."""
    path = out / MANIFEST
    if not path.is_file():
        return None
    try:
        manifest = parse_json(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return {}
    return manifest if isinstance(manifest, dict) else {}


def _written_by_conversion(file_name: str, manifest: dict) -> bool:
    """Whether the split's manifest accounts for ``file_name``: listed in its ``files`` or, for manifests written
    before that field, a ``*.json`` file (``answers.json``, ``caption_tokens.json``)."""
    if "files" in manifest:
        return isinstance(manifest["files"], list) and file_name in manifest["files"]
    return file_name.endswith(".json")


def _foreign(out: Path, entry: Path, name: str, kind: str) -> str:
    return (
        f"--out {out}: holds {entry.name} ({kind}) that no conversion of {name!r} wrote; a conversion replaces its "
        "whole --out folder, so give each split a folder of its own"
    )


def swap_in(staging: Path, out: Path) -> None:
    """Makes the complete split in ``staging`` the content of ``out`` and removes the split ``out`` held before."""
    if not os.path.lexists(out):
        os.rename(staging, out)
        return
    staging.chmod(stat.S_IMODE(out.stat().st_mode))
    if _exchange(staging, out):
        shutil.rmtree(staging, ignore_errors=True)  # the old split; a leftover is removed by the next conversion
        return
    replaced = _replaced_folder(out)
    os.rename(out, replaced)
    os.rename(staging, out)
    shutil.rmtree(replaced)


def _exchange(first: Path, second: Path) -> bool:
    """Atomically exchanges two paths (Linux ``renameat2`` with ``RENAME_EXCHANGE``); False where the system or the
    filesystem cannot."""
    renameat2 = _renameat2()
    if renameat2 is None:
        return False
    if renameat2(_AT_FDCWD, os.fsencode(first), _AT_FDCWD, os.fsencode(second), _RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in _NO_EXCHANGE:
        return False
    raise OSError(code, f"cannot swap {first} into place: {os.strerror(code)}", str(second))


def _renameat2():
    if not sys.platform.startswith("linux"):
        return None
    try:
        function = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):
        return None
    function.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    function.restype = ctypes.c_int
    return function
