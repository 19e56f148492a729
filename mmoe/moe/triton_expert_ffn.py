"""The autograd Function of the fused expert FFN (:func:`fused_expert_ffn`): the forward and backward passes over the
Triton GEMMs of :mod:`mmoe.moe.triton_experts` (the layout, schedule and kernels are described there).

The forward runs fc1 with GELU in its epilogue and fc2 scattered to each choice's place; the backward reuses the GEMM
for the input gradients (``dY[order[r]] @ W2[e]^T`` with GELU' in its epilogue, then ``dA @ W1^T`` scattered to the
choice's place) and the per-expert kernel for the weight gradients; frozen experts need only the input gradient.

Shape legend: C sorted choices (rows), S (sub-)tokens, D model width, H expert width, E experts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from mmoe.moe.triton_expert_kernels import GELU, GELU_GRAD, NO_EPILOGUE
from mmoe.moe.triton_experts import (
    BlockSchedule,
    block_schedule,
    expert_column_sums,
    gather_gemm,
    gelu_grad,
    gemm_tiles,
    weight_grad,
)


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


def _sub_ln_backward(grad_in2, hidden_CH, normed, pre_CH, ln_weight_EH, expert_C, eps: float):
    """dL/dA from dL/d(fc2 input) through Sub-LN's affine, its LayerNorm and GELU, in fp32, in A's dtype."""
    grad_normed = grad_in2.float() * ln_weight_EH.float()[expert_C]
    # LayerNorm backward without affine: (dn - mean(dn) - n mean(dn n)) / σ.
    rstd = torch.rsqrt(hidden_CH.float().var(1, unbiased=False, keepdim=True) + eps)
    grad_hidden = rstd * (
        grad_normed - grad_normed.mean(1, keepdim=True) - normed * (grad_normed * normed).mean(1, keepdim=True)
    )
    return (grad_hidden * gelu_grad(pre_CH.float())).to(pre_CH.dtype)


def _input_grad(grad_pre, fc1_w, x_SD, dispatch: FusedDispatch):
    """dL/dx: row r's input gradient ``dA[r] @ W1[e]^T`` goes to its choice's place; a token's top-k choices are then
    summed (rows by ``token_C`` where they are not K choices per token)."""
    grad_x = gather_gemm(
        grad_pre,
        fc1_w,
        None,
        dispatch.offsets_E,
        dispatch.schedule,
        dispatch.expert_C.numel(),
        out_index=dispatch.order_C,
        transpose_weight=True,
    )
    if dispatch.top_k is None:
        return torch.zeros_like(x_SD).index_add_(0, dispatch.token_C, grad_x)
    return grad_x.view(dispatch.top_k, -1, grad_x.shape[1]).sum(0)


class FusedExpertFFN(torch.autograd.Function):
    """``y[order[r]] = fc2(GELU(fc1(x[token[r]])))`` of expert e(r), optionally with BEiT-3's Sub-LN before fc2, in
    choice order (the module docstring); returns (K*S, N). The backward returns the gradients of x and of every
    expert parameter; biases and Sub-LN affines get fp32 per-expert sums."""

    @staticmethod
    @torch.amp.custom_fwd(device_type="cuda")
    def forward(
        ctx, x_SD, fc1_weight, fc1_bias, fc2_weight, fc2_bias, ln_weight, ln_bias, eps, dispatch: FusedDispatch
    ):
        dtype = x_SD.dtype
        num_rows = dispatch.expert_C.numel()
        fc1_w, fc2_w = fc1_weight.to(dtype), fc2_weight.to(dtype)
        schedule, offsets = dispatch.schedule, dispatch.offsets_E
        pre_CH = torch.empty(num_rows, fc1_w.shape[2], device=x_SD.device, dtype=dtype)
        hidden_CH = gather_gemm(
            x_SD,
            fc1_w,
            fc1_bias.to(dtype),
            offsets,
            schedule,
            num_rows,
            in_index=dispatch.token_C,
            epilogue=GELU,
            pre=pre_CH,
        )
        fc2_input = hidden_CH
        if ln_weight is not None:
            normed = F.layer_norm(hidden_CH.float(), (hidden_CH.shape[1],), eps=eps)
            fc2_input = _sub_ln_affine(normed, ln_weight, ln_bias, dispatch.expert_C).to(dtype)
        y = gather_gemm(fc2_input, fc2_w, fc2_bias.to(dtype), offsets, schedule, num_rows, out_index=dispatch.order_C)
        ctx.save_for_backward(x_SD, fc1_w, fc2_w, pre_CH, hidden_CH, ln_weight, ln_bias)
        ctx.dispatch, ctx.eps = dispatch, eps
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
            normed = F.layer_norm(hidden_CH.float(), (hidden_CH.shape[1],), eps=ctx.eps)
        if fc2_needs:
            fc2_input = _sub_ln_affine(normed, ln_weight, ln_bias, expert_C).to(dtype) if subln else hidden_CH
            grad_fc2_w, grad_fc2_b = weight_grad(
                fc2_input, grad_y, offsets, fc2_w.shape[1], None, dispatch.order_C, True
            )
        if x_needs or fc1_needs or ln_needs:
            # dL/d(fc2 input) = dY[order[r]] @ W2^T; without Sub-LN that input is GELU(A): GELU' rides in the epilogue.
            epilogue = NO_EPILOGUE if subln else GELU_GRAD
            grad_in2 = gather_gemm(
                grad_y,
                fc2_w,
                None,
                offsets,
                schedule,
                num_rows,
                in_index=dispatch.order_C,
                transpose_weight=True,
                epilogue=epilogue,
                pre=pre_CH,
            )
            grad_pre = grad_in2
            if subln:
                if ln_needs:
                    grad_ln_w = expert_column_sums(grad_in2, normed, offsets)
                    grad_ln_b = expert_column_sums(grad_in2, None, offsets)
                grad_pre = _sub_ln_backward(grad_in2, hidden_CH, normed, pre_CH, ln_weight, expert_C, ctx.eps)
            if fc1_needs:
                grad_fc1_w, grad_fc1_b = weight_grad(
                    x_SD, grad_pre, offsets, fc1_w.shape[1], dispatch.token_C, None, True
                )
            if x_needs:
                grad_x = _input_grad(grad_pre, fc1_w, x_SD, dispatch)
        weight_dtype, ln_dtype = ctx.parameter_dtypes

        def cast(grad, to):
            return None if grad is None else grad.to(to)

        weights = [cast(g, weight_dtype) for g in (grad_fc1_w, grad_fc1_b, grad_fc2_w, grad_fc2_b)]
        return grad_x, *weights, cast(grad_ln_w, ln_dtype), cast(grad_ln_b, ln_dtype), None, None


def fused_expert_ffn(
    x_SD: torch.Tensor,
    fc1_weight: torch.Tensor,
    fc1_bias: torch.Tensor,
    fc2_weight: torch.Tensor,
    fc2_bias: torch.Tensor,
    ln_weight: torch.Tensor | None,
    ln_bias: torch.Tensor | None,
    subln_eps: float,
    token_C: torch.Tensor,
    order_C: torch.Tensor,
    expert_C: torch.Tensor,
    offsets_E: torch.Tensor,
    top_k: int | None,
) -> torch.Tensor:
    """The experts on the (sub-)tokens ``x_SD`` (S, D) for the sorted choices of a dispatch; (K*S, D) outputs in
    choice order. Weights are stacked per expert: fc1 (E, D, H), fc2 (E, H, D); ``subln_eps`` is the Sub-LN's
    epsilon (unused without ``ln_weight``). ``top_k`` None: the rows are not K
    choices per token (:class:`FusedDispatch`); ``order_C`` then places each row's output."""
    tiles = gemm_tiles(x_SD.dtype, expert_C.numel(), offsets_E.numel())
    schedule = block_schedule(offsets_E, expert_C.numel(), tiles)
    dispatch = FusedDispatch(token_C, order_C, expert_C, offsets_E, top_k, schedule)
    weights = (fc1_weight, fc1_bias, fc2_weight, fc2_bias, ln_weight, ln_bias)
    return FusedExpertFFN.apply(x_SD, *weights, subln_eps, dispatch)
