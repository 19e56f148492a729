"""Token dispatch (:mod:`mmoe.moe.dispatch`): rows permuted by expert and back, with index_select's gradients, and no
``tokens x experts x capacity`` tensor anywhere in a layer's forward or backward."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from mmoe.moe import MoEConfig, MoELayer
from mmoe.moe.dispatch import combine, dispatch_rows, plan_dispatch


class _LargestTensor(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(tensor, torch.Tensor):
                self.largest = max(self.largest, tensor.numel())
        return out


@pytest.mark.parametrize("capacity", [None, 1.0])
def test_no_tokens_by_experts_by_capacity_tensor(capacity):
    tokens, experts, top_k, dim, hidden = 512, 8, 2, 16, 32
    layer = MoELayer(MoEConfig(dim, hidden, experts, top_k=top_k, capacity_factor=capacity))
    x = torch.randn(1, tokens, dim, requires_grad=True)
    with _LargestTensor() as probe:
        y, routing = layer(x)
        (y.sum() + routing.balance_loss).backward()
    one_hot_combine = tokens * experts * (top_k * tokens // experts)  # S x E x C at capacity factor 1
    assert probe.largest <= top_k * tokens * max(dim, hidden) < one_hot_combine


@pytest.mark.parametrize("top_k", [1, 2, 3])
def test_permuted_rows_match_index_select_forward_and_backward(top_k):
    """dispatch_rows / combine move rows through a permutation and its inverse; their gradients must be those of
    plain index_select (whose backward is a scatter-add)."""
    torch.manual_seed(top_k)
    tokens, experts, dim = 50, 6, 8
    expert_SK = torch.stack([torch.randperm(experts)[:top_k] for _ in range(tokens)])
    plan = plan_dispatch(expert_SK, None, experts, None)
    x = torch.randn(tokens, dim, dtype=torch.double, requires_grad=True)
    grad = torch.randn(top_k * tokens, dim, dtype=torch.double)
    rows = dispatch_rows(x, plan)
    reference = x.index_select(0, plan.token_C)
    assert torch.equal(rows, reference)
    (got,) = torch.autograd.grad((rows * grad).sum(), x)
    (want,) = torch.autograd.grad((reference * grad).sum(), x)
    torch.testing.assert_close(got, want)
    y = torch.randn(top_k * tokens, dim, dtype=torch.double, requires_grad=True)
    weight_SK = torch.rand(tokens, top_k, dtype=torch.double)
    out = combine(y, plan, weight_SK)
    y_KSD = y.index_select(0, plan.inverse_C).view(top_k, tokens, dim)
    out_reference = (y_KSD * weight_SK.t()[..., None]).sum(0)
    torch.testing.assert_close(out, out_reference)
    out_grad = torch.randn_like(out)
    (got,) = torch.autograd.grad((out * out_grad).sum(), y)
    (want,) = torch.autograd.grad((out_reference * out_grad).sum(), y)
    torch.testing.assert_close(got, want)
