"""Files mmoe writes get the permissions ``open()`` would give them (``0o666 & ~umask``, or the mode of the file they
replace), not the private 0600 of a bare ``tempfile.mkstemp``: exported backbones, codebooks, JSON results, figures,
and Lightning's checkpoints of ``mmoe fit``."""

from __future__ import annotations

import contextlib
import os
import stat
import subprocess
import sys

import pytest
import torch
import yaml

from mmoe.atomic import atomic_write, current_umask, write_json_atomic, write_text_atomic
from mmoe.model import MoEPlan, MultiwayConfig, MultiwayTransformer
from mmoe.model.config import PRESETS
from mmoe.runtime.checkpoint import export_backbone
from mmoe.tasks.visual_codebook import PatchCodebook


@contextlib.contextmanager
def umask(mask: int):
    previous = os.umask(mask)
    try:
        yield
    finally:
        os.umask(previous)


def mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_current_umask_reads_without_changing_it():
    with umask(0o027):
        assert current_umask() == 0o027
        assert os.umask(0o027) == 0o027


@pytest.mark.parametrize(("mask", "expected"), [(0o022, 0o644), (0o027, 0o640), (0o002, 0o664), (0o077, 0o600)])
def test_files_written_by_mmoe_follow_the_umask(tmp_path, mask, expected):
    backbone = MultiwayTransformer(MultiwayConfig.preset("tiny", depth=2, moe=MoEPlan(num_experts=2)))
    with umask(mask):
        export_backbone(backbone, tmp_path / "backbone.pt")
        PatchCodebook(torch.zeros(4, 12), patch_size=16, pool=2).save(tmp_path / "codebook.pt")
        write_json_atomic(tmp_path / "results.json", {"accuracy": 1.0})
        write_text_atomic(tmp_path / "notes.txt", "hello")
        atomic_write(tmp_path / "deep" / "figure.png", lambda temporary: temporary.write_bytes(b"png"))
    for name in ("backbone.pt", "codebook.pt", "results.json", "notes.txt", "deep/figure.png"):
        assert oct(mode(tmp_path / name)) == oct(expected), name
    assert sorted(path.name for path in tmp_path.iterdir()) == [
        "backbone.pt", "codebook.pt", "deep", "notes.txt", "results.json"
    ]  # fmt: skip


def test_a_replaced_file_keeps_its_mode(tmp_path):
    path = tmp_path / "results.json"
    path.write_text("{}")
    path.chmod(0o664)
    with umask(0o077):
        write_json_atomic(path, [1, 2])
    assert mode(path) == 0o664
    assert path.read_text() == "[\n  1,\n  2\n]\n"


def test_lightning_checkpoints_of_mmoe_fit_follow_the_umask(tmp_path):
    """``ModelCheckpoint`` (a step checkpoint and ``last.ckpt``), the saved config and the export of the checkpoint,
    from the ``mmoe`` command run under umask 027."""
    from tests.cli_fixtures import small_shards

    shards = small_shards(tmp_path, questions_per_image=2)
    run = tmp_path / "run"
    config = {
        "trainer": {
            "max_steps": 2, "accelerator": "cpu", "logger": False, "enable_progress_bar": False,
            "limit_val_batches": 0, "default_root_dir": str(run),
            "callbacks": [{"class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
                           "init_args": {"dirpath": str(run / "checkpoints"), "save_last": True,
                                         "every_n_train_steps": 1}}],
        },
        "model": {"class_path": "mmoe.tasks.nlvr2.NLVR2FineTuning",
                  "init_args": {"backbone": dict(PRESETS["test"]), "optimizer": {"warmup_steps": 1}}},
        "data": {"class_path": "mmoe.data.datamodules.NLVR2DataModule",
                 "init_args": {"train_shards": str(shards / "nlvr2-train"), "batch_size": 2, "max_text_length": 32,
                               "num_workers": 0}},
    }  # fmt: skip
    (tmp_path / "nlvr2.yaml").write_text(yaml.safe_dump(config))
    command = "import os, sys; os.umask(0o027); from mmoe.cli import main; sys.exit(main(sys.argv[1:]))"
    environment = os.environ | {"OMP_NUM_THREADS": "1"}
    for argv in (
        ["fit", "--config", str(tmp_path / "nlvr2.yaml")],
        ["export-backbone", "--ckpt", str(run / "checkpoints" / "last.ckpt"), "--out", str(run / "backbone.pt")],
    ):
        done = subprocess.run([sys.executable, "-c", command, *argv], capture_output=True, text=True, env=environment)
        assert done.returncode == 0, done.stderr[-3000:]
    written = sorted((run / "checkpoints").iterdir()) + [run / "config.yaml", run / "backbone.pt"]
    assert {path.name for path in written} >= {"last.ckpt", "config.yaml", "backbone.pt"}
    assert {path.name: oct(mode(path)) for path in written} == {path.name: "0o640" for path in written}
