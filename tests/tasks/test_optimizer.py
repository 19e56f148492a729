"""The one optimiser config of every task: its checks, its defaults per task, how configs and checkpoints fill it."""

from __future__ import annotations

import dataclasses

import lightning as L
import pytest
import torch

from mmoe.demo.settings import CONFIGS
from mmoe.model import MultiwayConfig
from mmoe.tasks.launch import read_config
from mmoe.tasks.nlvr2 import NLVR2FineTuning
from mmoe.tasks.optimizer import (
    FINETUNING_OPTIMIZER,
    OPTIMIZER_FIELDS,
    PRETRAINING_OPTIMIZER,
    OptimizerConfig,
    nest_optimizer_arguments,
    warmup_cosine,
)

TINY = MultiwayConfig.preset("test")


@pytest.mark.parametrize(
    "field, value",
    [("learning_rate", 0.0), ("eps", -1e-8), ("warmup_steps", -1), ("min_lr_ratio", 1.5), ("layer_decay", 0.0),
     ("betas", (0.9, 1.0)), ("total_steps", 0), ("weight_decay", -0.1), ("head_lr_multiplier", 0.0)],
)  # fmt: skip
def test_an_out_of_range_value_names_its_field(field, value):
    with pytest.raises(ValueError, match=rf"model\.optimizer\.{field}="):
        OptimizerConfig(**{field: value})


def test_the_plain_dict_of_a_checkpoint_round_trips():
    config = OptimizerConfig(learning_rate=3e-4, betas=[0.9, 0.98], layer_decay=0.65)
    assert config.betas == (0.9, 0.98)  # a list from YAML or a checkpoint becomes the tuple AdamW is given
    plain = config.to_dict()
    assert set(plain) == set(OPTIMIZER_FIELDS) and plain["betas"] == [0.9, 0.98]
    assert OptimizerConfig.from_value(plain) == config and OptimizerConfig.from_value(config) is config


def test_each_task_has_its_own_default():
    assert (PRETRAINING_OPTIMIZER.betas, PRETRAINING_OPTIMIZER.eps, PRETRAINING_OPTIMIZER.min_lr_ratio) == (
        (0.9, 0.98),
        1e-6,
        0.01,
    )
    assert (FINETUNING_OPTIMIZER.betas, FINETUNING_OPTIMIZER.eps, FINETUNING_OPTIMIZER.min_lr_ratio) == (
        (0.9, 0.999),
        1e-8,
        0.0,
    )
    task = NLVR2FineTuning(backbone=TINY)
    assert task.optimizer_config == FINETUNING_OPTIMIZER
    assert task.hparams.optimizer == FINETUNING_OPTIMIZER.to_dict()  # plain: readable with weights_only=True


def test_a_config_that_names_some_fields_keeps_the_tasks_default_for_the_others():
    pretrain = read_config(
        [CONFIGS / "pretrain" / "tiny.yaml", CONFIGS / "pretrain" / "tiny" / "xmoe.yaml"]
    ).fit.model.init_args
    assert (pretrain.optimizer.learning_rate, pretrain.optimizer.warmup_steps) == (1e-3, 30)  # the config's
    assert (pretrain.optimizer.betas, pretrain.optimizer.eps, pretrain.optimizer.min_lr_ratio) == (
        (0.9, 0.98),
        1e-6,
        0.01,
    )
    nlvr2 = read_config([str(CONFIGS / "finetune" / "nlvr2_tiny.yaml")]).fit.model.init_args
    assert (nlvr2.optimizer.layer_decay, nlvr2.optimizer.betas, nlvr2.optimizer.eps) == (0.65, (0.9, 0.999), 1e-8)


def test_flat_arguments_of_older_checkpoints_move_into_the_optimizer():
    old = {"backbone": None, "learning_rate": 1e-3, "layer_decay": 0.65, "num_beams": 3}
    assert nest_optimizer_arguments(old) == {
        "backbone": None,
        "num_beams": 3,
        "optimizer": {"learning_rate": 1e-3, "layer_decay": 0.65},
    }
    current = {"backbone": None, "optimizer": {"learning_rate": 1e-3}}
    assert nest_optimizer_arguments(current) is current


def test_adamw_gets_the_config_and_the_schedule_follows_warmup_cosine():
    config = OptimizerConfig(learning_rate=2e-3, betas=(0.8, 0.9), eps=1e-7, warmup_steps=4, total_steps=20)
    task = NLVR2FineTuning(backbone=TINY, optimizer=dataclasses.replace(config, min_lr_ratio=0.1))
    task.trainer = L.Trainer(max_steps=1000, logger=False)  # total_steps wins over the trainer's length
    configured = task.configure_optimizers()
    optimizer, scheduler = configured["optimizer"], configured["lr_scheduler"]["scheduler"]
    assert isinstance(optimizer, torch.optim.AdamW)
    assert optimizer.defaults["betas"] == (0.8, 0.9) and optimizer.defaults["eps"] == 1e-7
    expected = warmup_cosine(4, 20, 0.1)
    for step in range(25):
        assert optimizer.param_groups[0]["lr"] == pytest.approx(2e-3 * expected(step))
        optimizer.step()
        scheduler.step()


def test_a_schedule_without_a_length_is_an_error():
    task = NLVR2FineTuning(backbone=TINY)
    task.trainer = L.Trainer(max_epochs=-1, max_steps=-1, logger=False)
    with pytest.raises(ValueError, match="model.optimizer.total_steps"):
        task.configure_optimizers()
