"""One run per run folder: a lock file that ``mmoe fit | validate | test | predict`` hold in the folders they write.

Two runs writing into one folder mix their logs, checkpoints and configs silently. Each command therefore takes
:data:`LOCK_FILE` in ``trainer.default_root_dir`` (and, for ``fit``, in every ``ModelCheckpoint`` folder, inside the
run folder or not) once its config is instantiated and before it runs, and a second command into a held folder is
refused with the holder's host, pid and start time. A folder below one another run holds is refused too (a
``ModelCheckpoint`` dirpath, or a run folder, inside a running run's folder), so is a folder that cannot be written,
at the same point, before any step. A folder holding another run's folder below it is not searched: that run locked
its checkpoint folders, so a run whose own ``checkpoints/`` another run writes is refused there.

The lock is ``fcntl.flock`` on the open file: the kernel releases it when the holding process ends, however it ends
(SIGKILL included), so a lock is never stale while its file is, and no pid needs checking for liveness; the lock file
a killed run left above a folder blocks nothing. The file's text (host, pid, start time) is only what the refusal
names; a file left behind by a killed run is taken over with a line saying whose it was. A lock file is another run's
to read, never to trust: it is opened without following a symbolic link, one that is not a regular file (a link, a
fifo, a device) or is a hard link (writing the lock would write the file it shares) refuses the run, and only a line
of the form ``host <name> pid <n> started <time>`` is ever quoted from it. The file is removed on release; a run
that finds it removed under its lock (the holder released it meanwhile) locks afresh. Processes forked from the holder
(DataLoader workers) close their copy of the file at once, so a killed run's workers, which outlive it for a moment, do
not keep its folder locked.

A folder holding nothing but its lock file is a fresh run's: Lightning's warning that a checkpoint folder "exists and
is not empty" is silenced for it, in the checkpoint callback's ``setup`` only (:func:`quiet_fresh_folder_warning`);
it is still given for a folder holding checkpoints.

Under DDP only global rank 0 takes the lock: the other ranks are part of the same run.
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import fcntl
import os
import re
import socket
import stat
import sys
import tempfile
import time
import warnings
import weakref
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any, BinaryIO

import lightning as L
from jsonargparse import Namespace
from jsonargparse.typing import import_object
from lightning.fabric.utilities.rank_zero import rank_zero_only
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from mmoe.io import one_line

#: The lock file in a run folder.
LOCK_FILE = ".mmoe-run.lock"
#: What a holder writes into its lock (:func:`holder_text`), the only content of a lock file that messages quote.
HOLDER_LINE = re.compile(r"host [A-Za-z0-9._-]{1,255} pid [0-9]{1,10} started [A-Za-z0-9 :.+-]{1,40}")
#: How many times a run tries to lock a folder before it is refused as held (:func:`lock_now`).
PROBE_TRIES = 5
#: How much of a lock file is read: a holder line is far shorter.
LOCK_READ_BYTES = 512
#: File types a lock path may be instead of a regular file, as refusals name them.
FILE_TYPES = {
    stat.S_IFLNK: "a symbolic link",
    stat.S_IFIFO: "a fifo",
    stat.S_IFDIR: "a folder",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
    stat.S_IFSOCK: "a socket",
}


class RunFolderError(ValueError):
    """A run folder that is held by another run or cannot be written."""


def holder_text() -> str:
    """What this process writes into a lock it holds: ``host <name> pid <pid> started <UTC time>``."""
    started = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
    return f"host {socket.gethostname()} pid {os.getpid()} started {started}"


def holder_in(handle: BinaryIO) -> str | None:
    """The holder line of an open lock file ("" when it is empty), or None when it holds anything else, which is
    never quoted: a planted lock file may hold anything."""
    handle.seek(0)
    text = handle.read(LOCK_READ_BYTES).decode("utf-8", errors="replace").strip()
    return text if not text or HOLDER_LINE.fullmatch(text) else None


def lock_now(handle: BinaryIO) -> bool:
    """Takes the exclusive flock of ``handle`` unless another process holds it; tried a few times 10 ms apart, since
    another run looking at whether this folder is held (:func:`live_holder`) takes it shared for a moment."""
    for attempt in range(PROBE_TRIES):
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if attempt + 1 < PROBE_TRIES:
                time.sleep(0.01)
    return False


def live_holder(folder: Path) -> str | None:
    """Who holds ``folder``'s lock, when a live process does (its holder line, or a phrase when it has none); None
    when it has no lock file, an unlocked one (its run has ended), or one that is not this user's regular file (a lock
    file anyone could plant in a shared folder such as ``/tmp`` would otherwise refuse every run below it)."""
    try:
        descriptor = os.open(folder / LOCK_FILE, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    with os.fdopen(descriptor, "rb") as handle:
        status = os.fstat(descriptor)
        if not stat.S_ISREG(status.st_mode) or status.st_uid != os.geteuid():
            return None
        try:
            fcntl.flock(handle, fcntl.LOCK_SH | fcntl.LOCK_NB)  # let go when the file closes
        except BlockingIOError:
            return holder_phrase(holder_in(handle))
    return None


def holder_phrase(holder: str | None) -> str:
    """How a refusal names the holder of a lock from :func:`holder_in`'s reading of its file."""
    if holder is None:
        return "a process whose lock file holds something unrecognised"
    return holder or "a process that has not written its name yet"


