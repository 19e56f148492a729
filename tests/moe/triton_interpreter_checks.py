"""The fused expert kernels run by Triton's interpreter on CPU tensors, against the reference path. Triton must be
imported with ``TRITON_INTERPRET=1`` already set (its standard library is built for the interpreter at import), so
``tests/moe/test_triton_experts.py`` runs this file in a fresh process with that variable; it is not collected on its
own (no ``test_`` prefix)."""

from __future__ import annotations

import importlib
import os

import pytest
import torch
import triton
import triton.language as tl

from mmoe.moe import MoEConfig, build_moe_layer, triton_expert_kernels
from mmoe.moe.experts import GroupedExperts


@pytest.fixture(scope="module")
def kernels():
    """:mod:`mmoe.moe.triton_experts`, its kernels (:mod:`mmoe.moe.triton_expert_kernels`) built for Triton's
    interpreter."""
    assert os.environ.get("TRITON_INTERPRET") == "1", "run through tests/moe/test_triton_experts.py"
    from triton.runtime.interpreter import InterpretedFunction

    module = importlib.import_module("mmoe.moe.triton_experts")
    assert isinstance(triton_expert_kernels.gather_gemm_kernel, InterpretedFunction)
    return module


def slices(offsets: list[int]) -> list[tuple[int, int]]:
    return list(zip([0, *offsets[:-1]], offsets, strict=True))


