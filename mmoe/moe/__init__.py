"""Sparse Mixture-of-Experts layers: X-MoE scoring, MH-MoE sub-token routing, sort-based dropless dispatch.

Public API::

    from mmoe.moe import MoEConfig, build_moe_layer
    layer = build_moe_layer(MoEConfig(dim=768, ffn_dim=3072, num_experts=8))  # a MoELayer (StratifiedMoELayer
    y, routing = layer(x, padding_mask=None)                                   # with MoEConfig.strata set)
    first_router = layer.gate_routers()[0]                                     # (none in a SoftMoELayer)

Both layers are :class:`MoEFeedForward` ("any MoE layer"); only a :class:`MoELayer` can be expert-sharded.
"""

from mmoe.moe.base import MoEFeedForward, RoutingRecord
from mmoe.moe.config import MoEConfig, RoutingChoices
from mmoe.moe.experts import GroupedExperts
from mmoe.moe.factory import build_moe_layer
from mmoe.moe.layer import MoELayer, restore_expert_embedding_norm
from mmoe.moe.router import Router
from mmoe.moe.soft_moe import SoftMoELayer
from mmoe.moe.stratified import StratifiedMoELayer

__all__ = [
    "GroupedExperts",
    "MoEConfig",
    "MoEFeedForward",
    "MoELayer",
    "Router",
    "RoutingChoices",
    "RoutingRecord",
    "SoftMoELayer",
    "StratifiedMoELayer",
    "build_moe_layer",
    "restore_expert_embedding_norm",
]