def option_naming(what: str) -> str:
    """The option that gives a run another folder of the kind ``what``."""
    return "trainer.default_root_dir" if what == "run folder" else "ModelCheckpoint dirpath"


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
        self._file: BinaryIO | None = None

    def acquire(self) -> None:
        """Takes the lock, or raises.

        Raises:
            RunFolderError: another live process holds it (the message names the folder, its host and pid), or the
                folder cannot be written.
        """
        self.created = check_writable(self.folder, self.what)
        while self._file is None:
            handle = self._open()
            if not lock_now(handle):
                holder = holder_phrase(holder_in(handle))
                handle.close()
                raise RunFolderError(
                    f"{self.what} {self.folder} is in use by another run "
                    f"({holder}; lock file {self.path}): "
                    f"wait for it to end, or give this run another {option_naming(self.what)}"
                ) from None
            if not self._still_named(handle):
                handle.close()  # released and removed by its holder between our open and our lock: try again
                continue
            self._take(handle)

    def _open(self) -> BinaryIO:
        """The lock file opened for reading and writing (held open until release), created if absent; never through a
        symbolic link, and only a regular file (a fifo or a device could block or act on being opened) of its own
        (not a hard link)."""
        self._require_regular(os.lstat, self.path)
        flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
        try:
            descriptor = os.open(self.path, flags, 0o666)
        except OSError as error:
            if error.errno == errno.ELOOP:  # made a link since the check above
                self._require_regular(os.lstat, self.path)
            raise RunFolderError(f"{self.what} {self.folder} cannot be written: {one_line(error)}") from None
        try:
            self._require_regular(os.fstat, descriptor)
        except RunFolderError:
            os.close(descriptor)
            raise
        return os.fdopen(descriptor, "r+b")

    def _require_regular(self, status: Callable[[Any], os.stat_result], target: Path | int) -> None:
        """Refuses a lock path that exists and is not a regular file, or is a hard link (writing the lock would write
        the file it shares) (``status``: ``os.lstat`` or ``os.fstat``)."""
        try:
            found = status(target)
        except FileNotFoundError:
            return
        if not stat.S_ISREG(found.st_mode):
            kind = f"{FILE_TYPES.get(stat.S_IFMT(found.st_mode), 'a special file')}, not a regular file"
        elif found.st_nlink > 1:
            kind = f"a hard link (one of {found.st_nlink} names of one file), not a file of its own"
        else:
            return
        raise RunFolderError(
            f"{self.what} {self.folder}: its lock file {self.path} is {kind}: remove it (mmoe makes its lock files "
            "itself)"
        )

    def _still_named(self, handle: BinaryIO) -> bool:
        """Whether the locked file is still the one at :attr:`path` (not removed by a releasing holder)."""
        try:
            return os.lstat(self.path).st_ino == os.fstat(handle.fileno()).st_ino
        except FileNotFoundError:
            return False

    def _take(self, handle: BinaryIO) -> None:
        previous = holder_in(handle)
        if previous is None:
            previous = "its lock file held something unrecognised"
        if previous:  # the flock is free, so whoever wrote this has ended without releasing it
            print(
                f"mmoe {self.command}: {self.what} {self.folder}: taking over the lock of a run that ended without "
                f"releasing it ({previous})",
                file=sys.stderr,
            )
        handle.seek(0)
        handle.truncate()
        handle.write((holder_text() + "\n").encode())
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
        """Locks the run folder ``root`` and each of ``checkpoint_folders``, inside it or not (another run may name one
        inside it as its own), each refused when a folder above it is held by another run. Nothing without ``root``,
        and nothing on a rank other than global rank 0.

        Args:
            command: the command (``fit``, ``predict``, ...), named in its messages.
            root: ``trainer.default_root_dir``.
            checkpoint_folders: the ``ModelCheckpoint`` folders of the run.

        Raises:
            RunFolderError: a folder held by another run, or inside one, or one that cannot be written; the locks
                taken so far are released.
        """
        if root is None or not global_rank_zero():
            return
        try:
            self._lock(Path(root), command, "run folder")
            for folder in map(Path, checkpoint_folders):
                self._lock(folder, command, "checkpoint folder")
        except RunFolderError:
            self.release()
            raise

    def _lock(self, folder: Path, command: str, what: str) -> None:
        folder = Path(os.path.abspath(folder))
        if any(lock.folder == folder for lock in self.held):
            return
        self._refuse_inside_another_run(folder, what)
        lock = FolderLock(folder, command, what)
        lock.acquire()
        self.held.append(lock)
        self.created += lock.created

    def _refuse_inside_another_run(self, folder: Path, what: str) -> None:
        """Raises when a folder above ``folder`` (its real path) holds a live lock that is not one of this command's:
        a run folder or checkpoint folder of another run in progress."""
        ours = {lock.folder.resolve() for lock in self.held}
        for above in folder.resolve().parents:
            holder = None if above in ours else live_holder(above)
            if holder is not None:
                raise RunFolderError(
                    f"{what} {folder} is inside {above}, which another run holds ({holder}; lock file "
                    f"{above / LOCK_FILE}): wait for it to end, or give this run another {option_naming(what)}"
                )

    def release(self) -> None:
        """Releases every lock held, last taken first, and removes the folders it made that are still empty (a run
        that stopped before writing anything leaves no trace)."""
        while self.held:
            self.held.pop().release()
        for folder in sorted(self.created, key=lambda path: len(path.parts), reverse=True):
            with contextlib.suppress(OSError):
                folder.rmdir()
        self.created = []


