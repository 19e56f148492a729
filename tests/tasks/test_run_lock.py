"""The run-folder lock: a folder held by a live process is refused naming its host and pid, a lock left by a killed
process is taken over, unwritable folders are refused before anything runs."""

from __future__ import annotations

import contextlib
import fcntl
import os
import signal
import socket
import subprocess
import sys
import time
import warnings
from collections.abc import Iterator
from pathlib import Path

import lightning as L
import pytest
from jsonargparse import Namespace
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.demos.boring_classes import BoringModel

from mmoe.runtime.run_lock import (
    LOCK_FILE,
    FolderLock,
    RunFolderError,
    RunFolderLocks,
    quiet_fresh_folder_warning,
    run_folders,
)

#: Another process holding the lock of the folder argv[1] as mmoe does (flock on the file, its name in it) until
#: killed; it prints a line once it holds it.
HOLDER = """
import fcntl, os, socket, sys, time
handle = open(os.path.join(sys.argv[1], ".mmoe-run.lock"), "a+")
fcntl.flock(handle, fcntl.LOCK_EX)
handle.write(f"host {socket.gethostname()} pid {os.getpid()} started now\\n")
handle.flush()
print("held", flush=True)
time.sleep(600)
"""


def holding_process(folder: Path) -> contextlib.AbstractContextManager[subprocess.Popen]:
    """A live process that holds ``folder``'s lock; killed (SIGKILL) at the end if still running."""
    return process_holding(HOLDER, str(folder))


@contextlib.contextmanager
def process_holding(script: str, *arguments: str) -> Iterator[subprocess.Popen]:
    """A process running ``script`` with ``arguments``, once it printed that it holds its locks; SIGKILLed at the
    end if still running."""
    process = subprocess.Popen([sys.executable, "-c", script, *arguments], stdout=subprocess.PIPE, text=True)
    try:
        assert process.stdout.readline().strip() == "held"
        yield process
    finally:
        process.kill()
        process.wait()


@contextlib.contextmanager
def read_only(folder: Path) -> Iterator[Path]:
    """``folder`` made read-only: a read-only tmpfs mounted on it as root (chmod does not stop root), else chmod."""
    folder.mkdir(parents=True, exist_ok=True)
    if os.geteuid() == 0:
        mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(folder)],
                                 capture_output=True, text=True)  # fmt: skip
        if mounted.returncode != 0:
            pytest.skip(
                f"running as root, where chmod does not stop writes, and cannot mount: {mounted.stderr.strip()}"
            )
        try:
            yield folder
        finally:
            subprocess.run(["umount", str(folder)], check=True)
    else:
        folder.chmod(0o555)
        try:
            yield folder
        finally:
            folder.chmod(0o755)


def test_a_folder_held_by_a_live_process_is_refused_and_taken_over_once_it_is_killed(tmp_path, capsys):
    with holding_process(tmp_path) as holder:
        with pytest.raises(RunFolderError) as refused:
            FolderLock(tmp_path, "fit").acquire()
        message = str(refused.value)
        assert f"run folder {tmp_path} is in use by another run" in message
        assert f"host {socket.gethostname()} pid {holder.pid}" in message and "\n" not in message
        assert f"pid {holder.pid}" in (tmp_path / LOCK_FILE).read_text()  # the holder's lock is left alone
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    assert (tmp_path / LOCK_FILE).is_file()  # a SIGKILL leaves the file behind, but not the flock
    lock = FolderLock(tmp_path, "fit")
    lock.acquire()
    taken = capsys.readouterr().err.strip().splitlines()
    assert taken == [
        f"mmoe fit: run folder {tmp_path}: taking over the lock of a run that ended without releasing it "
        f"(host {socket.gethostname()} pid {holder.pid} started now)"
    ]
    assert f"pid {os.getpid()} " in (tmp_path / LOCK_FILE).read_text()
    lock.release()
    assert not (tmp_path / LOCK_FILE).exists()


