"""The fused expert kernels run by Triton's interpreter on CPU tensors, against the reference path. Triton must be
imported with ``TRITON_INTERPRET=1`` already set (its standard library is built for the interpreter at import), so
``tests/moe/test_triton_experts.py`` runs this file in a fresh process with that variable; it is not collected on its
own (no ``test_`` prefix)."""

from __future__ import annotations

import importlib
import os

import pytest
import torch

from mmoe.moe import MoEConfig, build_moe_layer
from mmoe.moe.experts import GroupedExperts


@pytest.fixture(scope="module")
def kernels():
    """:mod:`mmoe.moe.triton_experts` with its kernels built for Triton's interpreter."""
    assert os.environ.get("TRITON_INTERPRET") == "1", "run through tests/moe/test_triton_experts.py"
    from triton.runtime.interpreter import InterpretedFunction

    module = importlib.import_module("mmoe.moe.triton_experts")
    assert isinstance(module._gather_gemm_kernel, InterpretedFunction)
    return module


def slices(offsets: list[int]) -> list[tuple[int, int]]:
    return list(zip([0, *offsets[:-1]], offsets, strict=True))


def test_block_schedule_covers_every_row_once_within_its_expert(kernels):
    for counts in ([0, 5, 40, 0, 3], [32, 32], [0, 0, 7], [1] * 9, [100]):
        offsets = torch.tensor(counts).cumsum(0).to(torch.int32)
        rows = int(offsets[-1])
        expert_P, row_P = kernels.block_schedule(offsets, rows, block_m=8)
        assert expert_P.numel() == -(-rows // 8) + len(counts)
        seen = []
        for expert, start in zip(expert_P.tolist(), row_P.tolist(), strict=True):
            if expert == len(counts):
                continue
            begin, end = slices(offsets.tolist())[expert]
            assert begin <= start < end
            seen += list(range(start, min(start + 8, end)))
        assert sorted(seen) == list(range(rows)), counts


def test_gather_gemm_reads_and_writes_through_the_indices(kernels):
    torch.manual_seed(0)
    counts = [3, 0, 50, 11]
    offsets = torch.tensor(counts).cumsum(0).to(torch.int32)
    rows = sum(counts)
    expert_R = torch.repeat_interleave(torch.arange(4), torch.tensor(counts))
    weight, bias = torch.randn(4, 40, 70), torch.randn(4, 70)
    x = torch.randn(30, 40)
    in_index, out_index = torch.randint(0, 30, (rows,)), torch.randperm(rows)
    schedule = kernels.block_schedule(offsets, rows)
    expected = torch.einsum("rk,rkn->rn", x[in_index], weight[expert_R]) + bias[expert_R]
    gathered = kernels.gather_gemm(x, weight, bias, offsets, schedule, rows, in_index=in_index)
    torch.testing.assert_close(gathered, expected, rtol=1e-5, atol=1e-4)
    scattered = kernels.gather_gemm(expected, weight, None, offsets, schedule, rows, out_index=out_index,
                                    transpose_weight=True)  # fmt: skip
    reference = torch.empty_like(scattered)
    reference[out_index] = torch.einsum("rn,rkn->rk", expected, weight[expert_R])
    torch.testing.assert_close(scattered, reference, rtol=1e-5, atol=1e-3)
    grad = torch.randn(rows, 70)
    dw = kernels.weight_grad(x, grad, offsets, 40, in_index, out_index)
    expected_dw = torch.zeros(4, 40, 70).index_add_(0, expert_R, x[in_index][:, :, None] * grad[out_index][:, None])
    torch.testing.assert_close(dw, expected_dw, rtol=1e-5, atol=1e-4)


CASES = {
    "top-1": {"top_k": 1},
    "top-2 renormalised": {"top_k": 2},
    "top-2 raw": {"top_k": 2, "renormalize": False},
    "MH-MoE h=2": {"top_k": 2, "heads": 2},
    "capacity drops": {"top_k": 1, "capacity_factor": 0.5},
    "Sub-LN linear router": {"top_k": 2, "subln": True, "router": "linear"},
}


def run_layer(layer, x, padding):
    x = x.clone().requires_grad_(True)
    y, routing = layer(x, padding)
    (y.pow(2).mean() + routing.balance_loss).backward()
    grads = {name: p.grad.clone() for name, p in layer.named_parameters() if p.grad is not None}
    return y.detach(), x.grad, grads, routing


@pytest.mark.parametrize("case", CASES)
def test_fused_layer_equals_the_reference_path(kernels, monkeypatch, case):
    torch.manual_seed(1)
    options = CASES[case]
    reference = build_moe_layer(MoEConfig(dim=32, ffn_dim=48, num_experts=4, **options))
    fused = build_moe_layer(MoEConfig(dim=32, ffn_dim=48, num_experts=4, expert_kernels="triton", **options))
    fused.load_state_dict(reference.state_dict())
    calls = []
    original = GroupedExperts.forward_fused
    monkeypatch.setattr(GroupedExperts, "forward_fused", lambda self, *a: calls.append(1) or original(self, *a))
    x = torch.randn(3, 11, 32)
    padding = torch.zeros(3, 11, dtype=torch.bool)
    padding[1, 7:] = True
    y_ref, gx_ref, grads_ref, routing_ref = run_layer(reference, x, padding)
    y, gx, grads, routing = run_layer(fused, x, padding)
    assert calls == [1]
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(gx, gx_ref, rtol=1e-5, atol=1e-6)
    assert grads.keys() == grads_ref.keys()
    for name in grads:
        torch.testing.assert_close(grads[name], grads_ref[name], rtol=1e-4, atol=1e-6, msg=name)
    assert torch.equal(routing.expert_index, routing_ref.expert_index)
