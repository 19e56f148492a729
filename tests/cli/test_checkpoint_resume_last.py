"""``mmoe fit`` saves its last step whatever the checkpoint interval, and ``--ckpt_path last`` resumes the run's latest
checkpoint like a named file: read safely, its hyper-parameters used over an edited config and named, an unreadable
``last.ckpt`` replaced by the newest readable checkpoint beside it, a missing one refused in one line; a moved run
folder keeps writing its own ``last.ckpt``."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch
import yaml
from jsonargparse import Namespace
from lightning.pytorch.callbacks import ModelCheckpoint

from mmoe.config.launch import run_lightning
from mmoe.model.config import PRESETS
from mmoe.runtime.resume import checkpoint_folders, last_checkpoint_file
from tests.cli_fixtures import run_mmoe, small_shards

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

EVERY = 5


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    return small_shards(tmp_path_factory.mktemp("resume_last"))


def nlvr2_config(shards: Path, run: Path, steps: int, learning_rate: float = 1.0e-3) -> dict:
    """A tiny NLVR2 fine-tuning into ``run``: ``last.ckpt`` and a step-named checkpoint every :data:`EVERY` steps."""
    checkpoint = {
        "class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
        "init_args": {"save_last": True, "save_top_k": -1, "every_n_train_steps": EVERY},
    }
    return {
        "seed_everything": 0,
        "trainer": {"max_steps": steps, "accelerator": "cpu", "logger": False, "enable_progress_bar": False,
                    "enable_model_summary": False, "limit_val_batches": 0, "default_root_dir": str(run),
                    "callbacks": [checkpoint]},
        "model": {"class_path": "mmoe.tasks.nlvr2.NLVR2FineTuning",
                  "init_args": {"backbone": dict(PRESETS["test"]),
                                "optimizer": {"warmup_steps": 1, "learning_rate": learning_rate}}},
        "data": {"class_path": "mmoe.data.datamodules.NLVR2DataModule",
                 "init_args": {"data_root": str(shards), "train_shards": "nlvr2-train", "batch_size": 2,
                               "max_text_length": 32, "num_workers": 0}},
    }  # fmt: skip


def write_config(path: Path, config: dict) -> str:
    path.write_text(yaml.safe_dump(config))
    return str(path)


def saved(path: Path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=True)


def fit(capsys, config: str, *options: str) -> str:
    """``mmoe fit --config config options``, which must succeed; its stderr."""
    code, _, err = run_mmoe(["fit", "--config", config, *options], capsys)
    assert code in (0, None), err[-3000:]
    return err


def error_line(capsys, argv: list[str]) -> str:
    """The one stderr line ``mmoe <argv>`` ends with, exit code 2 and no traceback."""
    code, _, err = run_mmoe(argv, capsys)
    assert code == 2 and "Traceback" not in err, err[-3000:]
    return err.strip().splitlines()[-1]


@pytest.mark.slow
def test_the_last_step_is_saved_and_a_resume_saves_its_own(shards, tmp_path, capsys):
    run = tmp_path / "run"
    config = write_config(tmp_path / "fit.yaml", nlvr2_config(shards, run, steps=7))
    fit(capsys, config)
    last = run / "checkpoints" / "last.ckpt"
    assert saved(last)["global_step"] == 7  # not 5, the last multiple of the interval
    fit(capsys, config, "--trainer.max_steps", "9", "--ckpt_path", "last")
    assert saved(last)["global_step"] == 9
    assert sorted(path.name for path in last.parent.glob("last*")) == ["last.ckpt"]


@pytest.mark.slow
def test_resuming_last_takes_the_run_s_last_ckpt_over_a_newer_copy_beside_it_and_says_which(shards, tmp_path, capsys):
    run = tmp_path / "run"
    config = write_config(tmp_path / "fit.yaml", nlvr2_config(shards, run, steps=EVERY + 2))
    fit(capsys, config)
    checkpoints = run / "checkpoints"
    backup = checkpoints / "last-before-lr-change.ckpt"
    shutil.copy(next(checkpoints.glob(f"*step={EVERY}.ckpt")), backup)  # an older checkpoint, copied in last
    err = fit(capsys, config, "--trainer.max_steps", str(EVERY + 4), "--ckpt_path", "last")
    assert (
        f"mmoe fit: --ckpt_path last: resuming from {checkpoints / 'last.ckpt'} (step {EVERY + 2})" in err.splitlines()
    )
    assert saved(checkpoints / "last.ckpt")["global_step"] == EVERY + 4
    assert saved(backup)["global_step"] == EVERY  # left as it was


@pytest.mark.slow
def test_resuming_last_is_refused_when_a_run_started_afresh_beside_it_saved_a_newer_last_version(
    shards, tmp_path, capsys
):
    """A run started again without --ckpt_path beside a finished run's last.ckpt saves last-v1.ckpt; once it is
    killed, --ckpt_path last must not resume the older last.ckpt and pass over its steps."""
    run = tmp_path / "run"
    config = write_config(tmp_path / "fit.yaml", nlvr2_config(shards, run, steps=2))
    fit(capsys, config)
    checkpoints = run / "checkpoints"
    finished = (checkpoints / "last.ckpt").stat().st_mtime - 3600
    os.utime(checkpoints / "last.ckpt", (finished, finished))  # the first run ended an hour before
    fit(capsys, config, "--trainer.max_steps", "3")
    assert saved(checkpoints / "last-v1.ckpt")["global_step"] == 3
    line = error_line(capsys, ["fit", "--config", config, "--trainer.max_steps", "6", "--ckpt_path", "last"])
    assert line.startswith(f"mmoe fit: error: --ckpt_path last: {checkpoints / 'last-v1.ckpt'} (saved ")
    assert f") is newer than {checkpoints / 'last.ckpt'} (saved " in line
    assert line.endswith("name the checkpoint to resume with --ckpt_path FILE")
    assert saved(checkpoints / "last.ckpt")["global_step"] == 2  # neither file was written
    assert saved(checkpoints / "last-v1.ckpt")["global_step"] == 3
    older = (checkpoints / "last-v1.ckpt").stat().st_mtime - 7200
    os.utime(checkpoints / "last-v1.ckpt", (older, older))  # older than last.ckpt: last.ckpt is the run's own
    err = fit(capsys, config, "--trainer.max_steps", "4", "--ckpt_path", "last")
    assert f"resuming from {checkpoints / 'last.ckpt'} (step 2); not last-v1.ckpt beside it" in err


@pytest.mark.slow
def test_runs_started_from_python_save_their_last_step_too(shards, tmp_path):
    """The demo's way: ``run_lightning`` with a ``ModelCheckpoint`` object among its callbacks."""
    config = nlvr2_config(shards, tmp_path / "run", steps=3)
    config["trainer"]["callbacks"] = []
    checkpoints = tmp_path / "run" / "checkpoints"
    callback = ModelCheckpoint(dirpath=checkpoints, save_top_k=0, save_last=True, every_n_train_steps=2)
    run_lightning("fit", [write_config(tmp_path / "fit.yaml", config)], callbacks=[callback])
    assert saved(checkpoints / "last.ckpt")["global_step"] == 3


