"""One multiway Transformer layer (BEiT-3, Wang et al., 2023, §2.1; layout of the released unilm/beit3 code).

Pre-LN with Sub-LN (Magneto), per modality m in {vision, language}::

    h_m = x_m + DropPath(Dropout(Out_m(InnerLN_m(Attention(LN_m(x))))))  # one softmax over the joint sequence
    y_m = h_m + DropPath(Dropout(FFN_m(FFNLN_m(h_m))))                    # FFN_m = fc2(SubLN(GELU(fc1(.)))) or MoE

FFNLN_m is the identity for a Stratified MoE layer, which normalises its own input (one LayerNorm per stratum); every
FFN returns the update that the block adds, so the block has one FFN path.

The modality split is positional: the image tokens ([CLS, patches]) come first, the text tokens after them. The two
modalities are carried as two tensors through the layer, so no split position is ever stored on a module.

A depth-routed layer (Mixture-of-Depths, :mod:`mmoe.model.depth_router`) runs all this on the image tokens its router
keeps and the text; the other image tokens pass the layer unchanged.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from typing import NamedTuple

import torch
import torch.nn.functional as F
from timm.layers import DropPath
from torch import nn

from mmoe.model.config import MODALITIES, MultiwayConfig
from mmoe.model.depth_router import DepthRecord, DepthRouter, select_attention, sequence_positions
from mmoe.model.gate_residuals import GateResiduals, gate_residual_argument
from mmoe.moe import MoEFeedForward, MoELayer, RoutingRecord

VISION, LANGUAGE = 0, 1
MODALITY_NAMES = MODALITIES
#: One layer's attention keys and values of some tokens, (B, H, L, d) each.
KeysValues = tuple[torch.Tensor, torch.Tensor]


class ImageContext(NamedTuple):
    """One layer's keys and values of an image's tokens, (B, H, L_k, d) each, for text that attends to them; ``kept``:
    (B, L_k) the positions among the image tokens that they belong to in a depth-routed layer (its kept tokens), None
    where they are all the image's tokens."""

    keys: torch.Tensor
    values: torch.Tensor
    kept: torch.Tensor | None = None

    def repeat_interleave(self, repeats: int) -> ImageContext:
        """Each image's context ``repeats`` times in a row (its beams)."""
        parts = [None if part is None else part.repeat_interleave(repeats, dim=0) for part in self]
        return ImageContext(*parts)


class FeedForward(nn.Module):
    """Dense FFN ``fc2(SubLN(GELU(fc1(x))))`` with the MoE layer's call signature (returns no routing record)."""

    def __init__(self, dim: int, ffn_dim: int, subln: bool, eps: float) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, ffn_dim)
        self.norm = nn.LayerNorm(ffn_dim, eps=eps) if subln else nn.Identity()
        self.fc2 = nn.Linear(ffn_dim, dim)

    def forward(self, x: torch.Tensor, padding_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, None]:
        return self.fc2(self.norm(F.gelu(self.fc1(x)))), None


