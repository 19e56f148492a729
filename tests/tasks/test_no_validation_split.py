"""A run given no validation split trains without validating and without a warning: ``val_pair_shards: null`` (an
img2dataset folder with no held-out split) and a fine-tuning without ``val_shards`` (NLVR2 on its training split
alone), where Lightning used to warn ``Total length of `list` across ranks is zero``."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings

import pytest
import yaml

from mmoe.model import MultiwayConfig
from mmoe.runtime.checkpoint import config_to_dict
from tests.cli_fixtures import run_mmoe, small_shards
from tests.demo.test_demo import WARNING_LINE

pytestmark = pytest.mark.slow


def test_pretraining_with_val_pair_shards_null_prints_no_warning(synthetic_corpus, tmp_path):
    """The tiny config's ``mmoe fit`` as a user runs it (a process of its own, Python's default warning filters),
    validating every step but given no validation pairs."""
    run = tmp_path / "run"
    argv = [
        "fit", "--config", "configs/pretrain/tiny.yaml",
        "--data.init_args.data_root", str(synthetic_corpus),
        "--model.init_args.visual_codebook", str(synthetic_corpus / "codebook.pt"),
        "--data.init_args.val_pair_shards=null",
        "--data.init_args.num_workers", "0", "--data.init_args.batch_size", "4",
        "--model.init_args.backbone.dim", "32", "--model.init_args.backbone.num_heads", "2",
        "--model.init_args.backbone.ffn_dim", "64", "--model.init_args.backbone.depth", "2",
        "--trainer.max_steps", "2", "--trainer.val_check_interval", "1", "--trainer.accelerator", "cpu",
        "--trainer.enable_progress_bar", "false", "--trainer.default_root_dir", str(run),
    ]  # fmt: skip
    environment = {name: value for name, value in os.environ.items() if name != "PYTHONWARNINGS"}
    done = subprocess.run(
        [sys.executable, "-m", "mmoe.cli", *argv], env=environment, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert [line for line in done.stderr.splitlines() if WARNING_LINE.search(line)] == [], done.stderr
    assert "across ranks" not in done.stderr
    assert (run / "checkpoints" / "last.ckpt").is_file()


def test_a_fine_tuning_without_val_shards_neither_validates_nor_warns(tmp_path, capsys):
    shards = small_shards(tmp_path, train_images=8, val_images=2, test_images=2, questions_per_image=2)
    backbone = MultiwayConfig.preset("test")
    config = {
        "seed_everything": 0,
        "trainer": {"max_steps": 2, "val_check_interval": 1, "accelerator": "cpu", "logger": False,
                    "enable_progress_bar": False, "enable_checkpointing": False,
                    "default_root_dir": str(tmp_path / "run")},
        "model": {"class_path": "mmoe.tasks.nlvr2.NLVR2FineTuning",
                  "init_args": {"backbone": config_to_dict(backbone), "optimizer": {"warmup_steps": 1}}},
        "data": {"class_path": "mmoe.data.datamodules.NLVR2DataModule",
                 "init_args": {"train_shards": str(shards / "nlvr2-train"), "image_size": 32, "batch_size": 2,
                               "num_workers": 0}},
    }  # fmt: skip
    path = tmp_path / "nlvr2.yaml"
    path.write_text(yaml.safe_dump(config))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        code, _, err = run_mmoe(["fit", "--config", str(path)], capsys)
    assert code == 0, err[-3000:]
    assert [str(warning.message) for warning in caught if "across ranks" in str(warning.message)] == []
