"""The balance loss over the global batch (Qiu et al., 2025) on 2 CPU processes (gloo): the ranks' mean loss and their
averaged gradients equal one process's on the global batch; off training, or without a process group, it is the
local loss."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from mmoe.moe import MoEConfig, MoELayer
from tests.gloo import spawn_gloo
from tests.moe.test_expert_parallel import WORLD, rank_inputs

CASES = (
    {"top_k": 1, "router": "linear"},
    {"top_k": 2, "heads": 2},
    {"top_k": 3, "gate": "sigmoid", "shared_experts": 1},
)


def check_case(rank: int, options: dict) -> None:
    torch.manual_seed(0)
    config = MoEConfig(dim=16, ffn_dim=32, num_experts=4, balance_batch="global", **options)
    layer = MoELayer(config)
    local = MoELayer(MoEConfig(dim=16, ffn_dim=32, num_experts=4, **options))
    local.load_state_dict(layer.state_dict())

    # One process on the global batch: every rank's tokens in one batch (no process group is consulted there).
    inputs = [rank_inputs(source) for source in range(WORLD)]
    x_all = torch.cat([x for x, _ in inputs]).requires_grad_(True)
    _, routing_all = local(x_all, torch.cat([padding for _, padding in inputs]))
    routing_all.balance_loss.backward()

    x, padding = inputs[rank]
    x = x.clone().requires_grad_(True)
    _, routing = layer(x, padding)
    routing.balance_loss.backward()
    losses = [torch.zeros(()) for _ in range(WORLD)]
    dist.all_gather(losses, routing.balance_loss.detach())
    torch.testing.assert_close(torch.stack(losses).mean(), routing_all.balance_loss.detach())
    # The ranks' gradients averaged (data parallelism) are the global batch's; each rank's input gets its rows' share.
    for name, parameter in layer.router.named_parameters():
        want = dict(local.router.named_parameters())[name].grad
        if want is None:  # X-MoE's temperature: the balance loss uses the fixed tau_0
            assert parameter.grad is None, name
            continue
        dist.all_reduce(parameter.grad)
        torch.testing.assert_close(parameter.grad / WORLD, want, rtol=1e-4, atol=1e-7, msg=f"{options} {name}")
    torch.testing.assert_close(x.grad / WORLD, x_all.grad[2 * rank : 2 * rank + 2], rtol=1e-4, atol=1e-7)
    # Only in training: in eval each rank's loss is its own batch's, as with balance_batch: local.
    layer.eval(), local.eval()
    torch.testing.assert_close(layer(x, padding)[1].balance_loss, local(x, padding)[1].balance_loss)


def every_case(rank: int) -> None:
    for options in CASES:
        check_case(rank, options)


def test_two_process_global_balance_loss_equals_one_process_on_the_global_batch(tmp_path):
    spawn_gloo(every_case, WORLD, tmp_path)


def test_without_a_process_group_the_global_loss_is_the_local_one():
    torch.manual_seed(0)
    layer = MoELayer(MoEConfig(dim=16, ffn_dim=32, num_experts=4, top_k=2, balance_batch="global"))
    local = MoELayer(MoEConfig(dim=16, ffn_dim=32, num_experts=4, top_k=2))
    local.load_state_dict(layer.state_dict())
    x, padding = rank_inputs(0)
    torch.testing.assert_close(layer(x, padding)[1].balance_loss, local(x, padding)[1].balance_loss)
    with pytest.raises(ValueError, match="balance_batch must be one of"):
        MoEConfig(dim=16, ffn_dim=32, num_experts=4, balance_batch="rank")
    with pytest.raises(ValueError, match="balance_batch='global' with strata"):
        MoEConfig(dim=16, ffn_dim=32, num_experts=4, top_k=2, strata=[2, 2], balance_batch="global")
