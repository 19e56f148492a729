"""Save and load backbone weights: exported backbones and Lightning checkpoints of any mmoe task.

An exported backbone is one ``torch.save``d dict ``{"format": "mmoe-backbone", "config": {...}, "state_dict": {...}}``
(written atomically). A Lightning checkpoint of an mmoe task holds the task's init arguments under
``hyper_parameters`` (``backbone``: the :class:`MultiwayConfig`) and the weights under ``state_dict`` with the
``backbone.`` prefix; both load with :func:`load_backbone`.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from mmoe.atomic import atomic_write
from mmoe.model import MoEPlan, MultiwayConfig, MultiwayTransformer

BACKBONE_FORMAT = "mmoe-backbone"
PREFIX = "backbone."


def config_to_dict(config: MultiwayConfig) -> dict:
    return {f.name: getattr(config, f.name) for f in dataclasses.fields(config) if f.init} | {
        "moe": None if config.moe is None else dataclasses.asdict(config.moe)
    }


def config_from_dict(fields: dict) -> MultiwayConfig:
    fields = dict(fields)
    if isinstance(fields.get("moe"), dict):
        fields["moe"] = MoEPlan(**fields["moe"])
    return MultiwayConfig(**fields)


def atomic_save(obj: object, path: str | Path) -> None:
    """``torch.save`` to a temporary file beside ``path``, then rename: a reader never sees a partial file."""
    atomic_write(path, lambda temporary: torch.save(obj, temporary))


def export_backbone(backbone: MultiwayTransformer, path: str | Path) -> None:
    state = {"format": BACKBONE_FORMAT, "config": config_to_dict(backbone.config), "state_dict": backbone.state_dict()}
    atomic_save(state, path)


def read_backbone_state(path: str | Path) -> tuple[MultiwayConfig, dict[str, torch.Tensor]]:
    """(config, backbone state dict) from an exported backbone or a Lightning checkpoint of an mmoe task."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint {path} does not exist")
    try:
        state = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as error:  # noqa: BLE001 - any unpickling failure is reported the same way
        raise ValueError(f"checkpoint {path} could not be read: {error}") from error
    if not isinstance(state, dict):
        raise ValueError(f"checkpoint {path} holds a {type(state).__name__}, expected a dict")
    if state.get("format") == BACKBONE_FORMAT:
        return config_from_dict(state["config"]), state["state_dict"]
    hyper_parameters = state.get("hyper_parameters", {})
    config = hyper_parameters.get("backbone")
    if config is None or "state_dict" not in state:
        raise ValueError(
            f"checkpoint {path} is neither an exported mmoe backbone nor a Lightning checkpoint of an mmoe task "
            "(expected hyper_parameters.backbone and state_dict)"
        )
    if isinstance(config, dict):
        config = config_from_dict(config)
    weights = {k[len(PREFIX) :]: v for k, v in state["state_dict"].items() if k.startswith(PREFIX)}
    return config, weights


def load_backbone(path: str | Path, **config_overrides) -> MultiwayTransformer:
    """Rebuild the backbone a checkpoint was trained with and load its weights (``config_overrides`` e.g. frozen
    routing for fine-tuning must not change parameter shapes)."""
    config, weights = read_backbone_state(path)
    if config_overrides:
        config = dataclasses.replace(config, **config_overrides)
    backbone = MultiwayTransformer(config)
    backbone.load_state_dict(weights)
    return backbone
