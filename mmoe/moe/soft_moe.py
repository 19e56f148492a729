"""Soft MoE (Puigcerver, Riquelme, Mustafa, Houlsby, "From Sparse to Soft Mixtures of Experts", ICLR 2024, §2).

Per sequence (each sample of the batch separately, as the paper's groups are), with m tokens X (m x d), n experts
of p slots each and slot parameters Phi (d x n*p), slot s = i*p + j being slot j of expert i::

    L  = normalize(X) (scale * normalize(Phi))   # logits, m x n*p (§2.1 Eq. 1-2 with §2.3's normalisation)
    D  = softmax of L over the m tokens          # dispatch weights, one distribution per slot (§2.1 Eq. 1)
    X~ = D^T X                                   # slot inputs (n*p x d)
    Y~ = f_i(X~ of expert i's p slots)           # expert i on its p slots
    C  = softmax of L over the n*p slots         # combine weights, one distribution per token (§2.1 Eq. 2)
    Y  = C Y~                                    # outputs (m x d)

Normalisation (§2.3, "Normalization"): X and Phi are L2-normalised along d and Phi multiplied by a learned scalar
``scale`` before the logits only; the slots mix the raw X. Checked against the authors' code
(``google-research/vmoe``, ``vmoe/projects/soft_moe/router.py``): ``normalize(x) = x * rsqrt(sum(x**2) + 1e-6)``, the
scale starts at 1 and multiplies whichever of the two is smaller (the same logits), and ``mu`` (Phi) starts from JAX's
``lecun_normal`` on its (d, n, p) array: a normal truncated at two standard deviations with variance 1 / (d * n)
(JAX's fan-in of that shape); done the same here. The paper's own text was not at hand to check the section numbers
against; the equations are those of its Algorithm 1 as the code implements them.

Padding (``padding_mask`` True) is never dispatched: its logits take the dtype's lowest value before the dispatch
softmax and its weights are then zeroed, so a sequence of padding only feeds its slots zeros (no NaN); its outputs
are zero. No token is dropped; there is no balance loss (the authors' code returns a zero auxiliary loss) and no
z-loss (zeros in the record).

Experts run batched: expert i gets the B*p rows of its slots over the batch, a static shape
(:meth:`mmoe.moe.experts.GroupedExperts.forward_batched`). Every token's output depends on every token of its
sequence: not causal (captioning refuses it), but independent of the other samples of the batch.

Shape legend: B batch, L tokens per sequence (m), S slots n*p, E experts (n), P slots per expert (p), D width.
"""

from __future__ import annotations

import torch
from torch import nn

from mmoe.moe.base import MoEFeedForward, RoutingRecord, compute_dtype
from mmoe.moe.config import MoEConfig
from mmoe.moe.experts import GroupedExperts
from mmoe.moe.router import Router

#: vmoe's ``normalize``: x * rsqrt(sum(x**2) + eps).
NORMALIZE_EPS = 1e-6


def inverse_norm(x: torch.Tensor, dim: int) -> torch.Tensor:
    """``1 / sqrt(sum(x**2) + 1e-6)`` along ``dim``, kept: ``x * inverse_norm(x, dim)`` is the authors'
    ``normalize``."""
    return torch.rsqrt(torch.linalg.vector_norm(x, dim=dim, keepdim=True).square() + NORMALIZE_EPS)


def dispatch_weights(logits_BLS: torch.Tensor, valid_BL: torch.Tensor | None) -> torch.Tensor:
    """D: per sequence and slot, a softmax over the real tokens (§2.1 Eq. 1); padding gets exactly 0, and a
    sequence of padding only gets no weight at all (not NaN). ``valid_BL`` None: no padding."""
    if valid_BL is None:
        return torch.softmax(logits_BLS, dim=1)
    lowest = torch.finfo(logits_BLS.dtype).min
    dispatch_BLS = torch.softmax(logits_BLS.masked_fill(~valid_BL[..., None], lowest), dim=1)
    return dispatch_BLS * valid_BL[..., None]


def combine_weights(logits_BLS: torch.Tensor) -> torch.Tensor:
    """C: per token, a softmax over the n*p slots (§2.1 Eq. 2)."""
    return torch.softmax(logits_BLS, dim=-1)


