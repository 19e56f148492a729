"""One run per run folder: a lock file that ``mmoe fit | validate | test | predict`` hold in the folders they write.

Two runs writing into one folder mix their logs, checkpoints and configs silently. Each command therefore takes
:data:`LOCK_FILE` in ``trainer.default_root_dir`` (and, for ``fit``, in every ``ModelCheckpoint`` folder outside it)
once its config is instantiated and before it runs, and a second command into a held folder is refused with the
holder's host, pid and start time. A folder that cannot be written is refused at the same point, before any step.

The lock is ``fcntl.flock`` on the open file: the kernel releases it when the holding process ends, however it ends
(SIGKILL included), so a lock is never stale while its file is, and no pid needs checking for liveness. The file's
text (host, pid, start time) is only what the refusal names; a file left behind by a killed run is taken over with a
line saying whose it was. The file is removed on release; a run that finds it removed under its lock (the holder
released it meanwhile) locks afresh. Processes forked from the holder (DataLoader workers) close their copy of the
file at once, so a killed run's workers, which outlive it for a moment, do not keep its folder locked.

Under DDP only global rank 0 takes the lock: the other ranks are part of the same run.
"""

from __future__ import annotations

import contextlib
import datetime
import fcntl
import os
import socket
import sys
import tempfile
import weakref
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import IO, Any

from jsonargparse import Namespace
from jsonargparse.typing import import_object
from lightning.fabric.utilities.rank_zero import rank_zero_only
from lightning.pytorch.callbacks import ModelCheckpoint

from mmoe.io import one_line

#: The lock file in a run folder.
LOCK_FILE = ".mmoe-run.lock"


class RunFolderError(ValueError):
    """A run folder that is held by another run or cannot be written."""


def holder_text() -> str:
    """What this process writes into a lock it holds: ``host <name> pid <pid> started <UTC time>``."""
    started = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
    return f"host {socket.gethostname()} pid {os.getpid()} started {started}"


def check_writable(folder: Path, what: str = "run folder") -> list[Path]:
    """Creates ``folder`` (and its parents) and a file in it, which is removed again: a run fails here, before it
    trains, rather than at its first checkpoint. Returns the folders it created, deepest first.

    Raises:
        RunFolderError: the folder cannot be created or written (a read-only filesystem, no permission), named as
            ``what``.
    """
    created = [parent for parent in [folder, *folder.parents] if not parent.exists()]
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as error:
        raise RunFolderError(f"{what} {folder} cannot be written: {one_line(error)}") from None
    return created


#: The locks this process holds, which a forked child lets go of (:func:`close_in_forked_child`).
HELD: weakref.WeakSet[FolderLock] = weakref.WeakSet()


def close_in_forked_child() -> None:
    """Closes a forked child's copies of its parent's lock files (without unlocking: the lock is the parent's)."""
    for lock in list(HELD):
        lock.forget()


os.register_at_fork(after_in_child=close_in_forked_child)


class FolderLock:
    """The lock of one folder (:data:`LOCK_FILE` in it), held from :meth:`acquire` to :meth:`release`.

    Args:
        folder: the folder.
        command: the command that takes it (``fit``), named in the line about a lock taken over.
        what: what the folder is to the run, as messages name it.
    """

    def __init__(self, folder: str | os.PathLike, command: str, what: str = "run folder") -> None:
        self.folder = Path(folder)
        self.path = self.folder / LOCK_FILE
        self.command = command
        self.what = what
        self.created: list[Path] = []  # the folders acquire created, deepest first
        self._file: IO[str] | None = None

    def acquire(self) -> None:
        """Takes the lock, or raises.

        Raises:
            RunFolderError: another live process holds it (the message names the folder, its host and pid), or the
                folder cannot be written.
        """
        self.created = check_writable(self.folder, self.what)
        while self._file is None:
            handle = self._open()
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                handle.seek(0)
                holder = handle.read().strip() or "a process that has not written its name yet"
                handle.close()
                other = "trainer.default_root_dir" if self.what == "run folder" else "ModelCheckpoint dirpath"
                raise RunFolderError(
                    f"{self.what} {self.folder} is in use by another run ({holder}; lock file {self.path}): "
                    f"wait for it to end, or give this run another {other}"
                ) from None
            if not self._still_named(handle):
                handle.close()  # released and removed by its holder between our open and our lock: try again
                continue
            self._take(handle)

    def _open(self) -> IO[str]:
        try:
            return open(self.path, "a+", encoding="utf-8")  # held open until release
        except OSError as error:
            raise RunFolderError(f"{self.what} {self.folder} cannot be written: {one_line(error)}") from None

    def _still_named(self, handle: IO[str]) -> bool:
        """Whether the locked file is still the one at :attr:`path` (not removed by a releasing holder)."""
        try:
            return os.stat(self.path).st_ino == os.fstat(handle.fileno()).st_ino
        except FileNotFoundError:
            return False

    def _take(self, handle: IO[str]) -> None:
        handle.seek(0)
        previous = handle.read().strip()
        if previous:  # the flock is free, so whoever wrote this has ended without releasing it
            print(
                f"mmoe {self.command}: {self.what} {self.folder}: taking over the lock of a run that ended without "
                f"releasing it ({previous})",
                file=sys.stderr,
            )
        handle.seek(0)
        handle.truncate()
        handle.write(holder_text() + "\n")
        handle.flush()
        self._file = handle
        HELD.add(self)

    def release(self) -> None:
        """Removes the lock file and unlocks it (nothing when not held)."""
        if self._file is None:
            return
        self.path.unlink(missing_ok=True)  # before unlocking: a run waiting on this file sees it gone and retries
        fcntl.flock(self._file, fcntl.LOCK_UN)  # for every process sharing the open file, not only this one
        self.forget()

    def forget(self) -> None:
        """Closes this process's copy of the lock file, leaving the lock and the file as they are."""
        HELD.discard(self)
        if self._file is not None:
            self._file.close()
            self._file = None


