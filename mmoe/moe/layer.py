"""The MoE layer that replaces an FFN, and the routing record every forward returns.

Forward of :class:`MoELayer` (one dispatch path for every variant; they differ in scoring and shape only):

1. MH-MoE (Wu et al., 2024, §3.1, Eq. 3-4): multi-head linear D -> D, then a contiguous reshape of each token into
   h sub-tokens of width D/h; the padding mask is repeated per head. Skipped for h = 1.
2. Route every (sub-)token (:mod:`mmoe.moe.router`: X-MoE Eq. 7-9 or a linear scorer).
3. Sort the choices by expert and run each expert on its contiguous slice (:mod:`mmoe.moe.dispatch`,
   :mod:`mmoe.moe.experts`), then combine with the gate weights (MH-MoE Eq. 6 without its residual: Algorithm 1 and
   the public code have none, the block's residual is outside the layer), and add the shared experts' outputs
   (DeepSeekMoE, Dai et al., 2024, §3.2, Eq. 9: every (sub-)token passes through them with weight 1).
   MoE++'s copy and constant experts (:mod:`mmoe.moe.null_experts`), chosen by the router but never dispatched, add
   their weighted outputs after the combine.
   Expert-choice routing (Zhou et al., 2022, :mod:`mmoe.moe.expert_choice`) replaces this step: each expert takes
   its top-C (sub-)tokens, and the outputs are summed back with their gate values.
4. MH-MoE: merge the sub-tokens back in head order and apply the merge linear D -> D (MH-MoE Eq. 7-9).

Shape legend: B batch, L sequence, D width, S (sub-)tokens = B*L*h, K top-k, E experts.
"""

from __future__ import annotations

import math
import warnings

import torch
import torch.distributed as dist
from torch import nn
from torch.profiler import record_function

from mmoe.moe.base import MoEFeedForward, RoutingRecord, compute_dtype
from mmoe.moe.config import MoEConfig
from mmoe.moe.dispatch import combine, combine_unsorted, dispatch_rows
from mmoe.moe.expert_choice import combine_expert_choice, plan_expert_choice
from mmoe.moe.expert_parallel import ExpertShard, exchange
from mmoe.moe.experts import GroupedExperts
from mmoe.moe.null_experts import ZeroComputationExperts
from mmoe.moe.priority import plan_token_dispatch
from mmoe.moe.router import Router, RouterOutput
from mmoe.moe.scorers import XMoEScorer
from mmoe.moe.token_layout import TokenLayout


