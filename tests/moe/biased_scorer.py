"""A toy router for ``tests/moe/test_add_a_router.py``, written as ``docs/how-to/add_a_router.md`` says a new router
is: one module holding its scorer and everything mmoe asks of it. Scores s_i = h·e_i + b_i (a linear router with a
per-expert bias; made up for the test, no paper)."""

from __future__ import annotations

import torch
from torch import nn

from mmoe.moe import MoEConfig
from mmoe.moe.scorers import Scorer


class BiasedScorer(Scorer):
    """s_i = h·e_i + b_i, the same logits for the gate and the balance loss."""

    label = "Biased linear"

    def __init__(self, config: MoEConfig, num_experts: int) -> None:
        super().__init__(config, num_experts)
        self.weight = nn.Parameter(torch.randn(num_experts, config.head_dim))
        self.bias = nn.Parameter(torch.randn(num_experts))

    def forward(self, x_SD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits_SE = torch.addmm(self.bias.to(x_SD.dtype), x_SD, self.weight.to(x_SD.dtype).t())
        return logits_SE, logits_SE

    def reference_scores(self, x_D: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = torch.stack([x_D @ e + b for e, b in zip(self.weight, self.bias, strict=True)])
        return logits, logits

    @classmethod
    def parameter_count(cls, config: MoEConfig, num_experts: int) -> int:
        return (config.head_dim + 1) * num_experts

    @classmethod
    def flops_per_sub_token(cls, config: MoEConfig, num_experts: int) -> int:
        return 2 * config.head_dim * num_experts
