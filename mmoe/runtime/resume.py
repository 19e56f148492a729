"""Which checkpoint ``--ckpt_path`` names: a file, or ``last``, the run's latest checkpoint, found from the parsed
config before anything is built.

``last`` is resolved to the run's own last checkpoint in the folders of the config's ``ModelCheckpoint`` callbacks, so
that it goes through the same reading, task check and hyper-parameter merge as a named file: in each folder
``last.ckpt``, the file the run keeps writing over (on a resume too:
:class:`mmoe.runtime.checkpoint_saving.LastStepCheckpoint`); only without it Lightning's ``last-vN.ckpt`` of the highest
``N`` (what a run started afresh beside another run's ``last.ckpt`` writes). Any other file, such as a copy named
``last-before-lr-change.ckpt``, is never taken for it, however new: Lightning's own rule (the newest ``last*.ckpt``)
would resume such a copy and then write over the run's ``last.ckpt``. With several folders, the newer of their last
checkpoints is taken. The file and its step are said on stderr every time (the file is read whole anyway), and an
older ``last-vN.ckpt`` passed over beside ``last.ckpt`` is named; a newer one (modification time) is refused: a run
started afresh beside ``last.ckpt`` wrote it and may have been killed after many steps, so the user names the file to
resume with ``--ckpt_path FILE``. A ``last.ckpt`` or ``last-vN.ckpt`` that is a symbolic link is refused: a run
folder's links are never followed (one may lead to another run's checkpoint). When that file cannot be read (a save
cut short, an empty file), the readable checkpoint of the highest step in the same folder (not a link) is used
instead, and said; with none to resume, or none readable, it is an error naming the folder.
"""

from __future__ import annotations

import os
import re
import sys
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from jsonargparse import Namespace
from jsonargparse.typing import import_object
from lightning.fabric.utilities.rank_zero import rank_zero_only
from lightning.pytorch.callbacks import ModelCheckpoint

from mmoe.io import json_excerpt
from mmoe.runtime.checkpoint_saving import as_list
from mmoe.runtime.layout import RunLayout
from mmoe.safe_load import load_checkpoint_file, unreadable_reason

#: ``--ckpt_path``'s name for the run's latest checkpoint.
LAST = "last"
#: A run's last checkpoint: ``last.ckpt``.
LAST_FILE = ModelCheckpoint.CHECKPOINT_NAME_LAST + ModelCheckpoint.FILE_EXTENSION
#: The last checkpoints Lightning's version counter names (``last-v1.ckpt``, ...), its version in the group.
LAST_VERSION_FILE = re.compile(
    re.escape(ModelCheckpoint.CHECKPOINT_NAME_LAST + ModelCheckpoint.CHECKPOINT_JOIN_CHAR)
    + r"v([0-9]{1,9})"
    + re.escape(ModelCheckpoint.FILE_EXTENSION)
)


def checkpoint_folders(trainer: Namespace | None, callbacks: Any = None) -> list[Path]:
    """The folders the checkpoints of a run with the parsed ``trainer`` config are saved in: each ``ModelCheckpoint``'s
    ``dirpath`` (of the config's ``callbacks``, or the callback objects ``callbacks``: one or a list), and
    ``checkpoints/`` in the run folder (``default_root_dir``, the current folder without one) for a callback without
    one, as :func:`mmoe.config.cli.fill_run_folder` sets it, or when the config has none (Lightning's default
    callback)."""
    root = (trainer.get("default_root_dir") if isinstance(trainer, Namespace) else None) or os.getcwd()
    run_folder = RunLayout(Path(root)).checkpoints
    folders, found = [], False
    given = trainer.get("callbacks") if isinstance(trainer, Namespace) else None
    for callback in [*as_list(given), *as_list(callbacks)]:
        if isinstance(callback, ModelCheckpoint):
            dirpath = callback.dirpath
        elif is_model_checkpoint(callback):
            dirpath = (callback.get("init_args") or Namespace()).get("dirpath")
        else:
            continue
        found = True
        folder = Path(dirpath) if dirpath else run_folder
        if folder not in folders:
            folders.append(folder)
    return folders if found else [run_folder]


def is_model_checkpoint(callback: Any) -> bool:
    """Whether a parsed callback config (``class_path`` and ``init_args``) is a ``ModelCheckpoint``'s."""
    if not isinstance(callback, Namespace) or not isinstance(callback.get("class_path"), str):
        return False
    kind = import_object(callback.class_path)
    return isinstance(kind, type) and issubclass(kind, ModelCheckpoint)


def last_checkpoint_file(folders: Iterable[Path]) -> Path | None:
    """The run's last checkpoint in ``folders`` (see the module docstring); None if none."""
    files = [path for path in map(last_file_in, folders) if path is not None]
    return max(files, key=lambda path: path.stat().st_mtime, default=None)


def last_file_in(folder: Path) -> Path | None:
    """``folder``'s ``last.ckpt``, else its ``last-vN.ckpt`` of the highest ``N``; None if neither."""
    if (folder / LAST_FILE).is_file():
        return folder / LAST_FILE
    versions = last_versions(folder)
    return max(versions, key=versions.get, default=None)


def last_versions(folder: Path) -> dict[Path, int]:
    """``folder``'s ``last-vN.ckpt`` files and their ``N``."""
    if not folder.is_dir():
        return {}
    matches = ((path, LAST_VERSION_FILE.fullmatch(path.name)) for path in folder.iterdir())
    return {path: int(match.group(1)) for path, match in matches if match and path.is_file()}


