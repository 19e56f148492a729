"""X-MoE's scorer (Chi et al., 2022, §3.1): s_i = cos(W h, e_i) (X-MoE Eq. 7) with W a bias-free projection to
d_e = ``routing_dim`` dimensions, gated as softmax(s / tau) or sigmoid(s / tau) with a learnable temperature tau
(X-MoE Eq. 8); the balance loss (X-MoE Eq. 9) reads s / tau_0 with the fixed tau_0 (tau's initial value, App. A:
0.3 for softmax gates, 0.07 for sigmoid gates, ``MoEConfig.initial_temperature``)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from mmoe.moe.scorers.base import LayerConfig, Scorer

#: X-MoE §3.1 "Implementation Tips": expert embeddings start at, and are kept at, this L2 norm.
EXPERT_EMBEDDING_NORM = 0.1


class XMoEScorer(Scorer):
    """X-MoE routing scores on a low-dimensional hypersphere (Chi et al., 2022, §3.1, Eq. 7-8).

    Expert embeddings start at L2 norm 0.1 ("Implementation Tips"). The cosine score does not depend on that norm;
    the norm only sets how fast an embedding's angle moves under the optimiser, so it is restored after each
    optimiser step by :func:`mmoe.moe.restore_expert_embedding_norm`, never inside ``forward``.
    """

    label = "X-MoE"

    def __init__(self, config: LayerConfig, num_experts: int) -> None:
        super().__init__(config, num_experts)
        routing_dim, initial_temperature = config.routing_dim, config.initial_temperature
        self.projection = nn.Linear(config.head_dim, routing_dim, bias=False)  # W in X-MoE Eq. 7
        self.expert_embeddings = nn.Parameter(torch.empty(num_experts, routing_dim))  # e_i in X-MoE Eq. 7
        # tau is learned through its logarithm so it stays positive; a (1,) tensor, not a scalar, because FSDP2's
        # fully_shard refuses 0-dim parameters (files with the older scalar still load, see below).
        self.log_temperature = nn.Parameter(torch.full((1,), math.log(initial_temperature)))
        self._register_load_state_dict_pre_hook(_scalar_temperature_as_vector)
        self.register_buffer("balance_temperature", torch.tensor(initial_temperature), persistent=False)  # tau_0
        nn.init.normal_(self.expert_embeddings)
        self.restore_embedding_norm()

    @property
    def temperature(self) -> torch.Tensor:
        return self.log_temperature.exp()

    @torch.no_grad()
    def restore_embedding_norm(self) -> None:
        """Rescale every expert embedding to L2 norm 0.1 (X-MoE §3.1, Implementation Tips)."""
        self.expert_embeddings.mul_(EXPERT_EMBEDDING_NORM / self.expert_embeddings.norm(dim=-1, keepdim=True))

    def forward(self, x_SD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (s / tau for the gate, s / tau_0 for the balance loss), both (S, E) in x's dtype (fp32 or wider)."""
        token_SR = F.normalize(x_SD @ self.projection.weight.to(x_SD.dtype).t(), dim=-1)
        expert_ER = F.normalize(self.expert_embeddings.to(x_SD.dtype), dim=-1)
        cosine_SE = token_SR @ expert_ER.t()  # X-MoE Eq. 7, in [-1, 1]
        return cosine_SE / self.temperature.to(x_SD.dtype), cosine_SE / self.balance_temperature

    def reference_scores(self, x_D: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        projected = self.projection.weight @ x_D  # W h
        cosines = torch.stack([projected @ e / (projected.norm() * e.norm()) for e in self.expert_embeddings])  # Eq. 7
        return cosines / self.log_temperature.exp(), cosines / self.balance_temperature

    @classmethod
    def parameter_count(cls, config: LayerConfig, num_experts: int) -> int:
        return config.head_dim * config.routing_dim + num_experts * config.routing_dim + 1  # W, e_i, tau

    @classmethod
    def flops_per_sub_token(cls, config: LayerConfig, num_experts: int) -> int:
        return 2 * (config.head_dim * config.routing_dim + config.routing_dim * num_experts)  # W h, then e_i


def _scalar_temperature_as_vector(state_dict: dict, prefix: str, *args) -> None:
    """load_state_dict pre-hook: a checkpoint's 0-dim ``log_temperature`` (written before it became (1,)) loads."""
    key = prefix + "log_temperature"
    if key in state_dict and state_dict[key].dim() == 0:
        state_dict[key] = state_dict[key].reshape(1)
