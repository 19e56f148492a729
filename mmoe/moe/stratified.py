"""Stratified Mixture of Experts with dynamic capacity (Xu et al., 2023, §3, Eq. 4-11).

The N experts are split into strata of ``config.strata = [n_1, ..., n_L]`` experts. Gate i sees the E_i experts of
strata i..L (its *visible* experts). Every token starts at gate 1; at gate i (Stratified MoE Eq. 4-7)::

    x' = LN_i(x)                                # Stratified MoE Eq. 4: one LayerNorm per stratum
    G  = gate_i(x')                             # Stratified MoE Eq. 5: softmax(W_i x') over the E_i visible experts
    x  = x + sum_{e in top-2} G_e FFN_e(x')     # Stratified MoE Eq. 6-7

(G may use X-MoE scores instead; the two top-2 weights are renormalised as in the plain top-2 layer unless
``renormalize`` is off, which keeps Eq. 6's raw gate values) and the token
continues at gate stratum(best expert) + 1, leaving once its best expert is in the last stratum; a stratum it skips
adds nothing. So a token makes 1..L FFN passes; the requested capacity RC is the mean number of
passes per token (Stratified MoE §4, "RC").

Each pass reuses the core dispatch (:func:`mmoe.moe.dispatch.plan_dispatch`, :class:`GroupedExperts`,
:func:`combine`) on the tokens at that gate, over the shared expert list. With a capacity factor cf, each expert
takes at most ``ceil(cf * 2 * T_i / E_i)`` choices per pass, T_i the tokens reaching gate i (the paper's 2 T_i / E_i
at cf = 1). Balance loss of gate i: E_i * sum_e f_e p_e over its T_i tokens, f_e counting first choices
(Stratified MoE Eq. 8-10); the layer's loss is the mean over the L gates (Stratified MoE Eq. 11, a gate with no token
counts 0).

The layer carries its own LayerNorms (so a block gives it its input un-normalised) and returns the sum of its
passes' updates, ``x_out - x``, which the block adds to its residual stream like any FFN's output. Gathering the
tokens of each gate reads their count back to the host, one sync per stratum on a GPU.

Shape legend: T tokens (B*L), A tokens at the current gate, K = 2 choices, E experts.
"""

from __future__ import annotations

import torch
from torch import nn

from mmoe.moe.base import MoEFeedForward, RoutingRecord, compute_dtype
from mmoe.moe.config import MoEConfig
from mmoe.moe.dispatch import DispatchPlan, combine, dispatch_rows, plan_dispatch
from mmoe.moe.experts import GroupedExperts
from mmoe.moe.router import Router, RouterOutput


