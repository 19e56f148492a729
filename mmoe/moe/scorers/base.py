"""What a router's scorer is: one module per way of scoring (sub-)tokens against experts, which declares everything
the rest of mmoe needs of it.

A scorer is built from the layer's :class:`mmoe.moe.MoEConfig` and the number of experts it scores (a Stratified
MoE gate scores its visible experts only). Its ``forward`` gives the gate logits and the balance-loss logits; the
gate, the top-k selection and the losses are the router's (:class:`mmoe.moe.router.Router`). Beside it, the class
says what ``mmoe info`` calls it (:attr:`Scorer.label`), what it costs (:meth:`Scorer.parameter_count`,
:meth:`Scorer.flops_per_sub_token`, read by :mod:`mmoe.moe.cost`) and how one (sub-)token is scored when written
out from its paper's equation (:meth:`Scorer.reference_scores`, what the equivalence tests compare the batched
``forward`` with). Its name in configs is its line in :data:`mmoe.moe.scorers.SCORERS`.
"""

from __future__ import annotations

from typing import ClassVar, Protocol

import torch
from torch import nn


class LayerConfig(Protocol):
    """What scorers read of their layer's config, a :class:`mmoe.moe.MoEConfig` (named here by its fields, since
    the config module imports this package to check a config's ``router``)."""

    heads: int
    head_dim: int
    gate: str
    routing_dim: int
    initial_temperature: float


class Scorer(nn.Module):
    """Scores (sub-)tokens against experts; subclasses are built as ``Scorer(config, num_experts)``."""

    #: How ``mmoe info`` names a backbone routed by this scorer (``"X-MoE"``, ``"Switch"``).
    label: ClassVar[str]

    def __init__(self, config: LayerConfig, num_experts: int) -> None:
        super().__init__()

    def forward(self, x_SD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(gate logits, balance-loss logits), both (S, E) in x's dtype (fp32 or wider: routing runs in fp32)."""
        raise NotImplementedError

    def reference_scores(self, x_D: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(gate logits, balance-loss logits), both (E,), of one (sub-)token, written expert by expert from the
        paper's equation rather than batched: what tests compare :meth:`forward` with."""
        raise NotImplementedError

    @classmethod
    def parameter_count(cls, config: LayerConfig, num_experts: int) -> int:
        """Parameters of one scorer of ``num_experts`` experts in a layer of ``config``."""
        raise NotImplementedError

    @classmethod
    def flops_per_sub_token(cls, config: LayerConfig, num_experts: int) -> int:
        """Forward FLOPs of scoring one (sub-)token against ``num_experts`` experts (a multiply-add counts 2)."""
        raise NotImplementedError