@pytest.mark.slow
def test_resuming_last_uses_and_names_the_checkpoint_learning_rate_over_an_edited_config(shards, tmp_path, capsys):
    run = tmp_path / "run"
    fit(capsys, write_config(tmp_path / "fit.yaml", nlvr2_config(shards, run, steps=5, learning_rate=1.0e-3)))
    edited = write_config(tmp_path / "edited.yaml", nlvr2_config(shards, run, steps=7, learning_rate=9.0e-3))
    err = fit(capsys, edited, "--ckpt_path", "last")
    last = run / "checkpoints" / "last.ckpt"
    expected = f"mmoe fit: --ckpt_path {last}: model.init_args.optimizer.learning_rate: checkpoint 0.001 used over "
    assert f"{expected}config 0.009" in err.splitlines(), err[-3000:]
    resumed = saved(last)
    assert resumed["global_step"] == 7
    assert resumed["hyper_parameters"]["optimizer"]["learning_rate"] == 1.0e-3
    assert resumed["lr_schedulers"][0]["base_lrs"][0] == pytest.approx(1.0e-3)


def test_resuming_last_without_a_checkpoint_is_one_line_naming_the_folder(shards, tmp_path, capsys):
    run = tmp_path / "empty_run"
    config = write_config(tmp_path / "fit.yaml", nlvr2_config(shards, run, steps=2))
    line = error_line(capsys, ["fit", "--config", config, "--ckpt_path", "last"])
    assert line.startswith("mmoe fit: error: --ckpt_path last: ")
    assert str(run / "checkpoints") in line and "drop --ckpt_path to start a new run" in line
    assert not run.exists()  # nothing was trained