def test_the_forked_children_of_a_killed_holder_do_not_keep_its_folder_locked(tmp_path, capsys):
    """As DataLoader workers outlive a killed run for a moment."""
    read_end, write_end = os.pipe()
    holder = os.fork()
    if holder == 0:  # the run: takes the lock (held while ``held`` lives), forks a worker, ends without releasing
        try:
            held = FolderLock(tmp_path, "fit")
            held.acquire()
            worker = os.fork()
            if worker == 0:
                time.sleep(60)
                os._exit(0)
            os.write(write_end, f"{worker}\n".encode())
        finally:
            os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end) as pipe:
        worker = int(pipe.readline())
    os.waitpid(holder, 0)
    try:
        lock = FolderLock(tmp_path, "fit")
        lock.acquire()
        assert f"taking over the lock of a run that ended without releasing it (host {socket.gethostname()} pid " \
            f"{holder} started" in capsys.readouterr().err  # fmt: skip
        lock.release()
    finally:
        os.kill(worker, signal.SIGKILL)


def test_a_released_lock_is_taken_again_without_a_word_and_held_against_this_process_too(tmp_path, capsys):
    first = FolderLock(tmp_path, "fit")
    first.acquire()
    with pytest.raises(RunFolderError, match=f"pid {os.getpid()} started"):
        FolderLock(tmp_path, "predict").acquire()
    first.release()
    second = FolderLock(tmp_path, "fit")
    second.acquire()
    second.release()
    assert capsys.readouterr().err == ""


def test_a_checkpoint_folder_outside_the_run_folder_is_locked_as_well(tmp_path):
    root, elsewhere = tmp_path / "run", tmp_path / "elsewhere" / "checkpoints"
    locks = RunFolderLocks()
    locks.hold_folders("fit", root, [root / "checkpoints", elsewhere])
    assert (root / LOCK_FILE).is_file() and (elsewhere / LOCK_FILE).is_file()
    assert (root / "checkpoints" / LOCK_FILE).is_file()  # inside the run folder too: another run may name it
    with pytest.raises(RunFolderError, match=f"checkpoint folder {elsewhere} is in use by another run") as refused:
        RunFolderLocks().hold_folders("fit", tmp_path / "other_run", [elsewhere])
    assert str(refused.value).endswith("wait for it to end, or give this run another ModelCheckpoint dirpath")
    assert not (tmp_path / "other_run" / LOCK_FILE).exists()  # a refused run keeps no lock
    locks.release()
    assert not (root / LOCK_FILE).exists() and not (elsewhere / LOCK_FILE).exists()


def test_a_read_only_run_folder_is_refused_naming_it(tmp_path):
    with read_only(tmp_path / "ro") as folder:
        with pytest.raises(RunFolderError) as refused:
            RunFolderLocks().hold_folders("fit", folder / "run")
    assert str(refused.value).startswith(f"run folder {folder / 'run'} cannot be written: ")


def test_a_read_only_checkpoint_folder_is_refused_naming_it_and_the_run_folder_is_released(tmp_path):
    root = tmp_path / "run"
    with read_only(root / "checkpoints") as checkpoints:
        with pytest.raises(RunFolderError) as refused:
            RunFolderLocks().hold_folders("fit", root, [checkpoints])
    assert str(refused.value).startswith(f"checkpoint folder {checkpoints} cannot be written: ")
    assert not (root / LOCK_FILE).exists()


def test_run_folders_are_the_root_and_for_fit_the_checkpoint_folders_of_config_and_objects(tmp_path):
    trainer = Namespace(
        default_root_dir="runs/a",
        callbacks=[
            Namespace(class_path="lightning.pytorch.callbacks.ModelCheckpoint", init_args=Namespace(dirpath="ck/a")),
            Namespace(class_path="lightning.pytorch.callbacks.LearningRateMonitor", init_args=Namespace()),
        ],
    )
    defaults = {"callbacks": [ModelCheckpoint(dirpath=tmp_path / "ck_b")]}
    assert run_folders("fit", trainer, defaults) == ("runs/a", ["ck/a", str(tmp_path / "ck_b")])
    assert run_folders("predict", trainer, defaults) == ("runs/a", [])
    assert run_folders("fit", Namespace(default_root_dir=None, callbacks=None), {}) == (None, [])


def test_folders_the_lock_made_are_removed_on_release_while_empty(tmp_path):
    root = tmp_path / "new" / "run"
    locks = RunFolderLocks()
    locks.hold_folders("fit", root, [root / "checkpoints"])
    assert (root / "checkpoints").is_dir()
    locks.release()  # a run that stopped before writing anything
    assert list(tmp_path.iterdir()) == []
    locks.hold_folders("fit", root, [root / "checkpoints"])
    (root / "checkpoints" / "last.ckpt").write_bytes(b"weights")
    locks.release()
    assert sorted(path.name for path in root.rglob("*")) == ["checkpoints", "last.ckpt"]


