"""``mmoe predict`` that predicted fewer samples than the split's manifests hold (a truncated shard, a batch limit)
says how many are missing and exits 2, unless ``--allow_partial_predictions true``; a whole split passes quietly."""

from __future__ import annotations

import json
import shutil

import pytest
import yaml

from mmoe.data.shards import expected_samples, resolve_shards
from mmoe.model import MultiwayConfig
from mmoe.runtime.checkpoint import config_to_dict
from tests.cli_fixtures import run_mmoe, small_shards

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

BACKBONE = MultiwayConfig.preset("test", depth=1)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return small_shards(tmp_path_factory.mktemp("partial"), val_images=6)


def predict_config(tmp_path, shards, test_shards) -> str:
    vocab = str(shards / "vqav2-train2014" / "answers.json")
    config = {
        "seed_everything": 0,
        "trainer": {"accelerator": "cpu", "logger": False, "enable_progress_bar": False,
                    "enable_model_summary": False, "default_root_dir": str(tmp_path / "run")},
        "model": {"class_path": "mmoe.tasks.vqa.VQAFineTuning",
                  "init_args": {"backbone": config_to_dict(BACKBONE), "answer_vocab": vocab,
                                "predictions_file": str(tmp_path / "answers.json")}},
        "data": {"class_path": "mmoe.data.datamodules.VQADataModule",
                 "init_args": {"train_shards": str(shards / "vqav2-train2014"), "val_shards": None,
                               "test_shards": str(test_shards), "batch_size": 2, "eval_batch_size": 4,
                               "max_text_length": 32, "num_workers": 0}},
    }  # fmt: skip
    path = tmp_path / "vqa.yaml"
    path.write_text(yaml.safe_dump(config))
    return str(path)


def mmoe(argv: list[str], capsys) -> tuple[int, str]:
    """``mmoe <argv>`` in this process: (exit code, stderr)."""
    code, _, err = run_mmoe(argv, capsys)
    return code, err


def truncated_copy(split, out):
    """``split`` copied to ``out`` with its first shard cut in half: the samples after the cut are lost."""
    shutil.copytree(split, out)
    shard = resolve_shards(out)[0]
    data = open(shard, "rb").read()
    open(shard, "wb").write(data[: len(data) // 2])
    return out


def test_a_whole_split_predicts_quietly(corpus, tmp_path, capsys):
    code, err = mmoe(["predict", "--config", predict_config(tmp_path, corpus, corpus / "vqav2-val2014")], capsys)
    assert code == 0, err
    assert "predictions were written for" not in err
    total = sum(expected_samples(resolve_shards(corpus / "vqav2-val2014")).values())
    assert len(json.loads((tmp_path / "answers.json").read_text())) == total
    assert "mmoe predict: samples skipped: none" in err


def test_a_truncated_shard_fails_predict_naming_the_shortfall(corpus, tmp_path, capsys):
    split = truncated_copy(corpus / "vqav2-val2014", tmp_path / "val")
    total = sum(expected_samples(resolve_shards(split)).values())
    config = predict_config(tmp_path, corpus, split)
    code, err = mmoe(["predict", "--config", config], capsys)
    written = len(json.loads((tmp_path / "answers.json").read_text()))  # written, whole, but partial
    assert 0 < written < total
    assert code == 2
    last = err.strip().splitlines()[-1]
    assert last.startswith("mmoe predict: error: predictions were written for ")
    assert f"for {written} of the {total} samples" in last and f"({total - written} missing" in last
    assert "--allow_partial_predictions true" in last
    assert f"test: {total - written} skipped" in err  # the end-of-stage skip report the message points to

    code, err = mmoe(["predict", "--config", config, "--allow_partial_predictions", "true"], capsys)
    assert code == 0, err
    assert f"for {written} of the {total} samples" in err and "(accepted: --allow_partial_predictions)" in err


def test_a_batch_limit_is_a_partial_prediction_too(corpus, tmp_path, capsys):
    config = predict_config(tmp_path, corpus, corpus / "vqav2-val2014")
    code, err = mmoe(["predict", "--config", config, "--trainer.limit_predict_batches", "2"], capsys)
    assert code == 2
    assert "predictions were written for 8 of the " in err.strip().splitlines()[-1]