class StratifiedMoELayer(MoEFeedForward):
    """Stratified MoE layer; :func:`mmoe.moe.build_moe_layer` builds one from a ``MoEConfig(..., strata=[...])``.

    A :class:`MoEFeedForward` beside :class:`mmoe.moe.MoELayer` (no multi-head split, no fused kernels, never
    expert-sharded: its passes index the experts with global ids).

    Returns the update ``x_out - x`` (x_out after the last gate, Stratified MoE Eq. 7); the record's ``expert_index``
    holds the choices at the first gate, ``stratum_path`` (B, L, n_strata) each gate's first choice (-1 where
    skipped), ``expert_counts`` every pass.
    """

    def __init__(self, config: MoEConfig) -> None:
        super().__init__()
        if config.strata is None:
            raise ValueError("StratifiedMoELayer needs MoEConfig.strata")
        self.config = config
        strata = config.strata
        self.stratum_start = [sum(strata[:i]) for i in range(len(strata))]
        self.visible_experts = [config.num_experts - start for start in self.stratum_start]
        self.norms = nn.ModuleList(nn.LayerNorm(config.dim, eps=config.layernorm_eps) for _ in strata)
        self.routers = nn.ModuleList(Router(config, num_experts=visible) for visible in self.visible_experts)
        self.experts = GroupedExperts(
            config.num_experts, config.dim, config.expert_dim, config.subln, config.layernorm_eps
        )
        stratum_of_expert = torch.repeat_interleave(torch.arange(len(strata)), torch.tensor(strata))
        self.register_buffer("stratum_of_expert", stratum_of_expert, persistent=False)
        if config.frozen:
            self.routers.requires_grad_(False)
            self.experts.requires_grad_(False)

    def gate_routers(self) -> list[Router]:
        """One router per stratum (gate i of Stratified MoE Eq. 5), in gate order; the first one sees every token."""
        return list(self.routers)

    def _gate_pass(
        self, stratum: int, x_AD: torch.Tensor, capacity_factor: float | None
    ) -> tuple[torch.Tensor, torch.Tensor, RouterOutput, DispatchPlan]:
        """One FFN pass of the A tokens at gate ``stratum`` (Stratified MoE Eq. 4-6): their update before the
        residual, their choices as global expert ids (A, K), the router's output and the dispatch plan."""
        normed_AD = self.norms[stratum](x_AD)  # Stratified MoE Eq. 4
        routed = self.routers[stratum](normed_AD, None)  # Stratified MoE Eq. 5 over the visible experts
        expert_AK = routed.expert_SK + self.stratum_start[stratum]  # local -> global expert ids
        plan = plan_dispatch(
            expert_AK, None, self.config.num_experts, capacity_factor, capacity_experts=self.visible_experts[stratum]
        )
        rows = dispatch_rows(normed_AD.to(compute_dtype(normed_AD)), plan)
        update_AD = combine(
            self.experts(rows, plan.expert_C, plan.offsets_E), plan, routed.weight_SK
        )  # Stratified MoE Eq. 6
        return update_AD, expert_AK, routed, plan

    def forward(self, x: torch.Tensor, padding_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, RoutingRecord]:
        config = self.config
        batch, length, dim = x.shape
        num_strata, num_tokens = len(config.strata), batch * length
        device = x.device
        current_TD = x.reshape(num_tokens, dim)
        valid_T = torch.ones(num_tokens, dtype=torch.bool, device=device)
        if padding_mask is not None:
            valid_T = ~padding_mask.reshape(num_tokens)
        gate_T = torch.where(valid_T, 0, -1)  # the gate each token waits at; -1 = done (or padding)
        first_choices_TK = torch.full((num_tokens, 2), -1, dtype=torch.long, device=device)
        path_TL = torch.full((num_tokens, num_strata), -1, dtype=torch.long, device=device)
        counts_E = torch.zeros(config.num_experts, dtype=torch.long, device=device)
        balance_losses, passes, kept, choices = [], 0, 0, 0
        entropy_sum = z_loss_sum = torch.zeros((), device=device)
        factor = config.active_capacity_factor(self.training)

        for stratum in range(num_strata):
            index_A = (gate_T == stratum).nonzero().squeeze(1)
            tokens_here = index_A.numel()
            if tokens_here == 0:
                balance_losses.append(torch.zeros((), device=device))
                continue
            x_AD = current_TD.index_select(0, index_A)
            update_AD, expert_AK, routed, plan = self._gate_pass(stratum, x_AD, factor)
            # Stratified MoE Eq. 7 (the residual)
            current_TD = current_TD.index_copy(0, index_A, (x_AD + update_AD).to(current_TD.dtype))

            best_stratum_A = self.stratum_of_expert.index_select(0, expert_AK[:, 0])
            next_gate_A = torch.where(best_stratum_A == num_strata - 1, -1, best_stratum_A + 1)
            gate_T = gate_T.index_copy(0, index_A, next_gate_A)
            path_TL[index_A, stratum] = expert_AK[:, 0]
            if stratum == 0:
                kept_choices_AK = torch.where(plan.kept_SK, expert_AK, torch.full_like(expert_AK, -1))
                first_choices_TK[index_A, : expert_AK.shape[1]] = kept_choices_AK
            counts_E += plan.expert_counts_E
            balance_losses.append(routed.balance_loss)  # Stratified MoE Eq. 8-10 with E_i visible experts
            entropy_sum = entropy_sum + routed.entropy * tokens_here
            z_loss_sum = z_loss_sum + routed.z_loss * tokens_here
            passes += tokens_here
            kept += int(plan.kept_SK.sum())
            choices += plan.kept_SK.numel()

        entering = int(valid_T.sum())
        routing = RoutingRecord(
            # Stratified MoE Eq. 11 (alpha is applied by the training task)
            balance_loss=torch.stack(balance_losses).mean(),
            z_loss=z_loss_sum / max(passes, 1),  # ST-MoE Eq. 5 over every pass's routing decision
            expert_counts=counts_E,
            expert_index=first_choices_TK.view(batch, length, 1, 2),
            dropped_fraction=torch.tensor(1.0 - kept / choices if choices else 0.0, device=device),
            requested_capacity=torch.tensor(passes / entering if entering else 1.0, device=device),
            router_entropy=entropy_sum / max(passes, 1),
            stratum_path=path_TL.view(batch, length, num_strata),
        )
        # The passes' residual additions (Eq. 7) feed the next gate's LayerNorm, so they stay inside; the layer
        # returns their total update. (Summing the updates apart would round differently from x_out - x.)
        return current_TD.view(batch, length, dim) - x, routing
