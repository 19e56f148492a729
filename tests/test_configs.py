"""Every YAML in configs/ parses with the mmoe CLI (typos in keys are errors), and bad paths fail at start."""

from __future__ import annotations

from pathlib import Path

import lightning as L
import pytest
import yaml

from mmoe.tasks.cli import MMoECLI

pytestmark = pytest.mark.filterwarnings("ignore:LightningCLI's args parameter")

CONFIGS = sorted((Path(__file__).resolve().parents[1] / "configs").rglob("*.yaml"))


def parse(args: list[str]) -> int:
    with pytest.raises(SystemExit) as exit_info:
        MMoECLI(
            L.LightningModule,
            L.LightningDataModule,
            subclass_mode_model=True,
            subclass_mode_data=True,
            run=False,
            args=args,
        )
    return exit_info.value.code


def test_the_pretraining_configs_exist():
    names = {path.name for path in CONFIGS if path.parent.name == "pretrain"}
    for size in ("tiny", "base"):
        for variant in ("dense", "switch", "xmoe", "mhmoe", "stratified"):
            assert f"{size}_{variant}.yaml" in names


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_config_parses(path, capsys):
    assert parse(["--config", str(path), "--print_config"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["model"]["class_path"].startswith("mmoe.tasks.")
    assert printed["data"]["class_path"].startswith("mmoe.data.")


def test_unknown_key_is_an_error(tmp_path, capsys):
    config = yaml.safe_load((Path(__file__).resolve().parents[1] / "configs/pretrain/tiny_xmoe.yaml").read_text())
    config["model"]["init_args"]["backbone"]["moe"]["num_expert"] = 4  # typo
    path = tmp_path / "typo.yaml"
    path.write_text(yaml.safe_dump(config))
    assert parse(["--config", str(path), "--print_config"]) != 0
    assert "num_expert" in capsys.readouterr().err
