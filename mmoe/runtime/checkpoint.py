"""Save and load backbone weights: exported backbones and Lightning checkpoints of any mmoe task.

An exported backbone is one ``torch.save``d dict ``{"format": "mmoe-backbone", "config": {...}, "state_dict": {...}}``
(written atomically). A Lightning checkpoint of an mmoe task holds the task's init arguments under
``hyper_parameters`` (``backbone``: the :class:`MultiwayConfig` as a dict; older pre-training checkpoints hold the
instance) and the weights under ``state_dict`` with the ``backbone.`` prefix; both load with :func:`load_backbone`, as
does a folder written by ``mmoe export`` (safetensors, :mod:`mmoe.model.pretrained`).

Every file is read with ``torch.load(weights_only=True)`` (:func:`mmoe.safe_load.load_checkpoint_file`): unpickling
a checkpoint rebuilds only tensors, containers, numbers, strings and the configs registered below, never an arbitrary
callable, so a crafted file cannot run code. A file that is not a readable checkpoint is a ``ValueError`` naming it.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from mmoe.atomic import atomic_write
from mmoe.model import MoEPlan, MultiwayConfig, MultiwayTransformer
from mmoe.model.beit3 import beit3_config, is_beit3_state, mmoe_state, read_beit3
from mmoe.model.config import config_from_dict, config_to_dict
from mmoe.model.pretrained import load_weights, read_backbone
from mmoe.safe_load import load_checkpoint_file, require_finite_weights

BACKBONE_FORMAT = "mmoe-backbone"
PREFIX = "backbone."
#: What :func:`read_backbone_state` reads, as its errors name it.
BACKBONE_FILES = (
    "an exported mmoe backbone, a Lightning checkpoint of an mmoe task or a released BEiT-3 checkpoint, written by "
    "torch.save"
)


@dataclasses.dataclass
class PretrainedWeights:
    """What a ``pretrained`` file gives a task.

    Attributes:
        config: the backbone architecture it was trained with.
        backbone: the backbone's state dict (mmoe keys).
        heads: a released BEiT-3 file's other weights (task or pre-training heads, unilm names); empty for mmoe files.
        source: the file.
    """

    config: MultiwayConfig
    backbone: dict[str, torch.Tensor]
    heads: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)
    source: str = ""


# The only classes a checkpoint may hold besides tensors and builtins: a task's hyper-parameters keep the backbone's
# config (as these dataclasses when the task was built outside LightningCLI).
torch.serialization.add_safe_globals([MultiwayConfig, MoEPlan])


def atomic_save(obj: object, path: str | Path) -> None:
    """``torch.save`` to a temporary file beside ``path``, then rename: a reader never sees a partial file."""
    atomic_write(path, lambda temporary: torch.save(obj, temporary))


def export_backbone(backbone: MultiwayTransformer, path: str | Path) -> None:
    state = {"format": BACKBONE_FORMAT, "config": config_to_dict(backbone.config), "state_dict": backbone.state_dict()}
    atomic_save(state, path)


def read_backbone_state(path: str | Path) -> tuple[MultiwayConfig, dict[str, torch.Tensor]]:
    """(config, backbone state dict) of :func:`read_pretrained`."""
    weights = read_pretrained(path)
    return weights.config, weights.backbone


def read_pretrained(path: str | Path) -> PretrainedWeights:
    """The backbone (and, for a released BEiT-3 file, the heads) of an exported backbone, a Lightning checkpoint of
    an mmoe task or a BEiT-3 checkpoint (:mod:`mmoe.model.beit3`); errors as :func:`load_checkpoint_file`'s, and
    weights that hold NaN or Inf (:func:`require_finite_weights`) or a BEiT-3 backbone key mmoe has no place for are
    errors naming the file. A folder written by ``mmoe export`` (:mod:`mmoe.model.pretrained`) gives its backbone."""
    if Path(path).is_dir():
        config, weights = read_backbone(path)
        return PretrainedWeights(config, weights, source=str(path))
    state = load_checkpoint_file(path, "checkpoint", BACKBONE_FILES)
    require_finite_weights(state, path)
    return pretrained_of(state, path)


def pretrained_of(state: dict, path: str | Path) -> PretrainedWeights:
    """:func:`read_pretrained` of the dict already loaded from ``path``."""
    if is_beit3_state(state):
        released = read_beit3(state, name=str(path))
        weights, unexpected = mmoe_state(released)
        if unexpected:
            raise ValueError(f"checkpoint {path} has BEiT-3 keys this backbone has no place for, e.g. {unexpected[0]}")
        return PretrainedWeights(beit3_config(released), weights, released.heads, str(path))
    if state.get("format") == BACKBONE_FORMAT:
        config, weights = state.get("config"), state.get("state_dict")
    else:
        hyper_parameters = state.get("hyper_parameters")
        config = hyper_parameters.get("backbone") if isinstance(hyper_parameters, dict) else None
        weights = state.get("state_dict")
        if isinstance(weights, dict):
            weights = {k[len(PREFIX) :]: v for k, v in weights.items() if k.startswith(PREFIX)}
    if isinstance(config, dict):
        try:
            config = config_from_dict(config)
        except (TypeError, ValueError) as error:  # a field this MultiwayConfig does not have, or a bad value
            raise ValueError(f"checkpoint {path} holds a backbone config this mmoe cannot build: {error}") from None
    if not isinstance(config, MultiwayConfig) or not isinstance(weights, dict):
        raise ValueError(
            f"checkpoint {path} is neither an exported mmoe backbone, a Lightning checkpoint of an mmoe task nor a "
            "BEiT-3 checkpoint (expected hyper_parameters.backbone and state_dict, or BEiT-3's encoder.layers keys)"
        )
    return PretrainedWeights(config, weights, source=str(path))


def load_backbone(path: str | Path, **config_overrides) -> MultiwayTransformer:
    """Rebuild the backbone a checkpoint was trained with and load its weights (``config_overrides`` e.g. frozen
    routing for fine-tuning must not change parameter shapes)."""
    config, weights = read_backbone_state(path)
    if config_overrides:
        config = dataclasses.replace(config, **config_overrides)
    backbone = MultiwayTransformer(config)
    load_weights(backbone, weights, f"checkpoint {path} does not match its own config")
    return backbone
