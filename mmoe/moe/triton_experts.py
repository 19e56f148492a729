"""Expert linears with the row permutations fused into the GEMMs (ScatterMoE-style), as Triton kernels.

The reference path (:mod:`mmoe.moe.dispatch` + :class:`mmoe.moe.experts.GroupedExperts`) moves rows three times
around the expert GEMMs: gather the choices into expert order, run the grouped GEMMs, gather the outputs back. Here
the first linear reads its rows straight from the (sub-)token matrix (``x[token_C[r]]``) and the second writes each
output row straight to its choice's place (``y[order_C[r]]``), so no permuted copy of the activations is written:

    Y[out[r]] = X[in[r]] @ W[e(r)] + b[e(r)]      for every sorted choice r, e(r) its expert

Rows are processed in blocks of one expert each; the block schedule is built on the device from the slice ends
``offsets_E`` with a static grid of ``ceil(R / BLOCK_M) + E`` programs (the most blocks any split of R rows over E
experts can need), so nothing is read back to the host. The backward uses the same kernel for the input gradient
(``dY[out[r]] @ W[e]^T``) and a per-expert kernel for the weight gradient (``Σ_r X[in[r]]^T dY[out[r]]``).

Off by default (``MoEConfig.expert_kernels = "triton"`` turns it on). It runs on CUDA tensors, and on CPU tensors
under Triton's interpreter (``TRITON_INTERPRET=1`` set before this module is imported), which is how the test suite
checks it against the reference path without a GPU.

Shape legend: R rows (sorted choices), S (sub-)tokens, E experts, K input width, N output width.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

BLOCK_M, BLOCK_N, BLOCK_K = 32, 64, 32


def interpreting() -> bool:
    """Whether Triton runs kernels on the CPU (its interpreter)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def usable_on(x: torch.Tensor) -> bool:
    """The kernels run on CUDA tensors, and on CPU tensors under the interpreter."""
    return x.is_cuda or (x.device.type == "cpu" and interpreting())


def block_schedule(offsets_E: torch.Tensor, num_rows: int, block_m: int = BLOCK_M) -> tuple[torch.Tensor, torch.Tensor]:
    """Expert and first row of each program's block: (P,) int32 each, P = ceil(R / block_m) + E; programs past the
    last block get expert E (they do nothing)."""
    num_experts = offsets_E.numel()
    offsets = offsets_E.long()
    starts = torch.cat([offsets.new_zeros(1), offsets[:-1]])
    blocks_E = (offsets - starts + block_m - 1) // block_m
    ends_E = blocks_E.cumsum(0)
    programs = torch.arange(triton.cdiv(num_rows, block_m) + num_experts, device=offsets.device)
    expert_P = torch.searchsorted(ends_E, programs, right=True)
    inside = expert_P < num_experts
    safe = expert_P.clamp_max(num_experts - 1)
    first_block = ends_E.index_select(0, safe) - blocks_E.index_select(0, safe)
    row_P = starts.index_select(0, safe) + (programs - first_block) * block_m
    return expert_P.to(torch.int32), torch.where(inside, row_P, 0).to(torch.int32)


