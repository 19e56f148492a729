"""ReMoE's ReLU gates and their adaptive L1 penalty (Wang, Chen, Zhu, "ReMoE: Fully Differentiable Mixture-of-Experts
with ReLU Routing", ICLR 2025, §3; code: thu-ml/ReMoE, ``ReLURouter`` and its training loop's coefficient update).
The forms and constants below were checked against that code; the paper's section numbers are as recalled, unchecked.

* Gates (§3.1): ``g = ReLU(W_r x)``, the linear scorer's logits through a ReLU; the layer's output is
  ``sum_e g_e FFN_e(x)`` over the experts with ``g_e > 0``, never renormalised. A (sub-)token may use 0 to E experts;
  one whose gates are all zero gets a zero update. The choices are every expert, best gate first, the zero gates
  left empty (the expert id E, :mod:`mmoe.moe.dispatch`): K = E.
* Sparsity penalty (§3.2): ``L_reg = 1/T sum_t ||g(x_t)||_1`` over the T non-padding (sub-)tokens, weighted by a
  coefficient lambda that a controller drives toward the target sparsity ``S_target = 1 - k/E`` (k the config's
  ``top_k``: the experts a (sub-)token uses on average): after each training step
  ``lambda <- lambda * alpha^sign(S_target - S)``, S the share of zero gates in that step (:func:`next_coefficient`,
  run by :mod:`mmoe.runtime.relu_sparsity`). The paper's and the code's lambda_0 = 1e-8, alpha = 1.2.
* Load-balanced penalty (§3.3, the released code's only form): each expert's L1 weighted by its load,
  ``L_reg = sum_e f_e * 1/T sum_t g_e(x_t)`` with ``f_e = E / (k T) * #{t: g_e(x_t) > 0}`` (a constant, no
  gradient): Switch Transformer's balance loss with the ReLU gates in place of the softmax, so crowded experts'
  gates shrink faster. ``relu_l1_balanced: false`` takes the plain L1.

Shape legend: S (sub-)tokens, E experts, K = E choices.
"""

from __future__ import annotations

import math

import torch


def relu_choices(gate_logits_SE: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ReMoE §3.1: (gates g = ReLU(logits), every expert best gate first with the zero gates' choices naming the
    expert id E, their gate values: 0 at the empty choices). Ties among zero gates never matter: they are empty."""
    num_experts = gate_logits_SE.shape[-1]
    gates_SE = torch.relu(gate_logits_SE)
    weight_SK, expert_SK = gates_SE.topk(num_experts, dim=-1)
    expert_SK = torch.where(weight_SK > 0, expert_SK, torch.full_like(expert_SK, num_experts))
    return gates_SE, expert_SK, weight_SK


def l1_penalty(gates_SE: torch.Tensor, weights_S: torch.Tensor, top_k: int, balanced: bool) -> torch.Tensor:
    """ReMoE's L_reg over the rows of weight 1 (padding 0): the mean L1 norm of the gates (§3.2), or, ``balanced``,
    each expert's mean gate weighted by its load ``f_e = E / (k T) * #{t: g_e > 0}`` (§3.3); 0 with no row."""
    rows = weights_S.sum().clamp_min(1.0)
    mean_gate_E = (weights_S @ gates_SE) / rows
    if not balanced:
        return mean_gate_E.sum()
    load_E = (weights_S @ (gates_SE.detach() > 0).to(gates_SE.dtype)) / rows
    return (gates_SE.shape[-1] / top_k * load_E * mean_gate_E).sum()


def target_sparsity(top_k: int, num_experts: int) -> float:
    """ReMoE §3.2: ``S_target = 1 - k/E``, the share of zero gates when a (sub-)token uses k experts on average."""
    return 1.0 - top_k / num_experts


def next_coefficient(coefficient: float, sparsity: float, target: float, multiplier: float) -> float:
    """ReMoE §3.2: ``lambda * alpha^sign(S_target - S)``: up while the gates are denser than the target, down while
    sparser, unchanged on it."""
    return coefficient * multiplier ** math.copysign(1.0, target - sparsity) if sparsity != target else coefficient
