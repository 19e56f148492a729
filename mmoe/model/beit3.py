"""Released BEiT-3 weights (microsoft/unilm ``beit3/`` on torchscale) in mmoe's backbone, and back.

The released files (``beit3_base_patch16_224.pth``, the task checkpoints) hold torchscale's ``BEiT3`` module tree,
under ``beit3.`` in the unilm task models, wrapped in ``model`` or ``module``. Key by key (``X`` = ``A`` vision or
``B`` language, ``i`` a layer)::

    text_embed.weight                              -> text_embed.weight
    vision_embed.proj.{weight,bias}                -> patch_embed.{weight,bias}
    vision_embed.{cls_token,mask_token}            -> cls_token, mask_token
    encoder.embed_positions.{A,B}.weight           -> vision_positions, text_positions (rows from 2: position_offset 2)
    encoder.layers.i.self_attn_layer_norm.X        -> layers.i.attention.norm.{0,1}
    encoder.layers.i.self_attn.{q,k,v}_proj.X      -> layers.i.attention.qkv.{0,1} (rows [q; k; v])
    encoder.layers.i.self_attn.inner_attn_ln.X     -> layers.i.attention.inner_norm.{0,1}
    encoder.layers.i.self_attn.out_proj.X          -> layers.i.attention.out.{0,1}
    encoder.layers.i.final_layer_norm.X            -> layers.i.ffn_norm.{0,1}
    encoder.layers.i.ffn.X.{fc1,ffn_layernorm,fc2} -> layers.i.ffn.{0,1}.{fc1,norm,fc2}
    encoder.layer_norm.X                           -> final_norm.{0,1} (absent from the VQAv2 models: output_norm off)

The architecture is read from the shapes (width, depth, FFN width, vocabulary, patch size, image size from the vision
position rows, text positions, Sub-LN, final norm); the head count is not stored and is width / 64, as in every
released size. Keys outside the backbone are task heads (each fine-tuning task's ``beit3_heads``) or pre-training
heads, kept aside.
"""

from __future__ import annotations

import dataclasses
import math
import re
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch

from mmoe.model.backbone import MultiwayTransformer, resize_vision_positions
from mmoe.model.config import MultiwayConfig
from mmoe.safe_load import load_checkpoint_file

#: BEiT-3's first position index in both tables ("consistent with Fairseq").
POSITION_OFFSET = 2
#: Attention head width of every released BEiT-3 size (base 768 / 12, large 1024 / 16).
HEAD_DIM = 64
#: What a BEiT-3 checkpoint file is, as errors name it.
BEIT3_FILE = "a BEiT-3 checkpoint of microsoft/unilm (torchscale key layout), e.g. beit3_base_patch16_224.pth"
#: A key every BEiT-3 backbone has; its prefix is the backbone's prefix in the file.
ANCHOR = "encoder.layers.0.self_attn.q_proj.A.weight"
WAYS = {"A": 0, "B": 1}
LAYER_KEYS = {
    "self_attn_layer_norm": "attention.norm",
    "self_attn.inner_attn_ln": "attention.inner_norm",
    "self_attn.out_proj": "attention.out",
    "final_layer_norm": "ffn_norm",
}
FFN_KEYS = {"fc1": "fc1", "ffn_layernorm": "norm", "fc2": "fc2"}


@dataclass
class BEiT3Weights:
    """A BEiT-3 checkpoint split into backbone and the rest.

    Attributes:
        backbone: torchscale ``BEiT3`` keys (``text_embed.weight``, ``encoder.layers.0...``) -> tensors.
        heads: every other key of the file (task or pre-training heads, ``logit_scale``), prefix ``beit3.`` removed.
        source: the file it came from, or ``"state dict"``.
    """

    backbone: dict[str, torch.Tensor]
    heads: dict[str, torch.Tensor] = field(default_factory=dict)
    source: str = "state dict"


@dataclass
class BEiT3Load:
    """What :func:`load_beit3` built and what it did not use.

    Attributes:
        backbone: the mmoe backbone with the BEiT-3 weights.
        heads: the file's other weights (see :class:`BEiT3Weights`).
        unexpected: backbone keys of the file that have no place in mmoe's backbone (none for a released file).
    """

    backbone: MultiwayTransformer
    heads: dict[str, torch.Tensor]
    unexpected: list[str]


