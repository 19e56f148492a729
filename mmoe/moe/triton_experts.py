"""Expert FFNs with the row permutations fused into the GEMMs (ScatterMoE-style), as Triton kernels: their tiles,
block schedule, launches and autograd Function (:func:`fused_expert_ffn`); the kernels themselves are in
:mod:`mmoe.moe.triton_expert_kernels`.

The reference path (:mod:`mmoe.moe.dispatch` + :class:`mmoe.moe.experts.GroupedExperts`) moves rows three times
around the expert GEMMs: gather the choices into expert order, run the grouped GEMMs, gather the outputs back. Here
the first linear reads its rows straight from the (sub-)token matrix (``x[token_C[r]]``) and the second writes each
output row straight to its choice's place (``y[order_C[r]]``), so no permuted copy of the activations is written:

    A[r] = X[token[r]] @ W1[e(r)] + b1[e(r)],   G = GELU(A)        (fc1; bias and GELU in the GEMM's epilogue)
    Y[order[r]] = G[r] @ W2[e(r)] + b2[e(r)]                      (fc2; with Sub-LN, G is normalised first)

for every sorted choice r, e(r) its expert. Rows are processed in blocks of one expert each; the block schedule is
built on the device in one launch from the slice ends ``offsets_E``, over a static grid of ``ceil(R / BLOCK_M) + E``
row blocks (the most any split of R rows over E experts can need), so nothing is read back to the host and the layer
can be captured in a CUDA graph. The backward reuses the GEMM kernel for the input gradients (``dY[order[r]] @
W2[e]^T`` with GELU' in its epilogue, then ``dA @ W1^T`` scattered to the choice's place) and a per-expert kernel for
the weight gradients (``Σ_r X[in[r]]^T dY[r]`` over 128×128 output tiles, the bias gradient summed in the same pass).
No gradient is accumulated with atomics; per-expert sums (biases, Sub-LN affine) accumulate in fp32.

Tiles follow Hopper's rules (Triton uses wgmma when a tile's M is a multiple of 64 and the warps a multiple of 4):
:func:`gemm_tiles` picks 128×128×64 over 8 warps where the experts' slices fill 128-row blocks and 64×128×64 over 4
warps for small slices (E = 32, short sequences); fp32 inputs multiply in true fp32 (``input_precision="ieee"``, not
TF32). ``tests/moe/test_triton_compile.py`` compiles every variant the layer launches for sm_90 on the CPU and checks
wgmma, register spills and shared memory.

Off by default (``MoEConfig.expert_kernels = "triton"`` turns it on). It runs on CUDA tensors, and on CPU tensors
under Triton's interpreter (``TRITON_INTERPRET=1`` set before this module is imported), which is how the test suite
checks it against the reference path without a GPU.

Shape legend: R rows (sorted choices), S (sub-)tokens, E experts, K input width, N output width, P row blocks.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton

from mmoe.moe.triton_expert_kernels import (
    GELU,
    GELU_GRAD,
    NO_EPILOGUE,
    block_schedule_kernel,
    expert_column_sums_kernel,
    gather_gemm_kernel,
    weight_grad_kernel,
)


def interpreting() -> bool:
    """Whether Triton runs kernels on the CPU (its interpreter)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def usable_on(x: torch.Tensor) -> bool:
    """The kernels run on CUDA tensors, and on CPU tensors under the interpreter."""
    return x.is_cuda or (x.device.type == "cpu" and interpreting())


