"""Closed-form parameter counts, active parameters and forward FLOPs per token of a :class:`MultiwayTransformer`
(checked against the module and BEiT-3's table).

BEiT-3 base as released (multiway attention, 12 layers, 768 wide, FFN 3072): 170.29M parameters in the layers and
220.99M with a 64,010-token vocabulary, 1,024 text positions and 199 vision position rows (unilm/beit3 README).

Per token (a token of one modality; the two modality paths have the same shapes): the layer's attention way (pre-LN,
q/k/v, Sub-LN, output projection), its pre-FFN LayerNorm and its FFN (dense, or a MoE layer's active part: MH-MoE
App. D, :mod:`mmoe.moe.cost`). FLOPs count a multiply-add as 2 and cover the weights; the attention scores
(QK^T and the weighted sum of V, 4 L D per token and layer over a sequence of L tokens) are reported apart, since they
depend on L. A VL-FFN (``vl_layers``) serves image + text input in place of the modality FFN, with the same count.
"""

from __future__ import annotations

from mmoe.model.config import MultiwayConfig
from mmoe.moe.cost import active_parameters_per_token, flops_per_token, moe_parameter_count


def ffn_parameters(dim: int, ffn_dim: int, subln: bool) -> int:
    """One dense FFN ``dim -> ffn_dim -> dim``: both linears with biases, and BEiT-3's Sub-LN before the second."""
    return 2 * dim * ffn_dim + ffn_dim + dim + (2 * ffn_dim if subln else 0)


def ffn_flops_per_token(dim: int, ffn_dim: int) -> int:
    """Forward FLOPs of one token through a dense FFN's weights (a multiply-add counted as 2)."""
    return 4 * dim * ffn_dim


def dense_ffn_parameters(config: MultiwayConfig) -> int:
    """One dense FFN of the backbone (:func:`ffn_parameters` at its width)."""
    return ffn_parameters(config.dim, config.ffn_dim, config.subln)


def layer_parameters(config: MultiwayConfig, index: int) -> int:
    dim = config.dim
    ways = 2 if config.attention == "multiway" else 1
    attention = ways * attention_way_parameters(config)
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
    return embeddings + layers + (2 * 2 * dim if config.output_norm else 0)  # + final multiway LayerNorm


def attention_way_parameters(config: MultiwayConfig) -> int:
    """One attention way: pre-LN, fused q/k/v, Sub-LN, output projection."""
    dim = config.dim
    return 2 * dim + 3 * dim * dim + 3 * dim + (2 * dim if config.subln else 0) + dim * dim + dim


def layer_cost(config: MultiwayConfig, index: int) -> dict:
    """Layer ``index``: its parameters, and the active parameters and forward FLOPs (weights) of one token.

    ``active_parameters_per_token`` / ``flops_per_token`` are what every token takes; the ``max_`` fields are the
    most one token can take, which differ only in a Stratified MoE layer (a token passes gate 1, then up to all
    gates: Stratified MoE §3).
    """
    dim = config.dim
    attention = attention_way_parameters(config), 2 * 4 * dim * dim  # q, k, v and output projections
    is_moe = config.moe is not None and config.moe.is_moe_layer(index)
    if not is_moe:
        # pre-FFN LayerNorm and FFN
        dense = dense_ffn_parameters(config) + 2 * dim, ffn_flops_per_token(dim, config.ffn_dim)
        least = most = dense
    elif config.moe.strata is not None:  # the layer's own LayerNorms replace the block's pre-FFN LayerNorm
        moe = config.moe.layer_config(dim, config.ffn_dim, config.subln)
        least = active_parameters_per_token(moe, gates=[0]), flops_per_token(moe, gates=[0])
        most = active_parameters_per_token(moe), flops_per_token(moe)
    else:
        moe = config.moe.layer_config(dim, config.ffn_dim, config.subln)
        least = most = active_parameters_per_token(moe) + 2 * dim, flops_per_token(moe)
    return {
        "index": index,
        "ffn": "moe" if is_moe else "dense",
        "parameters": layer_parameters(config, index),
        "active_parameters_per_token": attention[0] + least[0],
        "flops_per_token": attention[1] + least[1],
        "max_active_parameters_per_token": attention[0] + most[0],
        "max_flops_per_token": attention[1] + most[1],
    }


def backbone_cost(config: MultiwayConfig, sequence_length: int) -> dict:
    """Every layer's :func:`layer_cost` and the backbone's totals for a sequence of ``sequence_length`` tokens:
    parameters (:func:`backbone_parameters`), active parameters per token (the layers and the final LayerNorm; as
    MH-MoE App. D, the embedding tables are left out), forward FLOPs per token in the weights and in the attention
    scores."""
    layers = [layer_cost(config, index) for index in range(config.depth)]
    final_norm = 2 * config.dim if config.output_norm else 0
    totals = {
        key: sum(layer[key] for layer in layers) + (final_norm if "active" in key else 0)
        for key in (
            "active_parameters_per_token",
            "flops_per_token",
            "max_active_parameters_per_token",
            "max_flops_per_token",
        )
    }
    return {
        "layers": layers,
        "parameters": backbone_parameters(config),
        **totals,
        "attention_score_flops_per_token": config.depth * 4 * sequence_length * config.dim,
        "sequence_length": sequence_length,
    }
