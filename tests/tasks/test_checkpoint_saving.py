"""Checkpoints written whole or not at all (:mod:`mmoe.runtime.checkpoint_saving`): a failed save leaves the previous
checkpoint and no temporary file, killed saves' temporary files are removed at a later save, every trainer of the
CLI saves through it, and a real ``mmoe fit`` killed with SIGKILL while it saves into a checkpoint folder on another
filesystem than ``$TMPDIR`` leaves its previous ``last.ckpt`` whole, to resume from."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch
import yaml
from lightning.fabric.plugins import TorchCheckpointIO

from mmoe.runtime.checkpoint_saving import STALE_AFTER_S, AtomicCheckpointIO, LastStepCheckpoint
from tests.cli.test_checkpoint_resume_last import nlvr2_config
from tests.cli_fixtures import instantiate, run_mmoe, small_shards
from tests.tasks.resumable_fit import saved_step

ROOT = Path(__file__).resolve().parents[2]
#: Steps of the run that is killed while it saves (its schedule's length too).
KILLED_RUN_STEPS = 10_000


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    return small_shards(tmp_path_factory.mktemp("checkpoint_saving"))


def temporaries(folder: Path) -> list[str]:
    return sorted(path.name for path in folder.iterdir() if path.name.startswith(".last.ckpt."))


def test_a_failed_save_leaves_the_previous_checkpoint_and_no_temporary_file(tmp_path):
    path = tmp_path / "checkpoints" / "last.ckpt"
    io = AtomicCheckpointIO()
    io.save_checkpoint({"global_step": 1, "weights": torch.ones(3)}, path)
    with pytest.raises(Exception, match="pickle"):
        io.save_checkpoint({"global_step": 2, "weights": torch.zeros(3), "unsavable": lambda: None}, path)
    assert torch.load(path, weights_only=True)["global_step"] == 1
    assert temporaries(path.parent) == []


def test_temporary_files_of_killed_saves_are_removed_at_the_next_save_in_their_folder(tmp_path):
    path = tmp_path / "last.ckpt"
    names = (".last.ckpt.k1ll3d_x", ".epoch=0-step=5.ckpt.k1ll3d_y", ".last.ckpt.wr1t1ng_", ".notes.k1ll3d_z")
    stale, stale_other, fresh, not_ours = (tmp_path / name for name in names)
    for leftover in (stale, stale_other, fresh, not_ours):
        leftover.write_bytes(b"PK\x03\x04 part of a checkpoint")
    old = time.time() - 2 * STALE_AFTER_S
    for leftover in (stale, stale_other, not_ours):
        os.utime(leftover, (old, old))
    AtomicCheckpointIO().save_checkpoint({"global_step": 3}, path)
    assert torch.load(path, weights_only=True)["global_step"] == 3
    assert not stale.exists() and not stale_other.exists()
    assert fresh.exists()  # may be another process's save in progress
    assert not_ours.exists()  # not a checkpoint's


def test_every_cli_trainer_saves_whole_checkpoints_at_the_last_step_unless_the_config_gives_its_own_io(
    shards, tmp_path
):
    config = nlvr2_config(shards, tmp_path / "run", steps=2)
    path = tmp_path / "fit.yaml"
    path.write_text(yaml.safe_dump(config))
    trainer = instantiate(["fit", "--config", str(path)]).trainer
    assert type(trainer.strategy.checkpoint_io) is AtomicCheckpointIO
    assert sum(isinstance(callback, LastStepCheckpoint) for callback in trainer.callbacks) == 1
    own = ["--trainer.plugins", '{"class_path": "lightning.fabric.plugins.TorchCheckpointIO"}']
    trainer = instantiate(["fit", "--config", str(path), *own]).trainer
    assert type(trainer.strategy.checkpoint_io) is TorchCheckpointIO


@pytest.fixture
def other_filesystem(tmp_path):
    """A folder on another filesystem than ``tmp_path`` (where ``$TMPDIR`` points): a tmpfs mounted in ``tmp_path``
    (as root), else a folder in ``/dev/shm`` when that is another device; removed afterwards."""
    folder = tmp_path / "tmpfs"
    folder.mkdir()
    mounted = os.geteuid() == 0 and subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=256m", "tmpfs", str(folder)], capture_output=True
    ).returncode == 0  # fmt: skip
    if mounted:
        yield folder
        subprocess.run(["umount", "-l", str(folder)], check=True)
        return
    shm = Path("/dev/shm")
    if not shm.is_dir() or shm.stat().st_dev == tmp_path.stat().st_dev:
        pytest.skip("no other filesystem than the temporary folder's: cannot mount a tmpfs and /dev/shm is the same")
    folder = Path(tempfile.mkdtemp(dir=shm))
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


@pytest.mark.slow
def test_a_fit_killed_while_it_saves_on_another_filesystem_leaves_its_last_checkpoint_whole(
    shards, other_filesystem, tmp_path, capsys
):
    checkpoints, spare = other_filesystem / "checkpoints", tmp_path / "tmpdir"
    spare.mkdir()
    # A run far longer than the catch needs (it is killed once a save is caught), so a loaded machine that schedules
    # this process rarely still sees a save begin before the run ends; the schedule's length is pinned, so the resumed
    # run below may stop sooner and train as this one would have.
    config = nlvr2_config(shards, tmp_path / "run", steps=KILLED_RUN_STEPS)
    config["model"]["init_args"]["optimizer"]["total_steps"] = KILLED_RUN_STEPS
    config["trainer"]["callbacks"][0]["init_args"].update(dirpath=str(checkpoints), every_n_train_steps=1, save_top_k=0)
    path = tmp_path / "fit.yaml"
    path.write_text(yaml.safe_dump(config))
    env = os.environ | {"OMP_NUM_THREADS": "1", "TMPDIR": str(spare), "PYTHONPATH": str(ROOT)}
    command = [sys.executable, "-m", "mmoe.cli", "fit", "--config", str(path)]
    process = subprocess.Popen(command, cwd=tmp_path, env=env, start_new_session=True,
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)  # fmt: skip
    last = checkpoints / "last.ckpt"
    try:
        deadline = time.monotonic() + 300
        while (first := saved_step(last)) is None:  # the first save, whole
            assert process.poll() is None and time.monotonic() < deadline, process.stderr.read()[-3000:]
        whole = last.stat().st_size
        # The next save has begun: its temporary file is there, or the checkpoint is being written over in place.
        deadline = time.monotonic() + 300
        while not temporaries(checkpoints) and last.stat().st_size >= whole:
            assert process.poll() is None and time.monotonic() < deadline, "no save was caught in progress"
    finally:
        with contextlib.suppress(ProcessLookupError):  # a run that ended on its own is reported above
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()
    step = saved_step(last)
    assert step is not None and step >= first, "last.ckpt is no longer a whole checkpoint"
    assert list(spare.iterdir()) == []  # nothing written to $TMPDIR
    orphans = temporaries(checkpoints)
    assert orphans, "killed while saving: its temporary file is left"

    # Resumed from it; the killed save's temporary file, once old, goes at the next save.
    old = time.time() - 2 * STALE_AFTER_S
    for orphan in orphans:
        os.utime(checkpoints / orphan, (old, old))
    code, _, err = run_mmoe(["fit", "--config", str(path), "--ckpt_path", "last", "--trainer.max_steps", str(step + 2)],
                            capsys)  # fmt: skip
    assert code in (0, None), err[-3000:]
    assert saved_step(last) == step + 2
    assert temporaries(checkpoints) == []
