"""FSDP2 (``fully_shard``) over a MoE backbone with 2 CPU processes (gloo): which modules are units, how the expert
stacks shard, and that sharded training computes what the unsharded backbone does (fp32), in bf16 mixed precision
and with activation checkpointing."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from mmoe.model import MoEPlan, MultiwayConfig, MultiwayTransformer
from mmoe.runtime.fsdp import shard_backbone
from tests.gloo import spawn_gloo

WORLD = 2
CONFIG = MultiwayConfig.preset("test", moe=MoEPlan(num_experts=4, top_k=2, every=1))
VARIANTS = {
    "xmoe top-2": CONFIG,
    "mh-moe h=2, activation checkpointing": dataclasses.replace(
        CONFIG, moe=MoEPlan(num_experts=4, top_k=1, heads=2, every=1), checkpoint_activations=True
    ),
}


def inputs(rank: int):
    generator = torch.Generator().manual_seed(10 + rank)
    image = torch.randn(2, 3, 32, 32, generator=generator)
    text = torch.randint(3, 100, (2, 7), generator=generator)
    padding = torch.zeros(2, 7, dtype=torch.bool)
    padding[rank, 5:] = True
    return {"image": image, "text": text, "text_padding_mask": padding}


def loss_of(backbone, batch):
    output = backbone(**batch)
    balance = sum(record.balance_loss for record in output.routing)
    return output.hidden.float().pow(2).mean() + 0.01 * balance, output


def check(rank: int, name: str, config: MultiwayConfig) -> None:
    torch.manual_seed(0)
    reference = MultiwayTransformer(config)
    sharded = MultiwayTransformer(config)
    sharded.load_state_dict(reference.state_dict())
    for source in range(WORLD):  # what data-parallel averaging gives: the mean of the ranks' gradients
        loss, output = loss_of(reference.train(), inputs(source))
        (loss / WORLD).backward()
        if source == rank:
            expected_hidden = output.hidden.detach()
    shard_backbone(sharded)
    experts = sharded.layers[0].ffn[0].experts.fc1_weight
    assert type(experts).__name__ == "DTensor" and experts.to_local().shape[0] == 4 // WORLD  # experts split on dim 0
    loss, output = loss_of(sharded.train(), inputs(rank))
    loss.backward()
    torch.testing.assert_close(output.hidden.detach(), expected_hidden, rtol=1e-5, atol=1e-5, msg=name)
    grads = dict(reference.named_parameters())
    for parameter_name, parameter in sharded.named_parameters():
        want = grads[parameter_name].grad
        if want is None:
            assert parameter.grad is None or not parameter.grad.full_tensor().any(), parameter_name
            continue
        got = parameter.grad.full_tensor()
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6, msg=f"{name}: {parameter_name}")


def check_bf16(rank: int) -> None:
    torch.manual_seed(0)
    reference, sharded = MultiwayTransformer(CONFIG), MultiwayTransformer(CONFIG)
    sharded.load_state_dict(reference.state_dict())
    shard_backbone(sharded, param_dtype=torch.bfloat16)
    loss, output = loss_of(sharded.train(), inputs(rank))
    loss.backward()
    assert output.hidden.dtype == torch.bfloat16
    expected = reference(**inputs(rank)).hidden
    torch.testing.assert_close(output.hidden.float(), expected, rtol=0.1, atol=0.1)
    for parameter_name, parameter in sharded.named_parameters():
        assert parameter.dtype == torch.float32, parameter_name  # the sharded master weights stay fp32
        if parameter.grad is not None:
            assert parameter.grad.dtype == torch.float32 and torch.isfinite(parameter.grad.full_tensor()).all()


def every_variant(rank: int) -> None:
    for name, config in VARIANTS.items():
        check(rank, name, config)
    check_bf16(rank)


def test_fully_sharded_moe_backbone_equals_the_unsharded_one(tmp_path):
    spawn_gloo(every_variant, WORLD, tmp_path)


def test_old_scalar_temperature_loads():
    backbone = MultiwayTransformer(CONFIG)
    state = backbone.state_dict()
    key = "layers.0.ffn.0.router.scorer.log_temperature"
    assert state[key].shape == (1,)  # fully_shard refuses 0-dim parameters
    state[key] = state[key].reshape(())
    MultiwayTransformer(CONFIG).load_state_dict(state)
    with pytest.raises(RuntimeError):
        state[key] = torch.zeros(2)
        MultiwayTransformer(CONFIG).load_state_dict(state)


@pytest.mark.slow
def test_fsdp_fit_equals_one_process_and_resumes_at_any_world_size(tmp_path):
    """Lightning's ModelParallelStrategy (FSDP2 through BackboneTask.configure_model) on 2 processes reaches the
    weights of one process on the same global batch; its single-file checkpoint resumes in one process, and one
    process's checkpoint resumes fully sharded."""
    from tests.moe.test_expert_parallel import assert_same_weights, fit

    single = fit(tmp_path / "single", 1, 1, 3)
    assert_same_weights(fit(tmp_path / "fsdp", 2, 1, 3, fsdp=True), single)
    single_more = fit(tmp_path / "single_more", 1, 1, 5, resume=tmp_path / "single" / "last.ckpt")
    assert_same_weights(fit(tmp_path / "up", 2, 1, 5, resume=tmp_path / "single" / "last.ckpt", fsdp=True), single_more)
    assert_same_weights(fit(tmp_path / "down", 1, 1, 5, resume=tmp_path / "fsdp" / "last.ckpt"), single_more)


def test_fsdp_and_expert_parallel_together_are_refused_in_one_line():
    from mmoe.runtime.fsdp import shard_task
    from tests.scripts.expert_parallel_fit import SquaredHidden

    with pytest.raises(ValueError, match="use one of the two") as error:
        shard_task(SquaredHidden(expert_parallel=2), mesh=None)
    assert "\n" not in str(error.value)
