"""Grouped experts (:class:`mmoe.moe.experts.GroupedExperts`): the grouped-GEMM path against the per-expert loop,
outputs and gradients, with Sub-LN and under autocast."""

from __future__ import annotations

from functools import partial

import pytest
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


def _outputs_and_gradients(experts, run, x, grad):
    out = run()
    return out, torch.autograd.grad((out * grad).sum(), [x, *experts.parameters()])


def test_batched_and_padded_paths_equal_the_loop_outputs_and_every_gradient():
    """Equal slices run as one batched GEMM per linear, uneven ones padded to the longest (its padding gets no
    gradient): both equal the per-expert loop, with Sub-LN's affine and the biases away from their start."""
    torch.manual_seed(0)
    experts = GroupedExperts(4, 8, 12, subln=True).double()
    with torch.no_grad():
        for parameter in experts.parameters():
            parameter.normal_(std=0.5)
    for counts in ([3, 3, 3, 3], [3, 0, 5, 2]):
        offsets = torch.tensor(counts).cumsum(0).to(torch.int32)
        x = torch.randn(sum(counts), 8, dtype=torch.double, requires_grad=True)
        grad = torch.randn(sum(counts), 8, dtype=torch.double)
        want, want_grads = _outputs_and_gradients(experts, partial(experts.forward_loop, x, offsets), x, grad)
        runs = [partial(experts.forward_padded, x, counts)]
        if len(set(counts)) == 1:
            runs.append(partial(experts.forward_batched, x))
        for run in runs:
            got, got_grads = _outputs_and_gradients(experts, run, x, grad)
            torch.testing.assert_close(got, want)
            for got_grad, want_grad in zip(got_grads, want_grads, strict=True):
                torch.testing.assert_close(got_grad, want_grad)


@pytest.mark.parametrize("threads", [2, 1])
def test_cpu_forward_pads_uneven_slices_only_within_the_tolerance_and_on_several_threads(monkeypatch, threads):
    from mmoe.moe import experts as experts_module

    experts = GroupedExperts(4, 8, 12)
    chosen = []
    for name in ("forward_batched", "forward_padded", "forward_grouped", "forward_loop"):
        original = getattr(GroupedExperts, name)
        monkeypatch.setattr(
            GroupedExperts, name, lambda self, *a, _n=name, _o=original: chosen.append(_n) or _o(self, *a)
        )
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for counts in ([300, 300, 300, 300], [300, 290, 310, 300], [600, 200, 200, 200], [3, 9, 1, 3]):
            offsets = torch.tensor(counts).cumsum(0).to(torch.int32)
            expert = torch.arange(4).repeat_interleave(torch.tensor(counts))
            experts(torch.randn(sum(counts), 8), expert, offsets)
    finally:
        torch.set_num_threads(before)
    assert experts_module.CPU_PAD_TOLERANCE == 1.25
    # Equal slices pad nothing; 310 x 4 rows pad 3 %, on several threads (one thread has no parallel region to
    # stall: the loop, without padding); 600 x 4 pads 100 % (>= 256 rows each: the loop); 9 x 4 pads 125 % of 16
    # rows (fewer than 256 rows each: the grouped GEMM).
    uneven = ["forward_padded", "forward_batched"] if threads > 1 else ["forward_loop"]
    assert chosen == ["forward_batched", *uneven, "forward_loop", "forward_grouped"]
