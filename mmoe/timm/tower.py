"""The vision tower of an mmoe multiway backbone behind timm's model interface.

The image-only path of :class:`mmoe.model.MultiwayTransformer` (BEiT-3, Wang et al., 2023, §2.1: every layer's
vision attention projections, LayerNorms and vision FFN or MoE FFN; a backbone whose MoE is shared routes the image
tokens through that one MoE) is the feature extractor; on top sits BEiT-3's ImageNet head (unilm ``beit3``
``BEiT3ForImageClassification``): the mean of the patch tokens (not the CLS token) -> LayerNorm -> Linear, the
linear's initial weights and bias scaled by 0.001.

timm's conventions, as its ``vision_transformer.py`` and ``beit.py`` keep them: ``forward_features`` gives the tokens
``(B, 1 + N, D)`` after the backbone (CLS first), ``forward_head(x, pre_logits)`` pools and classifies,
``forward_intermediates`` gives the patch grid after chosen layers as ``NCHW`` maps (``features_only=True`` wraps the
model in timm's ``FeatureGetterNet``, which calls it), ``prune_intermediate_layers`` drops the layers and head a
feature extractor does not use, ``feature_info`` names one entry per layer.

The routing records of the MoE layers of the last forward (:class:`mmoe.moe.RoutingRecord`, depth order) are kept as
``routing``; :meth:`MMoEVisionTower.forward_backbone` returns them with the tokens, and ``backbone.moe_layers()``
gives the layers themselves.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch
from timm.models._features import feature_take_indices  # in that module's __all__; timm.models leaves it out
from torch import nn

from mmoe.model.backbone import BackboneOutput, MultiwayTransformer, resize_vision_positions
from mmoe.model.config import MultiwayConfig
from mmoe.model.gate_residuals import initial_gate_residuals
from mmoe.model.heads import classification_head, init_head
from mmoe.model.layers import VISION
from mmoe.model.pretrained import WEIGHTS_FILE, PretrainedFolderError, load_weights, read_backbone
from mmoe.moe import RoutingRecord

#: The pooling of :meth:`MMoEVisionTower.forward_head`: BEiT-3's mean of the patch tokens, the CLS token, or none.
GLOBAL_POOLS = ("avg", "token", "")


def pretrained_folder(path: str | Path) -> Path:
    """The ``mmoe export`` folder ``path`` names: the folder itself, or the folder of its ``model.safetensors``."""
    path = Path(path)
    return path.parent if path.name == WEIGHTS_FILE and not path.is_dir() else path


class MMoEVisionTower(nn.Module):
    """An mmoe backbone's image-only path with BEiT-3's ImageNet head, as a timm model.

    Args:
        cfg: the backbone's config (its ``image_size`` the input side the model takes).
        num_classes: classes of the head; 0 = no head (``forward`` gives the pooled, normed features).
        global_pool: ``"avg"`` (BEiT-3: mean of the patch tokens), ``"token"`` (the CLS token) or ``""`` (none).
        drop_rate: dropout before the head's linear.
        drop_path_rate: stochastic depth of the backbone (None: the config's ``drop_path``).
        in_chans: image channels; must be the config's ``in_channels`` (timm passes its pretrained config's).
        img_size: input side (None: the config's); a folder of another side has its position table resized
            (:func:`mmoe.model.backbone.resize_vision_positions`, BEiT-3's ``load_model_and_may_interpolate``).
    """

    def __init__(
        self,
        cfg: MultiwayConfig,
        num_classes: int = 1000,
        global_pool: str = "avg",
        drop_rate: float = 0.0,
        drop_path_rate: float | None = None,
        in_chans: int = 3,
        img_size: int | tuple[int, int] | None = None,
    ) -> None:
        super().__init__()
        if in_chans != cfg.in_channels:
            raise ValueError(f"in_chans={in_chans} differs from the backbone's in_channels={cfg.in_channels}")
        cfg = dataclasses.replace(
            cfg,
            image_size=square_side(img_size) if img_size is not None else cfg.image_size,
            drop_path=cfg.drop_path if drop_path_rate is None else drop_path_rate,
        )
        self.backbone = MultiwayTransformer(cfg)
        self.num_classes = num_classes
        self.global_pool = check_pool(global_pool)
        self.num_features = self.head_hidden_size = self.embed_dim = cfg.dim
        self.num_prefix_tokens = 1  # the CLS token
        self.feature_info = [
            dict(module=f"backbone.layers.{i}", num_chs=cfg.dim, reduction=cfg.patch_size) for i in range(cfg.depth)
        ]
        self.fc_norm = nn.LayerNorm(cfg.dim, eps=cfg.layernorm_eps)
        self.head_drop = nn.Dropout(drop_rate)
        self.head = self._new_head(num_classes)
        init_head(self.fc_norm)
        self.routing: list[RoutingRecord] = []

    def _new_head(self, num_classes: int) -> nn.Module:
        """BEiT-3's ImageNet classifier as the classification task builds it
        (:func:`mmoe.model.heads.classification_head`: weight and bias x 0.001 after :func:`init_head`), on the
        backbone's device and dtype."""
        if num_classes <= 0:
            return nn.Identity()
        like = self.backbone.patch_embed.weight
        _, head = classification_head(self.embed_dim, num_classes, self.backbone.config.layernorm_eps)
        return head.to(device=like.device, dtype=like.dtype)

    def load_pretrained(self, checkpoint_path: str | Path) -> None:
        """Loads the backbone of an ``mmoe export`` folder (or of the folder of its ``model.safetensors``), read by
        :func:`mmoe.model.pretrained.read_backbone`; what timm's ``load_pretrained`` calls (``custom_load``). The
        head is kept: the folder holds none for it."""
        folder = pretrained_folder(checkpoint_path)
        config, weights = read_backbone(folder)
        own = self.backbone.config
        if config.image_size != own.image_size:
            weights["vision_positions"] = resize_vision_positions(weights["vision_positions"], config, own)
        try:
            load_weights(self.backbone, weights, f"{folder / WEIGHTS_FILE} does not fit the model's backbone")
        except ValueError as error:
            raise PretrainedFolderError(str(error)) from None

    def get_classifier(self) -> nn.Module:
        return self.head

    def reset_classifier(self, num_classes: int, global_pool: str | None = None) -> None:
        """A new head of ``num_classes`` (0: none, ``forward`` gives the pre-logits); ``global_pool`` as in the
        constructor (None: kept)."""
        self.num_classes = num_classes
        if global_pool is not None:
            self.global_pool = check_pool(global_pool)
        self.head = self._new_head(num_classes)

    def forward_backbone(self, x: torch.Tensor) -> BackboneOutput:
        """mmoe's own image-only forward of the backbone: the tokens and the routing records (kept as ``routing``)."""
        output = self.backbone(image=x)
        self.routing = output.routing
        return output

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        """(B, C, H, W) -> (B, 1 + N, D): the CLS token and the patch tokens after the backbone (its final LayerNorm
        where the config has ``output_norm``)."""
        return self.forward_backbone(x).hidden

    def forward_head(self, x: torch.Tensor, pre_logits: bool = False) -> torch.Tensor:
        """(B, 1 + N, D) tokens -> (B, num_classes) logits; ``pre_logits``: the pooled, normed (B, D) features."""
        if self.global_pool:
            x = x[:, self.num_prefix_tokens :].mean(dim=1) if self.global_pool == "avg" else x[:, 0]
        x = self.head_drop(self.fc_norm(x))
        return x if pre_logits else self.head(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward_head(self.forward_features(x))

    def final_norm(self, x: torch.Tensor) -> torch.Tensor:
        """The backbone's final vision LayerNorm (none where the config has no ``output_norm`` or it was pruned)."""
        norms = self.backbone.final_norm
        return x if norms is None else norms[0](x)

    def forward_intermediates(
        self,
        x: torch.Tensor,
        indices: int | list[int] | None = None,
        return_prefix_tokens: bool = False,
        norm: bool = False,
        stop_early: bool = False,
        output_fmt: str = "NCHW",
        intermediates_only: bool = False,
    ) -> list[torch.Tensor] | tuple[torch.Tensor, list[torch.Tensor]]:
        """The patch tokens after the layers ``indices`` (timm's: an int n = the last n layers, a list = those
        layers, negative from the end; None = all), as (B, D, H/p, W/p) maps (``NCHW``) or (B, N, D) (``NLC``);
        ``norm``: through the final LayerNorm; ``return_prefix_tokens``: each paired with its (B, 1, D) CLS token.
        Returns the list alone (``intermediates_only``) or after the final tokens, those of :meth:`forward_features`
        (the layers run past the last index unless ``stop_early``)."""
        if output_fmt not in ("NCHW", "NLC"):
            raise ValueError(f"output_fmt must be 'NCHW' or 'NLC', got {output_fmt!r}")
        layers = self.backbone.layers
        take_indices, max_index = feature_take_indices(len(layers), indices)
        batch, _, height, width = x.shape
        x = self.backbone.embed_dropout(self.backbone.embed_image(x))
        intermediates, routing = [], []
        carried = initial_gate_residuals(self.backbone.config, {VISION: x})
        for index, layer in enumerate(layers[: max_index + 1] if stop_early else layers):
            x, _, records, carried = self.backbone.run_layer(layer, x, None, None, None, carried)
            routing.extend(records)
            if index in take_indices:
                intermediates.append(self.final_norm(x) if norm else x)
        self.routing = routing
        prefix = [y[:, : self.num_prefix_tokens] for y in intermediates]
        intermediates = [y[:, self.num_prefix_tokens :] for y in intermediates]
        if output_fmt == "NCHW":
            patch = self.backbone.config.patch_size
            grid = (height // patch, width // patch)
            intermediates = [y.reshape(batch, *grid, -1).permute(0, 3, 1, 2).contiguous() for y in intermediates]
        if return_prefix_tokens:
            intermediates = list(zip(intermediates, prefix, strict=True))
        return intermediates if intermediates_only else (self.final_norm(x), intermediates)

    def set_grad_checkpointing(self, enable: bool = True) -> None:
        """timm's switch for activation checkpointing: the backbone's ``checkpoint_activations``."""
        self.backbone.config.checkpoint_activations = enable

    def prune_intermediate_layers(
        self, indices: int | list[int] = 1, prune_norm: bool = False, prune_head: bool = True
    ) -> list[int]:
        """Drops the layers after the last of ``indices``, the final LayerNorm (``prune_norm``) and the head
        (``prune_head``); returns the indices as absolute layer numbers."""
        take_indices, max_index = feature_take_indices(len(self.backbone.layers), indices)
        self.backbone.layers = self.backbone.layers[: max_index + 1]
        if prune_norm:
            self.backbone.final_norm = None
        if prune_head:
            self.fc_norm = nn.Identity()
            self.reset_classifier(0, "")
        return take_indices


def check_pool(global_pool: str) -> str:
    if global_pool not in GLOBAL_POOLS:
        raise ValueError(f"global_pool must be one of {GLOBAL_POOLS}, got {global_pool!r}")
    return global_pool


def square_side(img_size: int | tuple[int, int]) -> int:
    """The side of a square input size (an int or ``(H, W)``); the backbone takes square images only."""
    if isinstance(img_size, int):
        return img_size
    height, width = img_size
    if height != width:
        raise ValueError(f"img_size={tuple(img_size)}: the mmoe backbone takes square images only")
    return height
