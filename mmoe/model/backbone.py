"""The multiway Transformer backbone (BEiT-3, Wang et al., 2023) with MoE FFNs in chosen layers.

Input order ``[image CLS, patches, text tokens]``; 16-px patch embedding, token embedding, learned per-modality
position embeddings each starting at ``position_offset``; a learned mask token replaces masked patches (masked image
modeling). Layer i is a MoE layer per :class:`mmoe.model.MoEPlan`.

Initialisation follows BEiT-3's from-scratch path (unilm ``BEiT3Wrapper._init_weights``): truncated normal
(std 0.02, cut at ±0.02) for linear layers and expert weights, zero biases, LayerNorm 1/0, zero CLS and mask tokens.
Text embeddings keep torchscale's N(0, D^-1/2); position tables use the truncated normal 0.02 (torchscale leaves them
at ``nn.Embedding``'s N(0, 1)). Routers and the MH-MoE split/merge layers keep their papers' initialisation.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from mmoe.model.config import MultiwayConfig
from mmoe.model.cost import refuse_beyond_host_memory
from mmoe.model.depth_router import DepthRecord
from mmoe.model.gate_residuals import GateResiduals, initial_gate_residuals, next_gate_residuals
from mmoe.model.initialization import BEIT3_INIT_STD, init_beit3_
from mmoe.model.layers import LANGUAGE, VISION, FeedForward, ImageContext, MultiwayBlock
from mmoe.moe import GroupedExperts, MoEFeedForward, RoutingRecord, build_moe_layer


@dataclass
class BackboneOutput:
    """Attributes:
    hidden: (B, L, D) after the final LayerNorm (``output_norm``), ordered [image CLS, patches, text tokens].
    image_len: number of image tokens (CLS included), 0 without an image.
    text_len: number of text tokens, 0 without text.
    routing: routing records of the MoE layers in depth order (vision before language within a layer).
    depth_routing: what each depth-routed layer (Mixture-of-Depths, ``MultiwayConfig.depth_routing``) did with the
        image tokens, in depth order: per layer the (B, L_i) image tokens that ran it (``DepthRecord.processed``).
    image_depth: (B, L_i) the number of layers each image token ran (``depth`` for a token no router skipped);
        None without depth-routed layers or without an image.
    """

    hidden: torch.Tensor
    image_len: int
    text_len: int
    routing: list[RoutingRecord]
    depth_routing: list[DepthRecord] = field(default_factory=list)
    image_depth: torch.Tensor | None = None

    @property
    def image_hidden(self) -> torch.Tensor:
        return self.hidden[:, : self.image_len]

    @property
    def text_hidden(self) -> torch.Tensor:
        return self.hidden[:, self.image_len :]


@dataclass(frozen=True)
class MoELayerSlot:
    """Where one MoE FFN sits in the backbone.

    Attributes:
    index: 0-based layer index, as in the routing records' ``layer``.
    modality: "vision", "language" or "shared" (shared FFN or VL-FFN), as in the routing records' ``modality``.
    layer: the MoE layer (its routers in gate order: ``layer.gate_routers()``).
    """

    index: int
    modality: str
    layer: MoEFeedForward


class MultiwayTransformer(nn.Module):
    """``backbone(image=None, text=None, text_padding_mask=None, image_mask=None) -> BackboneOutput``."""

    def __init__(self, config: MultiwayConfig) -> None:
        super().__init__()
        if torch.get_default_device().type == "cpu":  # built in host memory (not on the meta device: shapes only)
            refuse_beyond_host_memory(config)
        self.config = config
        #: (depth + 1,) long: the image patches of the training forwards since the last take, by the layers they ran
        #: (Mixture-of-Depths); a plain attribute, not a buffer, so that DDP never overwrites a rank's own counts.
        self._patch_depth_counts: torch.Tensor | None = None
        dim, eps = config.dim, config.layernorm_eps
        self.patch_embed = nn.Conv2d(config.in_channels, dim, kernel_size=config.patch_size, stride=config.patch_size)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, dim))
        self.mask_token = nn.Parameter(torch.zeros(1, 1, dim))
        self.vision_positions = nn.Parameter(torch.empty(config.position_offset + config.num_patches + 1, dim))
        self.text_embed = nn.Embedding(config.vocab_size, dim)
        self.text_positions = nn.Parameter(torch.empty(config.max_text_positions, dim))

        moe_layers = set(config.moe_layer_indices())
        rates = [config.drop_path * i / max(config.depth - 1, 1) for i in range(config.depth)]  # linear, as BEiT-3
        self.layers = nn.ModuleList()
        for index in range(config.depth):
            is_moe = index in moe_layers
            self.layers.append(
                MultiwayBlock(
                    config,
                    index,
                    rates[index],
                    self._ffn_factory(is_moe),
                    self._norm_factory(is_moe),
                    shared_ffn=is_moe and config.moe.mode == "shared",
                    vision_language_ffn=index >= config.depth - config.vl_layers,
                )
            )
        self.final_norm = nn.ModuleList(nn.LayerNorm(dim, eps=eps) for _ in range(2)) if config.output_norm else None
        self.embed_dropout = nn.Dropout(config.dropout) if config.dropout > 0 else nn.Identity()
        self.reset_parameters()

    def _ffn_factory(self, is_moe: bool):
        config = self.config
        if is_moe:
            return lambda modality: build_moe_layer(
                config.moe.layer_config(config.dim, config.ffn_dim, config.subln, modality, config.layernorm_eps)
            )
        return lambda modality: FeedForward(config.dim, config.ffn_dim, config.subln, config.layernorm_eps)

    def _norm_factory(self, is_moe: bool):
        config = self.config
        if is_moe and config.moe.strata is not None:
            # Stratified MoE normalises its input itself, one LayerNorm per stratum (Stratified MoE Eq. 4).
            return nn.Identity
        return lambda: nn.LayerNorm(config.dim, eps=config.layernorm_eps)

    def moe_layers(self) -> Iterator[MoELayerSlot]:
        """The MoE FFNs in depth order (vision, language or shared, then the VL-FFN within a layer)."""
        for block in self.layers:
            for modality, layer in block.moe_ffns_by_modality():
                yield MoELayerSlot(block.index, modality, layer)

    def reset_parameters(self) -> None:
        std = BEIT3_INIT_STD
        # Routers and MH-MoE split/merge layers keep their papers' init; experts are handled below.
        inside_moe = {id(sub) for moe in self.modules() if isinstance(moe, MoEFeedForward) for sub in moe.modules()}
        for module in self.modules():
            if isinstance(module, nn.Linear) and id(module) not in inside_moe:
                init_beit3_(module.weight, std)
                nn.init.zeros_(module.bias)
            elif isinstance(module, nn.LayerNorm):
                nn.init.ones_(module.weight)
                nn.init.zeros_(module.bias)
            elif isinstance(module, GroupedExperts):
                for weight in (module.fc1_weight, module.fc2_weight):
                    init_beit3_(weight, std)
                nn.init.zeros_(module.fc1_bias)
                nn.init.zeros_(module.fc2_bias)
        nn.init.normal_(self.text_embed.weight, std=self.config.dim**-0.5)
        for table in (self.vision_positions, self.text_positions):
            init_beit3_(table, std)
        nn.init.zeros_(self.cls_token)
        nn.init.zeros_(self.mask_token)

    def embed_image(self, image: torch.Tensor, image_mask: torch.Tensor | None = None) -> torch.Tensor:
        """(B, C, H, W) -> (B, 1 + num_patches, D): CLS + patches, masked patches replaced, positions added."""
        config = self.config
        if image.shape[-2:] != (config.image_size, config.image_size):
            raise ValueError(
                f"image of size {tuple(image.shape[-2:])} does not match MultiwayConfig.image_size={config.image_size}"
            )
        patches = self.patch_embed(image).flatten(2).transpose(1, 2)  # (B, N, D)
        if image_mask is not None:
            patches = torch.where(image_mask[..., None], self.mask_token.to(patches.dtype), patches)
        x = torch.cat([self.cls_token.expand(patches.shape[0], -1, -1).to(patches.dtype), patches], dim=1)
        offset = config.position_offset
        return x + self.vision_positions[offset : offset + x.shape[1]]

    def embed_text(self, text: torch.Tensor) -> torch.Tensor:
        """(B, T) token ids -> (B, T, D) with positions added."""
        offset, length = self.config.position_offset, text.shape[1]
        if offset + length > self.config.max_text_positions:
            raise ValueError(
                f"text of {length} tokens (+ position_offset {offset}) exceeds "
                f"MultiwayConfig.max_text_positions={self.config.max_text_positions}"
            )
        return self.text_embed(text) + self.text_positions[offset : offset + length]

    def forward(
        self,
        image: torch.Tensor | None = None,
        text: torch.Tensor | None = None,
        text_padding_mask: torch.Tensor | None = None,
        image_mask: torch.Tensor | None = None,
        attn_mask: torch.Tensor | None = None,
    ) -> BackboneOutput:
        """Args:
        image: (B, C, H, W) pixels, or None for text-only input.
        text: (B, T) token ids, or None for image-only input.
        text_padding_mask: (B, T) bool, True = padding.
        image_mask: (B, num_patches) bool, True = patch replaced by the mask token.
        attn_mask: optional (B or 1, L, L) bool, True = query may attend to key, combined with the padding
            mask (e.g. BEiT-3 captioning's image-bidirectional / text-causal mask).
        """
        if image is None and text is None:
            raise ValueError("MultiwayTransformer needs an image, a text, or both")
        image_x = self.embed_dropout(self.embed_image(image, image_mask)) if image is not None else None
        text_x = self.embed_dropout(self.embed_text(text)) if text is not None else None
        if text is None:
            text_padding_mask = None
        mask = _attention_mask(image_x, text_x, text_padding_mask, attn_mask)

        records: list[RoutingRecord | DepthRecord] = []
        carried = initial_gate_residuals(self.config, {VISION: image_x, LANGUAGE: text_x})
        for layer in self.layers:
            image_x, text_x, layer_records, carried = self.run_layer(
                layer, image_x, text_x, text_padding_mask, mask, carried
            )
            records.extend(layer_records)
        return self._output(image_x, text_x, records)

    def run_layer(
        self,
        layer: MultiwayBlock,
        image_x: torch.Tensor | None,
        text_x: torch.Tensor | None,
        text_padding_mask: torch.Tensor | None,
        mask: torch.Tensor | None,
        gate_residuals: GateResiduals | None = None,
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, list, GateResiduals | None]:
        """One of :attr:`layers` as :meth:`forward` runs it: recomputed in the backward pass where the config asks
        (``checkpoint_activations``, in training), and MoE++'s carried logits handed on
        (:mod:`mmoe.model.gate_residuals`; None without them). Returns the outputs, the records and the logits."""
        if self.config.checkpoint_activations and self.training:
            image_x, text_x, records = checkpoint(
                layer, image_x, text_x, text_padding_mask, mask, None, gate_residuals, use_reentrant=False
            )
        else:
            image_x, text_x, records = layer(image_x, text_x, text_padding_mask, mask, None, gate_residuals)
        return image_x, text_x, records, next_gate_residuals(gate_residuals, records)

    def _output(self, image_x: torch.Tensor | None, text_x: torch.Tensor | None, records: list) -> BackboneOutput:
        parts = [x for x in (image_x, text_x) if x is not None]
        if self.final_norm is not None:
            parts = [norm(x) for norm, x in zip(self.final_norm, (image_x, text_x), strict=True) if x is not None]
        hidden = torch.cat(parts, dim=1) if len(parts) > 1 else parts[0]
        image_len = 0 if image_x is None else image_x.shape[1]
        text_len = 0 if text_x is None else text_x.shape[1]
        routing = [record for record in records if not isinstance(record, DepthRecord)]
        depths = [record for record in records if isinstance(record, DepthRecord)]
        image_depth = None
        if depths:  # each routed layer a token skipped takes one layer off its depth
            image_depth = self.config.depth - sum((~record.processed).long() for record in depths)
            if self.training:
                self._count_patch_depths(image_depth)
        return BackboneOutput(hidden, image_len, text_len, routing, depths, image_depth)

    @torch.no_grad()
    def _count_patch_depths(self, image_depth: torch.Tensor) -> None:
        patches = image_depth[:, 1:].reshape(-1)  # the CLS runs every layer
        if self._patch_depth_counts is None:
            self._patch_depth_counts = patches.new_zeros(self.config.depth + 1)
        self._patch_depth_counts.index_add_(0, patches, torch.ones_like(patches))

    def take_patch_depth_counts(self) -> torch.Tensor | None:
        """(depth + 1,) long: how many image patches ran 0, 1, ..., depth layers in the training forwards since the
        last call (Mixture-of-Depths' routed layers let a patch skip some), then starts the count again; None when
        nothing was counted (no depth routing, no training forward with an image). No host sync."""
        counts, self._patch_depth_counts = self._patch_depth_counts, None
        return counts

    def routes_each_token_alone(self) -> bool:
        """Whether, in the current mode (training or eval), every MoE layer routes each token on its own
        (:meth:`mmoe.moe.MoEConfig.routes_each_token_alone`): a token's output then depends only on the tokens it
        attends to, so a decoder may keep earlier tokens' keys and values (:meth:`image_context`)."""
        return all(slot.layer.config.routes_each_token_alone(self.training) for slot in self.moe_layers())

    def image_context(self, image: torch.Tensor) -> list[ImageContext]:
        """Per layer, the keys and values of ``image``'s tokens in an image-text sequence whose image tokens attend
        to the image only (BEiT-3 captioning's mask, :func:`mmoe.tasks.captioning.caption_attention_mask`). Computed
        once per image, they let each decoding step run its text tokens alone (:meth:`forward_text`); the result is
        that of :meth:`forward` on the whole sequence where :meth:`routes_each_token_alone` holds (depth routing
        included: its router ranks the image's patches only)."""
        image_x = self.embed_dropout(self.embed_image(image))
        carried = initial_gate_residuals(self.config, {VISION: image_x})
        context = []
        for layer in self.layers:
            image_x, keys_values, records = layer.image_keys_values(image_x, carried)
            carried = next_gate_residuals(carried, records)
            context.append(keys_values)
        return context

    def forward_text(
        self, text: torch.Tensor, image_context: list[ImageContext], attn_mask: torch.Tensor | None = None
    ) -> BackboneOutput:
        """The text tokens of an image-text sequence whose image's keys and values are ``image_context``
        (:meth:`image_context`, expanded to the text's batch): their hidden states (``image_len`` 0) and routing.
        ``attn_mask``: (B or 1, T, L_i + T) bool, True = may attend, the image's keys first (the text rows of
        captioning's mask)."""
        text_x = self.embed_dropout(self.embed_text(text))
        mask = _attention_mask(None, text_x, None, attn_mask)
        routing: list[RoutingRecord] = []
        carried = initial_gate_residuals(self.config, {LANGUAGE: text_x})
        for layer, context in zip(self.layers, image_context, strict=True):
            _, text_x, records = layer(None, text_x, None, mask, image_context=context, gate_residuals=carried)
            carried = next_gate_residuals(carried, records)
            routing.extend(records)
        return self._output(None, text_x, routing)


def resize_vision_positions(table: torch.Tensor, old: MultiwayConfig, new: MultiwayConfig) -> torch.Tensor:
    """Bicubic resize of the patch rows of a vision position table from ``old``'s patch grid to ``new``'s; the
    ``position_offset`` rows and the CLS row are kept (BEiT-3 ``load_model_and_may_interpolate``)."""
    if old.position_offset != new.position_offset:
        raise ValueError(
            f"MultiwayConfig.position_offset={new.position_offset} differs from the checkpoint's {old.position_offset}"
        )
    keep = old.position_offset + 1
    side_old, side_new = old.image_size // old.patch_size, new.image_size // new.patch_size
    grid = table[keep:].reshape(1, side_old, side_old, -1).permute(0, 3, 1, 2).float()
    grid = F.interpolate(grid, size=(side_new, side_new), mode="bicubic", align_corners=False)
    patches = grid.permute(0, 2, 3, 1).reshape(side_new * side_new, -1).to(table.dtype)
    return torch.cat([table[:keep], patches])


def _attention_mask(image_x, text_x, text_padding_mask, attn_mask) -> torch.Tensor | None:
    """Boolean (B, 1, L or 1, L) mask, True = may attend, from the text padding and an optional extra mask."""
    mask = None
    if text_padding_mask is not None and bool(text_padding_mask.any()):
        keys = ~text_padding_mask
        if image_x is not None:
            keys = torch.cat([keys.new_ones(image_x.shape[:2]), keys], dim=1)
        mask = keys[:, None, None, :]
    if attn_mask is not None:
        extra = attn_mask[:, None] if attn_mask.dim() == 3 else attn_mask
        mask = extra if mask is None else mask & extra
    return mask
