"""The linear scorer of Switch Transformer (Fedus et al., 2022) and GShard (Lepikhin et al., 2021): s_i = h·e_i."""

from __future__ import annotations

import torch
from torch import nn

from mmoe.moe.scorers.base import LayerConfig, Scorer


class LinearScorer(Scorer):
    """Dot-product scores s_i = h·e_i of Switch / GShard; the logits are the scores (gate and balance loss alike)."""

    label = "Switch"

    def __init__(self, config: LayerConfig, num_experts: int) -> None:
        super().__init__(config, num_experts)
        self.weight = nn.Parameter(torch.empty(num_experts, config.head_dim))
        nn.init.normal_(self.weight, std=0.02)

    def forward(self, x_SD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits_SE = x_SD @ self.weight.to(x_SD.dtype).t()
        return logits_SE, logits_SE

    def reference_scores(self, x_D: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = torch.stack([x_D @ e for e in self.weight])
        return logits, logits

    @classmethod
    def parameter_count(cls, config: LayerConfig, num_experts: int) -> int:
        return config.head_dim * num_experts  # MH-MoE Eq. 19 / 22

    @classmethod
    def flops_per_sub_token(cls, config: LayerConfig, num_experts: int) -> int:
        return 2 * config.head_dim * num_experts  # MH-MoE Eq. 12 / 15
