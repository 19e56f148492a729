"""`mmoe fit` from a pre-trained backbone (``backbone: null``), then `mmoe predict --ckpt_path` in new processes: the
checkpoint's saved hyper-parameters must parse (LightningCLI applies them over the config file) and the config it
saves must drive the next run."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import yaml

from mmoe.model import MoEPlan, MultiwayConfig, MultiwayTransformer
from mmoe.runtime.checkpoint import export_backbone
from tests.cli_fixtures import small_shards

pytestmark = pytest.mark.slow


def mmoe(*argv: str, cwd) -> subprocess.CompletedProcess:
    env = os.environ | {"OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-c", "import sys; from mmoe.cli import main; sys.exit(main(sys.argv[1:]))", *argv]
    return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)


def test_predict_in_a_new_process_from_a_checkpoint_fine_tuned_from_a_pretrained_backbone(tmp_path):
    shards = small_shards(
        tmp_path, train_images=60, val_images=8, test_images=4, questions_per_image=5, nlvr2_train_sets=2,
        nlvr2_eval_sets=2, texts=4,
    )  # fmt: skip
    backbone = MultiwayConfig.preset("test", moe=MoEPlan(num_experts=4, every=2, heads=2))
    export_backbone(MultiwayTransformer(backbone), tmp_path / "backbone.pt")
    vocab = str(shards / "vqav2-train2014" / "answers.json")
    config = {
        "trainer": {"max_steps": 2, "accelerator": "cpu", "logger": False, "enable_progress_bar": False,
                    "limit_val_batches": 0, "default_root_dir": str(tmp_path / "run")},
        "model": {"class_path": "mmoe.tasks.vqa.VQAFineTuning",
                  "init_args": {"answer_vocab": vocab, "backbone": None, "pretrained": str(tmp_path / "backbone.pt"),
                                "optimizer": {"warmup_steps": 1}}},
        "data": {"class_path": "mmoe.data.datamodules.VQADataModule",
                 "init_args": {"answer_vocab": vocab, "train_shards": str(shards / "vqav2-train2014"),
                               "val_shards": str(shards / "vqav2-val2014"),
                               "test_shards": str(shards / "vqav2-val2014"), "image_size": 32, "batch_size": 4,
                               "eval_batch_size": 8, "max_text_length": 32, "num_workers": 0}},
    }  # fmt: skip
    path = tmp_path / "vqa.yaml"
    path.write_text(yaml.safe_dump(config))
    fit = mmoe("fit", "--config", str(path), cwd=tmp_path)
    assert fit.returncode == 0, fit.stderr[-3000:]
    checkpoint = next((tmp_path / "run" / "checkpoints").glob("*.ckpt"))
    out = tmp_path / "answers.json"
    predict = mmoe("predict", "--config", str(path), "--ckpt_path", str(checkpoint),
                   "--model.init_args.predictions_file", str(out), cwd=tmp_path)  # fmt: skip
    assert predict.returncode == 0, predict.stderr[-3000:]
    answers = json.loads(out.read_text())
    assert answers and all(set(entry) == {"question_id", "answer"} for entry in answers)
    # The config LightningCLI saved during that predict (checkpoint hyper-parameters applied) drives the next one.
    saved = tmp_path / "run" / "config.yaml"
    again = mmoe("predict", "--config", str(saved), "--ckpt_path", str(checkpoint),
                 "--model.init_args.predictions_file", str(tmp_path / "again.json"), cwd=tmp_path)  # fmt: skip
    assert again.returncode == 0, again.stderr[-3000:]
    assert json.loads((tmp_path / "again.json").read_text()) == answers
