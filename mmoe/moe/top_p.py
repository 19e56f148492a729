"""Top-p (dynamic) routing (Huang et al., 2024, "Harder Tasks Need More Experts: Dynamic Routing in MoE Models",
ACL 2024, §3) with a controller that holds the mean number of active experts at a target (after DTop-p, arXiv
2512.13996, whose controller drives the threshold p; the rule below is mmoe's own).

Selection (Huang et al. §3.1): P = softmax(W_r x) over the E experts; sort P in descending order (indices I); the
(sub-)token uses the experts I_1..I_t with t the smallest k such that ``sum_{j<=k} P_{I_j} >= p``. The expert whose
probability makes the running sum reach p is included (so is it in the authors' released code, which keeps the
first index past the threshold): expert I_j is used exactly when the experts before it sum to less than p, so the
top expert is always used. The layer's output is ``sum_{e in S} P_e FFN_e(x)`` with the raw probabilities, not
renormalised over the chosen experts (the paper's mix and the released code's: ``MoEConfig.renormalize: false``;
``true`` divides them by their sum instead, a variant).

Dynamic loss (Huang et al. §3.2): the entropy ``-sum_e P_e log P_e`` of each (sub-)token's routing distribution,
averaged over the non-padding (sub-)tokens and minimised with weight ``dynamic_loss_weight`` (the paper's 1e-4), so
that the router cannot flatten P to buy more experts. Returned as ``RouterOutput.auxiliary_losses["dynamic_loss"]``.

Controller (``target_active_experts`` k*): p is a buffer (saved in checkpoints) moved in training only, after each
backward, by ``logit(p) += rate * (k* - m) / k*`` with m the mean number of experts per non-padding (sub-)token that
the router chose since the last move (its training forwards' batches). The step on the logit keeps p inside (0, 1)
and is largest at p = 1/2 where the number of experts is most sensitive to p; the relative error makes ``rate``
independent of the expert count; m grows with p, so the sign is right; and the knob integrates the error (p stops
moving only when m = k*), which a proportional step on p itself would not. DTop-p uses a proportional-integral
controller on p; this integral-only rule is the simplest that holds the target without a steady-state error.

Why after the backward: activation checkpointing runs the forward again during the backward, and that second pass
must route as the first did; the move therefore waits for a gradient hook on the gate weights, which fires after
any recomputation, and is applied at the start of the next training forward. Under data parallelism each rank
measures its own batch and DDP copies rank 0's buffers to every rank at each forward, so all ranks route with one p.
Evaluation routes with the frozen p.

Shape legend: S (sub-)tokens, E experts.
"""

from __future__ import annotations

import torch
from torch import nn

#: p stays in [P_FLOOR, 1 - P_FLOOR]: at 0 or 1 its logit would be infinite and the controller could not return.
P_FLOOR = 1e-6


