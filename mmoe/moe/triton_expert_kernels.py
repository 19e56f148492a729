"""The Triton kernels of the fused expert FFN; :mod:`mmoe.moe.triton_experts` picks their tiles and launches them.

- :func:`block_schedule_kernel`: the expert and first sorted row of every row block of BLOCK_M rows, built from the
  experts' slice ends in one launch (the static grid of ``ceil(R / BLOCK_M) + E`` blocks; blocks past the last row
  get expert E and do nothing).
- :func:`gather_gemm_kernel`: ``Y[out[r]] = X[in[r]] @ W[e(r)] (+ b[e(r)])`` for the rows of one block, reading and
  writing rows through the index vectors (ScatterMoE-style), with GELU (fc1) or GELU' (its input gradient) in the
  epilogue; row blocks are swizzled in groups of GROUP_M so that they share their weight tiles in L2 (Triton's matmul
  tutorial).
- :func:`weight_grad_kernel`: per expert, ``Σ_r X[in[r]]^T dY[dy[r]]`` over one output tile, the bias gradient
  summed in the same pass: no atomics.
- :func:`expert_column_sums_kernel`: per expert, the fp32 column sums ``Σ_r A[r] (* B[r])`` (the Sub-LN affine's
  gradients).

Row offsets are computed in 64 bits (:func:`row_offsets`). The kernels are built for Triton's interpreter when
``TRITON_INTERPRET=1`` is set before this module is imported; ``UPCAST`` then multiplies 16-bit operands as fp32.

Shape legend: R rows (sorted choices), E experts, K input width, N output width, P row blocks.
"""

from __future__ import annotations

import triton
import triton.language as tl

#: Epilogues of :func:`gather_gemm_kernel`: none; store A and GELU(A); multiply by GELU'(A) of a saved A.
NO_EPILOGUE, GELU, GELU_GRAD = 0, 1, 2


@triton.jit
def _gelu(a):
    """GELU(a) = a Φ(a), the exact (erf) form ``F.gelu`` computes by default."""
    return 0.5 * a * (1.0 + tl.math.erf(a * 0.7071067811865476))


@triton.jit
def _gelu_grad(a):
    """GELU'(a) = Φ(a) + a φ(a)."""
    return 0.5 * (1.0 + tl.math.erf(a * 0.7071067811865476)) + a * 0.3989422804014327 * tl.exp(-0.5 * a * a)


