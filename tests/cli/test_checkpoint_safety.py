"""No code runs from a checkpoint, and a file that is not one is a one-line error: through every ``mmoe`` entry point
that reads checkpoints (``export-backbone``, ``analyze``, ``viz``, ``model.init_args.pretrained``,
``model.init_args.visual_codebook``, ``model.init_args.vqkd_tokenizer``, ``--ckpt_path``). Also ``--ckpt_path`` of
another task, and the values a resumed run takes from its checkpoint over the config."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import yaml

from mmoe.cli import main
from mmoe.model import MoEPlan, MultiwayConfig, MultiwayTransformer
from mmoe.runtime.checkpoint import config_to_dict, export_backbone
from tests.cli_fixtures import run_mmoe, small_shards

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::UserWarning")]

ROOT = Path(__file__).resolve().parents[2]
BACKBONE = MultiwayConfig.preset("test", moe=MoEPlan(num_experts=4, every=2))


class Payload:
    """Unpickled, it creates the file ``marker`` (``open(marker, "w")``): what a crafted checkpoint could run."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return open, (str(self.marker), "w")


mmoe = run_mmoe


def assert_one_line(err: str, *named: str) -> str:
    """The error, the last line of stderr (Lightning may log its seed before it), naming each of ``named``."""
    assert "Traceback" not in err, err
    line = err.strip().splitlines()[-1]
    for text in named:
        assert text in line, line
    return line


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A small corpus, and a VQA and an NLVR2 checkpoint of two `mmoe fit` steps each, with their configs."""
    root = tmp_path_factory.mktemp("trained")
    shards = small_shards(root)
    vocab = str(shards / "vqav2-train2014" / "answers.json")
    loader = {"batch_size": 2, "eval_batch_size": 4, "max_text_length": 32, "num_workers": 0}
    tasks = {
        "vqa": ("mmoe.tasks.vqa.VQAFineTuning", {"answer_vocab": vocab}, "VQADataModule", "vqav2-train2014"),
        "nlvr2": ("mmoe.tasks.nlvr2.NLVR2FineTuning", {}, "NLVR2DataModule", "nlvr2-train"),
    }
    paths = {"shards": shards, "root": root}
    for name, (task, task_args, data_class, train) in tasks.items():
        run = root / f"{name}_run"
        config = {
            "seed_everything": 0,
            "trainer": {"max_steps": 2, "accelerator": "cpu", "logger": False, "enable_progress_bar": False,
                        "enable_model_summary": False, "limit_val_batches": 0, "default_root_dir": str(run)},
            "model": {"class_path": task, "init_args": {"backbone": config_to_dict(BACKBONE), **task_args,
                                                        "optimizer": {"warmup_steps": 1, "learning_rate": 1.0e-4}}},
            "data": {"class_path": f"mmoe.data.datamodules.{data_class}",
                     "init_args": {"train_shards": str(shards / train), "test_shards": str(shards / train), **loader}},
        }  # fmt: skip
        paths[f"{name}_config"] = root / f"{name}.yaml"
        paths[f"{name}_config"].write_text(yaml.safe_dump(config))
        assert main(["fit", "--config", str(paths[f"{name}_config"])]) == 0
        paths[f"{name}_ckpt"] = next((run / "checkpoints").glob("*.ckpt"))
    export_backbone(MultiwayTransformer(BACKBONE), root / "backbone.pt")
    paths["backbone"] = root / "backbone.pt"
    return paths


@pytest.fixture
def crafted(trained, tmp_path):
    """(checkpoint file, marker): an exported backbone and a task checkpoint, each with a payload that would create
    ``marker``; loading either without weights_only does create it."""
    marker = tmp_path / "ran"
    state = torch.load(trained["vqa_ckpt"], map_location="cpu", weights_only=True)
    state["hyper_parameters"]["note"] = Payload(marker)
    torch.save(state, tmp_path / "crafted.ckpt")
    backbone = torch.load(trained["backbone"], map_location="cpu", weights_only=True)
    torch.save(backbone | {"note": Payload(marker)}, tmp_path / "crafted.pt")
    control = tmp_path / "control"
    torch.save({"note": Payload(control)}, tmp_path / "control.pt")
    torch.load(tmp_path / "control.pt", weights_only=False)
    assert control.exists()  # the payload is real
    return tmp_path, marker


def entry_points(trained, checkpoint: Path, out: Path) -> dict[str, list[str]]:
    """Every way a user hands mmoe a checkpoint file, as command lines."""
    vqa, data = str(trained["vqa_config"]), str(trained["shards"] / "vqav2-val2014")
    pretraining = str(ROOT / "configs" / "pretrain" / "tiny.yaml")
    return {
        "export-backbone": ["export-backbone", "--ckpt", str(checkpoint), "--out", str(out / "backbone.pt")],
        "analyze": ["analyze", "routing", "--ckpt", str(checkpoint), "--data", data, "--batches", "1"],
        "viz": ["viz", "subtoken-map", "--ckpt", str(checkpoint), "--images", data, "--out", str(out / "figures")],
        "pretrained": ["fit", "--config", vqa, "--model.init_args.backbone=null",
                       f"--model.init_args.pretrained={checkpoint}"],
        "visual_codebook": ["fit", "--config", pretraining, f"--model.init_args.visual_codebook={checkpoint}"],
        "vqkd_tokenizer": ["fit", "--config", pretraining, "--model.init_args.visual_codebook=null",
                           f"--model.init_args.vqkd_tokenizer={checkpoint}"],
        "fit --ckpt_path": ["fit", "--config", vqa, "--ckpt_path", str(checkpoint)],
        "predict --ckpt_path": ["predict", "--config", vqa, "--ckpt_path", str(checkpoint)],
    }  # fmt: skip


ENTRY_POINTS = ["export-backbone", "analyze", "viz", "pretrained", "visual_codebook", "vqkd_tokenizer",
                "fit --ckpt_path", "predict --ckpt_path"]  # fmt: skip


@pytest.mark.parametrize("entry", ENTRY_POINTS)
@pytest.mark.parametrize("kind", ["crafted.pt", "crafted.ckpt"])
def test_a_crafted_checkpoint_is_refused_and_runs_nothing(trained, crafted, entry, kind, capsys, monkeypatch):
    folder, marker = crafted
    monkeypatch.chdir(folder)
    argv = entry_points(trained, folder / kind, folder / "out")[entry]
    code, out, err = mmoe(argv, capsys)
    assert code == 2
    line = assert_one_line(err, str(folder / kind), "refused", "asks to import io.open")
    assert "weights_only" not in err
    assert not marker.exists(), line
    assert not (folder / "out").exists()


def not_checkpoints(trained, folder: Path) -> dict[str, tuple[Path, str]]:
    """Files that are not checkpoints: (path, the reason the error gives)."""
    (folder / "random.ckpt").write_bytes(os.urandom(4096))
    (folder / "config.json").write_text(json.dumps({"model": {"learning_rate": 1e-4}}))
    (folder / "empty.ckpt").write_bytes(b"")
    task = trained["vqa_ckpt"].read_bytes()
    (folder / "truncated.ckpt").write_bytes(task[: len(task) // 2])
    backbone = trained["backbone"].read_bytes()
    (folder / "truncated.pt").write_bytes(backbone[: len(backbone) - 100])
    return {
        "random bytes": (folder / "random.ckpt", "not in torch.save's format"),
        "JSON": (folder / "config.json", "not in torch.save's format"),
        "empty": (folder / "empty.ckpt", "the file is empty"),
        "truncated task checkpoint": (folder / "truncated.ckpt", "truncated or corrupted"),
        "truncated backbone": (folder / "truncated.pt", "truncated or corrupted"),
    }


@pytest.mark.parametrize("entry", ENTRY_POINTS)
@pytest.mark.parametrize("case", ["random bytes", "JSON", "empty", "truncated task checkpoint", "truncated backbone"])
def test_a_file_that_is_not_a_checkpoint_is_one_line(trained, tmp_path, entry, case, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    path, reason = not_checkpoints(trained, tmp_path)[case]
    code, out, err = mmoe(entry_points(trained, path, tmp_path / "out")[entry], capsys)
    assert code == 2
    line = assert_one_line(err, str(path), "could not be read", reason, "(expected ")
    for torch_words in ("weights_only", "central directory", "Errno", "UnpicklingError"):
        assert torch_words not in err, line
    assert not (tmp_path / "out").exists()


def test_a_missing_checkpoint_is_one_line(trained, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for entry, argv in entry_points(trained, tmp_path / "nowhere.ckpt", tmp_path / "out").items():
        code, out, err = mmoe(argv, capsys)
        assert code == 2, entry
        assert_one_line(err, str(tmp_path / "nowhere.ckpt"), "does not exist")


def test_weights_only_cannot_be_turned_off(trained, capsys):
    code, out, err = mmoe(["fit", "--config", str(trained["vqa_config"]), "--weights_only", "false"], capsys)
    assert code == 2
    assert "--weights_only" in err


@pytest.mark.parametrize("subcommand", ["fit", "validate", "test", "predict"])
def test_a_checkpoint_of_another_task_is_refused_naming_both(trained, subcommand, capsys):
    argv = [subcommand, "--config", str(trained["vqa_config"]), "--ckpt_path", str(trained["nlvr2_ckpt"])]
    code, out, err = mmoe(argv, capsys)
    assert code == 2
    assert_one_line(
        err, f"mmoe {subcommand}: ", str(trained["nlvr2_ckpt"]), "mmoe.tasks.nlvr2.NLVR2FineTuning",
        "model.class_path is mmoe.tasks.vqa.VQAFineTuning",
    )  # fmt: skip


def test_a_resumed_run_names_each_value_the_checkpoint_overrides_once(trained, tmp_path, capsys, monkeypatch):
    """Resume with a config whose warm-up differs and a learning rate on the command line: the checkpoint's warm-up
    and the command line's learning rate are used, each said once; Lightning restores with weights_only=True."""
    config = yaml.safe_load(trained["vqa_config"].read_text())
    config["model"]["init_args"]["optimizer"]["warmup_steps"] = 5
    config["trainer"].update(max_steps=3, default_root_dir=str(tmp_path / "resumed"))
    path = tmp_path / "resume.yaml"
    path.write_text(yaml.safe_dump(config))
    loads = []
    original = torch.load

    def spy(*args, **kwargs):
        loads.append(kwargs.get("weights_only"))
        return original(*args, **kwargs)

    monkeypatch.setattr(torch, "load", spy)
    checkpoint = str(trained["vqa_ckpt"])
    argv = ["fit", "--config", str(path), "--ckpt_path", checkpoint]
    argv += ["--model.init_args.optimizer.learning_rate", "5e-4"]
    code, out, err = mmoe(argv, capsys)
    assert code in (0, None), err[-3000:]
    prefix = f"mmoe fit: --ckpt_path {checkpoint}: model.init_args."
    lines = [line for line in err.splitlines() if line.startswith(prefix)]
    assert lines == [
        f"{prefix}optimizer.learning_rate: command line 0.0005 used over checkpoint 0.0001",
        f"{prefix}optimizer.warmup_steps: checkpoint 1 used over config 5",
    ]
    assert len(loads) >= 2 and all(loads), loads  # mmoe's read of the hyper-parameters, then Lightning's restore
    assert (tmp_path / "resumed" / "checkpoints").is_dir()


def test_predicting_from_a_run_on_a_pretrained_backbone_names_no_difference(trained, tmp_path, capsys):
    """``backbone: null`` + ``pretrained`` (the architecture and weights come from the checkpoint) is no
    disagreement with a checkpoint that stores the architecture and no ``pretrained``, nor is the frozen MoE plan
    that ``frozen_routing`` stores."""
    config = yaml.safe_load(trained["nlvr2_config"].read_text())
    config["model"]["init_args"].update(backbone=None, pretrained=str(trained["backbone"]), frozen_routing=True)
    config["trainer"]["default_root_dir"] = str(tmp_path / "run")
    path = tmp_path / "nlvr2.yaml"
    path.write_text(yaml.safe_dump(config))
    assert main(["fit", "--config", str(path)]) == 0
    checkpoint = next((tmp_path / "run" / "checkpoints").glob("*.ckpt"))
    capsys.readouterr()
    code, out, err = mmoe(["predict", "--config", str(path), "--ckpt_path", str(checkpoint)], capsys)
    assert code in (0, None), err[-3000:]
    assert "used over" not in err