def refuse_linked_last(folders: Iterable[Path]) -> None:
    """Refuses a ``last.ckpt`` or ``last-vN.ckpt`` in ``folders`` that is a symbolic link: a run folder's links are
    never followed, since one may lead to another run's checkpoint, whose line this run would then continue.

    Raises:
        ValueError: naming the link and the path it leads to (as a JSON string: it may hold anything).
    """
    for folder in folders:
        for path in folder.iterdir() if folder.is_dir() else ():
            if (path.name == LAST_FILE or LAST_VERSION_FILE.fullmatch(path.name)) and path.is_symlink():
                raise ValueError(
                    f"--ckpt_path last: {path} is a symbolic link (to {json_excerpt(os.readlink(path), 200)}), and "
                    "links in a run folder are not followed: name the checkpoint to resume with --ckpt_path FILE"
                )


def newer_last_version(last: Path) -> Path | None:
    """The newest ``last-vN.ckpt`` beside ``last`` when ``last`` is a ``last.ckpt`` and that file is newer than it;
    None otherwise."""
    if last.name != LAST_FILE:
        return None
    modified = last.stat().st_mtime
    newer = [path for path in last_versions(last.parent) if path.stat().st_mtime > modified]
    return max(newer, key=lambda path: path.stat().st_mtime, default=None)


def modified_at(path: Path) -> str:
    """``path``'s modification time in local time, as ``ls -l`` would show it to the user."""
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(path.stat().st_mtime))


def read_checkpoint(ckpt_path: str, folders: list[Path], command: str, expected: str) -> tuple[str, dict[str, Any]]:
    """(file, its contents) that ``--ckpt_path ckpt_path`` resumes from: the file itself, or for ``last`` the run's
    latest checkpoint in ``folders`` (see the module docstring); a fall-back to an older file is said on stderr,
    prefixed ``mmoe <command>:``, and an error with no checkpoint at all says how to go on without one.

    Raises:
        FileNotFoundError: the file, or any last checkpoint in ``folders``, does not exist (naming the folders).
        ValueError: the file cannot be read, or for ``last`` no checkpoint in its folder can (naming it and why), or a
            ``last-vN.ckpt`` beside ``last.ckpt`` is newer than it (naming both).
    """
    if ckpt_path != LAST:
        return ckpt_path, load_checkpoint_file(ckpt_path, "--ckpt_path", expected)
    refuse_linked_last(folders)
    last = last_checkpoint_file(folders)
    if last is None:
        looked_in = " or ".join(str(folder.absolute()) for folder in folders)
        hint = "drop --ckpt_path to start a new run" if command == "fit" else "name a checkpoint file instead"
        raise FileNotFoundError(f"--ckpt_path last: there is no checkpoint to resume in {looked_in} ({hint})")
    newer = newer_last_version(last)
    if newer is not None:
        raise ValueError(
            f"--ckpt_path last: {newer} (saved {modified_at(newer)}) is newer than {last} (saved {modified_at(last)}), "
            "written by a run started afresh beside it: name the checkpoint to resume with --ckpt_path FILE"
        )
    path, state = read_last(last, command, expected)
    if rank_zero_only.rank == 0:
        passed_over = sorted(other.name for other in last_versions(last.parent) if other != last)
        beside = f"; not {', '.join(passed_over)} beside it (name one to use it)" if passed_over else ""
        verb = "resuming from" if command == "fit" else "using"
        print(
            f"mmoe {command}: --ckpt_path last: {verb} {path} (step {state.get('global_step')}){beside}",
            file=sys.stderr,
        )
    return str(path), state


def read_last(last: Path, command: str, expected: str) -> tuple[Path, dict[str, Any]]:
    """(file, contents) of the last checkpoint ``last``, or, when it cannot be read, of the readable checkpoint of
    the highest step beside it, said on stderr.

    Raises:
        ValueError: no checkpoint in the folder can be read.
    """
    try:
        return last, load_checkpoint_file(last, "--ckpt_path last:", expected)
    except ValueError as error:
        unreadable = error
    beside = last.parent.glob("*" + ModelCheckpoint.FILE_EXTENSION)
    older = newest_readable(path for path in beside if path != last and not path.is_symlink())
    if older is None:
        raise ValueError(f"{unreadable}; no other checkpoint in {last.parent} can be read either") from None
    path, state = older
    if rank_zero_only.rank == 0:
        print(
            f"mmoe {command}: --ckpt_path last: {last} cannot be read ({unreadable_reason(last)}); using {path}, "
            f"the newest readable checkpoint beside it (step {state.get('global_step')})",
            file=sys.stderr,
        )
    return path, state


def newest_readable(paths: Iterable[Path]) -> tuple[Path, dict[str, Any]] | None:
    """(file, contents) of the readable checkpoint among ``paths`` with the highest ``global_step`` (the newer file
    on a tie); None if none can be read."""
    best = None
    for path in sorted(paths, key=lambda path: path.stat().st_mtime):
        try:
            state = load_checkpoint_file(path)
        except ValueError:
            continue
        if isinstance(state.get("global_step"), int) and (
            best is None or state["global_step"] >= best[1]["global_step"]
        ):
            best = path, state
    return best