@triton.jit
def _gather_gemm_kernel(
    X, IN_INDEX, W, B, Y, OUT_INDEX, EXPERT_P, ROW_P, OFFSETS,
    num_experts, K, N,
    stride_xm, stride_we, stride_wk, stride_wn, stride_ym,
    GATHER_IN: tl.constexpr, SCATTER_OUT: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """Y[out[r]] = X[in[r]] @ W[e] (+ B[e]) for the rows r of one block of expert e."""
    program = tl.program_id(0)
    expert = tl.load(EXPERT_P + program)
    if expert >= num_experts:
        return
    row_start = tl.load(ROW_P + program)
    row_end = tl.load(OFFSETS + expert)
    rows = row_start + tl.arange(0, BLOCK_M)
    row_mask = rows < row_end
    source = tl.load(IN_INDEX + rows, mask=row_mask, other=0) if GATHER_IN else rows
    target = tl.load(OUT_INDEX + rows, mask=row_mask, other=0) if SCATTER_OUT else rows
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < K
        x = tl.load(X + source[:, None] * stride_xm + ks[None, :], mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        w_ptrs = W + expert * stride_we + ks[:, None] * stride_wk + cols[None, :] * stride_wn
        w = tl.load(w_ptrs, mask=k_mask[:, None] & col_mask[None, :], other=0.0)
        acc += tl.dot(x, w)
    if HAS_BIAS:
        acc += tl.load(B + expert * N + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    y_ptrs = Y + target[:, None] * stride_ym + cols[None, :]
    tl.store(y_ptrs, acc.to(Y.dtype.element_ty), mask=row_mask[:, None] & col_mask[None, :])


@triton.jit
def _weight_grad_kernel(
    X, IN_INDEX, DY, DY_INDEX, DW, OFFSETS,
    K, N, stride_xm, stride_dym,
    GATHER_IN: tl.constexpr, GATHER_DY: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """DW[e] = Σ_{r in e's slice} X[in[r]]^T dY[dy[r]], one (BLOCK_K, BLOCK_N) tile of one expert per program."""
    expert = tl.program_id(0)
    row_start = tl.load(OFFSETS + expert - 1, mask=expert > 0, other=0)
    row_end = tl.load(OFFSETS + expert)
    ks = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    cols = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    k_mask, col_mask = ks < K, cols < N
    acc = tl.zeros((BLOCK_K, BLOCK_N), dtype=tl.float32)
    for m0 in range(row_start, row_end, BLOCK_M):
        rows = m0 + tl.arange(0, BLOCK_M)
        row_mask = rows < row_end
        source = tl.load(IN_INDEX + rows, mask=row_mask, other=0) if GATHER_IN else rows
        grad_rows = tl.load(DY_INDEX + rows, mask=row_mask, other=0) if GATHER_DY else rows
        x_ptrs = X + source[None, :] * stride_xm + ks[:, None]
        x_t = tl.load(x_ptrs, mask=k_mask[:, None] & row_mask[None, :], other=0.0)
        dy_ptrs = DY + grad_rows[:, None] * stride_dym + cols[None, :]
        dy = tl.load(dy_ptrs, mask=row_mask[:, None] & col_mask[None, :], other=0.0)
        acc += tl.dot(x_t, dy)
    dw_ptrs = DW + expert * K * N + ks[:, None] * N + cols[None, :]
    tl.store(dw_ptrs, acc.to(DW.dtype.element_ty), mask=k_mask[:, None] & col_mask[None, :])


def gather_gemm(
    x: torch.Tensor,
    weight_EKN: torch.Tensor,
    bias_EN: torch.Tensor | None,
    offsets_E: torch.Tensor,
    schedule: tuple[torch.Tensor, torch.Tensor],
    num_rows: int,
    in_index: torch.Tensor | None = None,
    out_index: torch.Tensor | None = None,
    transpose_weight: bool = False,
) -> torch.Tensor:
    """(num_rows, N) with row ``out[r]`` = ``x[in[r]] @ W[e(r)] (+ b)``; ``transpose_weight`` multiplies by
    ``W[e]^T`` (the input gradient). Identity where an index is None."""
    weight = weight_EKN.transpose(1, 2) if transpose_weight else weight_EKN
    num_experts, k_dim, n_dim = weight.shape
    x = x.contiguous()
    y = torch.empty(num_rows, n_dim, device=x.device, dtype=x.dtype)
    expert_P, row_P = schedule
    dummy = offsets_E
    grid = (expert_P.numel(), triton.cdiv(n_dim, BLOCK_N))
    _gather_gemm_kernel[grid](
        x, dummy if in_index is None else in_index, weight, dummy if bias_EN is None else bias_EN, y,
        dummy if out_index is None else out_index, expert_P, row_P, offsets_E,
        num_experts, k_dim, n_dim,
        x.stride(0), weight.stride(0), weight.stride(1), weight.stride(2), y.stride(0),
        GATHER_IN=in_index is not None, SCATTER_OUT=out_index is not None, HAS_BIAS=bias_EN is not None,
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
    )  # fmt: skip
    return y


def weight_grad(
    x: torch.Tensor,
    grad: torch.Tensor,
    offsets_E: torch.Tensor,
    k_dim: int,
    in_index: torch.Tensor | None,
    grad_index: torch.Tensor | None,
) -> torch.Tensor:
    """(E, K, N) per-expert ``Σ x[in[r]]^T grad[gi[r]]`` over each expert's slice, in fp32."""
    x, grad = x.contiguous(), grad.contiguous()
    num_experts, n_dim = offsets_E.numel(), grad.shape[1]
    dw = torch.empty(num_experts, k_dim, n_dim, device=x.device, dtype=torch.float32)
    grid = (num_experts, triton.cdiv(k_dim, BLOCK_K), triton.cdiv(n_dim, BLOCK_N))
    _weight_grad_kernel[grid](
        x, offsets_E if in_index is None else in_index, grad, offsets_E if grad_index is None else grad_index, dw,
        offsets_E, k_dim, n_dim, x.stride(0), grad.stride(0),
        GATHER_IN=in_index is not None, GATHER_DY=grad_index is not None,
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
    )  # fmt: skip
    return dw


class GatherLinear(torch.autograd.Function):
    """``Y[out[r]] = X[in[r]] @ W[e(r)] + b[e(r)]`` over sorted rows, with its backward (see the module docstring).

    ``in_index`` gathers from X (then X has S rows and each row is read ``tiles`` times: ``in = order_C % S``, with
    ``inverse`` the inverse of ``order_C``); ``out_index`` scatters into Y. Exactly one of the two is given, or
    neither. ``schedule``: :func:`block_schedule` of ``offsets_E`` (one per dispatch, shared by both linears).
    """

    @staticmethod
    def forward(ctx, x, weight_EKN, bias_EN, offsets_E, expert_R, in_index, inverse, out_index, tiles: int, schedule):
        num_rows = expert_R.numel()
        y = gather_gemm(x, weight_EKN.to(x.dtype), None if bias_EN is None else bias_EN.to(x.dtype), offsets_E,
                        schedule, num_rows, in_index, out_index)  # fmt: skip
        ctx.save_for_backward(x, weight_EKN, offsets_E, expert_R, in_index, inverse, out_index, *schedule)
        ctx.tiles, ctx.has_bias = tiles, bias_EN is not None
        ctx.weight_dtype = weight_EKN.dtype
        return y

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_y):
        x, weight, offsets_E, expert_R, in_index, inverse, out_index, expert_P, row_P = ctx.saved_tensors
        grad_y = grad_y.contiguous()
        num_rows = expert_R.numel()
        grad_x = None
        if ctx.needs_input_grad[0]:
            # Row r of the sorted input gradient: dY[out[r]] @ W[e]^T.
            grad_sorted = gather_gemm(grad_y, weight.to(grad_y.dtype), None, offsets_E, (expert_P, row_P), num_rows,
                                      in_index=out_index, transpose_weight=True)  # fmt: skip
            if in_index is None:
                grad_x = grad_sorted
            else:  # back to (sub-)token order, summing the tiles (a token's top-k rows)
                grad_x = grad_sorted.index_select(0, inverse).view(ctx.tiles, -1, grad_sorted.shape[1]).sum(0)
        grad_w = grad_b = None
        if ctx.needs_input_grad[1]:
            grad_w = weight_grad(x, grad_y, offsets_E, weight.shape[1], in_index, out_index).to(ctx.weight_dtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_rows = grad_y if out_index is None else grad_y.index_select(0, out_index)
            grad_b = torch.zeros(offsets_E.numel(), grad_y.shape[1], device=grad_y.device, dtype=torch.float32)
            grad_b = grad_b.index_add_(0, expert_R.long(), grad_rows.float()).to(ctx.weight_dtype)
        return grad_x, grad_w, grad_b, None, None, None, None, None, None, None
