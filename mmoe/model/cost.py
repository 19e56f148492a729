"""Closed-form parameter counts, active parameters and forward FLOPs per token of a :class:`MultiwayTransformer`
(checked against the module and BEiT-3's table).

BEiT-3 base as released (multiway attention, 12 layers, 768 wide, FFN 3072): 170.29M parameters in the layers and
220.99M with a 64,010-token vocabulary, 1,024 text positions and 199 vision position rows (unilm/beit3 README).

Per token (a token of one modality; the two modality paths have the same shapes): the layer's attention way (pre-LN,
q/k/v, Sub-LN, output projection), its pre-FFN LayerNorm and its FFN (dense, or a MoE layer's active part: MH-MoE
App. D, :mod:`mmoe.moe.cost`). FLOPs count a multiply-add as 2 and cover the weights; the attention scores
(QK^T and the weighted sum of V, 4 L D per token and layer over a sequence of L tokens) are reported apart, since they
depend on L. A VL-FFN (``vl_layers``) serves image + text input in place of the modality FFN, with the same count.
With MoMa's modality-aware pools (``MoEPlan.experts_by_modality``) the two modality paths differ in their experts: a
layer's parameters count each pool, and the per-token numbers are the least and the most over the modalities, each
modality's own under ``by_modality``.
"""

from __future__ import annotations

import os
from dataclasses import replace

from mmoe.model.config import MODALITIES, MultiwayConfig
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
        one_ffn = moe_parameter_count(config.moe.layer_config(dim, config.ffn_dim, config.subln))  # also the VL-FFN
        modalities = ["shared"] if config.moe.mode == "shared" else MODALITIES
        ffns = sum(
            moe_parameter_count(config.moe.layer_config(dim, config.ffn_dim, config.subln, modality))
            for modality in modalities
        )
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


def refuse_beyond_host_memory(config: MultiwayConfig) -> None:
    """Refuse a backbone whose float32 parameters alone exceed this host's physical memory, before any is allocated
    (a pool of a million experts would otherwise end in the allocator's error, after a traceback)."""
    try:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, OSError, ValueError):  # no sysconf here: nothing to compare with
        return
    parameters = backbone_parameters(config)
    if 4 * parameters > memory:
        raise ValueError(
            f"MultiwayConfig: {parameters:,} parameters need {4 * parameters / 2**30:,.0f} GiB in float32, more than "
            f"this host's {memory / 2**30:,.0f} GiB of memory: use fewer or narrower experts (moe.num_experts, "
            "moe.experts_by_modality, moe.beta) or a smaller backbone"
        )


def attention_way_parameters(config: MultiwayConfig) -> int:
    """One attention way: pre-LN, fused q/k/v, Sub-LN, output projection."""
    dim = config.dim
    return 2 * dim + 3 * dim * dim + 3 * dim + (2 * dim if config.subln else 0) + dim * dim + dim


def layer_cost(config: MultiwayConfig, index: int) -> dict:
    """Layer ``index``: its parameters, and the active parameters and forward FLOPs (weights) of one token.

    ``active_parameters_per_token`` / ``flops_per_token`` are what every token takes; the ``max_`` fields are the
    most one token can take, which differ in a Stratified MoE layer (a token passes gate 1, then up to all gates:
    Stratified MoE §3), in a top-p layer with a target (the expected experts at the target; up to every expert: Huang
    et al., 2024) and between modalities whose pools differ (``MoEPlan.experts_by_modality``; each modality's
    numbers then under ``by_modality``).
    """
    attention = attention_way_parameters(config), 2 * 4 * config.dim * config.dim  # q, k, v and output projections
    is_moe = config.moe is not None and config.moe.is_moe_layer(index)
    pooled = is_moe and config.moe.experts_by_modality is not None
    by_modality = {modality: _ffn_cost(config, index, modality) for modality in MODALITIES}
    least = min(cost[0] for cost in by_modality.values()), min(cost[1] for cost in by_modality.values())
    most = max(cost[2] for cost in by_modality.values()), max(cost[3] for cost in by_modality.values())
    cost = {
        "index": index,
        "ffn": "moe" if is_moe else "dense",
        "parameters": layer_parameters(config, index),
        "active_parameters_per_token": attention[0] + least[0],
        "flops_per_token": attention[1] + least[1],
        "max_active_parameters_per_token": attention[0] + most[0],
        "max_flops_per_token": attention[1] + most[1],
    }
    if pooled:
        cost["by_modality"] = {
            modality: {
                "experts": config.moe.experts_of(modality),
                "active_parameters_per_token": attention[0] + active,
                "flops_per_token": attention[1] + flops,
            }
            for modality, (active, flops, _, _) in by_modality.items()
        }
    return cost


def _ffn_cost(config: MultiwayConfig, index: int, modality: str) -> tuple[int, int, int, int]:
    """One ``modality`` token's pre-FFN LayerNorm and FFN at layer ``index``: (least active parameters, least
    FLOPs, most active parameters, most FLOPs)."""
    dim = config.dim
    if config.moe is None or not config.moe.is_moe_layer(index):
        dense = dense_ffn_parameters(config) + 2 * dim, ffn_flops_per_token(dim, config.ffn_dim)
        return *dense, *dense
    moe = config.moe.layer_config(dim, config.ffn_dim, config.subln, modality)
    if moe.strata is not None:  # the layer's own LayerNorms replace the block's pre-FFN LayerNorm
        least = active_parameters_per_token(moe, gates=[0]), flops_per_token(moe, gates=[0])
        return *least, active_parameters_per_token(moe), flops_per_token(moe)
    routed = active_parameters_per_token(moe) + 2 * dim, flops_per_token(moe)
    if moe.target_active_experts is not None:  # top-p: the expected value at the target; a token may use every expert
        every = replace(moe, target_active_experts=None)
        return *routed, active_parameters_per_token(every) + 2 * dim, flops_per_token(every)
    return *routed, *routed


def backbone_cost(config: MultiwayConfig, sequence_length: int) -> dict:
    """Every layer's :func:`layer_cost` and the backbone's totals for a sequence of ``sequence_length`` tokens:
    parameters (:func:`backbone_parameters`), active parameters per token (the layers and the final LayerNorm; as
    MH-MoE App. D, the embedding tables are left out), forward FLOPs per token in the weights and in the attention
    scores; with modality pools, each modality's token under ``by_modality``."""
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
    if config.moe is not None and config.moe.experts_by_modality is not None:
        totals["by_modality"] = {
            modality: {
                key: final_norm * ("active" in key)
                + sum(layer.get("by_modality", {}).get(modality, layer)[key] for layer in layers)
                for key in ("active_parameters_per_token", "flops_per_token")
            }
            for modality in MODALITIES
        }
    return {
        "layers": layers,
        "parameters": backbone_parameters(config),
        **totals,
        "attention_score_flops_per_token": config.depth * 4 * sequence_length * config.dim,
        "sequence_length": sequence_length,
    }