class MultiwayAttention(nn.Module):
    """Self-attention over the joint sequence with per-modality (``ways=2``) or shared (``ways=1``) projections.

    Each way has its pre-LN, a fused q/k/v projection (the same parameters as BEiT-3's separate q, k, v), the Sub-LN
    before the output projection, and the output projection. The softmax runs once over all tokens
    (``scaled_dot_product_attention``, padding as a boolean key mask).
    """

    def __init__(self, config: MultiwayConfig, ways: int) -> None:
        super().__init__()
        dim, eps = config.dim, config.layernorm_eps
        self.num_heads = config.num_heads
        self.norm = nn.ModuleList(nn.LayerNorm(dim, eps=eps) for _ in range(ways))
        self.qkv = nn.ModuleList(nn.Linear(dim, 3 * dim) for _ in range(ways))
        self.inner_norm = nn.ModuleList(
            (nn.LayerNorm(dim, eps=eps) if config.subln else nn.Identity()) for _ in range(ways)
        )
        self.out = nn.ModuleList(nn.Linear(dim, dim) for _ in range(ways))

    def forward(
        self, parts: list[tuple[int, torch.Tensor]], attn_mask: torch.Tensor | None, context: KeysValues | None = None
    ) -> list[torch.Tensor]:
        """Args:
            parts: ``(way, x)`` per modality present, in sequence order; x is (B, L_m, D).
            attn_mask: boolean (B, 1, L or 1, L), True = may attend; None = attend everywhere. With ``context``, its
                keys span the context's tokens first: (B, 1, L or 1, L_c + L).
            context: keys and values ((B, H, L_c, d) each) of earlier tokens of the sequence that the parts attend
                to without running again (a decoder's cache, :meth:`attend`).

        Returns:
            The attention branch output for each part (before the residual).
        """
        return self.attend(parts, attn_mask, context)[0]

    def attend(
        self, parts: list[tuple[int, torch.Tensor]], attn_mask: torch.Tensor | None, context: KeysValues | None = None
    ) -> tuple[list[torch.Tensor], KeysValues]:
        """:meth:`forward`'s outputs, and the parts' own keys and values ((B, H, L, d) each): a later call's
        ``context``."""
        batch = parts[0][1].shape[0]
        qkv = torch.cat([self.qkv[way](self.norm[way](x)) for way, x in parts], dim=1)  # (B, L, 3D)
        length = qkv.shape[1]
        q, k, v = qkv.view(batch, length, 3, self.num_heads, -1).permute(2, 0, 3, 1, 4).unbind(0)  # (B, H, L, d)
        keys, values = (k, v) if context is None else (torch.cat([context[0], k], 2), torch.cat([context[1], v], 2))
        attended = F.scaled_dot_product_attention(q, keys, values, attn_mask=attn_mask)
        attended = attended.transpose(1, 2).reshape(batch, length, -1)  # (B, L, D)
        outputs, start = [], 0
        for way, x in parts:
            chunk = attended[:, start : start + x.shape[1]]
            outputs.append(self.out[way](self.inner_norm[way](chunk)))
            start += x.shape[1]
        return outputs, (k, v)