@dataclass(frozen=True)
class GemmTiles:
    """Tile of the gather/scatter GEMM: ``block_m`` rows of one expert × ``block_n`` output columns, ``block_k`` deep;
    ``group_m`` row blocks share their weight tiles in L2 (the GROUP_M swizzle of Triton's matmul tutorial)."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    group_m: int = 8


@dataclass(frozen=True)
class WeightGradTiles:
    """Tile of the weight-gradient kernel: a ``block_k`` × ``block_n`` output tile of one expert, ``block_m`` rows a
    step."""

    block_k: int
    block_n: int
    block_m: int
    num_warps: int
    num_stages: int


#: 16-bit inputs: wgmma tiles (M a multiple of 64, whole warp groups); shared memory 128 KB and 96 KB at 4 stages.
LARGE_SLICE_TILES = GemmTiles(128, 128, 64, num_warps=8, num_stages=4)
SMALL_SLICE_TILES = GemmTiles(64, 128, 64, num_warps=4, num_stages=4)
#: fp32 inputs multiply on the CUDA cores (exact fp32): smaller tiles keep the four-byte stages in shared memory.
FP32_TILES = GemmTiles(64, 64, 32, num_warps=4, num_stages=3)
WEIGHT_GRAD_TILES = WeightGradTiles(128, 128, 64, num_warps=8, num_stages=3)
FP32_WEIGHT_GRAD_TILES = WeightGradTiles(64, 64, 32, num_warps=4, num_stages=2)


def gemm_tiles(dtype: torch.dtype, num_rows: int, num_experts: int) -> GemmTiles:
    """The GEMM tiles for R = ``num_rows`` sorted rows over E experts: 128-row blocks once the mean slice fills one
    (fewer, larger tiles), else 64-row blocks (less padding in each expert's last block)."""
    if dtype == torch.float32:
        return FP32_TILES
    return LARGE_SLICE_TILES if num_rows >= LARGE_SLICE_TILES.block_m * num_experts else SMALL_SLICE_TILES


def weight_grad_tiles(dtype: torch.dtype) -> WeightGradTiles:
    return FP32_WEIGHT_GRAD_TILES if dtype == torch.float32 else WEIGHT_GRAD_TILES


def input_precision(dtype: torch.dtype) -> str:
    """``tl.dot``'s precision: fp32 operands multiply in fp32 ("ieee"); Triton's default would round them to TF32."""
    return "ieee" if dtype == torch.float32 else "tf32"


def launch(kernel, grid: tuple[int, ...], args: tuple, num_warps: int, num_stages: int, **constexprs) -> None:
    """Every kernel of :mod:`mmoe.moe.triton_expert_kernels` starts here (``tests/moe/test_triton_compile.py``
    records the launches)."""
    kernel[grid](*args, num_warps=num_warps, num_stages=num_stages, **constexprs)


@dataclass
class BlockSchedule:
    """Which expert and first row each of the P row blocks of a dispatch covers, and the tiles it was built for;
    one per dispatch, shared by both linears and their backward.

    Attributes:
        tiles: the GEMM tiles (``tiles.block_m`` rows per block).
        expert_P: (P,) int32, expert E for blocks past the last row.
        row_P: (P,) int32, the block's first sorted row.
    """

    tiles: GemmTiles
    expert_P: torch.Tensor
    row_P: torch.Tensor


def block_schedule(offsets_E: torch.Tensor, num_rows: int, tiles: GemmTiles) -> BlockSchedule:
    """The row blocks of ``num_rows`` rows sorted by expert (slice ends ``offsets_E``), in one launch."""
    num_experts = offsets_E.numel()
    num_blocks = triton.cdiv(num_rows, tiles.block_m) + num_experts
    expert_P = torch.empty(num_blocks, device=offsets_E.device, dtype=torch.int32)
    row_P = torch.empty_like(expert_P)
    block_p = 128
    launch(
        block_schedule_kernel, (triton.cdiv(num_blocks, block_p),),
        (offsets_E, expert_P, row_P, num_experts, num_blocks), num_warps=4, num_stages=1,
        BLOCK_M=tiles.block_m, BLOCK_E=triton.next_power_of_2(num_experts), BLOCK_P=block_p,
    )  # fmt: skip
    return BlockSchedule(tiles, expert_P, row_P)


def gather_gemm(
    x: torch.Tensor,
    weight_EKN: torch.Tensor,
    bias_EN: torch.Tensor | None,
    offsets_E: torch.Tensor,
    schedule: BlockSchedule,
    num_rows: int,
    in_index: torch.Tensor | None = None,
    out_index: torch.Tensor | None = None,
    transpose_weight: bool = False,
    epilogue: int = NO_EPILOGUE,
    pre: torch.Tensor | None = None,
) -> torch.Tensor:
    """(num_rows, N) with row ``out[r]`` = ``x[in[r]] @ W[e(r)] (+ b)``, identity where an index is None;
    ``transpose_weight`` multiplies by ``W[e]^T`` (an input gradient). ``epilogue``: :data:`GELU` also writes the
    pre-activation into ``pre`` (same shape) and returns GELU of it; :data:`GELU_GRAD` multiplies by GELU'(``pre``)."""
    weight = weight_EKN.transpose(1, 2) if transpose_weight else weight_EKN
    num_experts, k_dim, n_dim = weight.shape
    x = x.contiguous()
    y = torch.empty(num_rows, n_dim, device=x.device, dtype=x.dtype)
    tiles = schedule.tiles
    num_blocks_m = schedule.expert_P.numel()
    dummy = offsets_E
    grid = (num_blocks_m * triton.cdiv(n_dim, tiles.block_n),)
    launch(
        gather_gemm_kernel, grid,
        (x, dummy if in_index is None else in_index, weight, dummy if bias_EN is None else bias_EN, y,
         dummy if out_index is None else out_index, y if pre is None else pre, schedule.expert_P, schedule.row_P,
         offsets_E, num_blocks_m, num_experts, k_dim, n_dim,
         x.stride(0), weight.stride(0), weight.stride(1), weight.stride(2), y.stride(0)),
        tiles.num_warps, tiles.num_stages,
        GATHER_IN=in_index is not None, SCATTER_OUT=out_index is not None, HAS_BIAS=bias_EN is not None,
        EPILOGUE=epilogue, INPUT_PRECISION=input_precision(x.dtype), UPCAST=interpreting(),
        BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k, GROUP_M=tiles.group_m,
    )  # fmt: skip
    return y


def weight_grad(
    x: torch.Tensor,
    grad: torch.Tensor,
    offsets_E: torch.Tensor,
    k_dim: int,
    in_index: torch.Tensor | None,
    grad_index: torch.Tensor | None,
    with_bias: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(E, K, N) per-expert ``Σ x[in[r]]^T grad[gi[r]]`` over each expert's slice and, ``with_bias``, (E, N)
    ``Σ grad[gi[r]]``; both fp32."""
    x, grad = x.contiguous(), grad.contiguous()
    num_experts, n_dim = offsets_E.numel(), grad.shape[1]
    tiles = weight_grad_tiles(x.dtype)
    dw = torch.empty(num_experts, k_dim, n_dim, device=x.device, dtype=torch.float32)
    db = torch.empty(num_experts, n_dim, device=x.device, dtype=torch.float32) if with_bias else None
    grid = (triton.cdiv(n_dim, tiles.block_n), triton.cdiv(k_dim, tiles.block_k), num_experts)
    launch(
        weight_grad_kernel, grid,
        (x, offsets_E if in_index is None else in_index, grad, offsets_E if grad_index is None else grad_index, dw,
         dw if db is None else db, offsets_E, k_dim, n_dim, x.stride(0), grad.stride(0)),
        tiles.num_warps, tiles.num_stages,
        GATHER_IN=in_index is not None, GATHER_DY=grad_index is not None, HAS_BIAS=with_bias,
        INPUT_PRECISION=input_precision(x.dtype), UPCAST=interpreting(),
        BLOCK_K=tiles.block_k, BLOCK_N=tiles.block_n, BLOCK_M=tiles.block_m,
    )  # fmt: skip
    return dw, db


def expert_column_sums(a: torch.Tensor, b: torch.Tensor | None, offsets_E: torch.Tensor) -> torch.Tensor:
    """(E, N) fp32 ``Σ_{r in e's slice} a[r] (* b[r])`` over rows sorted by expert."""
    a = a.contiguous()
    b = None if b is None else b.contiguous()
    num_experts, n_dim = offsets_E.numel(), a.shape[1]
    out = torch.empty(num_experts, n_dim, device=a.device, dtype=torch.float32)
    block_n = 128
    launch(
        expert_column_sums_kernel, (triton.cdiv(n_dim, block_n), num_experts),
        (a, a if b is None else b, out, offsets_E, n_dim, a.stride(0), a.stride(0) if b is None else b.stride(0)),
        4, 2, HAS_B=b is not None, BLOCK_M=32, BLOCK_N=block_n,
    )  # fmt: skip
    return out


def gelu_grad(a: torch.Tensor) -> torch.Tensor:
    """GELU'(a) = Φ(a) + a φ(a), elementwise in torch (the Sub-LN backward, where it cannot ride in an epilogue)."""
    return 0.5 * (1.0 + torch.erf(a * (1.0 / math.sqrt(2.0)))) + a * torch.exp(-0.5 * a * a) / math.sqrt(2 * math.pi)


@dataclass
class FusedDispatch:
    """The parts of a :class:`mmoe.moe.dispatch.DispatchPlan` the kernels read, and the block schedule.

    Attributes:
        token_C: the (sub-)token of each sorted row (fc1 gathers its rows through it).
        order_C: the choice (``k * S + s``) of each sorted row (fc2 scatters its rows to it, and so does the input
            gradient before the top-k rows of a token are summed).
        expert_C: the expert of each sorted row.
        offsets_E: int32 slice ends.
        top_k: K, the rows each (sub-)token has; None: rows are not a token's K choices (expert choice: a token has
            0 to E rows, ``order_C`` is the identity), so the input gradient of a token sums its rows by ``token_C``.
        schedule: :func:`block_schedule` of ``offsets_E``.
    """

    token_C: torch.Tensor
    order_C: torch.Tensor
    expert_C: torch.Tensor
    offsets_E: torch.Tensor
    top_k: int | None
    schedule: BlockSchedule


def _sub_ln_affine(normed_CH, ln_weight_EH, ln_bias_EH, expert_C):
    return torch.addcmul(ln_bias_EH.float().index_select(0, expert_C), normed_CH, ln_weight_EH.float()[expert_C])


class FusedExpertFFN(torch.autograd.Function):
    """``y[order[r]] = fc2(GELU(fc1(x[token[r]])))`` of expert e(r), optionally with BEiT-3's Sub-LN before fc2, in
    choice order (the module docstring); returns (K*S, N). The backward returns the gradients of x and of every
    expert parameter; biases and Sub-LN affines get fp32 per-expert sums."""

    @staticmethod
    @torch.amp.custom_fwd(device_type="cuda")
    def forward(ctx, x_SD, fc1_weight, fc1_bias, fc2_weight, fc2_bias, ln_weight, ln_bias, dispatch: FusedDispatch):
        dtype = x_SD.dtype
        num_rows = dispatch.expert_C.numel()
        fc1_w, fc2_w = fc1_weight.to(dtype), fc2_weight.to(dtype)
        schedule, offsets = dispatch.schedule, dispatch.offsets_E
        pre_CH = torch.empty(num_rows, fc1_w.shape[2], device=x_SD.device, dtype=dtype)
        hidden_CH = gather_gemm(x_SD, fc1_w, fc1_bias.to(dtype), offsets, schedule, num_rows,
                                in_index=dispatch.token_C, epilogue=GELU, pre=pre_CH)  # fmt: skip
        fc2_input = hidden_CH
        if ln_weight is not None:
            normed = F.layer_norm(hidden_CH.float(), (hidden_CH.shape[1],))
            fc2_input = _sub_ln_affine(normed, ln_weight, ln_bias, dispatch.expert_C).to(dtype)
        y = gather_gemm(fc2_input, fc2_w, fc2_bias.to(dtype), offsets, schedule, num_rows,
                        out_index=dispatch.order_C)  # fmt: skip
        ctx.save_for_backward(x_SD, fc1_w, fc2_w, pre_CH, hidden_CH, ln_weight, ln_bias)
        ctx.dispatch = dispatch
        ctx.parameter_dtypes = [p.dtype if p is not None else None for p in (fc1_weight, ln_weight)]
        return y

    @staticmethod
    @torch.amp.custom_bwd(device_type="cuda")
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_y):
        x_SD, fc1_w, fc2_w, pre_CH, hidden_CH, ln_weight, ln_bias = ctx.saved_tensors
        dispatch: FusedDispatch = ctx.dispatch
        schedule, offsets, expert_C = dispatch.schedule, dispatch.offsets_E, dispatch.expert_C
        num_rows, dtype = expert_C.numel(), x_SD.dtype
        needs = ctx.needs_input_grad
        # Frozen experts (X-MoE §3.3 fine-tuning) need only the input gradient: no weight-gradient kernel runs.
        x_needs, fc1_needs, fc2_needs, ln_needs = needs[0], needs[1] or needs[2], needs[3] or needs[4], any(needs[5:7])
        grad_y = grad_y.contiguous().to(dtype)
        subln = ln_weight is not None
        grad_fc1_w = grad_fc1_b = grad_fc2_w = grad_fc2_b = grad_ln_w = grad_ln_b = grad_x = None
        if subln:
            normed = F.layer_norm(hidden_CH.float(), (hidden_CH.shape[1],))
        if fc2_needs:
            fc2_input = _sub_ln_affine(normed, ln_weight, ln_bias, expert_C).to(dtype) if subln else hidden_CH
            grad_fc2_w, grad_fc2_b = weight_grad(fc2_input, grad_y, offsets, fc2_w.shape[1], None, dispatch.order_C,
                                                 True)  # fmt: skip
        if x_needs or fc1_needs or ln_needs:
            # dL/d(fc2 input) = dY[order[r]] @ W2^T; without Sub-LN that input is GELU(A): GELU' rides in the epilogue.
            epilogue = NO_EPILOGUE if subln else GELU_GRAD
            grad_in2 = gather_gemm(grad_y, fc2_w, None, offsets, schedule, num_rows, in_index=dispatch.order_C,
                                   transpose_weight=True, epilogue=epilogue, pre=pre_CH)  # fmt: skip
            grad_pre = grad_in2
            if subln:
                if ln_needs:
                    grad_ln_w = expert_column_sums(grad_in2, normed, offsets)
                    grad_ln_b = expert_column_sums(grad_in2, None, offsets)
                grad_normed = grad_in2.float() * ln_weight.float()[expert_C]
                # LayerNorm backward without affine: (dn - mean(dn) - n mean(dn n)) / σ.
                rstd = torch.rsqrt(hidden_CH.float().var(1, unbiased=False, keepdim=True) + 1e-5)
                grad_hidden = rstd * (
                    grad_normed
                    - grad_normed.mean(1, keepdim=True)
                    - normed * (grad_normed * normed).mean(1, keepdim=True)
                )
                grad_pre = (grad_hidden * gelu_grad(pre_CH.float())).to(dtype)
            if fc1_needs:
                grad_fc1_w, grad_fc1_b = weight_grad(x_SD, grad_pre, offsets, fc1_w.shape[1], dispatch.token_C, None,
                                                     True)  # fmt: skip
            if x_needs:
                # Row r's input gradient goes to its choice's place; a token's top-k choices are then summed.
                grad_x = gather_gemm(grad_pre, fc1_w, None, offsets, schedule, num_rows, out_index=dispatch.order_C,
                                     transpose_weight=True)  # fmt: skip
                if dispatch.top_k is None:
                    grad_x = torch.zeros_like(x_SD).index_add_(0, dispatch.token_C, grad_x)
                else:
                    grad_x = grad_x.view(dispatch.top_k, -1, grad_x.shape[1]).sum(0)
        weight_dtype, ln_dtype = ctx.parameter_dtypes

        def cast(grad, to):
            return None if grad is None else grad.to(to)

        weights = [cast(g, weight_dtype) for g in (grad_fc1_w, grad_fc1_b, grad_fc2_w, grad_fc2_b)]
        return grad_x, *weights, cast(grad_ln_w, ln_dtype), cast(grad_ln_b, ln_dtype), None


def fused_expert_ffn(
    x_SD: torch.Tensor,
    fc1_weight: torch.Tensor,
    fc1_bias: torch.Tensor,
    fc2_weight: torch.Tensor,
    fc2_bias: torch.Tensor,
    ln_weight: torch.Tensor | None,
    ln_bias: torch.Tensor | None,
    token_C: torch.Tensor,
    order_C: torch.Tensor,
    expert_C: torch.Tensor,
    offsets_E: torch.Tensor,
    top_k: int | None,
) -> torch.Tensor:
    """The experts on the (sub-)tokens ``x_SD`` (S, D) for the sorted choices of a dispatch; (K*S, D) outputs in
    choice order. Weights are stacked per expert: fc1 (E, D, H), fc2 (E, H, D). ``top_k`` None: the rows are not K
    choices per token (:class:`FusedDispatch`); ``order_C`` then places each row's output."""
    tiles = gemm_tiles(x_SD.dtype, expert_C.numel(), offsets_E.numel())
    schedule = block_schedule(offsets_E, expert_C.numel(), tiles)
    dispatch = FusedDispatch(token_C, order_C, expert_C, offsets_E, top_k, schedule)
    return FusedExpertFFN.apply(x_SD, fc1_weight, fc1_bias, fc2_weight, fc2_bias, ln_weight, ln_bias, dispatch)
