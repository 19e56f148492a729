"""The task catalog: one name per fine-tuning task, read by configs, ``mmoe infer`` and checkpoints alike."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from mmoe.infer.command import parser
from mmoe.tasks.catalog import FINETUNING_TASKS, INFER_SPECS, class_path, task_of_class_path
from mmoe.tasks.pretraining import MaskedPretraining

CONFIGS = Path(__file__).resolve().parents[2] / "mmoe" / "configs" / "finetune"


@pytest.mark.parametrize("name", list(FINETUNING_TASKS))
def test_a_task_name_is_its_class_name_and_its_configs_name(name):
    task = FINETUNING_TASKS[name]
    assert task.name == name
    configs = sorted(CONFIGS.glob(f"{name}_*.yaml"))
    assert configs, f"no configs/finetune/{name}_*.yaml"
    for config in configs:
        assert yaml.safe_load(config.read_text())["model"]["class_path"] == class_path(task)


def test_a_saved_class_path_resolves_to_its_task_and_others_to_none():
    for task in FINETUNING_TASKS.values():
        assert task_of_class_path(class_path(task)) is task
    assert task_of_class_path(class_path(MaskedPretraining)) is None
    assert task_of_class_path("mmoe.tasks.vqa.Nothing") is None


def test_mmoe_infer_has_one_subcommand_per_task_and_the_old_names_as_aliases():
    assert list(INFER_SPECS) == list(FINETUNING_TASKS)
    for name, task in FINETUNING_TASKS.items():
        argv = [name, "--ckpt", "c.ckpt", "--shards", "s"]
        assert parser().parse_args(argv).task is task
        assert INFER_SPECS[name].task is task
        for alias in INFER_SPECS[name].aliases:
            assert parser().parse_args([alias, *argv[1:]]).task is task
    assert {alias for spec in INFER_SPECS.values() for alias in spec.aliases} == {
        "vqa",
        "caption",
        "retrieve",
        "classify",
    }
