"""Sparse Mixture-of-Experts layers: X-MoE scoring, MH-MoE sub-token routing, sort-based dropless dispatch.

Public API::

    from mmoe.moe import MoEConfig, MoELayer
    layer = MoELayer(MoEConfig(dim=768, ffn_dim=3072, num_experts=8))
    y, routing = layer(x, padding_mask=None)
"""

from mmoe.moe.config import MoEConfig
from mmoe.moe.layer import MoELayer, RoutingRecord, restore_expert_embedding_norm
from mmoe.moe.stratified import StratifiedMoELayer

__all__ = ["MoEConfig", "MoELayer", "RoutingRecord", "StratifiedMoELayer", "restore_expert_embedding_norm"]
