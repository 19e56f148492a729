"""docs/routing_logging.md's way to turn the detailed tier on, followed as written: its ``detailed.yaml`` given as a
third ``--config`` changes the shipped ``RoutingStatsCallback`` and keeps the checkpoint and learning-rate callbacks
(repeated ``--config`` files merge ``trainer.callbacks`` by class, as ``extends:`` does)."""

from __future__ import annotations

import csv
import re
from pathlib import Path

import pytest
from lightning.pytorch.callbacks import LearningRateMonitor, ModelCheckpoint

from mmoe.runtime.routing_callback import RoutingStatsCallback
from mmoe.tasks.visual_codebook import fit_codebook
from tests.cli_fixtures import instantiate, run_mmoe, small_shards
from tests.tasks.test_pretraining import images
from tests.tutorial_commands import FENCED_BLOCK, bash_blocks, block_commands

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

REPO = Path(__file__).resolve().parents[2]
PAGE = REPO / "docs" / "routing_logging.md"


def page_part_and_command() -> tuple[str, list[str]]:
    """The page's ``detailed.yaml`` (the yaml block after the sentence naming the file) and the ``mmoe fit`` command
    that gives it."""
    text = PAGE.read_text(encoding="utf-8")
    named = text.index("`detailed.yaml`")
    part = next(block["body"] for block in FENCED_BLOCK.finditer(text, named) if block["language"].strip() == "yaml")
    (command,) = [
        argv for body in bash_blocks(text) for argv in block_commands(body) if "detailed.yaml" in argv and "fit" in argv
    ]
    assert command[:2] == ["mmoe", "fit"]
    return part, command[1:]


@pytest.fixture()
def page_run(tmp_path, monkeypatch) -> tuple[list[str], Path]:
    """(the page's ``mmoe fit`` arguments with a small corpus, a codebook and a 2-step run laid over them, the run
    folder), in a folder holding ``configs`` and the page's ``detailed.yaml``."""
    part, command = page_part_and_command()
    monkeypatch.chdir(tmp_path)
    (tmp_path / "configs").symlink_to(REPO / "configs")
    (tmp_path / "detailed.yaml").write_text(part)
    shards = small_shards(tmp_path / "data")
    fit_codebook([images(64)], size=16, patch_size=16, pool=2, iterations=5).save(tmp_path / "codebook.pt")
    run = tmp_path / "run"
    small = [
        f"--data.init_args.data_root={shards.parent}",
        "--data.init_args.val_pair_shards=shards/pretrain-pairs",
        f"--model.init_args.visual_codebook={tmp_path / 'codebook.pt'}",
        "--model.init_args.backbone.image_size=32",
        "--trainer.max_steps=2",
        "--trainer.val_check_interval=2",
        "--trainer.limit_val_batches=1",
        "--trainer.log_every_n_steps=1",
        f"--trainer.default_root_dir={run}",
        "--data.init_args.batch_size=4",
        "--data.init_args.num_workers=0",
        "--data.init_args.batches_per_epoch=2",
    ]
    return command + small, run


def test_the_pages_part_turns_the_detailed_tier_on_and_keeps_the_shipped_callbacks(page_run):
    argv, run = page_run
    callbacks = instantiate(argv).trainer.callbacks
    (routing,) = [callback for callback in callbacks if isinstance(callback, RoutingStatsCallback)]
    assert routing.tier == "detailed"
    (checkpoint,) = [callback for callback in callbacks if isinstance(callback, ModelCheckpoint)]
    assert checkpoint.save_last and Path(checkpoint.dirpath) == run / "checkpoints"
    assert any(isinstance(callback, LearningRateMonitor) for callback in callbacks)


def test_the_pages_command_saves_last_ckpt_and_logs_the_learning_rate(page_run, capsys):
    argv, run = page_run
    code, _, err = run_mmoe(argv, capsys)
    assert code in (0, None), err[-3000:]
    assert (run / "checkpoints" / "last.ckpt").is_file()
    assert not list((run / "tensorboard").rglob("*.ckpt"))  # not Lightning's own checkpoint, in the logger's folder
    with open(next((run / "csv").rglob("metrics.csv")), newline="") as handle:
        columns = next(csv.reader(handle))
    assert any(re.fullmatch(r"lr-AdamW(/pg\d+)?", column) for column in columns), columns