def top_p_choices(probs_SE: torch.Tensor, p: float | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Huang et al. §3.1: (expert_SK, weight_SK), the experts in descending probability, the unused ones replaced by
    the id E (no expert) with weight 0; the weights are the used experts' probabilities (differentiable). K, at
    most E, is the most experts any of the S (sub-)tokens uses."""
    num_experts = probs_SE.shape[-1]
    sorted_SE, expert_SE = probs_SE.sort(dim=-1, descending=True)
    before_SE = sorted_SE.detach().cumsum(dim=-1) - sorted_SE.detach()  # what the experts ranked above sum to
    used_SE = before_SE < p
    used_SE[:, 0] = True  # the top expert, also for p <= 0 or a rounding of the sums
    expert_SE = torch.where(used_SE, expert_SE, torch.full_like(expert_SE, num_experts))
    weight_SE = torch.where(used_SE, sorted_SE, torch.zeros_like(sorted_SE))
    # Columns no (sub-)token uses are dropped (one host sync): the dispatch then moves K rows per (sub-)token with K
    # the most any of them uses, not E.
    width = max(int(used_SE.sum(dim=-1).max()), 1) if used_SE.numel() else 1
    return expert_SE[:, :width], weight_SE[:, :width]


def dynamic_loss(logits_SE: torch.Tensor, weights_S: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """Huang et al. §3.2, unweighted: the mean over the counted rows (``weights_S`` 1, padding 0; ``count`` their
    number, at least 1) of the routing distribution's entropy, from the log-softmax (a probability that underflows
    to 0 adds 0, not NaN)."""
    log_probs_SE = logits_SE.log_softmax(dim=-1)
    entropy_S = -(log_probs_SE.exp() * log_probs_SE).sum(dim=-1)
    return (weights_S @ entropy_S) / count


def controlled_p(p: torch.Tensor, measured: torch.Tensor, target: float, rate: float) -> torch.Tensor:
    """One controller move: ``logit(p) + rate * (target - measured) / target``, back to a probability in
    [P_FLOOR, 1 - P_FLOOR]."""
    logit = torch.logit(p.clamp(P_FLOOR, 1 - P_FLOOR)) + rate * (target - measured) / target
    return torch.sigmoid(logit).clamp(P_FLOOR, 1 - P_FLOOR)


class TopPThreshold(nn.Module):
    """A router's threshold p (buffer ``p``, saved in checkpoints) and, with a target, its controller.

    Args:
        p: the initial (or, without a target, fixed) threshold.
        target_active_experts: k*, the mean experts per (sub-)token the controller holds; None = p fixed.
        rate: the controller's step on logit(p) per unit of relative error.
    """

    def __init__(self, p: float, target_active_experts: float | None, rate: float) -> None:
        super().__init__()
        self.target = target_active_experts
        self.rate = rate
        # p's float64 bits in an int64 buffer: it follows the module to its device and into checkpoints, but a dtype
        # cast (``.to(torch.bfloat16)``, ``bf16-true``) leaves integer buffers alone, and in bf16 the controller's
        # small steps on p would round away.
        bits = torch.tensor(float(p), dtype=torch.float64).view(torch.int64)
        self.register_buffer("p_bits", bits)
        # Experts chosen and (sub-)tokens counted since the last move (not saved: a resumed run measures anew).
        self.register_buffer("chosen", torch.zeros((), dtype=torch.long), persistent=False)
        self.register_buffer("rows", torch.zeros((), dtype=torch.long), persistent=False)
        self.backward_seen = False

    @property
    def p(self) -> torch.Tensor:
        """The threshold, a float64 0-dim view of ``p_bits`` (writing to it moves p)."""
        return self.p_bits.view(torch.float64)

    def forward(self, probs_SE: torch.Tensor, valid_S: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Choose by the current p (moved first when a backward has closed a measurement), then, in training with a
        target, count this batch's choices and arm the hook that closes the measurement."""
        controlled = self.training and self.target is not None
        if controlled and self.backward_seen:
            self.move()
        expert_SE, weight_SE = top_p_choices(probs_SE, self.p.to(probs_SE.dtype))
        if controlled:
            used_S = (expert_SE < probs_SE.shape[-1]).sum(dim=-1)
            valid = torch.ones_like(used_S) if valid_S is None else valid_S.to(used_S.dtype)
            self.chosen += (valid * used_S).sum()
            self.rows += valid.sum()
            if weight_SE.requires_grad:
                weight_SE.register_hook(self._close_measurement)
        return expert_SE, weight_SE

    def _close_measurement(self, grad: torch.Tensor) -> torch.Tensor:
        self.backward_seen = True
        return grad

    @torch.no_grad()
    def move(self) -> None:
        """Move p toward the target from the choices counted since the last move (none counted: no move)."""
        if self.rows > 0:
            self.p.copy_(controlled_p(self.p, self.chosen.double() / self.rows, self.target, self.rate))
        self.chosen.zero_()
        self.rows.zero_()
        self.backward_seen = False
