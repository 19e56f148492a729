"""The optimiser of every mmoe task: AdamW, linear warm-up then cosine decay per step, and its parameter groups.

* No weight decay on biases, norms, position tables, CLS / mask tokens and the X-MoE router's expert embeddings and
  temperature (BEiT-3's optimiser factory, plus the router parameters whose scale X-MoE fixes).
* Optional BEiT-3 layer-wise learning-rate decay (unilm ``optim_factory.py``: embeddings are layer 0, ``layers.i`` is
  i + 1, the rest L + 1) and a task-head learning-rate multiplier (BEiT-3's ``--task_head_lr_weight``).

One typed config, :class:`OptimizerConfig`, is the ``optimizer`` argument of every task; each task states its own
default (:data:`PRETRAINING_OPTIMIZER`, :data:`FINETUNING_OPTIMIZER`). A setting named on the command line of a resume
(``--ckpt_path``) trains from the resumed step, the schedule going on from there (:mod:`mmoe.runtime.optimizer_resume`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

#: Parameters kept out of weight decay besides biases and norms (BEiT-3's optimiser factory, plus the X-MoE router's
#: expert embeddings, whose norm is fixed, and its temperature).
NO_DECAY = ("cls_token", "mask_token", "vision_positions", "text_positions", "expert_embeddings", "log_temperature")
#: Backbone parameters that count as BEiT-3's layer 0 for layer-wise learning-rate decay.
EMBEDDINGS = ("patch_embed", "cls_token", "mask_token", "vision_positions", "text_embed", "text_positions")


@dataclass(frozen=True)
class OptimizerConfig:
    """AdamW with a linear warm-up and a cosine decay of the learning rate, per optimiser step.

    Args:
        learning_rate: peak AdamW learning rate (of the top backbone layer; see ``layer_decay``).
        betas: AdamW betas (BEiT-3 and MH-MoE App. C pre-training: 0.9, 0.98; BEiT-3 fine-tuning: 0.9, 0.98 for
            VQAv2, 0.9, 0.999 elsewhere).
        eps: AdamW epsilon (BEiT-3 pre-training: 1e-6).
        weight_decay: AdamW weight decay; biases, norms, position tables, CLS / mask tokens and X-MoE router
            embeddings / temperatures get none.
        warmup_steps: linear warm-up steps, then cosine decay to ``min_lr_ratio * learning_rate`` at ``total_steps``.
        total_steps: length of the cosine schedule; None = the trainer's estimated stepping batches
            (``trainer.max_steps``).
        min_lr_ratio: final learning rate as a share of the peak.
        layer_decay: BEiT-3 layer-wise learning-rate decay: layer i's rate is scaled by
            ``layer_decay ** (depth + 1 - (i + 1))``, the embeddings' by ``layer_decay ** (depth + 1)`` (NLVR2 base:
            0.65; 1.0 = off).
        head_lr_multiplier: learning-rate multiplier of a fine-tuning task's head (BEiT-3 ``--task_head_lr_weight``:
            20 for VQAv2; 1.0 = off).
    """

    learning_rate: float = 1e-4
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.05
    warmup_steps: int = 100
    total_steps: int | None = None
    min_lr_ratio: float = 0.0
    layer_decay: float = 1.0
    head_lr_multiplier: float = 1.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "betas", tuple(self.betas))  # a list from YAML or a checkpoint
        checks = {
            "learning_rate": self.learning_rate > 0,
            "eps": self.eps > 0,
            "weight_decay": self.weight_decay >= 0,
            "warmup_steps": self.warmup_steps >= 0,
            "total_steps": self.total_steps is None or self.total_steps > 0,
            "min_lr_ratio": 0 <= self.min_lr_ratio <= 1,
            "layer_decay": self.layer_decay > 0,
            "head_lr_multiplier": self.head_lr_multiplier > 0,
            "betas": len(self.betas) == 2 and all(0 <= beta < 1 for beta in self.betas),
        }
        for name, valid in checks.items():
            if not valid:
                raise ValueError(f"model.optimizer.{name}={getattr(self, name)!r} is out of range")

    @classmethod
    def from_value(cls, value: OptimizerConfig | dict[str, Any]) -> OptimizerConfig:
        """The config itself, or one from the plain dict a checkpoint's hyper-parameters hold."""
        return value if isinstance(value, cls) else cls(**value)

    def to_dict(self) -> dict[str, Any]:
        """The plain dict a checkpoint stores (read back with ``weights_only=True``)."""
        return dataclasses.asdict(self) | {"betas": list(self.betas)}


#: The fine-tuning default.
FINETUNING_OPTIMIZER = OptimizerConfig()
#: The pre-training default: BEiT-3's AdamW (betas 0.9 / 0.98, eps 1e-6), decaying to 1 % of the peak.
PRETRAINING_OPTIMIZER = OptimizerConfig(learning_rate=1e-3, betas=(0.9, 0.98), eps=1e-6, min_lr_ratio=0.01)

#: The fields of :class:`OptimizerConfig`: flat task arguments of checkpoints written before the ``optimizer`` config.
OPTIMIZER_FIELDS = tuple(field.name for field in dataclasses.fields(OptimizerConfig))


def check_optimizer_fields(options: Mapping[str, Any], where: str) -> None:
    """Raises ValueError naming ``where`` and the first name of ``options`` that is not an :class:`OptimizerConfig`
    field (options that set some of its fields over a config's)."""
    unknown = sorted(set(options) - set(OPTIMIZER_FIELDS))
    if unknown:
        raise ValueError(f"{where}: {unknown[0]!r} is not an OptimizerConfig field")


