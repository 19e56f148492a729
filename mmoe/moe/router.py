"""Routers: score (sub-)tokens against experts, pick the top-k, and compute the balance loss.

Scorers, each one module of :mod:`mmoe.moe.scorers` named by ``MoEConfig.router``:

* :class:`mmoe.moe.scorers.LinearScorer` — s_i = h·e_i (Switch Transformer / GShard).
* :class:`mmoe.moe.scorers.XMoEScorer` — X-MoE (Chi et al., 2022) §3.1: s_i = cos(W h, e_i) (X-MoE Eq. 7) with W a
  bias-free projection to d_e dimensions, gated as softmax(s / tau) or sigmoid(s / tau) with a learnable temperature
  tau (X-MoE Eq. 8).

Balance loss (X-MoE Eq. 9, Switch form; MH-MoE Eq. 10 over sub-tokens): ``N * sum_i f_i * P_i``, with f_i the share of
non-padding (sub-)tokens whose *first* choice is expert i and P_i their mean routing probability. For the X-MoE scorer
P is a softmax over s / tau_0 with the fixed tau_0 (= tau's initial value), also when the gate is a sigmoid. DeepSeek's
conventions (every choice counted, per sequence; a sigmoid gate's normalised scores) are in :mod:`mmoe.moe.balance`.

Routing details (the parts of :class:`mmoe.moe.RoutingChoices`, :mod:`mmoe.moe.choices`): Switch Transformer's
router jitter, DeepSeek-V2/V3's group-limited top-k (:mod:`mmoe.moe.group_limited`) and routed scaling factor, LIMoE's
entropy losses (:mod:`mmoe.moe.entropy_losses`), and each (sub-)token's top gate value for V-MoE's batch-priority
routing (:mod:`mmoe.moe.priority`). The jitter (Fedus et al., 2022) is as Switch Transformer's released Mesh
TensorFlow code has it (``moe.py``'s default ``input_jitter`` policy, ``layers.multiplicative_jitter``): in training
only, the router's input, not the experts', times noise uniform in [1 - eps, 1 + eps], eps = 1e-2 there; the paper's
section for it is unchecked, so none is cited.

Global-batch balance loss (Qiu et al., 2025; ``MoEConfig.balance_batch="global"``): in training, with a process group,
f_i is counted over every data-parallel rank's (sub-)tokens (one all-reduce), and each rank's P_i is its share of the
global mean, so the ranks' mean loss is one process's loss on the global batch.

Auxiliary-loss-free balancing (Wang et al., 2024, §3, Eq. 3, Algorithm 1; ``MoEConfig.bias_update_rate > 0``): a
per-expert bias b is added to the gate scores for the top-k selection only; the gate weights are the unbiased scores.
After each optimiser step :meth:`Router.update_selection_bias` moves b by ``u * sign(mean load - load)``, or, with
``bias_update_rule="z_score"`` (MoE-ViE), by ``u * (mean load - load) / std(load)``: the step follows how far each
expert's load is from the mean in units of the loads' spread, instead of only its side.

Top-p routing (Huang et al., 2024; ``MoEConfig.top_p``; :mod:`mmoe.moe.top_p`): each (sub-)token takes its experts in
descending probability until they sum to p; K = the most experts any (sub-)token uses (at most E), the unused
choices the id E (no expert) with weight 0; with ``target_active_experts`` a controller moves p in training; the
dynamic loss is an auxiliary loss.

ReLU gates (ReMoE, Wang et al., 2025; ``gate="relu"``, :mod:`mmoe.moe.relu_routing`): every expert whose gate
ReLU(W_r x) is positive, best first, the rest of the E choices empty; the adaptive L1 penalty, weighted by the
router's ``relu_l1_coefficient`` buffer, is the auxiliary loss ``relu_l1_loss``.

Router z-loss (ST-MoE, Zoph et al., 2022, Eq. 5): ``mean over non-padding rows of (log sum_i exp(x_i))^2`` of the
gate logits x (s / tau for X-MoE), which keeps them small; computed always, weighted by the task's
``z_loss_coefficient`` (0 = off, ST-MoE uses 1e-3). X-MoE's logits are bounded (|s| <= 1), so there it mainly
acts on the learned temperature tau; with the sigmoid gate logsumexp is not the gate's normaliser, but it still
penalises large logits.

Null and zero-computation experts (AdaMoE; MoE++; :mod:`mmoe.moe.null_experts`): the scorer scores E + Z experts, the
top-k is over all of them and so is the balance loss; :func:`mmoe.moe.null_experts.split_choices` turns the
zero-computation choices into the "no expert" id E and hands the copy and constant experts' choices to the layer.
MoE++'s gating residual adds ``W_g`` times the (sub-)token's logits in its previous MoE layer to the gate and balance
logits (X-MoE's scorer: to both s / tau and s / tau_0).

Shape legend: S (sub-)tokens, E experts, K top-k choices, R routing dim.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from mmoe.moe.balance import balance_loss, counted_choices, deepseek_v3_scores, sequence_balance_loss
from mmoe.moe.config import MoEConfig
from mmoe.moe.entropy_losses import entropy_losses
from mmoe.moe.group_limited import group_limited_top_k
from mmoe.moe.null_experts import ZeroComputationChoices, split_choices
from mmoe.moe.relu_routing import l1_penalty, relu_choices
from mmoe.moe.scorers import SCORERS
from mmoe.moe.token_layout import TokenLayout
from mmoe.moe.top_p import TopPThreshold, dynamic_loss


@dataclass
class RouterOutput:
    """What a router decided for S (sub-)tokens.

    Attributes:
        expert_SK: chosen experts, first choice first.
        weight_SK: gate weight of each choice (top-k renormalised to sum to one unless ``renormalize`` is off), times
            the routed scaling factor.
        scores_SE: the gate values of every expert (softmax, sigmoid or ReLU; what expert-choice routing ranks).
        balance_loss: X-MoE Eq. 9 (or DeepSeek's conventions) over the non-padding (sub-)tokens; zero when none.
        z_loss: ST-MoE Eq. 5 over the non-padding (sub-)tokens; zero when there are none.
        entropy: mean entropy of the routing distribution over the non-padding (sub-)tokens (detached, for logs).
        priority_S: the top gate value of each (sub-)token (batch-priority routing's score; V-MoE batch priority).
        auxiliary_losses: the config's further weighted losses by name (LIMoE's entropy losses); empty when none.
        zero_computation: the choices of MoE++'s copy and constant experts (:mod:`mmoe.moe.null_experts`); None
            without zero-computation experts. Their choices, and null experts', are the id E in ``expert_SK``.
        gate_logits_SE: the gate logits (MoE++'s gating residual added), differentiable, for the next MoE layer's
            residual; None unless ``gating_residual``.
    """

    expert_SK: torch.Tensor
    weight_SK: torch.Tensor
    scores_SE: torch.Tensor
    balance_loss: torch.Tensor
    z_loss: torch.Tensor
    entropy: torch.Tensor
    priority_S: torch.Tensor | None = None
    auxiliary_losses: dict[str, torch.Tensor] = field(default_factory=dict)
    zero_computation: ZeroComputationChoices | None = None
    gate_logits_SE: torch.Tensor | None = None


class Router(nn.Module):
    """Scorer + gate + top-k (any k <= E) + balance loss (X-MoE Eq. 7-9; GShard top-2), as the parts of
    :class:`mmoe.moe.RoutingChoices` say."""

    def __init__(self, config: MoEConfig, num_experts: int | None = None) -> None:
        """``num_experts`` overrides the config's (a Stratified MoE gate scores its visible experts only); top-k is
        capped at the number of experts scored."""
        super().__init__()
        self.config = config
        self.gate = config.gate
        num_experts = config.num_experts if num_experts is None else num_experts
        self.top_k = num_experts if config.top_p is not None else min(config.top_k, num_experts)
        self.top_p = None
        if config.top_p is not None:  # Huang et al.'s p, moved toward a target unless the routing is frozen (X-MoE)
            target = None if config.frozen else config.target_active_experts
            self.top_p = TopPThreshold(config.top_p, target, config.top_p_rate)
        self.renormalize = config.renormalize
        self.bias_update_rate = config.bias_update_rate
        self.bias_update_rule = config.bias_update_rule
        self.balance_batch = config.balance_batch
        self.deepseek_v3_scores = config.gate == "sigmoid" and (
            config.balance_choices == "all" or config.balance_batch == "sequence"
        )
        if config.bias_update_rate:
            # b_i of Wang et al. (2024) Eq. 3: moved by update_selection_bias, never by the optimiser; saved in
            # checkpoints.
            self.register_buffer("selection_bias", torch.zeros(num_experts))
        else:
            self.selection_bias = None
        pool = num_experts + config.zero_computation_experts  # AdaMoE / MoE++: the zero-computation experts last
        self.scorer = SCORERS[config.router](config, pool)
        if config.gate == "relu":  # ReMoE's lambda: moved after training steps (mmoe.runtime.relu_sparsity), saved
            self.register_buffer("relu_l1_coefficient", torch.tensor(config.relu_l1_initial))
        self.gate_map = None
        if config.gating_residual:  # MoE++'s W_g: nn.Linear's default initialisation, as the released code's
            self.gate_map = nn.Linear(pool, pool, bias=False)

    def forward(
        self,
        x_SD: torch.Tensor,
        valid_S: torch.Tensor | None,
        layout: TokenLayout | None = None,
        previous_logits_SE: torch.Tensor | None = None,
    ) -> RouterOutput:
        """Route S (sub-)tokens; ``valid_S`` (bool, True = real token) excludes padding from the statistics;
        ``layout`` gives each (sub-)token's sequence and modality (None: one sequence, one modality);
        ``previous_logits_SE``: with ``gating_residual``, the (sub-)tokens' logits in their previous MoE layer
        (None: no residual)."""
        config = self.config
        layout = TokenLayout(batch=1, length=x_SD.shape[0]) if layout is None else layout
        # Routing runs in fp32 even under autocast: top-k choices and the balance loss are sensitive to the rounding
        # of near-tied bf16 logits, and the router costs ~0.1% of the expert FLOPs.
        with torch.autocast(device_type=x_SD.device.type, enabled=False):
            x_SD = x_SD.to(torch.promote_types(x_SD.dtype, torch.float32))
            gate_logits_SE, balance_logits_SE = self._logits(x_SD, previous_logits_SE)
            scores_SE, expert_SK, weight_SK = self._choose(gate_logits_SE, valid_S)
            priority_S = weight_SK[:, 0].detach()  # V-MoE batch priority: the top gate value, before renormalisation
            pool_SK, zero_computation = expert_SK, None  # the balance loss counts the whole pool (AdaMoE)
            if config.zero_computation_experts:
                renormalize = self.top_k > 1 and self.renormalize
                expert_SK, weight_SK, zero_computation = split_choices(expert_SK, weight_SK, config, renormalize)
            elif self.top_k > 1 and self.renormalize:  # GShard; MH-MoE Eq. 2 / 6 and Stratified Eq. 6 keep raw values
                weight_SK = weight_SK / weight_SK.sum(dim=-1, keepdim=True).clamp_min(torch.finfo(weight_SK.dtype).tiny)
            if config.routed_scaling_factor != 1:  # DeepSeek-V2/V3: the routed experts' mix times a constant
                weight_SK = weight_SK * config.routed_scaling_factor
            balance_probs_SE = balance_logits_SE.softmax(dim=-1)
            weights_S, count = _row_weights(balance_probs_SE, valid_S)
            if self.deepseek_v3_scores:  # a sigmoid gate's DeepSeek loss: its own normalised scores (Eq. 18-20)
                affinity_SE, counted_SK = deepseek_v3_scores(balance_logits_SE, self.top_k)
                balance = self._balance_loss(affinity_SE, counted_SK, weights_S, layout)
            else:
                balance = self._balance_loss(balance_probs_SE, pool_SK, weights_S, layout)
            z_loss = (weights_S @ gate_logits_SE.logsumexp(dim=-1).square()) / count  # ST-MoE Eq. 5
            entropy = (weights_S @ torch.special.entr(balance_probs_SE.detach()).sum(-1)) / count
            segment_S = layout.segment_S(x_SD.device)
            auxiliary = entropy_losses(gate_logits_SE, weights_S, segment_S, layout.num_segments, config)
            if config.dynamic_loss_weight > 0:  # Huang et al. (2024) §3.2
                auxiliary["dynamic_loss"] = config.dynamic_loss_weight * dynamic_loss(gate_logits_SE, weights_S, count)
            if self.gate == "relu":
                penalty = l1_penalty(scores_SE, weights_S, self.top_k, config.relu_l1_balanced)
                auxiliary["relu_l1_loss"] = self.relu_l1_coefficient.to(penalty.dtype) * penalty
        carried_SE = gate_logits_SE if self.gate_map is not None else None
        return RouterOutput(
            expert_SK,
            weight_SK,
            scores_SE,
            balance,
            z_loss,
            entropy,
            priority_S,
            auxiliary,
            zero_computation,
            carried_SE,
        )

    def _choose(
        self, gate_logits_SE: torch.Tensor, valid_S: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(gate values of every expert, chosen experts, their gate values) by the gate: ReLU, top-p or top-k."""
        if self.gate == "relu":  # ReMoE: K = E choices, the zero gates' left empty
            scores_SE, expert_SK, weight_SK = relu_choices(gate_logits_SE)
        elif self.top_p is not None:  # Huang et al. (2024): K <= E, the unused choices the id E, weight 0
            scores_SE = gate_logits_SE.softmax(dim=-1)
            expert_SK, weight_SK = self.top_p(scores_SE, valid_S)
        else:
            scores_SE = gate_logits_SE.softmax(dim=-1) if self.gate == "softmax" else gate_logits_SE.sigmoid()
            expert_SK = self._select(scores_SE)
            weight_SK = scores_SE.gather(-1, expert_SK)
        return scores_SE, expert_SK, weight_SK

    def _logits(self, x_SD: torch.Tensor, previous_logits_SE: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """The scorer's (gate, balance) logits of fp32 (sub-)tokens: Switch Transformer's input jitter first (in
        training), MoE++'s gating residual ``W_g G_{j-1}`` added to both after."""
        jitter = self.config.router_jitter
        if self.training and jitter > 0:  # the router's input only
            x_SD = x_SD * torch.empty_like(x_SD).uniform_(1 - jitter, 1 + jitter)
        gate_logits_SE, balance_logits_SE = self.scorer(x_SD)
        if self.gate_map is not None and previous_logits_SE is not None:  # MoE++: G_j = W_j x + W_g G_{j-1}
            residual_SE = self.gate_map(previous_logits_SE.to(gate_logits_SE.dtype))
            gate_logits_SE, balance_logits_SE = gate_logits_SE + residual_SE, balance_logits_SE + residual_SE
        return gate_logits_SE, balance_logits_SE

    def _select(self, scores_SE: torch.Tensor) -> torch.Tensor:
        """The top-k experts by the gate values, plus the loss-free selection bias when set (Wang et al. Eq. 3: the
        bias picks the experts, the unbiased scores weigh them), inside the best groups when grouped (DeepSeek)."""
        if self.selection_bias is not None:
            scores_SE = scores_SE + self.selection_bias.to(scores_SE.dtype)
        config = self.config
        return group_limited_top_k(scores_SE, self.top_k, config.expert_groups, config.top_groups, config.group_score)

    def _balance_loss(self, probs_SE, expert_SK, weights_S, layout: TokenLayout) -> torch.Tensor:
        chosen_SK = counted_choices(expert_SK, self.config.balance_choices)
        if self.balance_batch == "sequence":
            sequence_S = layout.sequence_S(probs_SE.device)
            return sequence_balance_loss(probs_SE, chosen_SK, weights_S, sequence_S, layout.batch)
        global_batch = self.balance_batch == "global" and self.training and dist.is_available()
        global_batch = global_batch and dist.is_initialized() and dist.get_world_size() > 1
        return balance_loss(probs_SE, chosen_SK, weights_S, global_batch)

    @torch.no_grad()
    def update_selection_bias(self, load_E: torch.Tensor) -> None:
        """Wang et al. (2024), Algorithm 1: ``b_i += u * sign(mean_j c_j - c_i)`` for the loads ``load_E`` (choices
        per expert) of one training step; experts above the mean load get a lower bias, those below a higher one.
        The z-score rule (MoE-ViE): ``b_i += u * (mean_j c_j - c_i) / std_j c_j``, the loads' population standard
        deviation; equal loads (std 0) leave the bias as it is."""
        load_E = load_E.to(self.selection_bias)
        error_E = load_E.mean() - load_E
        if self.bias_update_rule == "z_score":
            spread = load_E.std(correction=0)
            step_E = error_E / spread if spread > 0 else torch.zeros_like(error_E)
        else:
            step_E = torch.sign(error_E)
        self.selection_bias.add_(self.bias_update_rate * step_E)


def _row_weights(probs_SE: torch.Tensor, valid_S: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """1 for rows that count, 0 for padding, and their number (at least 1, so that no row gives 0, not NaN)."""
    weights_S = probs_SE.new_ones(probs_SE.shape[0]) if valid_S is None else valid_S.to(probs_SE.dtype)
    return weights_S, weights_S.sum().clamp_min(1.0)