class MultiwayBlock(nn.Module):
    """One layer: joint attention, then modality FFNs (dense or MoE) built by an injected factory.

    Args:
        config: backbone config.
        index: 0-based layer index (written into the routing records).
        drop_path: stochastic depth rate of this layer.
        make_ffn: builds one FFN module (``FeedForward`` or a MoE layer) for the modality it serves ("vision",
            "language", or "shared" for a shared FFN and the VL-FFN: a MoE layer's pool of experts may depend on it,
            ``MoEPlan.experts_by_modality``); called once per FFN the layer needs. The module returns the update
            ``FFN(norm(h))`` that the block adds to the residual stream.
        make_norm: builds one pre-FFN norm (a LayerNorm; ``nn.Identity``, which has no parameters, for an FFN that
            normalises its own input, such as a Stratified MoE layer); one per modality, one for the VL-FFN.
        shared_ffn: one FFN for all tokens (MoE ``mode="shared"``) instead of one per modality.
        vision_language_ffn: add a VL-FFN used when both modalities are present (BEiT-3 paper's top layers).
    """

    def __init__(
        self,
        config: MultiwayConfig,
        index: int,
        drop_path: float,
        make_ffn: Callable[[str], nn.Module],
        make_norm: Callable[[], nn.Module],
        shared_ffn: bool = False,
        vision_language_ffn: bool = False,
    ) -> None:
        super().__init__()
        self.index = index
        self.attention_ways = 2 if config.attention == "multiway" else 1
        self.attention = MultiwayAttention(config, self.attention_ways)
        self.ffn = nn.ModuleList(make_ffn(modality) for modality in (["shared"] if shared_ffn else MODALITY_NAMES))
        self.ffn_norm = nn.ModuleList(make_norm() for _ in range(2))
        self.vl_ffn = make_ffn("shared") if vision_language_ffn else None
        self.vl_norm = make_norm() if vision_language_ffn else None
        self.drop_path = DropPath(drop_path) if drop_path > 0 else nn.Identity()
        # Residual dropout (MultiwayConfig.dropout), before drop path as torchscale's encoder layer does it.
        self.dropout = nn.Dropout(config.dropout) if config.dropout > 0 else nn.Identity()
        routed = index in config.depth_routed_layers()
        self.depth_router = DepthRouter(config.dim, config.depth_routing) if routed else None

    def moe_ffns_by_modality(self) -> Iterator[tuple[str, MoEFeedForward]]:
        """``(modality, layer)`` for each MoE FFN of this block, modality as in its routing records ("vision",
        "language", or "shared" for a shared FFN and the VL-FFN); the per-modality FFNs come before the VL-FFN."""
        named = [("shared" if len(self.ffn) == 1 else MODALITY_NAMES[m], ffn) for m, ffn in enumerate(self.ffn)]
        if self.vl_ffn is not None:
            named.append(("shared", self.vl_ffn))
        for modality, ffn in named:
            if isinstance(ffn, MoEFeedForward):
                yield modality, ffn

    def forward(
        self,
        image_x: torch.Tensor | None,
        text_x: torch.Tensor | None,
        text_padding_mask: torch.Tensor | None,
        attn_mask: torch.Tensor | None,
        image_context: ImageContext | None = None,
        gate_residuals: GateResiduals | None = None,
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, list[RoutingRecord | DepthRecord]]:
        """The layer on the image and text tokens present; ``image_context`` (with ``image_x`` None): the keys and
        values of the sequence's image tokens in this layer (:meth:`image_keys_values`), which the text attends to
        (``attn_mask`` spanning all the image's tokens first) without running them again. Returns the image and text
        outputs and the layer's records: its MoE FFNs' routing records, then, where the layer routed image tokens by
        depth, its :class:`DepthRecord` (the backbone returns the two kinds apart). ``gate_residuals``: each present
        modality's logits in its previous MoE layer (:mod:`mmoe.model.gate_residuals`), for MoE++'s gating residuals."""
        if self.depth_router is not None and image_x is not None:
            return self._routed(image_x, text_x, text_padding_mask, attn_mask)
        present = [(m, x) for m, x in ((VISION, image_x), (LANGUAGE, text_x)) if x is not None]
        context = None
        if image_context is not None:
            context = image_context.keys, image_context.values
            if image_context.kept is not None and attn_mask is not None:  # the keys of the image tokens kept
                text_len = text_x.shape[1]
                positions = sequence_positions(image_context.kept, attn_mask.shape[-1] - text_len, text_len)
                attn_mask = select_attention(attn_mask, positions, queries=False)
        image_text = len(present) == 2 or image_context is not None
        out, records, _ = self._layer(present, text_padding_mask, attn_mask, context, image_text, gate_residuals)
        return out.get(VISION), out.get(LANGUAGE), records

    def _routed(
        self,
        image_x: torch.Tensor,
        text_x: torch.Tensor | None,
        text_padding_mask: torch.Tensor | None,
        attn_mask: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor | None, list[RoutingRecord | DepthRecord]]:
        """The layer on the image tokens its depth router keeps and the text (:mod:`mmoe.model.depth_router`): a
        skipped image token is neither a query nor a key; its output is its input."""
        route = self.depth_router(image_x)
        kept = route.gather(image_x)  # (B, K, D)
        text_len = 0 if text_x is None else text_x.shape[1]
        mask = select_attention(attn_mask, sequence_positions(route.indices, image_x.shape[1], text_len), True)
        present = [(m, x) for m, x in ((VISION, kept), (LANGUAGE, text_x)) if x is not None]
        out, records, _ = self._layer(present, text_padding_mask, mask, None, image_text=text_x is not None)
        image_out = route.merge(image_x, kept, out[VISION])
        return image_out, out.get(LANGUAGE), [*records, route.record(self.index, image_x.shape[1])]

    def image_keys_values(
        self, image_x: torch.Tensor, gate_residuals: GateResiduals | None = None
    ) -> tuple[torch.Tensor, ImageContext, list[RoutingRecord]]:
        """The layer's output on the image tokens of an image-text sequence whose image tokens attend to the image
        only (BEiT-3 captioning's mask), and their keys and values: what every decoding step's text attends to in
        this layer. The image takes the FFN it takes beside text (the VL-FFN where the layer has one); a depth-routed
        layer runs its kept tokens only, and only they are keys. Also returns the layer's routing records (MoE++'s
        carried logits are read from them, ``gate_residuals`` the image's in its previous MoE layer)."""
        if self.depth_router is None:
            out, records, keys_values = self._layer([(VISION, image_x)], None, None, None, True, gate_residuals)
            return out[VISION], ImageContext(*keys_values), records
        route = self.depth_router(image_x)
        kept = route.gather(image_x)
        out, records, keys_values = self._layer([(VISION, kept)], None, None, None, image_text=True)
        return route.merge(image_x, kept, out[VISION]), ImageContext(*keys_values, route.indices), records

    def _layer(
        self,
        present: list[tuple[int, torch.Tensor]],
        text_padding_mask: torch.Tensor | None,
        attn_mask: torch.Tensor | None,
        context: KeysValues | None,
        image_text: bool,
        gate_residuals: GateResiduals | None = None,
    ) -> tuple[dict[int, torch.Tensor], list[RoutingRecord], KeysValues]:
        modalities = [m for m, _ in present]
        padding = [text_padding_mask if m == LANGUAGE else None for m in modalities]
        way = (lambda m: m) if self.attention_ways == 2 else (lambda m: 0)
        attended, keys_values = self.attention.attend([(way(m), x) for m, x in present], attn_mask, context)
        hidden = [x + self.drop_path(self.dropout(a)) for (_, x), a in zip(present, attended, strict=True)]

        records: list[RoutingRecord] = []
        joint = None  # one FFN over both modalities: the VL-FFN on image + text, or a shared FFN
        if self.vl_ffn is not None and image_text:
            joint = self.vl_ffn, [self.vl_norm, self.vl_norm]
        elif len(self.ffn) == 1:
            joint = self.ffn[0], self.ffn_norm
        if joint is not None:
            carried = gate_residual_argument(joint[0], gate_residuals, modalities)
            updates, record = self._joint_ffn(*joint, hidden, modalities, padding, carried)
            if record is not None:
                records.append(_tag(record, self.index, "shared"))
        else:
            updates = []
            for m, h, mask in zip(modalities, hidden, padding, strict=True):
                carried = gate_residual_argument(self.ffn[m], gate_residuals, [m])
                update, record = self.ffn[m](self.ffn_norm[m](h), mask, **carried)
                updates.append(update)
                if record is not None:
                    records.append(_tag(record, self.index, MODALITY_NAMES[m]))
        out = {m: h + self.drop_path(self.dropout(u)) for m, h, u in zip(modalities, hidden, updates, strict=True)}
        return out, records, keys_values

    def _joint_ffn(
        self, ffn, norms, hidden, modalities, padding, carried
    ) -> tuple[list[torch.Tensor], RoutingRecord | None]:
        """One FFN over the concatenated modalities (each normed by its own LayerNorm): the per-modality updates and
        the FFN's routing record (None for a dense FFN). A :class:`MoELayer` with LIMoE's entropy losses is told the
        modalities' lengths in sequence order (image tokens, then text tokens): the losses are per modality."""
        joint_mask = None
        if any(mask is not None for mask in padding):
            joint_mask = torch.cat(
                [
                    mask if mask is not None else h.new_zeros(h.shape[:2], dtype=torch.bool)
                    for mask, h in zip(padding, hidden, strict=True)
                ],
                dim=1,
            )
        joint = torch.cat([norms[m](h) for m, h in zip(modalities, hidden, strict=True)], dim=1)
        lengths = [h.shape[1] for h in hidden]
        update, record = ffn(joint, joint_mask, **_modality_segments(ffn, lengths), **carried)
        return list(torch.split(update, lengths, dim=1)), record


def _modality_segments(ffn: nn.Module, lengths: list[int]) -> dict[str, list[int]]:
    """``{"segment_lengths": lengths}`` for a MoE layer with LIMoE's per-modality entropy losses on, else nothing: a
    dense FFN and a Stratified MoE layer take no lengths, and no other loss reads them (a layer given lengths copies
    them to the device on every forward)."""
    config = ffn.config if isinstance(ffn, MoELayer) else None
    if config is not None and (config.local_entropy_weight > 0 or config.global_entropy_weight > 0):
        return {"segment_lengths": lengths}
    return {}


def _tag(record: RoutingRecord, layer: int, modality: str) -> RoutingRecord:
    """A copy of ``record`` that names the backbone layer and modality it came from."""
    return dataclasses.replace(record, layer=layer, modality=modality)
