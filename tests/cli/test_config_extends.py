"""``extends: part.yaml``: a config file laid over a shared part (the fine-tuning configs over their size's trainer),
read by every ``mmoe`` command; a part that cannot be read safely is one line naming both files (exit 2)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from mmoe.config.extends import MAX_EXTENDS_DEPTH, merged, read_config_file, undotted
from mmoe.config.launch import read_config
from mmoe.config.yaml_reading import ConfigFileError
from tests.cli_fixtures import run_mmoe

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

FINETUNE = Path(__file__).resolve().parents[2] / "configs" / "finetune"

#: Each shipped fine-tuning config's own trainer settings: what it lays over its size's part.
OWN_TRAINER = {"max_steps", "val_check_interval", "default_root_dir", "callbacks", "devices", "strategy",
               "accumulate_grad_batches"}  # fmt: skip


def test_mappings_merge_key_by_key_and_a_class_list_by_class():
    part = {
        "trainer": {"max_steps": 300, "precision": "32-true", "plugins": ["a", "b"]},
        "callbacks": [
            {"class_path": "lightning.pytorch.callbacks.ModelCheckpoint", "init_args": {"save_last": True}},
            {"class_path": "lightning.pytorch.callbacks.LearningRateMonitor"},
        ],
    }
    settings = {
        "trainer": {"max_steps": 7, "plugins": ["c"]},
        "callbacks": [
            {"class_path": "ModelCheckpoint", "init_args": {"monitor": "val/accuracy"}},  # the class name alone
            {"class_path": "mmoe.runtime.routing_callback.RoutingStatsCallback"},
        ],
    }
    assert merged(part, settings) == {
        "trainer": {"max_steps": 7, "precision": "32-true", "plugins": ["c"]},  # a plain list is replaced whole
        "callbacks": [
            {"class_path": "ModelCheckpoint", "init_args": {"save_last": True, "monitor": "val/accuracy"}},
            {"class_path": "lightning.pytorch.callbacks.LearningRateMonitor"},
            {"class_path": "mmoe.runtime.routing_callback.RoutingStatsCallback"},
        ],
    }
    assert undotted({"trainer.max_steps": 7, "trainer": {"precision": "bf16-mixed"}}) == {
        "trainer": {"max_steps": 7, "precision": "bf16-mixed"}
    }


@pytest.mark.parametrize("config", sorted(FINETUNE.glob("*_*.yaml")), ids=lambda path: path.stem)
def test_each_fine_tuning_config_extends_its_size_s_trainer_and_gives_only_its_own_settings(config):
    size = config.stem.rsplit("_", 1)[-1]
    text = config.read_text()
    assert f"\nextends: trainer/{size}.yaml" in text
    own = read_config_file(FINETUNE / "trainer" / f"{size}.yaml")  # the part itself
    settings = read_config_file(config)
    file_only = {key for key in settings["trainer"] if key not in own["trainer"]}
    assert file_only <= OWN_TRAINER
    # Parsed as mmoe fit parses it: the part's callbacks with the task's monitor, once each.
    trainer = read_config([config]).fit.trainer
    names = [callback.class_path.rsplit(".", 1)[-1] for callback in trainer.callbacks]
    assert names == ["ModelCheckpoint", "LearningRateMonitor", "RoutingStatsCallback"]
    checkpoint = trainer.callbacks[0].init_args
    assert checkpoint.save_last is True and checkpoint.mode == "max" and checkpoint.monitor.startswith("val/")
    assert trainer.precision == ("bf16-mixed" if size == "base" else "32-true")
    assert trainer.default_root_dir == f"runs/finetune/{config.stem}"


def write_extending(folder: Path, part_name: str, extra: str = "") -> Path:
    config = folder / "run.yaml"
    config.write_text(f"extends: {part_name}\ntrainer:\n  max_steps: 5\n{extra}")
    return config


def test_a_part_in_a_subfolder_and_its_own_part_are_merged_in_order(tmp_path):
    (tmp_path / "parts").mkdir()
    (tmp_path / "parts" / "trainer.yaml").write_text(
        "extends: ../root.yaml\ntrainer:\n  max_steps: 100\n  log_every_n_steps: 3\n"
    )
    (tmp_path / "root.yaml").write_text("seed_everything: 4\ntrainer:\n  max_steps: 1000\n  gradient_clip_val: 2.0\n")
    config = write_extending(tmp_path, "parts/trainer.yaml", "trainer.log_every_n_steps: 9\n")
    assert read_config_file(config) == {
        "seed_everything": 4,
        "trainer": {"max_steps": 5, "gradient_clip_val": 2.0, "log_every_n_steps": 9},
    }


def refused(config: Path, capsys) -> str:
    code, out, err = run_mmoe(["fit", "--config", str(config), "--print_config"], capsys)
    assert code == 2 and out == "", (code, out, err)
    assert err.count("\n") == 1 and "Traceback" not in err
    with pytest.raises(ConfigFileError) as error:
        read_config_file(config)
    assert str(error.value).split(": ", 1)[1] in err  # the same reason, from Python
    return err


def test_a_part_that_is_a_link_a_device_missing_or_not_settings_is_one_line_naming_both_files(tmp_path, capsys):
    secret = tmp_path / "secret.yaml"
    secret.write_text("trainer:\n  max_steps: 123456789\n")  # would parse: only the link itself refuses it
    (tmp_path / "link.yaml").symlink_to(secret)
    config = write_extending(tmp_path, "link.yaml")
    err = refused(config, capsys)
    assert str(config) in err and str(tmp_path / "link.yaml") in err and "symbolic link" in err
    assert "123456789" not in err

    err = refused(write_extending(tmp_path, "/dev/zero"), capsys)
    assert "/dev/zero is not a regular file" in err
    err = refused(write_extending(tmp_path, "missing.yaml"), capsys)
    assert f"no file {tmp_path / 'missing.yaml'}" in err

    (tmp_path / "passwd.yaml").write_text("root:x:0:0:root:/root:/bin/bash\n")
    err = refused(write_extending(tmp_path, "passwd.yaml"), capsys)
    assert "holds no mapping of settings" in err and "root:x" not in err
    (tmp_path / "text.yaml").write_text("just a line of text\n")
    err = refused(write_extending(tmp_path, "text.yaml"), capsys)
    assert "holds no mapping of settings" in err and "just a line" not in err
    (tmp_path / "binary.yaml").write_bytes(b"\xff\xfe\x00trainer")
    assert "not UTF-8 text" in refused(write_extending(tmp_path, "binary.yaml"), capsys)


def test_a_part_with_a_key_given_twice_is_refused_as_the_file_itself_would_be(tmp_path, capsys):
    (tmp_path / "part.yaml").write_text("trainer:\n  max_steps: 3\ntrainer:\n  max_steps: 7\n")
    err = refused(write_extending(tmp_path, "part.yaml"), capsys)
    assert f"config {tmp_path / 'part.yaml'}: key 'trainer' is given twice" in err


def test_a_chain_of_parts_that_comes_back_or_runs_too_deep_is_refused(tmp_path, capsys):
    (tmp_path / "a.yaml").write_text("extends: b.yaml\n")
    (tmp_path / "b.yaml").write_text("extends: a.yaml\n")
    err = refused(write_extending(tmp_path, "a.yaml"), capsys)
    assert "comes back to itself" in err and err.count("a.yaml") >= 2

    for index in range(MAX_EXTENDS_DEPTH + 1):
        (tmp_path / f"level{index}.yaml").write_text(f"extends: level{index + 1}.yaml\n")
    (tmp_path / f"level{MAX_EXTENDS_DEPTH + 1}.yaml").write_text("seed_everything: 1\n")
    err = refused(write_extending(tmp_path, "level0.yaml"), capsys)
    assert f"more than {MAX_EXTENDS_DEPTH} files deep" in err
    (tmp_path / "run.yaml").write_text("extends: [a.yaml]\n")
    assert "expected the path of a config file" in refused(tmp_path / "run.yaml", capsys)


def test_a_config_extending_a_part_runs_with_the_merged_settings(tmp_path, capsys):
    part = tmp_path / "trainer.yaml"
    part.write_text((FINETUNE / "trainer" / "tiny.yaml").read_text())
    config = tmp_path / "vqa.yaml"
    shipped = (FINETUNE / "vqav2_tiny.yaml").read_text().replace("extends: trainer/tiny.yaml", "extends: trainer.yaml")
    config.write_text(shipped)
    code, out, err = run_mmoe(["fit", "--config", str(config), "--trainer.max_steps", "11", "--print_config"], capsys)
    assert code == 0, err
    assert "max_steps: 11" in out and "gradient_clip_val: 3.0" in out and "monitor: val/vqa_accuracy" in out
    assert "extends" not in out  # the printed config is whole: it runs without the part
    os.remove(part)
    code, _, err = run_mmoe(["fit", "--config", str(config), "--print_config"], capsys)
    assert code == 2 and f"no file {part}" in err
