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
modality's own under ``by_modality``. A Soft MoE layer's FLOPs per token depend on the m tokens it mixes
(:func:`mmoe.moe.cost.soft_moe_flops_per_token`, :func:`soft_moe_tokens`): ``mmoe info`` counts an image FFN at the
image's tokens (patches + CLS), a text FFN at the text length it reports, and a shared FFN or VL-FFN at the whole
image-text sequence.

A depth-routed layer (Mixture-of-Depths, ``MultiwayConfig.depth_routing``) adds its router (D -> 1, with a bias) to
the parameters; an image patch's FLOPs there are expected values: the router's 2 D plus the kept share
ceil(C n) / n of the block's FLOPs (under the layer's ``depth_routing`` and, summed, ``by_modality["vision"]``); the
CLS and the text run every layer as before.
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
    router = config.dim + 1 if index in config.depth_routed_layers() else 0
    return attention + 2 * norm + ffns + vision_language + router


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


def soft_moe_tokens(config: MultiwayConfig, modality: str, sequence_length: int, shared: bool) -> int:
    """m, the tokens a Soft MoE FFN mixes per sequence in a sequence of ``sequence_length`` tokens (image tokens
    first): a shared FFN or VL-FFN (``shared``) all of them; a vision FFN the image's patches and CLS; a language FFN
    the rest (all of them when the sequence is shorter than an image: text alone)."""
    image = config.num_patches + 1
    if shared:
        return sequence_length
    if modality == "vision":
        return image
    return sequence_length - image if sequence_length > image else sequence_length


def layer_cost(config: MultiwayConfig, index: int, sequence_length: int | None = None) -> dict:
    """Layer ``index``: its parameters, and the active parameters and forward FLOPs (weights) of one token.

    ``active_parameters_per_token`` / ``flops_per_token`` are what every token takes; the ``max_`` fields are the
    most one token can take, which differ in a Stratified MoE layer (a token passes gate 1, then up to all gates:
    Stratified MoE §3), in a top-p layer with a target (the expected experts at the target; up to every expert: Huang
    et al., 2024) and between modalities whose pools differ (``MoEPlan.experts_by_modality``; each modality's
    numbers then under ``by_modality``). ``sequence_length``: the image-text sequence a Soft MoE layer's count
    assumes (:func:`soft_moe_tokens`); None = an image and a 64-token text.
    """
    attention = attention_way_parameters(config), 2 * 4 * config.dim * config.dim  # q, k, v and output projections
    is_moe = config.moe is not None and config.moe.is_moe_layer(index)
    pooled = is_moe and config.moe.experts_by_modality is not None
    length = config.num_patches + 1 + 64 if sequence_length is None else sequence_length
    by_modality = {modality: _ffn_cost(config, index, modality, length) for modality in MODALITIES}
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
    if index in config.depth_routed_layers():
        vision = by_modality["vision"]
        cost["depth_routing"] = _patch_cost(config, attention[0] + vision[0], attention[1] + vision[1])
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


def _patch_cost(config: MultiwayConfig, active: int, flops: int) -> dict:
    """An image patch's expected cost in a depth-routed layer whose block takes ``active`` parameters and ``flops``
    FLOPs per token: the router on every patch, the block on the kept share ceil(C n) / n of them."""
    patches = config.num_patches
    share = config.depth_routing.kept(patches) / patches
    router = config.dim + 1
    return {
        "capacity": config.depth_routing.capacity,
        "kept_share": share,
        "router_parameters": router,
        "patch_active_parameters_per_token": router + share * active,
        "patch_flops_per_token": 2 * config.dim + share * flops,
    }


def _modality_totals(layers: list[dict], modality: str, final_norm: int) -> dict:
    """One ``modality`` token's totals over ``layers``: its pool's numbers where the layer has pools, an image
    patch's expected numbers in a depth-routed layer, the layer's otherwise."""
    totals = {}
    for key in ("active_parameters_per_token", "flops_per_token"):
        total = final_norm * ("active" in key)
        for layer in layers:
            if modality == "vision" and "depth_routing" in layer:
                total += layer["depth_routing"][f"patch_{key}"]
            else:
                total += layer.get("by_modality", {}).get(modality, layer)[key]
        totals[key] = total
    return totals


def _ffn_cost(config: MultiwayConfig, index: int, modality: str, length: int) -> tuple[int, int, int, int]:
    """One ``modality`` token's pre-FFN LayerNorm and FFN at layer ``index`` in a sequence of ``length`` tokens:
    (least active parameters, least FLOPs, most active parameters, most FLOPs)."""
    dim = config.dim
    if config.moe is None or not config.moe.is_moe_layer(index):
        dense = dense_ffn_parameters(config) + 2 * dim, ffn_flops_per_token(dim, config.ffn_dim)
        return *dense, *dense
    moe = config.moe.layer_config(dim, config.ffn_dim, config.subln, modality)
    if moe.strata is not None:  # the layer's own LayerNorms replace the block's pre-FFN LayerNorm
        least = active_parameters_per_token(moe, gates=[0]), flops_per_token(moe, gates=[0])
        return *least, active_parameters_per_token(moe), flops_per_token(moe)
    shared = config.moe.mode == "shared" or index >= config.depth - config.vl_layers
    tokens = soft_moe_tokens(config, modality, length, shared) if moe.routing == "soft" else None
    routed = active_parameters_per_token(moe) + 2 * dim, flops_per_token(moe, tokens=tokens)
    if moe.target_active_experts is not None:  # top-p: the expected value at the target; a token may use every expert
        every = replace(moe, target_active_experts=None)
        return *routed, active_parameters_per_token(every) + 2 * dim, flops_per_token(every)
    return *routed, *routed


def backbone_cost(config: MultiwayConfig, sequence_length: int) -> dict:
    """Every layer's :func:`layer_cost` and the backbone's totals for a sequence of ``sequence_length`` tokens:
    parameters (:func:`backbone_parameters`), active parameters per token (the layers and the final LayerNorm; as
    MH-MoE App. D, the embedding tables are left out), forward FLOPs per token in the weights and in the attention
    scores; with modality pools or depth routing, each modality's token under ``by_modality`` (an image patch's
    expected numbers with depth routing)."""
    layers = [layer_cost(config, index, sequence_length) for index in range(config.depth)]
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
    pooled = config.moe is not None and config.moe.experts_by_modality is not None
    if pooled or config.depth_routing is not None:
        totals["by_modality"] = {modality: _modality_totals(layers, modality, final_norm) for modality in MODALITIES}
    return {
        "layers": layers,
        "parameters": backbone_parameters(config),
        **totals,
        "attention_score_flops_per_token": config.depth * 4 * sequence_length * config.dim,
        "sequence_length": sequence_length,
    }