class SoftMoELayer(MoEFeedForward):
    """Soft MoE layer; :func:`mmoe.moe.build_moe_layer` builds one from a ``MoEConfig(..., routing="soft")``.

    Attributes:
        slot_embeddings: Phi, (D, E*P): column ``i*P + j`` is slot j of expert i.
        scale: the learned scalar that multiplies the normalised Phi (§2.3).
        experts: the n experts, each run on its P slots of every sequence.

    The record's ``expert_index`` (B, L, 1, 1) holds the expert of each token's largest combine weight (-1 at
    padding), ``expert_counts`` the slots each expert processed (P per sequence with a real token),
    ``router_entropy`` the mean entropy of the real tokens' combine weights, ``requested_capacity`` 1.
    """

    def __init__(self, config: MoEConfig) -> None:
        super().__init__()
        if config.routing != "soft":
            raise ValueError(f"SoftMoELayer needs MoEConfig.routing='soft', got {config.routing!r}")
        self.config = config
        self.num_slots = config.num_experts * config.slots_per_expert
        self.slot_embeddings = nn.Parameter(torch.empty(config.dim, self.num_slots))
        self.scale = nn.Parameter(torch.ones(()))
        self.experts = GroupedExperts(
            config.num_experts, config.dim, config.expert_dim, config.subln, config.layernorm_eps
        )
        self.reset_slot_embeddings()
        if config.frozen:
            self.requires_grad_(False)

    @torch.no_grad()
    def reset_slot_embeddings(self) -> None:
        """vmoe's ``lecun_normal`` on its (d, n, p) array: truncated at +-2 sigma, variance 1 / (d * n)."""
        std = (self.config.dim * self.config.num_experts) ** -0.5 / 0.87962566103423978  # JAX's truncation factor
        nn.init.trunc_normal_(self.slot_embeddings, std=std, a=-2 * std, b=2 * std)
        self.scale.fill_(1.0)

    def gate_routers(self) -> list[Router]:
        """None: Soft MoE has slots, not a router that picks experts per token."""
        return []

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """L = normalize(X) (scale * normalize(Phi)), (B, L, S), in float32 at least (§2.3). Computed as
        (X Phi') / |X| with Phi' = Phi * scale / |Phi|: the same logits, the token norms applied to the (B, L, S)
        product rather than to X, one elementwise pass fewer over the wider of the two."""
        dtype = torch.promote_types(x.dtype, torch.float32)
        phi = self.slot_embeddings.to(dtype)
        phi = phi * (self.scale.to(dtype) * inverse_norm(phi, dim=0))
        x = x.to(dtype)
        return (x @ phi) * inverse_norm(x, dim=-1)

    def forward(self, x: torch.Tensor, padding_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, RoutingRecord]:
        """Args:
            x: (B, L, D) tokens.
            padding_mask: (B, L) bool, True = padding: never dispatched, output zero.

        Returns:
            ``(y, routing)`` with y of x's shape, in the compute dtype (the autocast dtype under autocast).
        """
        batch, length, dim = x.shape
        valid_BL = None if padding_mask is None else ~padding_mask
        logits_BLS = self.logits(x)
        dispatch_BLS, combine_BLS = dispatch_weights(logits_BLS, valid_BL), combine_weights(logits_BLS)
        dtype = compute_dtype(x)
        slots_BSD = dispatch_BLS.transpose(1, 2).to(dtype) @ x.to(dtype)
        outputs_BSD = self.run_experts(slots_BSD)
        y = (combine_BLS.to(dtype) @ outputs_BSD).to(dtype)
        if valid_BL is None:
            valid_BL = x.new_ones((batch, length), dtype=torch.bool)
        else:
            y = torch.where(valid_BL[..., None], y, torch.zeros_like(y))
        return y, self._record(combine_BLS.detach(), valid_BL)

    def run_experts(self, slots_BSD: torch.Tensor) -> torch.Tensor:
        """Expert i on the B*P rows of its slots over the batch, all experts in one batched GEMM per linear."""
        batch, _, dim = slots_BSD.shape
        experts, per_expert = self.config.num_experts, self.config.slots_per_expert
        rows = slots_BSD.view(batch, experts, per_expert, dim).transpose(0, 1).reshape(-1, dim)
        out = self.experts.forward_batched(rows)
        return out.view(experts, batch, per_expert, dim).transpose(0, 1).reshape(batch, experts * per_expert, dim)

    def _record(self, combine_BLS: torch.Tensor, valid_BL: torch.Tensor) -> RoutingRecord:
        config = self.config
        device = combine_BLS.device
        top_expert_BL = combine_BLS.argmax(dim=-1) // config.slots_per_expert
        expert_index = torch.where(valid_BL, top_expert_BL, torch.full_like(top_expert_BL, -1))
        fed_sequences = valid_BL.any(dim=1).sum()
        counts_E = (fed_sequences * config.slots_per_expert).expand(config.num_experts).clone()
        entropy_BL = torch.special.entr(combine_BLS).sum(-1)
        real = valid_BL.sum().clamp_min(1)
        zero = torch.zeros((), device=device)
        return RoutingRecord(
            balance_loss=zero,
            z_loss=zero.clone(),
            expert_counts=counts_E,
            expert_index=expert_index.view(*valid_BL.shape, 1, 1),
            dropped_fraction=zero.clone(),
            requested_capacity=torch.ones((), device=device),
            router_entropy=(entropy_BL * valid_BL).sum() / real,
            token_mask=valid_BL,
        )