#: How a link is planted as a lock file, and how to see it is left there.
PLANTED_LOCKS = {
    "a symbolic link": (lambda lock, victim: lock.symlink_to(victim), lambda lock: lock.is_symlink()),
    "a hard link": (lambda lock, victim: os.link(victim, lock), lambda lock: os.stat(lock).st_nlink == 2),
}


@pytest.mark.parametrize("kind", PLANTED_LOCKS)
def test_a_lock_file_that_is_a_link_is_refused_and_its_target_left_untouched(kind, tmp_path):
    """A link planted in a shared or unpacked run folder would otherwise have the run truncate and write its target
    (for a hard link, the file it shares)."""
    plant, left_there = PLANTED_LOCKS[kind]
    victim = tmp_path / "victim.txt"
    victim.write_text("precious data line 1\nline 2\n")
    folder = tmp_path / "run"
    folder.mkdir()
    plant(folder / LOCK_FILE, victim)
    with pytest.raises(RunFolderError) as refused:
        RunFolderLocks().hold_folders("fit", folder)
    message = str(refused.value)
    assert message.startswith(f"run folder {folder}: its lock file {folder / LOCK_FILE} is {kind}")
    assert "\n" not in message and "precious" not in message
    assert victim.read_text() == "precious data line 1\nline 2\n"
    assert left_there(folder / LOCK_FILE)  # left for its owner to look at


def test_a_lock_file_that_is_a_fifo_is_refused(tmp_path):
    os.mkfifo(tmp_path / LOCK_FILE)
    with pytest.raises(RunFolderError, match=f"its lock file {tmp_path / LOCK_FILE} is a fifo, not a regular file"):
        FolderLock(tmp_path, "fit").acquire()


@pytest.mark.parametrize(
    "content",
    ["precious data line 1\nline 2\n", "host h pid 1 started now\nsecond line\n", "\x1b]0;title\x07", "\xff\xfe"],
    ids=["lines", "two-lines", "escape", "not-utf8"],
)
def test_an_old_lock_holding_anything_but_a_holder_line_is_taken_over_without_quoting_it(content, tmp_path, capsys):
    (tmp_path / LOCK_FILE).write_bytes(content.encode("latin-1"))
    lock = FolderLock(tmp_path, "fit")
    lock.acquire()
    assert capsys.readouterr().err.strip().splitlines() == [
        f"mmoe fit: run folder {tmp_path}: taking over the lock of a run that ended without releasing it (its lock "
        "file held something unrecognised)"
    ]
    assert (tmp_path / LOCK_FILE).read_text().startswith(f"host {socket.gethostname()} pid {os.getpid()} started ")
    lock.release()


def test_a_refusal_does_not_quote_a_held_lock_s_content_unless_it_is_a_holder_line(tmp_path):
    (tmp_path / LOCK_FILE).write_text("secret line 1\nsecret line 2\n")
    with open(tmp_path / LOCK_FILE) as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        with pytest.raises(RunFolderError) as refused:
            FolderLock(tmp_path, "fit").acquire()
    assert "secret" not in str(refused.value)
    assert f"run folder {tmp_path} is in use by another run (a process whose lock file holds something " \
        f"unrecognised; lock file {tmp_path / LOCK_FILE})" in str(refused.value)  # fmt: skip


#: Another process running as a run does: holding the locks of the run folder argv[1] and the checkpoint folders
#: argv[2:] (:meth:`RunFolderLocks.hold_folders`) until killed; it prints a line once it holds them.
RUN_HOLDER = """
import sys, time
from mmoe.runtime.run_lock import RunFolderLocks
locks = RunFolderLocks()
locks.hold_folders("fit", sys.argv[1], sys.argv[2:])
print("held", flush=True)
time.sleep(600)
"""


def running_run(root: Path, *checkpoint_folders: Path) -> contextlib.AbstractContextManager[subprocess.Popen]:
    """Another process holding the folders of a run into ``root`` (see :data:`RUN_HOLDER`); SIGKILLed at the end."""
    return process_holding(RUN_HOLDER, str(root), *map(str, checkpoint_folders))


