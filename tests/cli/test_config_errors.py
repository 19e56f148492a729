"""``mmoe fit|validate|test|predict`` config errors are one clear line (exit 2), and the settings the model and the data
both need (image size, patch size, VQA answer vocabulary) are given once, to the model, and linked to the data."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml

from mmoe.cli import main
from mmoe.config.cli import init_parameters
from mmoe.config.launch import run_lightning
from mmoe.model import MultiwayConfig, MultiwayTransformer
from mmoe.model.config import PRESETS
from mmoe.runtime.checkpoint import export_backbone
from mmoe.tasks.visual_codebook import PatchCodebook
from tests.cli_fixtures import instantiate, run_mmoe, small_shards, tiny_pretraining

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "configs"
TINY = dict(PRESETS["test"])


def mmoe(argv: list[str], capsys) -> tuple[int, str]:
    """``mmoe <argv>`` in this process: (exit code, stderr)."""
    code, _, err = run_mmoe(argv, capsys)
    return code, err


def error_line(err: str) -> str:
    """The error: the last line of stderr (Lightning may log its seed before it); no traceback anywhere."""
    assert "Traceback" not in err and "Union subtypes" not in err, err
    return err.strip().splitlines()[-1]


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> Path:
    return small_shards(tmp_path_factory.mktemp("corpus"), questions_per_image=4, texts=4)


# -- invalid settings ------------------------------------------------------------------------------------------------

XMOE = ("pretrain/tiny.yaml", "pretrain/tiny/xmoe.yaml")
INVALID = {
    "num_heads": (XMOE, "backbone.num_heads", "5", "MultiwayConfig.dim=192 is not divisible by num_heads=5"),
    "top_k": (XMOE, "backbone.moe.top_k", "9", "MoEPlan.top_k=9 exceeds MoEPlan.num_experts=8"),
    "strata": (("pretrain/tiny.yaml", "pretrain/tiny/stratified.yaml"), "backbone.moe.strata", "[4, 2]",
               "MoEPlan.strata=[4, 2] sums to 6"),
    "image_size": (("finetune/vqav2_tiny.yaml",), "backbone.image_size", "70", "MultiwayConfig.image_size=70 is not "
                   "divisible by patch_size=16"),
    "mh-moe heads": (("pretrain/tiny.yaml", "pretrain/tiny/mhmoe.yaml"), "backbone.moe.heads", "5",
                     "MultiwayConfig.dim=192 is not divisible by MoEPlan.heads=5"),
}  # fmt: skip


@pytest.mark.parametrize("case", INVALID)
@pytest.mark.parametrize("where", ["command line", "config file"])
def test_an_invalid_backbone_or_moe_setting_is_its_message_in_one_line(case, where, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)  # nothing may be written anywhere else
    configs, key, value, message = INVALID[case]
    argv = ["fit"]
    for config in configs:
        argv += ["--config", str(CONFIGS / config)]
    if where == "command line":
        argv.append(f"--model.init_args.{key}={value}")
    else:  # one more config file over the shipped ones, with the value alone
        edited = yaml.safe_load(value)
        for name in reversed(["model", "init_args", *key.split(".")]):
            edited = {name: edited}
        (tmp_path / "edited.yaml").write_text(yaml.safe_dump(edited))
        argv += ["--config", str(tmp_path / "edited.yaml")]
    code, err = mmoe(argv, capsys)
    assert code == 2
    assert error_line(err).startswith(f"mmoe fit: error: {message}")
    assert err.count(message) == 1
    assert list(tmp_path.iterdir()) == ([] if where == "command line" else [tmp_path / "edited.yaml"])


def test_an_unknown_key_or_a_wrong_type_is_named_by_the_parser(capsys, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    configs = ["--config", str(CONFIGS / XMOE[0]), "--config", str(CONFIGS / XMOE[1])]
    code, err = mmoe(["fit", *configs, "--model.init_args.backbone.moe.num_expert=4"], capsys)
    assert code == 2
    assert "Traceback" not in err and "num_expert" in err and "error:" in err
    code, err = mmoe(["fit", *configs, "--model.init_args.optimizer.learning_rate=fast"], capsys)
    assert code == 2
    assert "Traceback" not in err and 'Parser key "optimizer.learning_rate"' in err and "Got value: fast" in err


BAD_FILES = {
    "unknown key": {"model": {"init_args": {"backbone": {"moe": {"num_expert": 4}}}}},
    "wrong type": {"model": {"init_args": {"optimizer": {"learning_rate": "fast"}}}},
    "unknown trainer key": {"trainer": {"max_step": 4}},
    "missing data root": {"data": {"init_args": {"data_root": None, "image_shards": None}}},
}


@pytest.mark.parametrize("bad", BAD_FILES)
def test_a_bad_file_under_options_laid_over_it_from_python_is_the_error_it_is_without_them(bad, tmp_path, capsys):
    """A run from Python with options over the files (``overrides``) parses the files without validating them, then
    validates the whole once the options are laid over: each bad file is refused with the line it gets alone."""
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump(BAD_FILES[bad]))
    configs = [CONFIGS / XMOE[0], CONFIGS / XMOE[1], tmp_path / "bad.yaml"]
    code, alone = mmoe(["fit", *(f"--config={config}" for config in configs)], capsys)
    assert code == 2 and "Traceback" not in alone and alone.strip().splitlines()[-1].startswith("mmoe fit: error: ")
    for overrides in ({"trainer": {"default_root_dir": str(tmp_path / "run")}}, lambda config: {"seed_everything": 3}):
        with pytest.raises(SystemExit) as stopped:
            run_lightning("fit", configs, overrides)
        assert stopped.value.code == 2
        err = capsys.readouterr().err
        assert "Traceback" not in err and err.strip().splitlines()[-1] == alone.strip().splitlines()[-1]
    assert not (tmp_path / "run").exists()


def test_a_missing_or_foreign_vqkd_tokenizer_file_is_one_line(capsys, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    missing = tmp_path / "vqkd_encoder_base_decoder_3x768x12_clip-d5036aa7.pth"
    argv = ["fit", "--config", str(CONFIGS / XMOE[0]), "--model.init_args.visual_codebook=null"]
    code, err = mmoe([*argv, f"--model.init_args.vqkd_tokenizer={missing}"], capsys)
    assert code == 2
    assert error_line(err) == f"mmoe fit: error: model.vqkd_tokenizer {missing} does not exist"
    foreign = tmp_path / "beit3.pth"
    torch.save({"model": {"encoder.layers.0.self_attn.q_proj.A.weight": torch.zeros(2, 2)}}, foreign)
    code, err = mmoe([*argv, f"--model.init_args.vqkd_tokenizer={foreign}"], capsys)
    assert code == 2
    assert error_line(err).startswith(
        f"mmoe fit: error: model.vqkd_tokenizer {foreign} is not a VQ-KD tokenizer: it has no key "
        "encoder.patch_embed.proj.weight"
    )
    assert sorted(tmp_path.iterdir()) == [foreign]


# -- linked settings -------------------------------------------------------------------------------------------------


def pretraining_config(tmp_path: Path, shards: Path, patch_size: int, **data) -> Path:
    """The tiny X-MoE pre-training config on the test shards, with a ``patch_size`` backbone and codebook."""
    config = tiny_pretraining("xmoe")
    codebook = tmp_path / f"codebook{patch_size}.pt"
    PatchCodebook(torch.rand(8, 12), patch_size=patch_size, pool=2).save(codebook)
    config["trainer"] = {"max_steps": 1, "accelerator": "cpu", "logger": False, "enable_progress_bar": False,
                         "enable_checkpointing": False, "enable_model_summary": False, "limit_val_batches": 0,
                         "default_root_dir": str(tmp_path / "run")}  # fmt: skip
    config["model"]["init_args"]["backbone"].update(TINY, patch_size=patch_size)
    config["model"]["init_args"]["visual_codebook"] = str(codebook)
    config["data"]["init_args"].update(
        image_shards=str(shards / "pretrain-images"), text_shards=str(shards / "pretrain-text"),
        pair_shards=str(shards / "pretrain-pairs"), val_pair_shards=None, batch_size=2, **{"num_workers": 0, **data},
    )  # fmt: skip
    path = tmp_path / "pretrain.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def test_the_data_takes_image_and_patch_size_from_the_model_and_trains(shards, tmp_path, capsys):
    """A backbone of 8-px patches on 32-px images, given once: the masks of the data follow it, and a step runs."""
    config = pretraining_config(tmp_path, shards, patch_size=8)
    cli = instantiate(["fit", "--config", str(config)])
    assert (cli.datamodule.image_size, cli.datamodule.grid) == (32, (4, 4))
    assert main(["fit", "--config", str(config)]) == 0


def test_a_data_setting_that_disagrees_with_the_model_is_one_line_before_training(shards, tmp_path, capsys):
    config = pretraining_config(tmp_path, shards, patch_size=16)
    code, err = mmoe(["fit", "--config", str(config), "--data.init_args.patch_size", "8"], capsys)
    assert code == 2
    assert error_line(err) == (
        "mmoe fit: error: data.init_args.patch_size=8 disagrees with model.init_args.backbone.patch_size=16 (the "
        "data's patch_size follows the model's: leave it out of the data arguments)"
    )
    assert not (tmp_path / "run").exists()
    code, err = mmoe(["fit", "--config", str(config), "--data.init_args.image_size=64"], capsys)
    assert code == 2
    assert "data.init_args.image_size=64 disagrees with model.init_args.backbone.image_size=32" in error_line(err)
    # The same value twice is no disagreement (the demo sets both).
    cli = instantiate(["fit", "--config", str(config), "--data.init_args.image_size=32"])
    assert cli.datamodule.image_size == 32


def test_a_pretrained_backbone_gives_the_data_its_image_size(shards, tmp_path):
    """``backbone: null`` + ``pretrained``: the architecture, image size included, is the checkpoint's."""
    export_backbone(MultiwayTransformer(MultiwayConfig.preset("test")), tmp_path / "backbone.pt")
    config = {
        "trainer": {"accelerator": "cpu", "logger": False, "default_root_dir": str(tmp_path)},
        "model": {"class_path": "mmoe.tasks.nlvr2.NLVR2FineTuning",
                  "init_args": {"backbone": None, "pretrained": str(tmp_path / "backbone.pt")}},
        "data": {"class_path": "mmoe.data.datamodules.NLVR2DataModule",
                 "init_args": {"train_shards": str(shards / "nlvr2-train"), "num_workers": 0}},
    }  # fmt: skip
    (tmp_path / "nlvr2.yaml").write_text(yaml.safe_dump(config))
    cli = instantiate(["fit", "--config", str(tmp_path / "nlvr2.yaml")])
    assert cli.model.backbone.config.image_size == cli.datamodule.image_size == 32  # not the DataModule's 224