def nest_optimizer_arguments(hparams: dict[str, Any]) -> dict[str, Any]:
    """A checkpoint's saved task arguments with flat optimiser arguments (``learning_rate``, ``betas``, ... as
    written before the ``optimizer`` config) moved into ``optimizer``; unchanged when there are none."""
    flat = {name: hparams[name] for name in OPTIMIZER_FIELDS if name in hparams}
    if not flat:
        return hparams
    rest = {name: value for name, value in hparams.items() if name not in flat}
    return rest | {"optimizer": {**dict(rest.get("optimizer") or {}), **flat}}


def warmup_cosine(warmup_steps: int, total_steps: int, min_ratio: float) -> Callable[[int], float]:
    """Learning-rate multiplier: linear warm-up to 1 over ``warmup_steps``, cosine decay to ``min_ratio``."""

    def multiplier(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return multiplier


def layer_id(name: str, depth: int) -> int:
    """BEiT-3's layer id of a backbone parameter name (without the ``backbone.`` prefix): 0 for embeddings,
    i + 1 for ``layers.i``, depth + 1 for the rest (final norms)."""
    first = name.split(".", 1)[0]
    if first in EMBEDDINGS:
        return 0
    if first == "layers":
        return int(name.split(".")[1]) + 1
    return depth + 1


def parameter_groups(module: nn.Module, config: OptimizerConfig, head_prefixes: tuple[str, ...] = ()) -> list[dict]:
    """AdamW parameter groups of a task module with a ``backbone`` (a :class:`MultiwayTransformer`).

    Each group carries ``config.weight_decay`` (or none: :data:`NO_DECAY`, biases, norms) and ``lr_scale``:
    ``config.layer_decay ** (depth + 1 - layer_id)`` for backbone parameters, ``config.head_lr_multiplier`` for
    parameters whose name starts with one of ``head_prefixes``, 1 otherwise. Groups with weight decay come first.
    """
    weight_decay, layer_decay, head_lr_multiplier = config.weight_decay, config.layer_decay, config.head_lr_multiplier
    depth = module.backbone.config.depth
    groups: dict[tuple[float, float], list[nn.Parameter]] = {}
    for name, parameter in module.named_parameters():
        if not parameter.requires_grad:
            continue
        skip = parameter.ndim < 2 or name.endswith(".bias") or name.split(".")[-1] in NO_DECAY
        if name.startswith("backbone."):
            scale = layer_decay ** (depth + 1 - layer_id(name[len("backbone.") :], depth))
        elif name.startswith(head_prefixes):
            scale = head_lr_multiplier
        else:
            scale = 1.0
        groups.setdefault((0.0 if skip else weight_decay, scale), []).append(parameter)
    ordered = sorted(groups.items(), key=lambda item: (item[0][0] == 0.0, item[0][1]))  # decayed groups first
    return [{"params": params, "weight_decay": decay, "lr_scale": scale} for (decay, scale), params in ordered]


def fused_kernel_applies(module: nn.Module) -> bool:
    """Whether torch's fused AdamW can update ``module``'s trainable parameters: all plain floating tensors on CPU or
    CUDA. It runs one kernel per step instead of a dozen small ops per parameter (the default on CPU): the same update
    up to float rounding, and faster on the demo's captioning task, whose text embedding holds most of its parameters
    (how much: docs/benchmarks.md, ``benchmarks/optimizer_step.py``). Sharded parameters (FSDP2's
    DTensors) keep torch's default."""
    trainable = [parameter for parameter in module.parameters() if parameter.requires_grad]
    return bool(trainable) and all(
        type(p.data) is torch.Tensor and p.device.type in ("cpu", "cuda") and p.is_floating_point() for p in trainable
    )


def schedule_length(config: OptimizerConfig, estimated_steps: Callable[[], float]) -> int:
    """The length of the warm-up cosine schedule: ``config.total_steps``, else ``estimated_steps()`` (the trainer's
    estimate, from ``trainer.max_steps``)."""
    total = config.total_steps or estimated_steps()
    if not math.isfinite(total):
        raise ValueError(
            "the cosine schedule needs a length: set trainer.max_steps or model.optimizer.total_steps (the loaders "
            "are iterable, so the trainer cannot count the steps of an epoch)"
        )
    return max(1, int(total))


def adamw_with_schedule(
    module: nn.Module,
    config: OptimizerConfig,
    head_prefixes: tuple[str, ...],
    estimated_steps: Callable[[], float],
    fused: bool = True,
) -> dict[str, Any]:
    """Lightning's ``configure_optimizers`` answer: AdamW over :func:`parameter_groups` and the warm-up cosine
    schedule per step, ``config.total_steps`` long (else ``estimated_steps()``, the trainer's estimate); torch's fused
    kernel where it applies (:func:`fused_kernel_applies`) unless ``fused`` is False."""
    groups = parameter_groups(module, config, head_prefixes)
    for group in groups:
        group["lr"] = config.learning_rate * group.pop("lr_scale")
    fused = fused and fused_kernel_applies(module)
    optimizer = torch.optim.AdamW(groups, lr=config.learning_rate, betas=config.betas, eps=config.eps, fused=fused)
    schedule = warmup_cosine(config.warmup_steps, schedule_length(config, estimated_steps), config.min_lr_ratio)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}
