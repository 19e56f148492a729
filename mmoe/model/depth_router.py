"""Mixture-of-Depths over the image patches (Raposo et al., 2024, "Mixture-of-Depths: Dynamically allocating compute
in transformer-based language models", §3; for the vision tokens of multimodal models: p-MoD, γ-MoD).

In a routed layer l a linear router scores each image patch, r_i = w^T x_i + b, and per image the top
k = ceil(C · n_patches) patches (capacity C) run the whole block; every other patch rides the residual stream:

    x_{l+1,i} = x_i + g(r_i) · f(X̃)_i    for a kept patch i    (Raposo et al. §3.1; the paper writes r_i f(X̃) + x_i)
    x_{l+1,i} = x_i                          for a skipped patch

f(X̃) is the block's residual update (attention, then the FFN) on the kept set X̃, gathered into a smaller dense
tensor so that compute drops. As in the paper, the block runs only on the kept tokens: a skipped patch is neither a
query nor a key or value of the layer. The image CLS and the text tokens are always kept, with weight 1: the CLS is
what the heads read, and the router never sees the text (so the text attends to the kept patches only in a routed
layer; in a decoder the image side is computed before any text, as it is today). g is the sigmoid (``weight:
sigmoid``, the default: 0.5 at the from-scratch initialisation, where the raw score near 0 would silence the block)
or the identity (``weight: raw``, the paper's r_i); either way the router is trained through the weight, since top-k
itself has no gradient. Top-k over an image's patches is non-causal across the patches only; the image never depends
on the text.

Masked image modelling's masked patches (the mask token plus their position) are image patches like the others:
they compete for the k places; the router sees the mask token and learns from the masked-modelling loss, which is
taken on them, whether they are worth the block.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from mmoe.moe.choices.values import finite_at_least, is_int


@dataclass(frozen=True, kw_only=True)
class DepthRouting:
    """Which layers route the image patches by depth, and how many patches they keep.

    Args:
        capacity: C in (0, 1], the share of an image's patches that run a routed layer: ceil(C · n_patches) of them
            (Raposo et al. route 12.5% of the tokens).
        every: layer i (0-based) is routed iff ``(i + 1) % every == 0``; 2 = every other layer (Raposo et al.).
        layers: explicit 0-based routed layers; overrides ``every`` when given.
        weight: the factor of a kept patch's block update: ``"sigmoid"`` of its router score (default), or the
            ``"raw"`` score, as the paper writes it.
    """

    capacity: float = 0.5
    every: int = 2
    layers: list[int] | None = None
    weight: Literal["sigmoid", "raw"] = "sigmoid"

    def __post_init__(self) -> None:
        if not (finite_at_least(self.capacity, 0.0) and 0 < self.capacity <= 1):
            raise ValueError(f"DepthRouting.capacity must be a share of the patches in (0, 1], got {self.capacity!r}")
        if not is_int(self.every) or self.every < 1:
            raise ValueError(f"DepthRouting.every must be a positive integer, got {self.every!r}")
        if self.layers is not None and (not self.layers or not all(is_int(i) for i in self.layers)):
            raise ValueError(f"DepthRouting.layers must be a non-empty list of layer indices, got {self.layers!r}")
        if self.weight not in ("sigmoid", "raw"):
            raise ValueError(f"DepthRouting.weight must be 'sigmoid' or 'raw', got {self.weight!r}")

    def require_layers_within(self, depth: int) -> None:
        """Refuse routed layers that a backbone of ``depth`` layers does not have."""
        bad = [i for i in self.layers or [] if not 0 <= i < depth]
        if bad:
            raise ValueError(f"DepthRouting.layers={self.layers} has indices outside [0, {depth}): {bad}")
        if self.layers is None and self.every > depth:
            raise ValueError(f"DepthRouting.every={self.every} routes no layer of a backbone of depth {depth}")

    def is_routed(self, index: int) -> bool:
        """Whether the 0-based layer ``index`` routes its image patches: listed in ``layers``, else every
        ``every``-th layer."""
        if self.layers is not None:
            return index in self.layers
        return (index + 1) % self.every == 0

    def kept(self, patches: int) -> int:
        """How many of ``patches`` image patches run a routed layer: ceil(C · patches)."""
        return math.ceil(self.capacity * patches - 1e-9)  # C · n computed as 4.000000001 keeps 4, not 5


@dataclass
class DepthRecord:
    """What one routed layer did with the image tokens.

    Attributes:
        layer: 0-based backbone layer.
        processed: (B, L_i) bool over the image tokens [CLS, patches], True where the token ran the layer.
    """

    layer: int
    processed: torch.Tensor

    @property
    def processed_fraction(self) -> float:
        """The share of the image patches (the CLS left out, always processed) that ran the layer."""
        return float(self.processed[:, 1:].float().mean())


@dataclass
class DepthRoute:
    """The image tokens one routed layer keeps, per image: ``indices`` (B, K) ascending positions among [CLS,
    patches], the CLS (0) first; ``weights`` (B, K) the factors g(r_i) of their block updates, 1 for the CLS."""

    indices: torch.Tensor
    weights: torch.Tensor

    def gather(self, image_x: torch.Tensor) -> torch.Tensor:
        """(B, L_i, D) -> (B, K, D): the kept tokens, a dense tensor the block runs on."""
        batch, length, dim = image_x.shape
        return image_x.reshape(batch * length, dim).index_select(0, self._flat(length)).view(batch, -1, dim)

    def merge(self, image_x: torch.Tensor, kept: torch.Tensor, kept_out: torch.Tensor) -> torch.Tensor:
        """The layer's output on all image tokens: x_i + g(r_i) (block(x̃)_i - x̃_i) at the kept positions (the
        block's update, weighted), x_i elsewhere. An index_add onto x: its gradient passes to x unchanged."""
        batch, length, dim = image_x.shape
        update = (self.weights[..., None] * (kept_out - kept)).to(image_x.dtype)  # (B, K, D)
        merged = image_x.reshape(batch * length, dim).index_add(0, self._flat(length), update.reshape(-1, dim))
        return merged.view(batch, length, dim)

    def _flat(self, length: int) -> torch.Tensor:
        """(B K,) the kept tokens' rows in the image tokens flattened to (B L_i, D)."""
        rows = torch.arange(self.indices.shape[0], device=self.indices.device)[:, None] * length
        return (self.indices + rows).reshape(-1)

    def record(self, layer: int, image_len: int) -> DepthRecord:
        processed = self.indices.new_zeros(self.indices.shape[0], image_len, dtype=torch.bool)
        return DepthRecord(layer, processed.scatter(1, self.indices, True))


