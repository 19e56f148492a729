"""Expert FFNs with the row permutations fused into the GEMMs (ScatterMoE-style), as Triton kernels: their tiles,
block schedule and launches; the kernels themselves are in :mod:`mmoe.moe.triton_expert_kernels`, the autograd
Function over them (:func:`mmoe.moe.triton_expert_ffn.fused_expert_ffn`) in :mod:`mmoe.moe.triton_expert_ffn`.

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
import triton

from mmoe.moe.triton_expert_kernels import (
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