def test_block_schedule_covers_every_row_once_within_its_expert(kernels):
    tiles = kernels.GemmTiles(8, 16, 16, num_warps=4, num_stages=1)
    for counts in ([0, 5, 40, 0, 3], [32, 32], [0, 0, 7], [1] * 9, [100], [0] * 130 + [300] + [2] * 10):
        offsets = torch.tensor(counts).cumsum(0).to(torch.int32)
        rows = int(offsets[-1])
        schedule = kernels.block_schedule(offsets, rows, tiles)
        assert schedule.expert_P.numel() == -(-rows // 8) + len(counts)
        seen = []
        for expert, start in zip(schedule.expert_P.tolist(), schedule.row_P.tolist(), strict=True):
            if expert == len(counts):
                assert start == 0
                continue
            begin, end = slices(offsets.tolist())[expert]
            assert begin <= start < end and (start - begin) % 8 == 0
            seen += list(range(start, min(start + 8, end)))
        assert sorted(seen) == list(range(rows)), counts


def gelu_grad(a: torch.Tensor) -> torch.Tensor:
    a = a.detach().requires_grad_(True)
    torch.nn.functional.gelu(a).sum().backward()
    return a.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows_per_expert", [20, 300])  # 300: 128-row tiles in bf16
def test_gather_gemm_reads_and_writes_through_the_indices(kernels, dtype, rows_per_expert):
    torch.manual_seed(0)
    counts = [3, 0, rows_per_expert, 11]
    offsets = torch.tensor(counts).cumsum(0).to(torch.int32)
    rows = sum(counts)
    expert_R = torch.repeat_interleave(torch.arange(4), torch.tensor(counts))
    weight, bias = torch.randn(4, 40, 70, dtype=dtype), torch.randn(4, 70, dtype=dtype)
    x = torch.randn(30, 40, dtype=dtype)
    in_index, out_index = torch.randint(0, 30, (rows,)), torch.randperm(rows)
    tiles = kernels.gemm_tiles(dtype, rows, 4)
    schedule = kernels.block_schedule(offsets, rows, tiles)
    tolerance = dict(rtol=1e-5, atol=1e-4) if dtype == torch.float32 else dict(rtol=1e-2, atol=5e-2)

    expected = torch.einsum("rk,rkn->rn", x[in_index].double(), weight[expert_R].double()) + bias[expert_R].double()
    gathered = kernels.gather_gemm(x, weight, bias, offsets, schedule, rows, in_index=in_index)
    torch.testing.assert_close(gathered.double(), expected, **tolerance)

    pre = torch.empty(rows, 70, dtype=dtype)
    activated = kernels.gather_gemm(x, weight, bias, offsets, schedule, rows, in_index=in_index,
                                    epilogue=triton_expert_kernels.GELU, pre=pre)  # fmt: skip
    torch.testing.assert_close(pre.double(), expected, **tolerance)
    torch.testing.assert_close(activated.double(), torch.nn.functional.gelu(expected), **tolerance)

    grad = torch.randn(rows, 70, dtype=dtype)
    scattered = kernels.gather_gemm(grad, weight, None, offsets, schedule, rows, out_index=out_index,
                                    transpose_weight=True)  # fmt: skip
    reference = torch.empty(rows, 40, dtype=torch.float64)
    reference[out_index] = torch.einsum("rn,rkn->rk", grad.double(), weight[expert_R].double())
    torch.testing.assert_close(scattered.double(), reference, **tolerance)

    grad_in = torch.randn(rows, 40, dtype=dtype)
    through_gelu = kernels.gather_gemm(grad_in, weight, None, offsets, schedule, rows, in_index=out_index,
                                       epilogue=triton_expert_kernels.GELU_GRAD, pre=pre)  # fmt: skip
    linear = torch.einsum("rk,rkn->rn", grad_in[out_index].double(), weight[expert_R].double())
    torch.testing.assert_close(through_gelu.double(), linear * gelu_grad(pre.double()), **tolerance)

    dw, db = kernels.weight_grad(x, grad, offsets, 40, in_index, out_index, with_bias=True)
    assert dw.dtype == db.dtype == torch.float32
    products = x[in_index].double()[:, :, None] * grad[out_index].double()[:, None]
    expected_dw = torch.zeros(4, 40, 70, dtype=torch.float64).index_add_(0, expert_R, products)
    expected_db = torch.zeros(4, 70, dtype=torch.float64).index_add_(0, expert_R, grad[out_index].double())
    torch.testing.assert_close(dw.double(), expected_dw, rtol=1e-5, atol=1e-3)
    torch.testing.assert_close(db.double(), expected_db, rtol=1e-5, atol=1e-4)
    assert kernels.weight_grad(x, grad, offsets, 40, in_index, out_index, with_bias=False)[1] is None


def test_expert_column_sums_accumulate_each_slice_in_fp32(kernels):
    torch.manual_seed(0)
    counts = [0, 70, 5, 2000]
    offsets = torch.tensor(counts).cumsum(0).to(torch.int32)
    expert_R = torch.repeat_interleave(torch.arange(4), torch.tensor(counts))
    # A bf16 running sum of 2000 values near 1 stops at 256 (its spacing there reaches 2); fp32 keeps every one.
    a = (1 + torch.rand(sum(counts), 130) / 8).to(torch.bfloat16)
    b = torch.randn(sum(counts), 130)
    expected = torch.zeros(4, 130, dtype=torch.float64).index_add_(0, expert_R, a.double())
    torch.testing.assert_close(kernels.expert_column_sums(a, None, offsets).double(), expected, rtol=1e-6, atol=1e-3)
    expected = torch.zeros(4, 130, dtype=torch.float64).index_add_(0, expert_R, a.double() * b.double())
    torch.testing.assert_close(kernels.expert_column_sums(a, b, offsets).double(), expected, rtol=1e-5, atol=1e-3)


@triton.jit
def _offsets_kernel(ROWS, OUT64, OUT32, stride, N: tl.constexpr):
    rows = tl.load(ROWS + tl.arange(0, N))
    tl.store(OUT64 + tl.arange(0, N), triton_expert_kernels.row_offsets(rows, stride))
    tl.store(OUT32 + tl.arange(0, N), (rows * stride).to(tl.int64))


def test_row_offsets_are_64_bit(kernels):
    """``rows * stride`` for 700K rows of width 3072 passes 2^31: the kernels' offsets must not wrap. The same product
    in 32 bits (the kernels before) wraps under the interpreter as on a GPU, so this test sees the bug."""
    rows = torch.tensor([5, 699_050, 699_051, 2_000_000], dtype=torch.int32)
    out64, out32 = torch.empty(4, dtype=torch.int64), torch.empty(4, dtype=torch.int64)
    _offsets_kernel[(1,)](rows, out64, out32, 3072, N=4)
    assert out64.tolist() == [r * 3072 for r in rows.tolist()]
    assert out32.tolist() != out64.tolist()  # 32-bit products wrap from 699,051 rows


CASES = {
    "top-1": {"top_k": 1},
    "top-2 renormalised": {"top_k": 2},
    "top-2 raw": {"top_k": 2, "renormalize": False},
    "MH-MoE h=2": {"top_k": 2, "heads": 2},
    "capacity drops": {"top_k": 1, "capacity_factor": 0.5},
    "Sub-LN linear router": {"top_k": 2, "subln": True, "router": "linear"},
    "Sub-LN with a backbone's epsilon": {"top_k": 2, "subln": True, "layernorm_eps": 0.5},
    "top-3 MH-MoE h=2": {"top_k": 3, "heads": 2},
    "top-4 of 4 with capacity": {"top_k": 4, "capacity_factor": 1.0},
    "fine-grained with a shared expert": {"top_k": 3, "beta": 0.5, "shared_experts": 1},
}


def close_in_bf16(actual: torch.Tensor, expected: torch.Tensor, share: float = 0.03) -> bool:
    """bf16 paths that round in different places: the largest difference within ``share`` of the largest value."""
    return (actual.float() - expected.float()).abs().max() <= share * expected.float().abs().max()


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


def test_frozen_experts_get_no_gradient_and_launch_no_weight_gradient_kernel(kernels, monkeypatch):
    """X-MoE §3.3 fine-tuning freezes routers and experts: the input gradient still matches the reference path, and
    the backward skips the weight-gradient kernel (the work a trainable layer needs)."""
    torch.manual_seed(1)
    options = {"top_k": 2, "subln": True, "frozen": True}
    reference = build_moe_layer(MoEConfig(dim=32, ffn_dim=48, num_experts=4, **options))
    fused = build_moe_layer(MoEConfig(dim=32, ffn_dim=48, num_experts=4, expert_kernels="triton", **options))
    fused.load_state_dict(reference.state_dict())
    calls = []
    original = kernels.weight_grad
    monkeypatch.setattr(kernels, "weight_grad", lambda *a, **k: calls.append(1) or original(*a, **k))
    x = torch.randn(3, 11, 32)
    padding = torch.zeros(3, 11, dtype=torch.bool)
    y_ref, gx_ref, grads_ref, _ = run_layer(reference, x, padding)
    y, gx, grads, _ = run_layer(fused, x, padding)
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(gx, gx_ref, rtol=1e-5, atol=1e-6)
    assert not grads and not grads_ref and calls == []


BF16_CASES = CASES | {"top-2 E 2 (128-row tiles)": {"top_k": 2, "num_experts": 2}}


@pytest.mark.parametrize("case", BF16_CASES)
def test_fused_layer_is_close_to_the_reference_in_bf16(kernels, case):
    torch.manual_seed(1)
    options = {"num_experts": 4} | BF16_CASES[case]
    reference = build_moe_layer(MoEConfig(dim=64, ffn_dim=128, **options))
    fused = build_moe_layer(MoEConfig(dim=64, ffn_dim=128, expert_kernels="triton", **options))
    fused.load_state_dict(reference.state_dict())
    x = torch.randn(3, 100, 64)
    padding = torch.zeros(3, 100, dtype=torch.bool)
    padding[1, 77:] = True
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y_ref, gx_ref, grads_ref, routing_ref = run_layer(reference, x, padding)
        y, gx, grads, routing = run_layer(fused, x, padding)
    assert y.dtype == torch.bfloat16
    assert torch.equal(routing.expert_index, routing_ref.expert_index)
    assert close_in_bf16(y, y_ref) and close_in_bf16(gx, gx_ref)
    assert grads.keys() == grads_ref.keys()
    far = [name for name in grads if not close_in_bf16(grads[name], grads_ref[name])]
    assert not far, far


@pytest.mark.parametrize(
    "options",
    [
        {"capacity_factor": 1.0},
        {"capacity_factor": 2.0, "heads": 2, "subln": True, "shared_experts": 1, "router": "linear"},
    ],
)
def test_fused_expert_choice_equals_the_reference_path(kernels, monkeypatch, options):
    """Expert choice (rows that are not K choices per token: a token has 0 to E rows) through the fused kernels:
    outputs, the input gradient (summed by token) and every parameter gradient equal the batched reference path."""
    torch.manual_seed(4)
    reference, fused = (
        build_moe_layer(MoEConfig(32, 48, num_experts=4, routing="expert_choice", expert_kernels=kernel, **options))
        for kernel in ("torch", "triton")
    )
    with torch.no_grad():
        for parameter in reference.experts.parameters():
            parameter.normal_(std=0.3)  # Sub-LN affine and biases away from their 1 / 0 start
    fused.load_state_dict(reference.state_dict())
    calls = []
    original = GroupedExperts.forward_fused_rows
    monkeypatch.setattr(GroupedExperts, "forward_fused_rows", lambda self, *a: calls.append(1) or original(self, *a))
    x, padding = torch.randn(2, 13, 32), torch.arange(13).expand(2, 13) >= torch.tensor([[13], [9]])
    (y_ref, gx_ref, grads_ref, routing_ref), (y, gx, grads, routing) = (
        run_layer(layer, x, padding) for layer in (reference, fused)
    )
    assert calls == [1] and int((routing.expert_index >= 0).sum(-1).max()) > 1  # some token has several rows
    torch.testing.assert_close((y, gx), (y_ref, gx_ref), rtol=1e-5, atol=1e-6)
    assert grads.keys() == grads_ref.keys() and "experts.fc1_weight" in grads
    torch.testing.assert_close(grads, grads_ref, rtol=1e-4, atol=1e-6)
    assert torch.equal(routing.expert_index, routing_ref.expert_index)
