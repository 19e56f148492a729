"""Which checkpoint ``--ckpt_path`` names: a file, or ``last``, the run's latest checkpoint, found from the parsed
config before anything is built.

``last`` is resolved to the file Lightning would resume from (the newest ``last*.ckpt`` in the folders of the
config's ``ModelCheckpoint`` callbacks), so that it goes through the same reading, task check and hyper-parameter
merge as a named file. When that file cannot be read (a save cut short, an empty file), the readable checkpoint of
the highest step in the same folder is used instead, and said; with none to resume, or none readable, it is an
error naming the folder.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from jsonargparse import Namespace
from jsonargparse.typing import import_object
from lightning.fabric.utilities.rank_zero import rank_zero_only
from lightning.pytorch.callbacks import ModelCheckpoint

from mmoe.safe_load import load_checkpoint_file, unreadable_reason
from mmoe.tasks.checkpoint_saving import as_list
from mmoe.tasks.layout import RunLayout

#: ``--ckpt_path``'s name for the run's latest checkpoint.
LAST = "last"
#: Files Lightning takes for a last checkpoint: ``last.ckpt``, ``last-v1.ckpt``, ...
LAST_FILE = re.compile(
    re.escape(ModelCheckpoint.CHECKPOINT_NAME_LAST) + r".*" + re.escape(ModelCheckpoint.FILE_EXTENSION)
)


def checkpoint_folders(trainer: Namespace | None, callbacks: Any = None) -> list[Path]:
    """The folders the checkpoints of a run with the parsed ``trainer`` config are saved in: each ``ModelCheckpoint``'s
    ``dirpath`` (of the config's ``callbacks``, or the callback objects ``callbacks``: one or a list), and
    ``checkpoints/`` in the run folder (``default_root_dir``, the current folder without one) for a callback without
    one, as :func:`mmoe.tasks.cli.fill_run_folder` sets it, or when the config has none (Lightning's default
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


def latest_last_file(folders: Iterable[Path]) -> Path | None:
    """The newest (by modification time) last checkpoint in ``folders``, as Lightning picks it; None if none."""
    files = [
        path for folder in folders if folder.is_dir() for path in folder.iterdir() if LAST_FILE.fullmatch(path.name)
    ]
    return max(files, key=lambda path: path.stat().st_mtime, default=None)


def read_checkpoint(ckpt_path: str, folders: list[Path], command: str, expected: str) -> tuple[str, dict[str, Any]]:
    """(file, its contents) that ``--ckpt_path ckpt_path`` resumes from: the file itself, or for ``last`` the run's
    latest checkpoint in ``folders`` (see the module docstring); a fall-back to an older file is said on stderr,
    prefixed ``mmoe <command>:``, and an error with no checkpoint at all says how to go on without one.

    Raises:
        FileNotFoundError: the file, or any last checkpoint in ``folders``, does not exist (naming the folders).
        ValueError: the file cannot be read, or for ``last`` no checkpoint in its folder can (naming it and why).
    """
    if ckpt_path != LAST:
        return ckpt_path, load_checkpoint_file(ckpt_path, "--ckpt_path", expected)
    last = latest_last_file(folders)
    if last is None:
        looked_in = " or ".join(str(folder.absolute()) for folder in folders)
        hint = "drop --ckpt_path to start a new run" if command == "fit" else "name a checkpoint file instead"
        raise FileNotFoundError(f"--ckpt_path last: there is no checkpoint to resume in {looked_in} ({hint})")
    try:
        return str(last), load_checkpoint_file(last, "--ckpt_path last:", expected)
    except ValueError as error:
        unreadable = error
    older = newest_readable(path for path in last.parent.glob("*" + ModelCheckpoint.FILE_EXTENSION) if path != last)
    if older is None:
        raise ValueError(f"{unreadable}; no other checkpoint in {last.parent} can be read either") from None
    path, state = older
    if rank_zero_only.rank == 0:
        print(
            f"mmoe {command}: --ckpt_path last: {last} cannot be read ({unreadable_reason(last)}); using {path}, "
            f"the newest readable checkpoint beside it (step {state.get('global_step')})",
            file=sys.stderr,
        )
    return str(path), state


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