def quiet_fresh_folder_warning(callback: Callback) -> None:
    """Keeps Lightning's warning that a ``ModelCheckpoint``'s folder "exists and is not empty" off while it holds only
    its lock file, in the callback's ``setup`` (where Lightning warns): a fresh run's folder, which the warning would
    flag on every fit, teaching to ignore it where it matters (a folder holding checkpoints, still warned about)."""
    if not isinstance(callback, ModelCheckpoint) or callback.dirpath is None:
        return
    folder, setup = str(callback.dirpath), callback.setup

    def setup_quietly(trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        with warnings.catch_warnings():
            if os.path.isdir(folder) and os.listdir(folder) == [LOCK_FILE]:
                names = "|".join(re.escape(name) for name in sorted({folder, os.path.realpath(folder)}))
                warnings.filterwarnings(
                    "ignore", rf"Checkpoint directory ({names}) exists and is not empty\.\Z", UserWarning
                )
            setup(trainer, pl_module, stage)

    callback.setup = setup_quietly


def global_rank_zero() -> bool:
    """Whether this process is global rank 0 of its run, before the Trainer exists: Lightning's rank from the
    environment (``RANK``, ``LOCAL_RANK``, ...) and, in a multi-node run started once per node, ``NODE_RANK``."""
    return rank_zero_only.rank == 0 and os.environ.get("NODE_RANK", "0") == "0"


def run_folders(
    subcommand: str | None, trainer: Namespace, trainer_defaults: Mapping[str, Any]
) -> tuple[str | None, list[str]]:
    """The folders a command writes: the run folder (``trainer.default_root_dir``) and, for ``fit``, the folders of
    the ``ModelCheckpoint`` callbacks, given in the parsed ``trainer`` config or as objects in ``trainer_defaults``
    (:func:`mmoe.config.launch.run_lightning`'s callbacks)."""
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
