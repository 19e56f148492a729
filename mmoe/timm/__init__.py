"""mmoe backbones as timm models: ``import mmoe.timm`` registers one timm model per shipped pre-training config.

``mmoe_<size>_<router>``: ``<size>`` a backbone of ``configs/pretrain/<size>.yaml`` (``tiny``, ``base``), ``<router>``
a MoE part of ``configs/pretrain/<size>/<router>.yaml`` (``xmoe``, ``mhmoe``, ``switch``, ...) or ``dense`` (no part).
``timm.list_models("mmoe_*")`` lists them. timm finds models only through ``register_model`` at import (it reads no
package entry points), so the import is what makes the names known. Each is :class:`MMoEVisionTower`: the backbone's
image-only path with BEiT-3's ImageNet head::

    import mmoe.timm  # registers the names
    model = timm.create_model("mmoe_tiny_xmoe", pretrained=True, pretrained_cfg_overlay=dict(file="exports/xmoe"))

``file`` is an ``mmoe export`` folder (of a backbone or of a task model) or its ``model.safetensors``; mmoe ships no
weights, so ``pretrained=True`` needs one. The folder is read by :mod:`mmoe.model.pretrained`'s readers, and its
config must agree with the name's shipped config in what the name fixes: the backbone's shape
(:data:`NAMED_FIELDS`), dense or MoE, which layers are MoE layers, and how they route (:data:`NAMED_MOE_FIELDS`);
a folder that differs is refused in one line naming the field and both values. Everything else comes from the
folder's config: the image side (the model's ``pretrained_cfg["input_size"]``), drop path and dropout, the final
LayerNorm (``output_norm``; BEiT-3's ImageNet classifier runs without it), position offset, text vocabulary,
capacity and the training-only routing settings (balance losses, selection-bias rate, frozen routing, expert
kernels). The head is new (the folder holds none for it); ``num_classes=0`` leaves it out. Without ``pretrained``
the model is the shipped config's, freshly initialised.

``pretrained_cfg``: ``input_size`` the config's image side, mean = std = 0.5 per channel, bicubic resize and centre
crop of the whole side (``crop_pct`` 1), as mmoe's own evaluation transform (:mod:`mmoe.data.transforms`, BEiT-3's
IMAGENET_INCEPTION constants, which timm names ``IMAGENET_INCEPTION_MEAN`` / ``_STD``), what
``timm.data.resolve_model_data_config(model)`` reads. ``features_only=True`` gives the patch grid after the last
three layers (all of a shallower backbone; ``out_indices`` to choose) as ``(B, D, H/p, W/p)`` maps, p the patch size.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import yaml
from timm.data import IMAGENET_INCEPTION_MEAN, IMAGENET_INCEPTION_STD
from timm.models import build_model_with_cfg, generate_default_cfgs, register_model

from mmoe.model.config import MultiwayConfig, config_from_dict
from mmoe.model.pretrained import (
    CONFIG_FILE,
    WEIGHTS_FILE,
    PretrainedFolderError,
    backbone_config,
    read_folder_config,
)
from mmoe.timm.tower import MMoEVisionTower, pretrained_folder

__all__ = ["MODELS", "MMoEVisionTower", "create_tower", "shipped_config"]

#: The pre-training configs shipped in the package (``configs/`` at the repo root links here).
CONFIGS = Path(__file__).resolve().parents[1] / "configs"
#: The router part of a name whose backbone has no MoE layer (the size's config alone).
DENSE = "dense"
#: The backbone fields a model's name fixes: its weights' shapes and the attention layout.
NAMED_FIELDS = ("dim", "depth", "num_heads", "ffn_dim", "patch_size", "in_channels", "attention", "subln")
#: The MoE plan's fields a model's name fixes: the experts' pools and shapes, and how tokens are scored and chosen.
NAMED_MOE_FIELDS = (
    *("num_experts", "experts_by_modality", "heads", "strata", "beta", "shared_experts", "mode"),
    *("router", "gate", "routing_dim", "routing", "top_k", "renormalize", "routed_scaling_factor"),
)
#: The features ``features_only=True`` gives without ``out_indices``: the last three layers (timm's ViT default).
FEATURE_LAYERS = 3


def shipped_models() -> dict[str, tuple[str, str]]:
    """``mmoe_<size>_<router>`` -> (size, router) for every size config and its MoE parts, ``dense`` included."""
    models = {}
    for size_file in sorted((CONFIGS / "pretrain").glob("*.yaml")):
        size = size_file.stem
        for router in [DENSE, *sorted(part.stem for part in (CONFIGS / "pretrain" / size).glob("*.yaml"))]:
            models[f"mmoe_{size}_{router}"] = (size, router)
    return models


#: The registered names, each with its size and router.
MODELS = shipped_models()


def config_files(size: str, router: str) -> list[Path]:
    """The shipped configs a model is built from: the size's, then its router part (none for ``dense``)."""
    files = [CONFIGS / "pretrain" / f"{size}.yaml"]
    return files if router == DENSE else [*files, CONFIGS / "pretrain" / size / f"{router}.yaml"]