def is_beit3_state(state: Mapping) -> bool:
    """Whether a loaded checkpoint (or the ``model`` / ``module`` dict inside it) holds a BEiT-3 backbone."""
    return any(isinstance(key, str) and key.endswith(ANCHOR) for key in unwrap(state))


def unwrap(state: Mapping) -> Mapping:
    """The state dict inside a checkpoint: unilm saves ``{"model": ...}`` (DeepSpeed ``{"module": ...}``)."""
    for key in ("model", "module", "state_dict"):
        inner = state.get(key)
        if isinstance(inner, Mapping) and not any(k.endswith(ANCHOR) for k in state if isinstance(k, str)):
            return unwrap(inner)
    return state


def read_beit3(source: str | Path | Mapping, name: str | None = None) -> BEiT3Weights:
    """The backbone and head weights of a BEiT-3 checkpoint file (``.pth`` or the same zip archive saved as ``.zip``,
    read with ``weights_only=True``) or of a state dict already loaded (``name``: the file it came from, for errors).

    Raises:
        FileNotFoundError: the file does not exist.
        ValueError: the file is unreadable or holds no BEiT-3 backbone (one line naming it and its first keys).
    """
    name = name or ("state dict" if isinstance(source, Mapping) else str(source))
    state = source if isinstance(source, Mapping) else load_checkpoint_file(source, "BEiT-3 checkpoint", BEIT3_FILE)
    state = unwrap(state)
    anchors = [key for key in state if isinstance(key, str) and key.endswith(ANCHOR)]
    if not anchors:
        first = ", ".join(list(map(str, state))[:3]) or "none"
        raise ValueError(f"{name} is not a BEiT-3 checkpoint: it has no key *{ANCHOR} (first keys: {first})")
    prefix = anchors[0][: -len(ANCHOR)]
    if prefix and not prefix.endswith("."):
        raise ValueError(f"{name} is not a BEiT-3 checkpoint: unexpected key {anchors[0]}")
    backbone, heads = {}, {}
    for key, value in state.items():
        if not isinstance(value, torch.Tensor):
            continue
        if key.startswith(prefix) and key[len(prefix) :].split(".", 1)[0] in ("text_embed", "vision_embed", "encoder"):
            backbone[key[len(prefix) :]] = value
        else:
            heads[key.removeprefix(prefix)] = value
    return BEiT3Weights(backbone, heads, name)