@triton.jit
def _dot(a, b, acc, INPUT_PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """``acc + a @ b``. ``UPCAST`` (set under the interpreter only) multiplies 16-bit operands as fp32, which is
    exact: Triton's interpreter multiplies bf16 operands as their raw 16-bit integers."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(a, b, acc, input_precision=INPUT_PRECISION)


@triton.jit
def row_offsets(rows, stride):
    """``rows * stride`` in 64 bits: the product passes 2^31 from ~700K rows of width 3072."""
    return rows.to(tl.int64) * stride


@triton.jit
def block_schedule_kernel(
    OFFSETS, EXPERT_P, ROW_P, num_experts, num_programs,
    BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_P: tl.constexpr,
):  # fmt: skip
    """Expert and first row of row blocks p: expert e owns blocks ``[Σ_{e'<e} b_e', Σ_{e'≤e} b_e')``, b_e =
    ``ceil(count_e / BLOCK_M)``; blocks past the last get expert E."""
    experts = tl.arange(0, BLOCK_E)
    real = experts < num_experts
    ends = tl.load(OFFSETS + experts, mask=real, other=0)
    starts = tl.load(OFFSETS + experts - 1, mask=real & (experts > 0), other=0)
    counts = ends - starts
    blocks = (counts + BLOCK_M - 1) // BLOCK_M
    block_ends = tl.cumsum(blocks, 0)
    programs = tl.program_id(0) * BLOCK_P + tl.arange(0, BLOCK_P)
    # Experts whose blocks all lie before program p: their number is p's expert, their blocks and rows its offsets.
    before = (block_ends[None, :] <= programs[:, None]) & real[None, :]
    expert = tl.sum(before.to(tl.int32), 1)
    first_block = tl.sum(tl.where(before, blocks[None, :], 0), 1)
    first_row = tl.sum(tl.where(before, counts[None, :], 0), 1)
    row = first_row + (programs - first_block) * BLOCK_M
    inside = programs < num_programs
    tl.store(EXPERT_P + programs, expert, mask=inside)
    tl.store(ROW_P + programs, tl.where(expert < num_experts, row, 0), mask=inside)


@triton.jit
def gather_gemm_kernel(
    X, IN_INDEX, W, B, Y, OUT_INDEX, PRE, EXPERT_P, ROW_P, OFFSETS,
    num_blocks_m, num_experts, K, N,
    stride_xm, stride_we, stride_wk, stride_wn, stride_ym,
    GATHER_IN: tl.constexpr, SCATTER_OUT: tl.constexpr, HAS_BIAS: tl.constexpr, EPILOGUE: tl.constexpr,
    INPUT_PRECISION: tl.constexpr, UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):  # fmt: skip
    """Y[out[r]] = X[in[r]] @ W[e] (+ B[e]) for the rows r of one block of expert e, then the epilogue: GELU (A
    stored to PRE, GELU(A) to Y) or GELU' (Y = acc * GELU'(PRE[r]))."""
    program = tl.program_id(0)
    num_blocks_n = tl.cdiv(N, BLOCK_N)
    programs_in_group = GROUP_M * num_blocks_n
    first_block_m = (program // programs_in_group) * GROUP_M
    group_size_m = tl.minimum(num_blocks_m - first_block_m, GROUP_M)
    block_m = first_block_m + (program % programs_in_group) % group_size_m
    block_n = (program % programs_in_group) // group_size_m

    expert = tl.load(EXPERT_P + block_m)
    if expert >= num_experts:
        return
    row_start = tl.load(ROW_P + block_m)
    row_end = tl.load(OFFSETS + expert)
    rows = row_start + tl.arange(0, BLOCK_M)
    row_mask = rows < row_end
    source = tl.load(IN_INDEX + rows, mask=row_mask, other=0) if GATHER_IN else rows
    target = tl.load(OUT_INDEX + rows, mask=row_mask, other=0) if SCATTER_OUT else rows
    cols = block_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    ks = tl.arange(0, BLOCK_K)
    x_ptrs = X + row_offsets(source, stride_xm)[:, None] + ks[None, :]
    w_ptrs = W + expert.to(tl.int64) * stride_we + ks[:, None] * stride_wk + cols[None, :] * stride_wn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_mask = ks < K - k0
        x = tl.load(x_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=k_mask[:, None] & col_mask[None, :], other=0.0)
        acc = _dot(x, w, acc, INPUT_PRECISION, UPCAST)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K * stride_wk
    if HAS_BIAS:
        acc += tl.load(B + expert * N + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    out_offsets = row_offsets(target, stride_ym)[:, None] + cols[None, :]
    out_mask = row_mask[:, None] & col_mask[None, :]
    if EPILOGUE == 1:
        tl.store(PRE + out_offsets, acc.to(PRE.dtype.element_ty), mask=out_mask)
        acc = _gelu(acc)
    elif EPILOGUE == 2:
        acc *= _gelu_grad(tl.load(PRE + out_offsets, mask=out_mask, other=0.0).to(tl.float32))
    tl.store(Y + out_offsets, acc.to(Y.dtype.element_ty), mask=out_mask)


@triton.jit
def weight_grad_kernel(
    X, IN_INDEX, DY, DY_INDEX, DW, DB, OFFSETS,
    K, N, stride_xm, stride_dym,
    GATHER_IN: tl.constexpr, GATHER_DY: tl.constexpr, HAS_BIAS: tl.constexpr, INPUT_PRECISION: tl.constexpr,
    UPCAST: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr,
):  # fmt: skip
    """DW[e] = Σ_{r in e's slice} X[in[r]]^T dY[dy[r]] for one (BLOCK_K, BLOCK_N) tile of expert e; the programs of
    the first K tile also write DB[e] = Σ_r dY[dy[r]] for their columns (in fp32, no atomics)."""
    block_n, block_k, expert = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    row_start = tl.load(OFFSETS + expert - 1, mask=expert > 0, other=0)
    row_end = tl.load(OFFSETS + expert)
    ks = block_k * BLOCK_K + tl.arange(0, BLOCK_K)
    cols = block_n * BLOCK_N + tl.arange(0, BLOCK_N)
    k_mask, col_mask = ks < K, cols < N
    acc = tl.zeros((BLOCK_K, BLOCK_N), dtype=tl.float32)
    bias_acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for m0 in range(row_start, row_end, BLOCK_M):
        rows = m0 + tl.arange(0, BLOCK_M)
        row_mask = rows < row_end
        source = tl.load(IN_INDEX + rows, mask=row_mask, other=0) if GATHER_IN else rows
        grad_rows = tl.load(DY_INDEX + rows, mask=row_mask, other=0) if GATHER_DY else rows
        x_ptrs = X + row_offsets(source, stride_xm)[None, :] + ks[:, None]
        x_t = tl.load(x_ptrs, mask=k_mask[:, None] & row_mask[None, :], other=0.0)
        dy_ptrs = DY + row_offsets(grad_rows, stride_dym)[:, None] + cols[None, :]
        dy = tl.load(dy_ptrs, mask=row_mask[:, None] & col_mask[None, :], other=0.0)
        acc = _dot(x_t, dy, acc, INPUT_PRECISION, UPCAST)
        if HAS_BIAS:
            bias_acc += tl.sum(dy.to(tl.float32), 0)
    dw_ptrs = DW + expert.to(tl.int64) * K * N + ks[:, None] * N + cols[None, :]
    tl.store(dw_ptrs, acc, mask=k_mask[:, None] & col_mask[None, :])
    if HAS_BIAS:
        tl.store(DB + expert * N + cols, bias_acc, mask=col_mask & (block_k == 0))


@triton.jit
def expert_column_sums_kernel(
    A, B, OUT, OFFSETS, N, stride_am, stride_bm,
    HAS_B: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """OUT[e] = Σ_{r in e's slice} A[r] (* B[r]) in fp32, for one block of columns."""
    block_n, expert = tl.program_id(0), tl.program_id(1)
    row_start = tl.load(OFFSETS + expert - 1, mask=expert > 0, other=0)
    row_end = tl.load(OFFSETS + expert)
    cols = block_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for m0 in range(row_start, row_end, BLOCK_M):
        rows = m0 + tl.arange(0, BLOCK_M)
        mask = (rows < row_end)[:, None] & col_mask[None, :]
        values = tl.load(A + row_offsets(rows, stride_am)[:, None] + cols[None, :], mask=mask, other=0.0)
        values = values.to(tl.float32)
        if HAS_B:
            b_ptrs = B + row_offsets(rows, stride_bm)[:, None] + cols[None, :]
            values *= tl.load(b_ptrs, mask=mask, other=0.0).to(tl.float32)
        acc += tl.sum(values, 0)
    tl.store(OUT + expert * N + cols, acc, mask=col_mask)
