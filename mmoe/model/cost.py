"""Closed-form parameter count of a :class:`MultiwayTransformer` (checked against the module and BEiT-3's table).

BEiT-3 base as released (multiway attention, 12 layers, 768 wide, FFN 3072): 170.29M parameters in the layers and
220.99M with a 64,010-token vocabulary, 1,024 text positions and 199 vision position rows (unilm/beit3 README).
"""

from __future__ import annotations

from mmoe.model.config import MultiwayConfig
from mmoe.moe.cost import moe_parameter_count


def dense_ffn_parameters(config: MultiwayConfig) -> int:
    dim, ffn = config.dim, config.ffn_dim
    return 2 * dim * ffn + ffn + dim + (2 * ffn if config.subln else 0)


def layer_parameters(config: MultiwayConfig, index: int) -> int:
    dim = config.dim
    ways = 2 if config.attention == "multiway" else 1
    attention = ways * (2 * dim + 3 * dim * dim + 3 * dim + (2 * dim if config.subln else 0) + dim * dim + dim)
    if config.moe is not None and config.moe.is_moe_layer(index):
        one_ffn = moe_parameter_count(config.moe.layer_config(dim, config.ffn_dim, config.subln))
        ffns = one_ffn * (1 if config.moe.mode == "shared" else 2)
    else:
        one_ffn = dense_ffn_parameters(config)
        ffns = 2 * one_ffn
    # A Stratified MoE has its own LayerNorms in place of the block's pre-FFN LayerNorms.
    stratified = config.moe is not None and config.moe.strata is not None and config.moe.is_moe_layer(index)
    norm = 0 if stratified else 2 * dim
    vision_language = norm + one_ffn if index >= config.depth - config.vl_layers else 0
    return attention + 2 * norm + ffns + vision_language


def backbone_parameters(config: MultiwayConfig) -> int:
    dim = config.dim
    embeddings = (
        config.in_channels * config.patch_size**2 * dim
        + dim  # patch embedding
        + 2 * dim  # CLS and mask tokens
        + (config.position_offset + config.num_patches + 1) * dim
        + config.vocab_size * dim
        + config.max_text_positions * dim
    )
    layers = sum(layer_parameters(config, i) for i in range(config.depth))
    return embeddings + layers + 2 * 2 * dim  # + final multiway LayerNorm
