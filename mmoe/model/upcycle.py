"""Sparse upcycling (Komatsuzaki et al., 2023): a MoE backbone whose experts start as copies of a dense backbone's FFNs.

Every weight outside the MoE FFNs (embeddings, attention, norms) is the dense backbone's. In each MoE layer the
router (and a Stratified layer's gates) is new; the experts start from the dense FFN the layer replaces:

* Switch / X-MoE (``heads = 1``, ``beta = 1``): every expert is a copy of the FFN of its modality (``mode:
  shared``: experts alternate between the vision and the language FFN). With all experts equal the layer outputs
  ``sum_k g_k FFN(x)``: the dense FFN exactly when the gate weights sum to 1 (top-2, renormalised; with raw top-2
  weights, ``renormalize: false``, it is (g_1 + g_2) FFN(x)), and ``g_1 FFN(x)``
  with top-1, whose gate weight is the router's probability (Switch has no renormalisation, so the router learns
  from the task loss).
* Stratified MoE: each stratum's LayerNorm is the dense pre-FFN LayerNorm and every expert a copy of the FFN; a token
  that leaves after its first gate gets the dense update (top-2 weights sum to 1), one that makes more passes adds
  one update per pass, so the layer is not the dense FFN at step 0.
* MH-MoE (``heads = h > 1``): a sub-token expert sees D/h of the D inputs, so no choice of weights makes it the dense
  FFN. The multi-head and merge layers start as the identity, and expert e takes head block ``j = e mod h`` of the
  dense FFN: the rows of fc1 that read block j, all hidden units, and the rows of fc2 that write block j. A sub-token
  routed to an expert of its own block computes the dense FFN's block-diagonal part; across blocks it does not.

``noise`` adds Gaussian noise of that share of each copied tensor's standard deviation to every expert (seeded), so
equal experts can drift apart under a router that does not yet separate them.

``drop_ratio`` r is Drop-Upcycling (Nakamura et al., ICLR 2025, §3, "diversity re-initialization"): after the copy,
each expert draws its own set S of ⌊r·H⌋ of its H intermediate units (seeded), and every weight of those units is
drawn again from a normal distribution with the mean and standard deviation of the dense tensor it was copied from:
the units' columns of fc1 (their rows in the paper's W_up / W_gate) and rows of fc2 (the paper's W_down columns), and,
which the paper's FFN without biases or Sub-LN does not have, the units' fc1 biases and Sub-LN weights and biases,
each from its own dense tensor's statistics. fc2's bias, which belongs to no unit, stays the copy. One S per expert
serves all its tensors, as the paper's index set does (its released script draws one per projection). r = 0 is the
plain copy, bit for bit; r = 1 keeps only the statistics of the dense FFN.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from mmoe.model.backbone import MultiwayTransformer
from mmoe.model.config import MoEPlan
from mmoe.model.layers import LANGUAGE, VISION, FeedForward
from mmoe.moe import GroupedExperts, MoEFeedForward


def upcycle(
    dense: MultiwayTransformer, plan: MoEPlan, noise: float = 0.0, seed: int = 0, drop_ratio: float = 0.0
) -> MultiwayTransformer:
    """A MoE backbone of ``dense``'s architecture with ``plan``'s MoE layers, upcycled from ``dense`` (see the module
    docstring for what each variant equals at step 0); ``drop_ratio``: Drop-Upcycling's share of each expert's
    intermediate units drawn again (module docstring).

    Raises:
        ValueError: ``dense`` has MoE layers already, the plan changes an expert's width for a plain MoE layer
            (``beta`` other than 1 with one head), it has shared experts (DeepSeekMoE), or ``noise`` is negative or
            ``drop_ratio`` outside [0, 1].
    """
    if dense.config.moe is not None:
        raise ValueError("upcycling starts from a dense backbone; this one has MoE layers already")
    if not noise >= 0:
        raise ValueError(f"upcycling noise must be >= 0, got {noise!r}")
    if not 0 <= drop_ratio <= 1:
        raise ValueError(f"Drop-Upcycling's drop ratio must be in [0, 1], got {drop_ratio!r}")
    if plan.shared_experts:
        raise ValueError(
            f"MoEPlan.shared_experts={plan.shared_experts}: upcycling copies the dense FFN into the routed experts, "
            "and shared experts beside them would add it again; set shared_experts: 0 to upcycle"
        )
    config = dataclasses.replace(dense.config, moe=plan)
    moe = MultiwayTransformer(config)
    sparse = {key: value for key, value in moe.state_dict().items()}
    for key, value in dense.state_dict().items():
        if key in sparse and sparse[key].shape == value.shape:
            sparse[key] = value
    moe.load_state_dict(sparse)  # the dense weights outside the MoE FFNs; routers and experts below
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for slot in moe.moe_layers():
            block = dense.layers[slot.index]
            if slot.layer is moe.layers[slot.index].vl_ffn:
                ffns, norm = [block.vl_ffn], block.vl_norm
            elif slot.modality == "shared":
                ffns, norm = [block.ffn[VISION], block.ffn[LANGUAGE]], block.ffn_norm[VISION]
            else:
                modality = VISION if slot.modality == "vision" else LANGUAGE
                ffns, norm = [block.ffn[modality]], block.ffn_norm[modality]
            copy_experts(slot.layer, ffns, generator, noise, drop_ratio)
            if slot.layer.config.strata is not None:
                for stratum_norm in slot.layer.norms:
                    stratum_norm.load_state_dict(norm.state_dict())
    return moe


def copy_experts(
    layer: MoEFeedForward, ffns: list[FeedForward], generator: torch.Generator, noise: float, drop_ratio: float = 0.0
) -> None:
    """Fills ``layer``'s experts from the dense ``ffns`` (expert e from ``ffns[e % len(ffns)]``), each with
    ``drop_ratio`` of its units drawn again (:func:`redraw_units`)."""
    experts: GroupedExperts = layer.experts
    heads = layer.config.heads
    first = ffns[0]
    dim, hidden = first.fc1.in_features, first.fc1.out_features
    if heads == 1 and experts.hidden_dim != hidden:
        raise ValueError(
            f"an expert is {experts.hidden_dim} wide and the dense FFN {hidden}: upcycling copies the FFN, so a "
            "one-head MoE plan needs beta 1"
        )
    if heads > 1:
        nn.init.eye_(layer.multi_head.weight)
        nn.init.zeros_(layer.multi_head.bias)
        nn.init.eye_(layer.merge.weight)
        nn.init.zeros_(layer.merge.bias)
    width = dim // heads
    for expert in range(experts.num_experts):
        ffn = ffns[expert % len(ffns)]
        block = slice((expert % heads) * width, (expert % heads + 1) * width)
        units = slice(0, experts.hidden_dim)  # MH-MoE with beta < 1: the first hidden units
        tensors = {
            experts.fc1_weight: ffn.fc1.weight[units, block].T,
            experts.fc1_bias: ffn.fc1.bias[units],
            experts.fc2_weight: ffn.fc2.weight[block, units].T,
            experts.fc2_bias: ffn.fc2.bias[block],
        }
        if experts.ln_weight is not None:
            tensors[experts.ln_weight] = ffn.norm.weight[units]
            tensors[experts.ln_bias] = ffn.norm.bias[units]
        # Each tensor's axis of intermediate units, in the experts' (x @ W) layout; fc2's bias has none.
        unit_axes = {experts.fc1_weight: 1, experts.fc1_bias: 0, experts.fc2_weight: 0}
        if experts.ln_weight is not None:
            unit_axes |= {experts.ln_weight: 0, experts.ln_bias: 0}
        dropped = None
        if drop_ratio > 0:
            dropped = torch.randperm(experts.hidden_dim, generator=generator)[: int(drop_ratio * experts.hidden_dim)]
        for stacked, value in tensors.items():
            if value.shape != stacked[expert].shape:  # MH-MoE with beta > 1: experts wider than the dense FFN
                raise ValueError(
                    f"an MH-MoE expert of hidden width {experts.hidden_dim} cannot start from a dense FFN of {hidden}"
                    " (beta > 1): use beta <= 1 to upcycle"
                )
            copied = value.to(stacked.dtype)
            if noise > 0:
                scale = noise * float(copied.float().std()) if copied.numel() > 1 else 0.0
                copied = copied + scale * torch.randn(copied.shape, generator=generator).to(copied)
            if dropped is not None and stacked in unit_axes:
                copied = redraw_units(copied, value, dropped, unit_axes[stacked], generator)
            stacked[expert].copy_(copied)


def redraw_units(
    copied: torch.Tensor, dense: torch.Tensor, units: torch.Tensor, axis: int, generator: torch.Generator
) -> torch.Tensor:
    """``copied`` with its slices ``units`` along ``axis`` drawn from N(mean, std²) of the ``dense`` tensor it was
    copied from (Drop-Upcycling §3; a one-element tensor has no spread: its mean)."""
    statistics = dense.detach().float()
    mean = float(statistics.mean())
    std = float(statistics.std()) if statistics.numel() > 1 else 0.0
    shape = list(copied.shape)
    shape[axis] = units.numel()
    fresh = mean + std * torch.randn(shape, generator=generator)
    return copied.index_copy(axis, units, fresh.to(copied.dtype))