def beit3_config(weights: BEiT3Weights, **overrides) -> MultiwayConfig:
    """The :class:`MultiwayConfig` of the checkpoint's shapes, with ``overrides`` over it (e.g. ``image_size=480``:
    the vision position table is resized; ``drop_path=0.1``; anything that changes a weight's shape is refused at
    load time)."""
    state = weights.backbone
    vocab_size, dim = state["text_embed.weight"].shape
    patch = state["vision_embed.proj.weight"]
    vision_rows = state["encoder.embed_positions.A.weight"].shape[0]
    side = math.isqrt(vision_rows - POSITION_OFFSET - 1)
    if side * side != vision_rows - POSITION_OFFSET - 1:
        raise ValueError(
            f"{weights.source}: encoder.embed_positions.A.weight has {vision_rows} rows, not 2 + 1 + a square"
        )
    layers = {int(match.group(1)) for key in state if (match := re.match(r"encoder\.layers\.(\d+)\.", key))}
    fields = dict(
        dim=dim,
        depth=max(layers) + 1,
        num_heads=max(1, dim // HEAD_DIM),
        ffn_dim=state["encoder.layers.0.ffn.A.fc1.weight"].shape[0],
        image_size=side * patch.shape[-1],
        patch_size=patch.shape[-1],
        in_channels=patch.shape[1],
        vocab_size=vocab_size,
        max_text_positions=state["encoder.embed_positions.B.weight"].shape[0],
        position_offset=POSITION_OFFSET,
        attention="multiway",
        subln="encoder.layers.0.ffn.A.ffn_layernorm.weight" in state,
        output_norm="encoder.layer_norm.A.weight" in state,
    )
    return MultiwayConfig(**(fields | overrides))


#: BEiT-3 keys that map one to one, whatever the layer.
SIMPLE_KEYS = {
    "text_embed.weight": "text_embed.weight",
    "vision_embed.proj.weight": "patch_embed.weight",
    "vision_embed.proj.bias": "patch_embed.bias",
    "vision_embed.cls_token": "cls_token",
    "vision_embed.mask_token": "mask_token",
    "encoder.embed_positions.A.weight": "vision_positions",
    "encoder.embed_positions.B.weight": "text_positions",
}


def mmoe_key(key: str) -> str | None:
    """The mmoe backbone key of one BEiT-3 backbone key (q / k / v projections: the fused ``qkv`` key, whose rows
    the caller stacks); None for a key mmoe has no place for."""
    if key in SIMPLE_KEYS:
        return SIMPLE_KEYS[key]
    if match := re.fullmatch(r"encoder\.layer_norm\.([AB])\.(weight|bias)", key):
        return f"final_norm.{WAYS[match.group(1)]}.{match.group(2)}"
    if match := re.fullmatch(r"encoder\.layers\.(\d+)\.ffn\.([AB])\.(fc1|ffn_layernorm|fc2)\.(weight|bias)", key):
        layer, way, module, kind = match.groups()
        return f"layers.{layer}.ffn.{WAYS[way]}.{FFN_KEYS[module]}.{kind}"
    if match := re.fullmatch(r"encoder\.layers\.(\d+)\.(.+)\.([AB])\.(weight|bias)", key):
        layer, module, way, kind = match.groups()
        if module in LAYER_KEYS:
            return f"layers.{layer}.{LAYER_KEYS[module]}.{WAYS[way]}.{kind}"
        if module in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"):
            return f"layers.{layer}.attention.qkv.{WAYS[way]}.{kind}"
    return None


def beit3_key(key: str, projection: str = "q") -> str:
    """The BEiT-3 key of an mmoe backbone key (for the fused ``qkv``: that of ``projection``); ``key`` itself when
    BEiT-3 has none."""
    simple = {ours: theirs for theirs, ours in SIMPLE_KEYS.items()}
    if key in simple:
        return simple[key]
    if match := re.fullmatch(r"final_norm\.([01])\.(weight|bias)", key):
        return f"encoder.layer_norm.{'AB'[int(match.group(1))]}.{match.group(2)}"
    if match := re.fullmatch(r"layers\.(\d+)\.ffn\.([01])\.(fc1|norm|fc2)\.(weight|bias)", key):
        layer, way, module, kind = match.groups()
        module = {ours: theirs for theirs, ours in FFN_KEYS.items()}[module]
        return f"encoder.layers.{layer}.ffn.{'AB'[int(way)]}.{module}.{kind}"
    if match := re.fullmatch(r"layers\.(\d+)\.(.+)\.([01])\.(weight|bias)", key):
        layer, module, way, kind = match.groups()
        modules = {ours: theirs for theirs, ours in LAYER_KEYS.items()} | {
            "attention.qkv": f"self_attn.{projection}_proj"
        }
        if module in modules:
            return f"encoder.layers.{layer}.{modules[module]}.{'AB'[int(way)]}.{kind}"
    return key


def mmoe_state(weights: BEiT3Weights) -> tuple[dict[str, torch.Tensor], list[str]]:
    """(mmoe backbone state dict, BEiT-3 backbone keys with no place in it) of a checkpoint's backbone weights."""
    state, unexpected, qkv = {}, [], {}
    for key, value in weights.backbone.items():
        target = mmoe_key(key)
        if target is None:
            unexpected.append(key)
        elif ".attention.qkv." in target:
            projection = key.split("self_attn.")[1][0]  # q, k or v
            qkv.setdefault(target, {})[projection] = value
        else:
            state[target] = value
    for target, parts in qkv.items():
        if set(parts) != {"q", "k", "v"}:
            raise ValueError(f"{weights.source}: {target} lacks {sorted({'q', 'k', 'v'} - set(parts))} projections")
        state[target] = torch.cat([parts["q"], parts["k"], parts["v"]])
    return state, unexpected


def load_beit3(source: str | Path | Mapping, **config_overrides) -> BEiT3Load:
    """:func:`from_beit3` with what it did not use: the heads and unexpected keys (see :class:`BEiT3Load`)."""
    weights = read_beit3(source)
    stored = beit3_config(weights)
    config = dataclasses.replace(stored, **config_overrides) if config_overrides else stored
    state, unexpected = mmoe_state(weights)
    if config.image_size != stored.image_size or config.patch_size != stored.patch_size:
        state["vision_positions"] = resize_vision_positions(state["vision_positions"], stored, config)
    backbone = MultiwayTransformer(config)
    expected = backbone.state_dict()
    for key, value in state.items():
        if key in expected and expected[key].shape != value.shape:
            raise ValueError(
                f"{weights.source} does not fit the backbone: {beit3_key(key)} has shape {tuple(value.shape)}, the "
                f"backbone's {key} {tuple(expected[key].shape)}"
            )
    missing = [key for key in expected if key not in state]
    if missing:
        hint = " (MoE FFNs start from dense ones with `mmoe upcycle`)" if config.moe is not None else ""
        raise ValueError(f"{weights.source} has no weights for {len(missing)} backbone keys, e.g. {missing[0]}{hint}")
    backbone.load_state_dict({key: value for key, value in state.items() if key in expected})
    return BEiT3Load(backbone, weights.heads, unexpected)


def from_beit3(source: str | Path | Mapping, **config_overrides) -> MultiwayTransformer:
    """An mmoe backbone in the exact BEiT-3 layout with a released checkpoint's weights.

    Args:
        source: a checkpoint path (``.pth``, or the same file named ``.zip``) or a state dict, pre-training or task
            model, with or without the ``beit3.`` / ``model`` wrapping.
        **config_overrides: :class:`MultiwayConfig` fields over the checkpoint's (``image_size`` resizes the vision
            positions bicubically as BEiT-3 does; ``drop_path``, ``checkpoint_activations``); a field that changes a
            weight's shape is refused naming the key and both shapes.

    Returns:
        The backbone, called as every mmoe backbone: ``.hidden`` is (B, L, D) in BEiT-3's order (image tokens, then
        text tokens). Keys outside the backbone (heads) are left out; :func:`load_beit3` returns them. Backbone keys
        with no place in mmoe's backbone (none in a released file) are named in a warning.
    """
    loaded = load_beit3(source, **config_overrides)
    if loaded.unexpected:
        first = ", ".join(loaded.unexpected[:3])
        warnings.warn(f"BEiT-3 keys left unused: {len(loaded.unexpected)} ({first})", stacklevel=2)
    return loaded.backbone


def to_beit3(backbone: MultiwayTransformer) -> dict[str, torch.Tensor]:
    """The backbone's weights in torchscale's ``BEiT3`` key layout (no ``beit3.`` prefix): loads into
    ``torchscale.model.BEiT3.BEiT3`` of the same shape. Only the layout BEiT-3 has can be exported: a dense backbone
    with multiway attention, no VL-FFN, Sub-LN and ``position_offset`` 2."""
    config = backbone.config
    problems = {
        "moe": config.moe is not None,
        "attention": config.attention != "multiway",
        "vl_layers": config.vl_layers != 0,
        "subln": not config.subln,
        "position_offset": config.position_offset != POSITION_OFFSET,
    }
    wrong = [name for name, bad in problems.items() if bad]
    if wrong:
        values = ", ".join(f"{name}={getattr(config, name)!r}" for name in wrong)
        raise ValueError(f"this backbone has no BEiT-3 layout ({values}); BEiT-3 is dense, multiway, Sub-LN, offset 2")
    exported = {}
    for key, value in backbone.state_dict().items():
        if ".attention.qkv." in key:
            for projection, part in zip("qkv", value.chunk(3), strict=True):
                exported[beit3_key(key, projection)] = part.clone()
        else:
            exported[beit3_key(key)] = value.clone()
    return exported
