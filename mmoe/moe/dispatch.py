"""Sort-based token dispatch: group routed choices by expert, optionally enforce a capacity, combine back.

Dropless by default: every choice of every (sub-)token is sorted by expert so that each expert runs on one
contiguous slice; outputs are gathered back through the inverse permutation (on a CPU: summed onto their tokens by
one weighted ``embedding_bag``) and summed with the gate weights. No ``S x E x C`` one-hot tensor is ever built, and
nothing here reads a tensor back to the host, so the path has no host-device sync.

Both row moves are permutations of the K*S choices. On a GPU each one's backward is a gather through the other
permutation (:class:`_PermutedRows`), not the scatter-add that ``index_select``'s backward would run: that atomic
``index_add_`` in bf16 took as long as both expert GEMMs together (H100, 16K tokens, d 768; benchmarks/moe_layer.py).
On a CPU, where ``index_add_`` runs without atomics, the dispatch's backward for K > 1 adds each row's gradient onto
its (sub-)token instead: one pass over the K*S rows into an (S, D) result, where the gather wrote a (K*S, D)
temporary and summed it again (for K = 1 the gather writes the result itself and stays).

Shapes stay static: padding rows and choices dropped by the capacity remain in their expert's slice with a zero
combine weight (they add nothing and get no gradient), so the row count is always ``K * S``.

Capacity (GShard): expert e keeps at most ``C = ceil(cf * K * T / E)`` choices, T the non-padding (sub-)tokens;
first choices come before second choices, then earlier tokens before later ones.

No expert: an adaptive router (top-p, ReLU gates, null experts) leaves some of a (sub-)token's K choices empty by
choosing the id ``E`` (one past the last expert). Those choices sort after every real expert's slice, so the rows the
experts run are the first ``offsets_E[-1]``; they are neither kept, nor counted, nor dropped.

Shape legend: S (sub-)tokens, K choices per token, C = K*S choices, E experts, D width.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class DispatchPlan:
    """Where each routed choice goes.

    Attributes:
        order_C: choice indices (rank-major: ``k * S + s``) sorted by expert, stable.
        inverse_C: the inverse permutation: the sorted row of each choice.
        token_C: the (sub-)token of each sorted row.
        expert_C: the expert of each sorted row (non-decreasing).
        offsets_E: int32 cumulative row counts per expert (slice ends), for grouped GEMMs.
        kept_SK: bool, True where a choice is computed and combined (not padding, not dropped).
        expert_counts_E: long, kept choices per expert.
        dropped_fraction: share of non-padding choices dropped by the capacity (0 when dropless).
    """

    order_C: torch.Tensor
    inverse_C: torch.Tensor
    token_C: torch.Tensor
    expert_C: torch.Tensor
    offsets_E: torch.Tensor
    kept_SK: torch.Tensor
    expert_counts_E: torch.Tensor
    dropped_fraction: torch.Tensor


def plan_dispatch(
    expert_SK: torch.Tensor,
    valid_S: torch.Tensor | None,
    num_experts: int,
    capacity_factor: float | None,
    capacity_experts: int | None = None,
) -> DispatchPlan:
    """Sort the choices ``expert_SK`` by expert and decide which are kept.

    Args:
        expert_SK: chosen expert of every choice, ids in ``[0, num_experts]``; ``num_experts`` is no expert.
        valid_S: bool, True = real (sub-)token; None = all real.
        num_experts: E, the experts the ids index.
        capacity_factor: None = dropless; else each expert keeps ``ceil(cf * K * T / capacity_experts)`` choices.
        capacity_experts: the experts the capacity is spread over (default E; a Stratified MoE gate spreads it over
            its visible experts only).
    """
    num_tokens, top_k = expert_SK.shape
    device = expert_SK.device
    expert_flat_C = expert_SK.t().reshape(-1)  # rank-major: all first choices, then all second choices
    # Sort keys in as few bits as E needs: CUDA's sort (a stable radix sort, for every integer dtype) reads only the
    # key's bits, 8 instead of 64 for E <= 256 (MegaBlocks sorts with an end bit of ceil(log2 E)); the CPU sort is
    # stable for these dtypes too. The sorted ids go back to expert_SK's dtype, so the plan's tensors do not change.
    # E + 1 ids: the id E is "no expert" (module docstring).
    key_C, order_C = torch.sort(expert_flat_C.to(sort_key_dtype(num_experts + 1)), stable=True)
    expert_C = key_C.to(expert_SK.dtype)
    token_C = order_C % num_tokens
    inverse_C = torch.empty_like(order_C).scatter_(0, order_C, torch.arange(order_C.numel(), device=device))
    experts_E = torch.arange(num_experts, device=device)
    offsets_E = torch.searchsorted(expert_C, experts_E, right=True, out_int32=True)  # slice ends of the sorted ids

    valid_SK = torch.ones_like(expert_SK, dtype=torch.bool) if valid_S is None else valid_S[:, None].expand(-1, top_k)
    valid_SK = valid_SK & (expert_SK < num_experts)  # a choice of no expert is no choice
    if capacity_factor is None:
        kept_SK = valid_SK
    else:
        valid_sorted_C = valid_SK.t().reshape(-1).index_select(0, order_C).long()
        # Position of each valid choice within its expert's slice, counting valid choices only.
        valid_before_C = valid_sorted_C.cumsum(0) - valid_sorted_C
        valid_per_expert_E = expert_C.new_zeros(num_experts + 1).index_add_(0, expert_C, valid_sorted_C)
        slice_start_E = valid_per_expert_E.cumsum(0) - valid_per_expert_E
        position_C = valid_before_C - slice_start_E.index_select(0, expert_C)
        num_valid = valid_S.sum() if valid_S is not None else expert_SK.new_full((), num_tokens)
        spread = num_experts if capacity_experts is None else capacity_experts
        capacity = torch.ceil(num_valid.double() * (capacity_factor * top_k / spread))
        kept_sorted_C = (position_C < capacity) & valid_sorted_C.bool()
        kept_flat_C = torch.empty_like(kept_sorted_C).scatter_(0, order_C, kept_sorted_C)
        kept_SK = kept_flat_C.view(top_k, num_tokens).t()

    kept_flat_C = kept_SK.t().reshape(-1)
    expert_counts_E = experts_E.new_zeros(num_experts + 1).index_add_(0, expert_flat_C, kept_flat_C.long())
    expert_counts_E = expert_counts_E[:num_experts]
    num_valid_choices = valid_SK.sum()
    dropped = (num_valid_choices - kept_flat_C.sum()).float()
    dropped_fraction = dropped / num_valid_choices.clamp_min(1).float()
    return DispatchPlan(order_C, inverse_C, token_C, expert_C, offsets_E, kept_SK, expert_counts_E, dropped_fraction)


def sort_key_dtype(num_experts: int) -> torch.dtype:
    """The narrowest integer dtype that holds the expert ids ``[0, num_experts)``."""
    if num_experts <= 256:
        return torch.uint8
    if num_experts <= 32767:
        return torch.int16
    return torch.int32


class _PermutedRows(torch.autograd.Function):
    """Rows ``rows_C`` of ``source`` (N rows), where ``rows_C = order_C % N`` for a permutation ``order_C`` of the
    C = tiles * N rows of ``source`` tiled ``tiles`` times; ``inverse_C`` is the inverse of ``order_C``, so the backward
    gathers instead of scatter-adding (on a CPU with ``tiles > 1`` it adds the rows onto their sources, module
    docstring)."""

    @staticmethod
    def forward(ctx, source_ND: torch.Tensor, rows_C: torch.Tensor, inverse_C: torch.Tensor, tiles: int):
        ctx.save_for_backward(rows_C, inverse_C)
        ctx.tiles = tiles
        return source_ND.index_select(0, rows_C)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_CD: torch.Tensor):
        rows_C, inverse_C = ctx.saved_tensors
        if grad_CD.device.type == "cpu" and ctx.tiles > 1:
            sources = rows_C.numel() // ctx.tiles
            return grad_CD.new_zeros(sources, grad_CD.shape[-1]).index_add_(0, rows_C, grad_CD), None, None, None
        grad_CD = grad_CD.index_select(0, inverse_C)
        if ctx.tiles > 1:
            grad_CD = grad_CD.view(ctx.tiles, -1, grad_CD.shape[-1]).sum(0)
        return grad_CD, None, None, None


def dispatch_rows(x_SD: torch.Tensor, plan: DispatchPlan) -> torch.Tensor:
    """The (sub-)token row of every choice in expert order: ``x_SD[plan.token_C]``, (K*S, D)."""
    top_k = plan.kept_SK.shape[1]
    return _PermutedRows.apply(x_SD, plan.token_C, plan.inverse_C, top_k)


def combine(y_CD: torch.Tensor, plan: DispatchPlan, weight_SK: torch.Tensor) -> torch.Tensor:
    """Sum each (sub-)token's expert outputs weighted by its gate weights (zero where not kept).

    On a GPU the sort is undone by a gather (no atomic scatter-add, module docstring). On a CPU each (sub-)token's K
    sorted rows form one bag of a weighted-sum ``embedding_bag`` (its K rows ``inverse_C``, its K gate weights as the
    per-sample weights): one pass over the K*S rows and no (K*S, D) temporary, where weighting the rows, then adding
    them onto their tokens, wrote and read one (benchmarks/moe_layer.py, docs/moe_layer_speed.md)."""
    if y_CD.device.type == "cuda":
        return combine_unsorted(_PermutedRows.apply(y_CD, plan.inverse_C, plan.order_C, 1), plan, weight_SK)
    num_tokens, top_k = weight_SK.shape
    kept_weight_SK = torch.where(plan.kept_SK, weight_SK, torch.zeros_like(weight_SK)).to(y_CD.dtype)
    sorted_row_SK = plan.inverse_C.view(top_k, num_tokens).t().contiguous()
    # .to: under an autocast that runs embedding_bag in another dtype, the output keeps y_CD's.
    return F.embedding_bag(sorted_row_SK, y_CD, mode="sum", per_sample_weights=kept_weight_SK).to(y_CD.dtype)


def combine_unsorted(y_CD: torch.Tensor, plan: DispatchPlan, weight_SK: torch.Tensor) -> torch.Tensor:
    """Sum each (sub-)token's expert outputs weighted by its gate weights (zero where not kept); ``y_CD`` already in
    choice order (all first choices, then all second choices), as the fused kernels write it."""
    top_k = weight_SK.shape[1]
    num_tokens = weight_SK.shape[0]
    weight_KS1 = torch.where(plan.kept_SK, weight_SK, torch.zeros_like(weight_SK)).t().to(y_CD.dtype)[..., None]
    if top_k == 1:
        return y_CD * weight_KS1.view(num_tokens, 1)
    # One product and one sum over the K choices rather than a loop over y[k]: each slice's backward would write a
    # full-size (K, S, D) zero gradient (K of them, measured 10 % of a top-4 layer's step on the CPU).
    return (y_CD.view(top_k, num_tokens, y_CD.shape[-1]) * weight_KS1).sum(0)