@functools.cache
def shipped_config(size: str, router: str) -> MultiwayConfig:
    """The backbone config of ``mmoe_<size>_<router>``: ``model.init_args.backbone`` of the size's config with the
    router part's over it, as ``mmoe fit --config <size>.yaml --config <size>/<router>.yaml`` merges them."""
    backbone: dict[str, Any] = {}
    for path in config_files(size, router):
        backbone |= yaml.safe_load(path.read_text())["model"]["init_args"]["backbone"]
    return config_from_dict(backbone)


def pretrained_cfg(size: str) -> dict[str, Any]:
    """timm's pretrained config of a size: its input, mmoe's normalisation and evaluation resize, the head's name."""
    config = shipped_config(size, DENSE)
    return dict(
        num_classes=1000,
        input_size=(config.in_channels, config.image_size, config.image_size),
        fixed_input_size=True,
        interpolation="bicubic",
        crop_pct=1.0,
        mean=IMAGENET_INCEPTION_MEAN,
        std=IMAGENET_INCEPTION_STD,
        first_conv="backbone.patch_embed",
        classifier="head",
    )


default_cfgs = generate_default_cfgs({name: pretrained_cfg(size) for name, (size, _) in MODELS.items()})


def create_tower(name: str, pretrained: bool = False, **kwargs: Any) -> MMoEVisionTower:
    """What ``timm.create_model(name, ...)`` runs: the shipped config's model, or with ``pretrained`` the model of
    the folder ``pretrained_cfg_overlay["file"]`` names, checked against the name (:func:`folder_config`), its
    weights loaded by timm's ``load_pretrained`` through :meth:`MMoEVisionTower.load_pretrained`.

    Raises:
        PretrainedFolderError: no folder named, an unreadable folder, or one whose config the name does not fit;
            one line.
    """
    size, router = MODELS[name]
    config = shipped_config(size, router)
    overlay = dict(kwargs.pop("pretrained_cfg_overlay", None) or {})
    out_indices = kwargs.pop("out_indices", None)
    if pretrained:
        folder, config = folder_config(name, overlay.get("file"))
        side = (config.in_channels, config.image_size, config.image_size)
        overlay |= {"file": str(folder), "custom_load": True, "input_size": side}
    return build_model_with_cfg(
        MMoEVisionTower,
        name,
        pretrained,
        pretrained_cfg_overlay=overlay,
        model_cfg=config,
        feature_cfg=dict(out_indices=out_indices or min(FEATURE_LAYERS, config.depth), feature_cls="getter"),
        **kwargs,
    )


def folder_config(name: str, file: str | Path | None) -> tuple[Path, MultiwayConfig]:
    """The folder ``file`` names and its backbone config, refused where it differs from ``name``'s shipped config
    in a field the name fixes (:data:`NAMED_FIELDS`, the MoE layers, :data:`NAMED_MOE_FIELDS`)."""
    if not file:
        raise PretrainedFolderError(
            f"{name}: pretrained=True needs an mmoe export folder (mmoe ships no weights): pass "
            f"pretrained_cfg_overlay=dict(file=<the folder or its {WEIGHTS_FILE}>)"
        )
    folder = pretrained_folder(file)
    config = backbone_config(folder, read_folder_config(folder))
    size, router = MODELS[name]
    difference = named_difference(shipped_config(size, router), config, name)
    if difference is not None:
        shipped = " + ".join(str(path.relative_to(CONFIGS.parent)) for path in config_files(size, router))
        raise PretrainedFolderError(
            f"{folder / CONFIG_FILE}: {difference} ({shipped}); expected the backbone the name "
            "fixes: create the mmoe_<size>_<router> model whose shipped config has the folder's architecture"
        )
    return folder, config


def named_difference(named: MultiwayConfig, folder: MultiwayConfig, name: str) -> str | None:
    """The first field the model ``name`` fixes where ``folder`` differs from ``named``, in an error's words, or
    None."""
    for field in NAMED_FIELDS:
        if getattr(folder, field) != getattr(named, field):
            return f"backbone.{field} is {getattr(folder, field)!r}, {name} has {getattr(named, field)!r}"
    if (folder.moe is None) != (named.moe is None):
        return (
            f"backbone.moe is null (dense), {name} has MoE layers"
            if folder.moe is None
            else f"backbone.moe sets MoE layers, {name} is dense"
        )
    if folder.moe_layer_indices() != named.moe_layer_indices():
        return f"the MoE layers are {folder.moe_layer_indices()}, {name} has {named.moe_layer_indices()}"
    for field in NAMED_MOE_FIELDS if named.moe is not None else ():
        if getattr(folder.moe, field) != getattr(named.moe, field):
            return f"backbone.moe.{field} is {getattr(folder.moe, field)!r}, {name} has {getattr(named.moe, field)!r}"
    return None


def entrypoint(name: str):
    """timm's entry function of ``name`` (registered under its ``__name__``, with this module's ``default_cfgs``)."""

    def create(pretrained: bool = False, **kwargs: Any) -> MMoEVisionTower:
        return create_tower(name, pretrained, **kwargs)

    create.__name__ = create.__qualname__ = name
    create.__module__ = __name__
    create.__doc__ = f"{name}: {' + '.join(str(path.name) for path in config_files(*MODELS[name]))} as a timm model."
    return create


for _name in MODELS:
    register_model(entrypoint(_name))