class MoELayer(MoEFeedForward):
    """Sparse Mixture-of-Experts FFN (top-k, X-MoE, MH-MoE): ``y, routing = layer(x, padding_mask)``.

    :func:`mmoe.moe.build_moe_layer` builds this layer, or a :class:`mmoe.moe.stratified.StratifiedMoELayer` (another
    :class:`MoEFeedForward`, not a subclass of this one) when ``config.strata`` is set. Every MoE layer returns the
    update the block adds to its residual stream. Only this layer can be expert-sharded (:meth:`shard_experts`).

    Args:
        config: the layer's :class:`MoEConfig`.
    """

    def __init__(self, config: MoEConfig) -> None:
        super().__init__()
        if config.strata is not None:
            raise ValueError(
                f"MoELayer got MoEConfig.strata={config.strata!r}: "
                "build a Stratified layer with mmoe.moe.build_moe_layer"
            )
        self.config = config
        self._warned_kernels = False
        #: Set by :meth:`shard_experts`: E/W experts here, rows travel by all-to-all; None: every expert here.
        self.shard: ExpertShard | None = None
        if config.heads > 1:
            # MH-MoE App. E: multi-head layer xavier-uniform with gain 1/sqrt(2) and default bias; merge layer
            # xavier-uniform with zero bias.
            self.multi_head = nn.Linear(config.dim, config.dim)
            self.merge = nn.Linear(config.dim, config.dim)
            nn.init.xavier_uniform_(self.multi_head.weight, gain=1 / math.sqrt(2))
            nn.init.xavier_uniform_(self.merge.weight)
            nn.init.zeros_(self.merge.bias)
        else:
            self.multi_head = self.merge = None
        self.router = Router(config)
        self.experts = GroupedExperts(
            config.num_experts, config.head_dim, config.expert_dim, config.subln, config.layernorm_eps
        )
        #: DeepSeekMoE's always-on experts (§3.2); never expert-sharded (every rank runs them on its own tokens).
        self.shared_experts = (
            GroupedExperts(
                config.shared_experts, config.head_dim, config.expert_dim, config.subln, config.layernorm_eps
            )
            if config.shared_experts
            else None
        )
        #: MoE++'s copy and constant experts (:mod:`mmoe.moe.null_experts`), added here without the dispatch.
        cheap = config.copy_experts or config.constant_experts
        self.zero_computation = ZeroComputationExperts(config) if cheap else None
        if config.frozen:
            self.router.requires_grad_(False)
            self.experts.requires_grad_(False)
            for cheap_experts in (self.shared_experts, self.zero_computation):
                if cheap_experts is not None:
                    cheap_experts.requires_grad_(False)

    def use_fused_kernels(self, x: torch.Tensor) -> bool:
        """``expert_kernels: triton`` and a device the kernels run on; otherwise a one-time warning (the reference
        path then runs)."""
        if self.config.expert_kernels != "triton":
            return False
        try:
            from mmoe.moe.triton_experts import usable_on
        except ImportError as error:  # a torch build without Triton
            reason = f"Triton is not installed ({error})"
        else:
            if usable_on(x):
                return True
            reason = f"{x.device.type} tensors take the reference path"
        if not self._warned_kernels:
            self._warned_kernels = True
            message = "MoEConfig.expert_kernels='triton' runs on CUDA tensors (or under TRITON_INTERPRET=1); "
            warnings.warn(message + reason, stacklevel=2)
        return False

    def shard_experts(self, group: dist.ProcessGroup) -> ExpertShard:
        """Keep on this rank only its E/W experts and route the rows through ``group`` (W ranks) from now on; returns
        the shard. Expert gradients are scaled by 1/W; checkpoints still hold every expert
        (:mod:`mmoe.moe.expert_parallel`). ValueError (one line) for sizes that do not divide."""
        shard = ExpertShard.of_group(group, self.config.num_experts)
        self.experts.keep_shard(shard)
        self.shard = shard
        return shard

    def gate_routers(self) -> list[Router]:
        """The layer's routers in the order a token meets them: the one router here, one per stratum (gate) in a
        Stratified MoE layer. The first one sees every (sub-)token."""
        return [self.router]

    def forward(
        self,
        x: torch.Tensor,
        padding_mask: torch.Tensor | None = None,
        segment_lengths: list[int] | None = None,
        gate_residual: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, RoutingRecord]:
        """Args:
            x: (B, L, D) tokens.
            padding_mask: (B, L) bool, True = padding; padding neither counts nor changes other tokens.
            segment_lengths: the lengths of the modalities the sequence is made of, in order (a shared FFN's image
                and text tokens), for LIMoE's per-modality entropy losses; None = one modality.
            gate_residual: (B, L, heads, E + Z): each (sub-)token's logits in its previous MoE layer (MoE++'s
                ``gating_residual``; that layer's record's ``gate_logits``); None = none.

        Returns:
            ``(y, routing)`` with y of x's shape and dtype (the autocast dtype under autocast).
        """
        config = self.config
        batch, length, dim = x.shape
        heads = config.heads
        if self.multi_head is not None:
            x = self.multi_head(x)  # MH-MoE Eq. 3
        x_SD = x.reshape(batch * length * heads, config.head_dim)  # MH-MoE Eq. 4: contiguous split into sub-tokens
        valid_S = None
        if padding_mask is not None:
            valid_S = (~padding_mask).reshape(batch * length, 1).expand(-1, heads).reshape(-1)

        # The record_function labels name the phases in profiles (benchmarks/moe_layer.py, expert_parallel.py sum them).
        with record_function("mmoe.moe.route"):
            previous = () if gate_residual is None else (gate_residual.reshape(x_SD.shape[0], -1),)  # MoE++
            routed = self.router(x_SD, valid_S, TokenLayout(batch, length, heads, segment_lengths), *previous)
        if config.routing == "expert_choice":
            y_SD, counts_E, expert_index_SK, dropped, unrouted = self._expert_choice(x_SD, valid_S, routed)
            balance_loss = torch.zeros((), device=x.device)  # balanced by construction: every expert takes C
        else:
            y_SD, counts_E, expert_index_SK, dropped = self._token_choice(x_SD, valid_S, routed)
            balance_loss, unrouted = routed.balance_loss, None
            if self.zero_computation is not None:  # MoE++'s copy and constant experts: O(D) per (sub-)token
                y_SD = self.zero_computation(y_SD, x_SD.to(y_SD.dtype), routed.zero_computation, valid_S)

        if self.shared_experts is not None:
            y_SD = y_SD + self._shared_experts(x_SD, valid_S)  # DeepSeekMoE Eq. 9
        y = y_SD.reshape(batch, length, dim)  # MH-MoE Eq. 7-8: sub-tokens merged back in head order
        if self.merge is not None:
            y = self.merge(y)  # MH-MoE Eq. 9
        routing = RoutingRecord(
            balance_loss=balance_loss,
            z_loss=routed.z_loss,
            expert_counts=counts_E,
            expert_index=expert_index_SK.view(batch, length, heads, expert_index_SK.shape[-1]),
            dropped_fraction=dropped,
            requested_capacity=torch.ones((), device=x.device),
            router_entropy=routed.entropy,
            unrouted_fraction=unrouted,
            token_mask=x.new_ones((batch, length), dtype=torch.bool) if padding_mask is None else ~padding_mask,
            auxiliary_losses=routed.auxiliary_losses,
            gate_logits=None if routed.gate_logits_SE is None else routed.gate_logits_SE.view(batch, length, heads, -1),
        )
        return y, routing

    def _shared_experts(self, x_SD: torch.Tensor, valid_S: torch.Tensor | None) -> torch.Tensor:
        """DeepSeekMoE's always-on experts on every (sub-)token, summed; nothing for padding."""
        with record_function("mmoe.moe.shared_experts"):
            shared_SD = self.shared_experts.forward_every_expert(x_SD.to(compute_dtype(x_SD)))
            if valid_S is not None:  # padding gets nothing from any expert
                shared_SD = torch.where(valid_S[:, None], shared_SD, torch.zeros_like(shared_SD))
            return shared_SD

    def _token_choice(self, x_SD: torch.Tensor, valid_S: torch.Tensor | None, routed: RouterOutput):
        """Each (sub-)token's top-k experts, sorted dispatch: (y, expert counts, expert index, dropped fraction)."""
        config = self.config
        with record_function("mmoe.moe.plan"):
            priority_S = routed.priority_S if config.capacity_priority == "batch_priority" else None  # V-MoE §4.1
            plan = plan_token_dispatch(
                routed.expert_SK, priority_S, valid_S, config.num_experts, config.active_capacity_factor(self.training)
            )
        if self.shard is None and not config.may_choose_no_expert and self.use_fused_kernels(x_SD):
            with record_function("mmoe.moe.experts"):
                y_CD = self.experts.forward_fused(x_SD.to(compute_dtype(x_SD)), plan)
            with record_function("mmoe.moe.combine"):
                y_SD = combine_unsorted(y_CD, plan, routed.weight_SK)
        else:
            with record_function("mmoe.moe.permute"):
                rows_CD = dispatch_rows(x_SD.to(compute_dtype(x_SD)), plan)
            if config.may_choose_no_expert:
                y_CD = self._run_chosen_rows(rows_CD, plan)
            else:
                y_CD = self._run_experts(rows_CD, plan.expert_C, plan.offsets_E)
            with record_function("mmoe.moe.combine"):
                y_SD = combine(y_CD, plan, routed.weight_SK)
        expert_index_SK = torch.where(plan.kept_SK, routed.expert_SK, torch.full_like(routed.expert_SK, -1))
        return y_SD, plan.expert_counts_E, expert_index_SK, plan.dropped_fraction

    def _run_chosen_rows(self, rows_CD: torch.Tensor, plan) -> torch.Tensor:
        """The experts on the rows of real choices only, zeros for the choices of no expert (an adaptive router's,
        sorted last by the plan): the experts' work follows the experts chosen. Reads the row count on the host (the
        rows' number changes from batch to batch)."""
        used = int(plan.offsets_E[-1])
        y_CD = self._run_experts(rows_CD[:used], plan.expert_C[:used], plan.offsets_E)
        return torch.cat([y_CD, y_CD.new_zeros(rows_CD.shape[0] - used, y_CD.shape[-1])])

    def _expert_choice(self, x_SD: torch.Tensor, valid_S: torch.Tensor | None, routed: RouterOutput):
        """Each expert's top-C (sub-)tokens (Zhou et al., 2022): (y, expert counts, expert index, dropped fraction 0,
        unrouted fraction). The rows go through the experts as a token-choice plan's do (fused where that runs), as
        E slices of exactly C rows."""
        with record_function("mmoe.moe.plan"):
            plan = plan_expert_choice(routed.scores_SE, valid_S, self.config.active_capacity_factor(self.training))
        x_SD = x_SD.to(compute_dtype(x_SD))
        if self.shard is None and self.use_fused_kernels(x_SD):
            with record_function("mmoe.moe.experts"):
                y_CD = self.experts.forward_fused_rows(x_SD, plan.token_C, plan.expert_C, plan.offsets_E)
        else:
            with record_function("mmoe.moe.permute"):
                rows_CD = x_SD.index_select(0, plan.token_C)
            y_CD = self._run_experts(rows_CD, plan.expert_C, plan.offsets_E, plan.capacity)
        with record_function("mmoe.moe.combine"):
            y_SD = combine_expert_choice(y_CD, plan, x_SD.shape[0])
        dropped = torch.zeros((), device=x_SD.device)
        return y_SD, plan.expert_counts_E, plan.expert_index_SE, dropped, plan.unrouted_fraction

    def _run_experts(
        self,
        rows_CD: torch.Tensor,
        expert_C: torch.Tensor,
        offsets_E: torch.Tensor,
        rows_per_expert: int | None = None,
    ) -> torch.Tensor:
        """The experts on rows sorted by expert: here, or through the expert-parallel exchange when sharded.
        ``rows_per_expert``: every expert's slice has this many rows (a static shape)."""
        if self.shard is not None:
            return exchange(rows_CD, offsets_E, self.shard, self.experts)
        with record_function("mmoe.moe.experts"):
            return self.experts(rows_CD, expert_C, offsets_E, rows_per_expert)


@torch.no_grad()
def restore_expert_embedding_norm(module: nn.Module) -> None:
    """Rescale every X-MoE expert embedding in ``module`` back to L2 norm 0.1 (X-MoE §3.1, Implementation Tips).

    Training tasks call this after each optimiser step; the cosine scores do not depend on the norm, which only sets
    how fast the embeddings' angles move.
    """
    for submodule in module.modules():
        if isinstance(submodule, XMoEScorer):
            submodule.restore_embedding_norm()