def vqa_config(tmp_path: Path, shards: Path, **data) -> Path:
    vocab = str(shards / "vqav2-train2014" / "answers.json")
    config = {
        "trainer": {"accelerator": "cpu", "logger": False, "default_root_dir": str(tmp_path)},
        "model": {"class_path": "mmoe.tasks.vqa.VQAFineTuning", "init_args": {"answer_vocab": vocab, "backbone": TINY}},
        "data": {"class_path": "mmoe.data.datamodules.VQADataModule",
                 "init_args": {"train_shards": str(shards / "vqav2-train2014"), "num_workers": 0, **data}},
    }  # fmt: skip
    path = tmp_path / "vqa.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def test_the_vqa_answer_vocabulary_is_the_models(shards, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cli = instantiate(["fit", "--config", str(vqa_config(tmp_path, shards))])
    assert cli.datamodule.answers == cli.model.answers and cli.datamodule.image_size == 32
    answers = json.loads((shards / "vqav2-train2014" / "answers.json").read_text())
    (tmp_path / "copy.json").write_text((shards / "vqav2-train2014" / "answers.json").read_text())
    (tmp_path / "other.json").write_text(json.dumps(answers[::-1]))
    cli = instantiate(["fit", "--config", str(vqa_config(tmp_path, shards, answer_vocab=str(tmp_path / "copy.json")))])
    assert cli.datamodule.answers == cli.model.answers  # the same vocabulary at another path agrees
    code, err = mmoe(["fit", "--config", str(vqa_config(tmp_path, shards, answer_vocab="other.json"))], capsys)
    assert code == 2
    line = error_line(err)
    assert line.startswith("mmoe fit: error: data.init_args.answer_vocab=other.json disagrees with ")
    assert f"model.init_args.answer_vocab={shards / 'vqav2-train2014' / 'answers.json'}" in line


