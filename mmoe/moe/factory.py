"""Build the MoE layer a :class:`mmoe.moe.MoEConfig` describes.

The choice is made here, by the caller's factory, rather than inside a layer's ``__new__``: the layers are
siblings (both :class:`mmoe.moe.base.MoEFeedForward`), neither knows the other.
"""

from __future__ import annotations

from mmoe.moe.base import MoEFeedForward
from mmoe.moe.config import MoEConfig
from mmoe.moe.layer import MoELayer
from mmoe.moe.soft_moe import SoftMoELayer
from mmoe.moe.stratified import StratifiedMoELayer


def build_moe_layer(config: MoEConfig) -> MoEFeedForward:
    """A :class:`StratifiedMoELayer` (Xu et al., 2023) when ``config.strata`` is set, a :class:`SoftMoELayer`
    (Puigcerver et al., 2024) with ``routing: soft``, else a :class:`MoELayer` (X-MoE / MH-MoE / top-k, per the
    config's router, gate and heads)."""
    if config.routing == "soft":
        return SoftMoELayer(config)
    if config.strata is not None:
        return StratifiedMoELayer(config)
    return MoELayer(config)
