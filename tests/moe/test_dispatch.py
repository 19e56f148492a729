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
    layer = MoELayer(MoEConfig(dim, hidden, num_experts=experts, top_k=top_k, capacity_factor=capacity))
    x = torch.randn(1, tokens, dim, requires_grad=True)
    with _LargestTensor() as probe:
        y, routing = layer(x)
        (y.sum() + routing.balance_loss).backward()
    one_hot_combine = tokens * experts * (top_k * tokens // experts)  # S x E x C at capacity factor 1
    assert probe.largest <= top_k * tokens * max(dim, hidden) < one_hot_combine


@pytest.mark.parametrize("num_experts", [4, 300, 40000])  # uint8, int16 and int32 sort keys
def test_plan_equals_a_stable_int64_sort(num_experts):
    """Sorting narrow keys changes no tensor of the plan: the same order, inverse, expert ids (dtype included) and
    offsets as a stable sort of the int64 ids."""
    generator = torch.Generator().manual_seed(num_experts)
    tokens, top_k = 4096, 2
    expert_SK = torch.randint(num_experts, (tokens, top_k), generator=generator)
    expert_SK[:, 1] = (expert_SK[:, 0] + 1 + expert_SK[:, 1] % (num_experts - 1)) % num_experts  # distinct choices
    plan = plan_dispatch(expert_SK, None, num_experts, None)
    expert_C, order_C = torch.sort(expert_SK.t().reshape(-1), stable=True)
    inverse_C = torch.empty_like(order_C).scatter_(0, order_C, torch.arange(order_C.numel()))
    offsets_E = torch.bincount(expert_C, minlength=num_experts).cumsum(0).int()
    assert torch.equal(plan.order_C, order_C) and torch.equal(plan.inverse_C, inverse_C)
    assert plan.expert_C.dtype == torch.int64 and torch.equal(plan.expert_C, expert_C)
    assert plan.offsets_E.dtype == torch.int32 and torch.equal(plan.offsets_E, offsets_E)
    assert torch.equal(plan.token_C, order_C % tokens)


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
