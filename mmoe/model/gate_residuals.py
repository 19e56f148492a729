"""MoE++'s gating residuals across a multiway backbone (Jin et al., ICLR 2025, §3.3; ``MoEPlan.gating_residual``).

Each MoE layer's router adds ``W_g G_{j-1}`` to its logits, G_{j-1} the (sub-)token's logits in its previous MoE
layer, that layer's residual included (:class:`mmoe.moe.Router`; the released code's ``Router.gate_map`` and the
``gate_residual`` its decoder layers hand on). In a multiway backbone a token's previous MoE layer is the last one
whose FFN it went through: its modality's FFN, or the VL-FFN or shared FFN that served both modalities at once. The
backbone keeps, for each modality present, its tokens' latest logits, (B, L_m, heads, E + Z):

* zeros before the first MoE layer (G_0 = 0: the first layer's logits stay as they are, and its W_g stays in the
  graph with a zero gradient, as data-parallel training needs of every parameter);
* handed on unchanged through dense layers;
* taken from each MoE layer's routing record (``gate_logits``), split back per modality after a joint FFN.

Shape legend: B batch, L_m the modality's tokens, P = E + Z the experts scored.
"""

from __future__ import annotations

import torch

from mmoe.model.config import MODALITIES, MultiwayConfig
from mmoe.moe import RoutingRecord

#: Per modality index (0 vision, 1 language) present, its tokens' logits in their latest MoE layer.
GateResiduals = dict[int, torch.Tensor]


def initial_gate_residuals(config: MultiwayConfig, streams: dict[int, torch.Tensor | None]) -> GateResiduals | None:
    """G_0 = 0 for each modality's tokens in ``streams`` (index -> (B, L_m, D) or None); None unless the backbone's MoE
    plan has gating residuals."""
    plan = config.moe
    if plan is None or not plan.gating_residual:
        return None
    pool = plan.num_experts + plan.zero_computation_experts
    return {
        modality: x.new_zeros(x.shape[0], x.shape[1], plan.heads, pool, dtype=torch.float32)
        for modality, x in streams.items()
        if x is not None
    }


def next_gate_residuals(carried: GateResiduals | None, records: list) -> GateResiduals | None:
    """``carried`` after one block: each modality's logits from the block's MoE records, a joint FFN's split along
    the sequence in modality order (image tokens first), as the block joined them."""
    if carried is None:
        return None
    carried = dict(carried)
    for record in records:
        if not isinstance(record, RoutingRecord) or record.gate_logits is None:
            continue
        if record.modality == "shared":
            order = sorted(carried)
            parts = torch.split(record.gate_logits, [carried[m].shape[1] for m in order], dim=1)
            carried.update(zip(order, parts, strict=True))
        else:
            carried[MODALITIES.index(record.modality)] = record.gate_logits
    return carried


def gate_residual_argument(ffn: torch.nn.Module, carried: GateResiduals | None, modalities: list[int]) -> dict:
    """``{"gate_residual": ...}`` for an MoE FFN with gating residuals, the logits of ``modalities``' tokens joined
    in that order; nothing for a dense FFN, another MoE layer or no carried logits."""
    config = getattr(ffn, "config", None)
    if carried is None or not getattr(config, "gating_residual", False):
        return {}
    return {"gate_residual": torch.cat([carried[m] for m in modalities], dim=1)}