def test_an_unreadable_last_checkpoint_with_no_readable_one_beside_it_is_one_line(shards, tmp_path, capsys):
    run = tmp_path / "run"
    checkpoints = run / "checkpoints"
    checkpoints.mkdir(parents=True)
    (checkpoints / "last.ckpt").write_bytes(b"")
    (checkpoints / "epoch=0-step=5.ckpt").write_bytes(b"PK\x03\x04 cut short")
    config = write_config(tmp_path / "fit.yaml", nlvr2_config(shards, run, steps=2))
    line = error_line(capsys, ["fit", "--config", config, "--ckpt_path", "last"])
    assert f"{checkpoints / 'last.ckpt'} could not be read: the file is empty" in line
    assert f"no other checkpoint in {checkpoints} can be read either" in line


@pytest.mark.slow
def test_a_truncated_last_checkpoint_resumes_from_the_newest_readable_one_and_says_so(shards, tmp_path, capsys):
    run = tmp_path / "run"
    config = write_config(tmp_path / "fit.yaml", nlvr2_config(shards, run, steps=EVERY * 2))
    fit(capsys, config)
    checkpoints = run / "checkpoints"
    last, newest_readable = checkpoints / "last.ckpt", next(checkpoints.glob("*step=10.ckpt"))
    with open(last, "r+b") as file:  # a save cut short
        file.truncate(last.stat().st_size // 2)
    err = fit(capsys, config, "--trainer.max_steps", str(EVERY * 2 + 2), "--ckpt_path", "last")
    notice = f"mmoe fit: --ckpt_path last: {last} cannot be read (the file is truncated or corrupted"
    lines = [line for line in err.splitlines() if line.startswith(notice)]
    assert len(lines) == 1, err[-3000:]
    assert lines[0].endswith(f"; using {newest_readable}, the newest readable checkpoint beside it (step 10)")
    assert saved(last)["global_step"] == EVERY * 2 + 2  # written over the truncated file, not beside it
    assert sorted(path.name for path in checkpoints.glob("last*")) == ["last.ckpt"]


@pytest.mark.slow
def test_a_moved_run_folder_keeps_writing_its_own_last_checkpoint(shards, tmp_path, capsys):
    first = tmp_path / "first"
    fit(capsys, write_config(tmp_path / "first.yaml", nlvr2_config(shards, first, steps=3)))
    moved = tmp_path / "moved"
    shutil.copytree(first, moved)
    config = write_config(tmp_path / "moved.yaml", nlvr2_config(shards, moved, steps=6))
    fit(capsys, config, "--ckpt_path", "last")
    checkpoints = moved / "checkpoints"
    assert sorted(path.name for path in checkpoints.glob("last*")) == ["last.ckpt"]
    assert saved(checkpoints / "last.ckpt")["global_step"] == 6
    assert saved(first / "checkpoints" / "last.ckpt")["global_step"] == 3  # the original is left alone


def test_last_is_the_newest_last_checkpoint_where_the_run_saves_them(tmp_path):
    def trainer(dirpath: str | None) -> Namespace:
        init_args = Namespace(dirpath=dirpath, save_last=True)
        callback = Namespace(class_path="lightning.pytorch.callbacks.ModelCheckpoint", init_args=init_args)
        return Namespace(default_root_dir=str(tmp_path / "run"), callbacks=[callback])

    assert checkpoint_folders(trainer(None)) == [tmp_path / "run" / "checkpoints"]
    assert checkpoint_folders(Namespace(default_root_dir=str(tmp_path / "run"), callbacks=None)) == [
        tmp_path / "run" / "checkpoints"
    ]
    objects = ModelCheckpoint(dirpath=tmp_path / "objects")
    folders = checkpoint_folders(trainer(str(tmp_path / "given")), [objects])
    assert folders == [tmp_path / "given", tmp_path / "objects"]
    for folder in folders:
        folder.mkdir()
    (tmp_path / "given" / "last.ckpt").write_bytes(b"older")
    os.utime(tmp_path / "given" / "last.ckpt", (1, 1))
    (tmp_path / "objects" / "last-v1.ckpt").write_bytes(b"newer")
    for not_last in (".last.ckpt.abcd1234", "epoch=0-step=9.ckpt", "last.ckpt.bak"):
        (tmp_path / "given" / not_last).write_bytes(b"newest, not a last checkpoint")
    assert last_checkpoint_file(folders) == tmp_path / "objects" / "last-v1.ckpt"  # the newer of the folders' own
    assert last_checkpoint_file([tmp_path / "nowhere"]) is None


def test_last_is_the_folder_s_last_ckpt_else_lightning_s_highest_version_never_a_copy_beside_it(tmp_path):
    for name, mtime in [("last.ckpt", 1), ("last-v3.ckpt", 3), ("last-v12.ckpt", 2), ("last-before-lr.ckpt", 9)]:
        (tmp_path / name).write_bytes(b"a checkpoint")
        os.utime(tmp_path / name, (mtime, mtime))
    assert last_checkpoint_file([tmp_path]) == tmp_path / "last.ckpt"
    (tmp_path / "last.ckpt").unlink()
    assert last_checkpoint_file([tmp_path]) == tmp_path / "last-v12.ckpt"  # the highest version, not the newest file
    for name in ("last-v3.ckpt", "last-v12.ckpt"):
        (tmp_path / name).unlink()
    assert last_checkpoint_file([tmp_path]) is None  # a copy named last-something is not the run's


def test_resuming_last_never_follows_a_link_in_the_run_folder(shards, tmp_path, capsys):
    """A last.ckpt (or last-vN.ckpt) that is a symbolic link, to another run's checkpoint or to nothing, is refused
    in one line naming the link and where it leads; the other run's file is left as it is."""
    other = tmp_path / "other"
    fit(capsys, write_config(tmp_path / "other.yaml", nlvr2_config(shards, other, steps=2)))
    theirs = other / "checkpoints" / "last.ckpt"
    before = theirs.read_bytes()
    run = tmp_path / "run"
    config = write_config(tmp_path / "fit.yaml", nlvr2_config(shards, run, steps=4))
    checkpoints = run / "checkpoints"
    for name, target in [("last.ckpt", theirs), ("last-v1.ckpt", theirs), ("last.ckpt", tmp_path / "absent.ckpt")]:
        checkpoints.mkdir(parents=True, exist_ok=True)
        for path in checkpoints.iterdir():
            path.unlink()
        (checkpoints / name).symlink_to(target)
        line = error_line(capsys, ["fit", "--config", config, "--ckpt_path", "last"])
        assert line == (
            f'mmoe fit: error: --ckpt_path last: {checkpoints / name} is a symbolic link (to "{target}"), and links '
            "in a run folder are not followed: name the checkpoint to resume with --ckpt_path FILE"
        )
        assert sorted(path.name for path in checkpoints.iterdir()) == [name]
    assert theirs.read_bytes() == before
