"""The one optimiser config of every task: its checks, its defaults per task, how configs and checkpoints fill it."""

from __future__ import annotations

import dataclasses

import lightning as L
import pytest
import torch

from mmoe.config.launch import read_config
from mmoe.model import MultiwayConfig
from mmoe.pipeline.launch import CONFIGS
from mmoe.runtime.optimizer import (
    FINETUNING_OPTIMIZER,
    OPTIMIZER_FIELDS,
    PRETRAINING_OPTIMIZER,
    OptimizerConfig,
    fused_kernel_applies,
    nest_optimizer_arguments,
    warmup_cosine,
)
from mmoe.tasks.nlvr2 import NLVR2FineTuning

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


def adamw_reference(parameter, grads, lr, betas, eps, weight_decay):
    """Loshchilov & Hutter's AdamW (decoupled weight decay, bias-corrected moments), one tensor, step by step."""
    value, first, second = parameter.clone().double(), torch.zeros_like(parameter).double(), 0
    for step, grad in enumerate(grads, start=1):
        grad = grad.double()
        value = value * (1 - lr * weight_decay)
        first = betas[0] * first + (1 - betas[0]) * grad
        second = betas[1] * second + (1 - betas[1]) * grad * grad
        corrected = first / (1 - betas[0] ** step), second / (1 - betas[1] ** step)
        value = value - lr * corrected[0] / (corrected[1].sqrt() + eps)
    return value


def test_a_cpu_task_gets_the_fused_adamw_and_its_update_is_adamws():
    config = OptimizerConfig(learning_rate=1e-2, weight_decay=0.05, warmup_steps=0, total_steps=1000)
    task = NLVR2FineTuning(backbone=TINY, optimizer=config)
    task.trainer = L.Trainer(max_steps=1000, logger=False)
    optimizer = task.configure_optimizers()["optimizer"]
    assert optimizer.defaults["fused"] is True
    weight = task.backbone.text_embed.weight  # decayed, and the largest tensor
    start = weight.detach().clone()
    generator = torch.Generator().manual_seed(0)
    grads = [torch.randn(weight.shape, generator=generator) * scale for scale in (1.0, 0.1, 3.0, 0.5)]
    lr = optimizer.param_groups[0]["lr"]  # the cosine schedule's step-0 value; the scheduler is not stepped
    for grad in grads:
        optimizer.zero_grad()
        for parameter in task.parameters():
            parameter.grad = torch.zeros_like(parameter)
        weight.grad = grad.clone()
        optimizer.step()
    expected = adamw_reference(start, grads, lr, config.betas, config.eps, config.weight_decay)
    torch.testing.assert_close(weight.detach().double(), expected, rtol=1e-5, atol=1e-6)
    assert not torch.equal(weight.detach(), start)


def test_parameters_the_fused_kernel_cannot_take_keep_torchs_default():
    on_meta = NLVR2FineTuning(backbone=TINY).to("meta")
    assert not fused_kernel_applies(on_meta)
    frozen = NLVR2FineTuning(backbone=TINY).requires_grad_(False)
    assert not fused_kernel_applies(frozen)
    assert fused_kernel_applies(NLVR2FineTuning(backbone=TINY))