def test_a_checkpoint_folder_inside_a_running_run_s_folder_is_refused_and_free_once_that_run_is_killed(
    tmp_path, capsys
):
    run_a, run_c = tmp_path / "A", tmp_path / "C"
    with running_run(run_a, run_a / "checkpoints") as holder:
        for folder in (run_a / "checkpoints", run_a / "elsewhere"):  # its own checkpoint folder, or any in it
            with pytest.raises(RunFolderError) as refused:
                RunFolderLocks().hold_folders("fit", run_c, [folder])
            assert str(refused.value).startswith(
                f"checkpoint folder {folder} is inside {run_a}, which another run holds (host {socket.gethostname()} "
                f"pid {holder.pid} started "
            )
            assert str(refused.value).endswith(f"; lock file {run_a / LOCK_FILE}): wait for it to end, or give this "
                                               "run another ModelCheckpoint dirpath")  # fmt: skip
        with pytest.raises(RunFolderError, match=f"run folder {run_a / 'nested'} is inside {run_a}, which another "):
            RunFolderLocks().hold_folders("fit", run_a / "nested")
        assert not run_c.exists() and not (run_a / "elsewhere").exists() and not (run_a / "nested").exists()
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    locks = RunFolderLocks()  # the killed run's lock files are left behind, and block nothing
    locks.hold_folders("fit", run_c, [run_a / "checkpoints", run_a / "elsewhere"])
    assert f"checkpoint folder {run_a / 'checkpoints'}: taking over the lock" in capsys.readouterr().err
    locks.release()


def test_a_run_whose_checkpoint_folder_another_run_holds_is_refused_before_it_writes(tmp_path):
    """The other order: a run with another root writes into this run folder's checkpoints/ first."""
    run_a, run_c = tmp_path / "A", tmp_path / "C"
    with running_run(run_c, run_a / "checkpoints") as holder:
        with pytest.raises(RunFolderError, match=f"checkpoint folder {run_a / 'checkpoints'} is in use by another "
                                                 f"run \\(host {socket.gethostname()} pid {holder.pid} "):  # fmt: skip
            RunFolderLocks().hold_folders("fit", run_a, [run_a / "checkpoints"])
        assert sorted(path.name for path in run_a.iterdir()) == ["checkpoints"]  # its root lock was let go


def test_a_run_s_own_checkpoint_folders_are_locked_beside_its_root_without_conflict(tmp_path):
    root = tmp_path / "run"
    locks = RunFolderLocks()
    locks.hold_folders("fit", root, [root / "checkpoints", root / "checkpoints" / "best"])
    assert all((folder / LOCK_FILE).is_file() for folder in (root, root / "checkpoints", root / "checkpoints" / "best"))
    locks.release()
    assert list(tmp_path.iterdir()) == []


def not_empty_warnings(root: Path) -> list[str]:
    """The "exists and is not empty" warnings of a one-step Lightning fit into ``root``, its folders locked and its
    checkpoint callback quieted as ``mmoe fit`` does; the filter must be gone once the callback is set up."""
    checkpoints = root / "checkpoints"
    trainer = L.Trainer(max_steps=1, default_root_dir=root, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[ModelCheckpoint(dirpath=checkpoints)])  # fmt: skip
    locks = RunFolderLocks()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        filters = list(warnings.filters)
        locks.hold_folders("fit", root, [checkpoints])
        for callback in trainer.checkpoint_callbacks:
            quiet_fresh_folder_warning(callback)
        try:
            trainer.fit(BoringModel())
            assert warnings.filters == filters  # the filter lived in the callback's setup only
        finally:
            locks.release()
    return [str(warning.message) for warning in caught if "exists and is not empty" in str(warning.message)]


def test_a_fresh_checkpoint_folder_holding_only_the_lock_is_not_warned_about_and_one_holding_checkpoints_is(tmp_path):
    root = tmp_path / "run"
    assert not_empty_warnings(root) == []
    assert any(path.suffix == ".ckpt" for path in (root / "checkpoints").iterdir())
    assert not_empty_warnings(root) == [f"Checkpoint directory {root / 'checkpoints'} exists and is not empty."]
