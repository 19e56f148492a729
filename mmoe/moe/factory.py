"""Build the MoE layer a :class:`mmoe.moe.MoEConfig` describes.

The choice is made here, by the caller's factory, rather than inside ``MoELayer.__new__``, so that
:mod:`mmoe.moe.layer` does not import :mod:`mmoe.moe.stratified` (which subclasses it).
"""

from __future__ import annotations

from mmoe.moe.config import MoEConfig
from mmoe.moe.layer import MoELayer
from mmoe.moe.stratified import StratifiedMoELayer


def build_moe_layer(config: MoEConfig) -> MoELayer:
    """A :class:`StratifiedMoELayer` (Xu et al., 2023) when ``config.strata`` is set, else a :class:`MoELayer`
    (X-MoE / MH-MoE / top-k, per the config's router, gate and heads)."""
    if config.strata is not None:
        return StratifiedMoELayer(config)
    return MoELayer(config)
