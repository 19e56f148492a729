"""The version: one value (pyproject.toml's), printed by ``mmoe --version`` and ``mmoe info``, recorded in every
exported ``config.json``, and the newest entry of CHANGELOG.md."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

import mmoe
from mmoe.cli import main
from mmoe.model import MultiwayConfig, MultiwayTransformer, from_pretrained, save_pretrained

ROOT = Path(__file__).resolve().parents[2]
#: ``project.version`` of pyproject.toml (its first ``version =`` line, in the ``[project]`` table).
VERSION = re.search(r'^version = "([^"]+)"$', (ROOT / "pyproject.toml").read_text(), flags=re.M).group(1)


def test_the_package_version_is_pyproject_s():
    assert mmoe.__version__ == VERSION


@pytest.mark.parametrize("flag", ["--version", "-V"])
def test_mmoe_version_prints_it(flag, capsys):
    assert main([flag]) == 0
    assert capsys.readouterr().out == f"mmoe {VERSION}\n"


def test_an_exported_folder_records_the_version_that_wrote_it_and_still_loads(tmp_path):
    backbone = MultiwayTransformer(MultiwayConfig.preset("test"))
    save_pretrained(backbone, tmp_path / "backbone")
    config = json.loads((tmp_path / "backbone" / "config.json").read_text())
    assert config["mmoe_version"] == VERSION and config["format"] == "mmoe-pretrained"
    assert from_pretrained(tmp_path / "backbone").config == backbone.config


def test_mmoe_info_names_the_version(capsys):
    config = str(ROOT / "configs" / "pretrain" / "tiny.yaml")
    assert main(["info", "--config", config, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["mmoe_version"] == VERSION
    assert main(["info", "--config", config]) == 0
    assert capsys.readouterr().out.splitlines()[0].endswith(f"counted by mmoe {VERSION}")


def test_the_changelog_s_newest_entry_is_this_version():
    headings = re.findall(r"^## \[?([^\]\s]+)\]?", (ROOT / "CHANGELOG.md").read_text(), flags=re.M)
    released = [heading for heading in headings if heading != "Unreleased"]
    assert released and released[0] == VERSION
