"""Every YAML in configs/finetune parses with the ``mmoe fit`` parser (LightningCLI ``--print_config``, in-process),
names an mmoe fine-tuning task and a DataModule, gives the cosine schedule a length and the image size once."""

from __future__ import annotations

import contextlib
import io
from pathlib import Path

import pytest
import yaml

from mmoe.tasks.cli import lightning_command

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = sorted((ROOT / "configs" / "finetune").glob("*.yaml"))


def test_every_task_and_size_has_a_config():
    names = {path.stem for path in CONFIGS}
    assert {f"{task}_{size}" for task in ("vqav2", "nlvr2", "captioning") for size in ("tiny", "base")} <= names


@pytest.mark.parametrize("path", CONFIGS, ids=lambda path: path.stem)
def test_config_parses_with_the_fit_parser(path, monkeypatch):
    monkeypatch.chdir(ROOT)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed), pytest.raises(SystemExit) as stop:
        lightning_command(["fit", "--config", str(path), "--print_config"])
    assert stop.value.code in (0, None)
    config = yaml.safe_load(printed.getvalue())
    model, data = config["model"], config["data"]
    assert model["class_path"].split(".")[:2] == ["mmoe", "tasks"]
    assert data["class_path"].startswith("mmoe.data.datamodules.")
    assert config["trainer"]["max_steps"] > 0  # iterable loaders: the schedule needs a step count
    assert config["trainer"]["check_val_every_n_epoch"] is None
    # The data's image size is the backbone's, linked by the CLI: given once, in the model.
    assert "image_size" not in yaml.safe_load(path.read_text())["data"]["init_args"]
    assert "image_size" in model["init_args"]["backbone"]