class RunFolderLocks:
    """The locks one command holds, from :meth:`hold` until :meth:`release`."""

    def __init__(self) -> None:
        self.held: list[FolderLock] = []
        self.created: list[Path] = []  # folders made by hold, removed on release while still empty

    def hold(self, subcommand: str | None, trainer: Namespace, trainer_defaults: Mapping[str, Any]) -> None:
        """Locks the folders ``mmoe <subcommand>`` writes (:func:`run_folders`) with the parsed ``trainer`` config and
        LightningCLI's ``trainer_defaults`` (:meth:`hold_folders`)."""
        if isinstance(trainer, Namespace):
            self.hold_folders(subcommand or "fit", *run_folders(subcommand, trainer, trainer_defaults))

    def hold_folders(
        self, command: str, root: str | os.PathLike | None, checkpoint_folders: Iterable[str | os.PathLike] = ()
    ) -> None:
        """Locks the run folder ``root`` and each of ``checkpoint_folders`` outside it, and checks that those inside
        it can be written. Nothing without ``root``, and nothing on a rank other than global rank 0.

        Args:
            command: the command (``fit``, ``predict``, ...), named in its messages.
            root: ``trainer.default_root_dir``.
            checkpoint_folders: the ``ModelCheckpoint`` folders of the run.

        Raises:
            RunFolderError: a folder held by another run, or one that cannot be written; the locks taken so far are
                released.
        """
        if root is None or not global_rank_zero():
            return
        root = Path(root).absolute()
        try:
            self._lock(root, command, "run folder")
            for folder in map(Path, checkpoint_folders):
                folder = folder.absolute()
                if folder.is_relative_to(root):
                    self.created += check_writable(folder, "checkpoint folder")
                else:
                    self._lock(folder, command, "checkpoint folder")
        except RunFolderError:
            self.release()
            raise

    def _lock(self, folder: Path, command: str, what: str) -> None:
        if any(lock.folder == folder for lock in self.held):
            return
        lock = FolderLock(folder, command, what)
        lock.acquire()
        self.held.append(lock)
        self.created += lock.created

    def release(self) -> None:
        """Releases every lock held, last taken first, and removes the folders it made that are still empty (a run
        that stopped before writing anything leaves no trace)."""
        while self.held:
            self.held.pop().release()
        for folder in sorted(self.created, key=lambda path: len(path.parts), reverse=True):
            with contextlib.suppress(OSError):
                folder.rmdir()
        self.created = []


def global_rank_zero() -> bool:
    """Whether this process is global rank 0 of its run, before the Trainer exists: Lightning's rank from the
    environment (``RANK``, ``LOCAL_RANK``, ...) and, in a multi-node run started once per node, ``NODE_RANK``."""
    return rank_zero_only.rank == 0 and os.environ.get("NODE_RANK", "0") == "0"


def run_folders(
    subcommand: str | None, trainer: Namespace, trainer_defaults: Mapping[str, Any]
) -> tuple[str | None, list[str]]:
    """The folders a command writes: the run folder (``trainer.default_root_dir``) and, for ``fit``, the folders of
    the ``ModelCheckpoint`` callbacks, given in the parsed ``trainer`` config or as objects in ``trainer_defaults``
    (:func:`mmoe.tasks.launch.run_lightning`'s callbacks)."""
    if subcommand != "fit":
        return trainer.get("default_root_dir"), []
    given = trainer_defaults.get("callbacks") or []
    folders = []
    for callback in [*(trainer.get("callbacks") or []), *(given if isinstance(given, list) else [given])]:
        if isinstance(callback, ModelCheckpoint) and callback.dirpath is not None:
            folders.append(str(callback.dirpath))
        elif isinstance(callback, Namespace) and isinstance(callback.get("init_args"), Namespace):
            if issubclass(import_object(callback.class_path), ModelCheckpoint) and callback.init_args.get("dirpath"):
                folders.append(str(callback.init_args.dirpath))
    return trainer.get("default_root_dir"), folders