@pytest.mark.parametrize("workers", [0, 2])
def test_a_stream_without_usable_samples_stops_fit_in_one_line(shards, tmp_path, capsys, workers):
    """``pair_shards`` pointing at text-only shards: no sample can be used, so the run stops naming the shards
    (from DataLoader workers too) instead of skipping forever."""
    config = pretraining_config(tmp_path, shards, patch_size=16, num_workers=workers)
    text = str(shards / "pretrain-text")
    code, err = mmoe(["fit", "--config", str(config), "--data.init_args.pair_shards", text], capsys)
    assert code == 2
    line = error_line(err)
    assert line.startswith("mmoe fit: error: train/pair: 1000 samples in a row could not be used")
    assert "missing entry jpg|jpeg|png|webp" in line and f"{text}/pretrain-text-000000.tar" in line


def test_datamodule_parameters_include_those_passed_on_to_the_shared_base():
    vqa = init_parameters("mmoe.data.datamodules.VQADataModule")
    assert list(vqa)[:2] == ["answer_vocab", "train_shards"] and vqa["image_size"].default == 224
    captioning = init_parameters("mmoe.data.datamodules.CaptioningDataModule")
    assert captioning["max_text_length"].default == 32  # its own default over the base's 64
    assert set(init_parameters("mmoe.data.datamodules.NLVR2DataModule")) == set(vqa) - {"answer_vocab"}
    assert init_parameters("mmoe.data.datamodules.NoSuchModule") == {}
