"""Grouped experts (:class:`mmoe.moe.experts.GroupedExperts`): the grouped-GEMM path against the per-expert loop,
outputs and gradients, with Sub-LN and under autocast."""

from __future__ import annotations

import torch

from mmoe.moe.experts import GroupedExperts


def test_grouped_and_loop_expert_paths_agree():
    torch.manual_seed(0)
    experts = GroupedExperts(4, 8, 12, subln=True)
    with torch.no_grad():
        experts.ln_weight.normal_()
        experts.ln_bias.normal_()
    x = torch.randn(10, 8, requires_grad=True)
    expert = torch.tensor([0, 0, 0, 2, 2, 2, 2, 3, 3, 3])  # expert 1 gets no row
    offsets = torch.tensor([3, 3, 7, 10], dtype=torch.int32)
    grad = torch.randn(10, 8)
    outputs, gradients = [], []
    for run in (lambda: experts.forward_grouped(x, expert, offsets), lambda: experts.forward_loop(x, offsets)):
        out = run()
        inputs = [x, *experts.parameters()]
        outputs.append(out)
        gradients.append(torch.autograd.grad((out * grad).sum(), inputs))
    torch.testing.assert_close(outputs[0], outputs[1])
    for got, want in zip(*gradients, strict=True):
        torch.testing.assert_close(got, want)


def test_subln_grouped_path_under_autocast_matches_the_loop():
    """The grouped Sub-LN path agrees with the per-expert loop in bf16 under autocast. (CUDA autocast also returns
    layer_norm in fp32, which the grouped GEMM refuses; test_backbone's CUDA test covers that case.)"""
    torch.manual_seed(0)
    experts = GroupedExperts(4, 8, 16, subln=True)
    with torch.no_grad():
        experts.ln_weight.normal_()
        experts.ln_bias.normal_()
    x = torch.randn(10, 8).bfloat16()
    expert = torch.tensor([0, 0, 0, 2, 2, 2, 2, 3, 3, 3])
    offsets = torch.tensor([3, 3, 7, 10], dtype=torch.int32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        grouped = experts.forward_grouped(x, expert, offsets)
        loop = experts.forward_loop(x, offsets)
    assert grouped.dtype == torch.bfloat16
    torch.testing.assert_close(grouped.float(), loop.float(), atol=5e-2, rtol=5e-2)


def test_grouped_path_under_an_autocast_of_another_dtype_keeps_the_input_dtype():
    """Rows handed over in fp32 inside a bf16 autocast: addmm / @ return bf16 there, and the grouped GEMM (no autocast
    op) must still see one dtype."""
    torch.manual_seed(0)
    experts = GroupedExperts(4, 8, 16, subln=True)
    x = torch.randn(10, 8)
    expert = torch.tensor([0, 0, 0, 2, 2, 2, 2, 3, 3, 3])
    offsets = torch.tensor([3, 3, 7, 10], dtype=torch.int32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = experts.forward_grouped(x, expert, offsets)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, experts.forward_loop(x, offsets), atol=5e-2, rtol=5e-2)