class DepthRouter(nn.Module):
    """The router of one routed layer: a linear scorer D -> 1 on the image patches, and the top-k per image."""

    def __init__(self, dim: int, routing: DepthRouting) -> None:
        super().__init__()
        self.routing = routing
        self.score = nn.Linear(dim, 1)

    def forward(self, image_x: torch.Tensor) -> DepthRoute:
        """(B, L_i, D) image tokens [CLS, patches] -> the kept tokens and their weights."""
        patches = image_x[:, 1:]
        # Scores in at least fp32, under autocast too: the ranking of near-equal bf16 scores would be rounding's.
        dtype = torch.promote_types(patches.dtype, torch.float32)
        with torch.autocast(image_x.device.type, enabled=False):
            weight, bias = self.score.weight.to(dtype), self.score.bias.to(dtype)
            scores = F.linear(patches.to(dtype), weight, bias).squeeze(-1)  # (B, N)
        top = scores.topk(self.routing.kept(patches.shape[1]), dim=1).indices.sort(dim=1).values  # (B, k)
        chosen = scores.gather(1, top)
        weights = chosen.sigmoid() if self.routing.weight == "sigmoid" else chosen
        cls = top.new_zeros(top.shape[0], 1)
        return DepthRoute(torch.cat([cls, top + 1], dim=1), torch.cat([torch.ones_like(weights[:, :1]), weights], 1))


def sequence_positions(kept: torch.Tensor, image_len: int, text_len: int) -> torch.Tensor:
    """(B, K + T): the positions in the whole sequence [image tokens, text] of the kept image tokens, then the
    text's."""
    text = torch.arange(image_len, image_len + text_len, device=kept.device).expand(kept.shape[0], -1)
    return torch.cat([kept, text], dim=1)


def select_attention(mask: torch.Tensor | None, positions: torch.Tensor, queries: bool) -> torch.Tensor | None:
    """A boolean attention mask (B or 1, 1, L_q or 1, L) over the whole sequence, cut to the keys at ``positions``
    (B, n) and, with ``queries`` and one row per query, to those query rows too."""
    if mask is None:
        return None
    batch, count = positions.shape
    mask = mask.expand(batch, *mask.shape[1:])
    mask = mask.gather(3, positions[:, None, None, :].expand(batch, mask.shape[1], mask.shape[2], count))
    if queries and mask.shape[2] > 1:
        mask = mask.gather(2, positions[:, None, :, None].expand(batch, mask.shape[1], count, count))
    return mask
