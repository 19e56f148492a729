"""Fully sharded data parallel (FSDP2, ``torch.distributed.fsdp.fully_shard``) for mmoe backbones.

Each :class:`mmoe.model.layers.MultiwayBlock` is one FSDP unit (its attention, its FFNs and MoE layers, routers and
stacked experts), and the backbone root holds the rest (embeddings, position tables, final norms). A unit's
parameters are sharded on dim 0 over the data-parallel ranks: the stacked expert weights ``(E, D, H)`` split by
experts, so each rank stores E/W experts' weights between the unit's all-gather and its reduce-scatter; every rank
still computes every expert on its own tokens (this is FSDP, not expert parallelism). ``mixed_precision`` casts the
gathered parameters (e.g. bf16) and keeps gradient reduction in fp32; ``MultiwayConfig.checkpoint_activations``
recomputes each block in the backward, and composes with the units because both work per block.
"""

from __future__ import annotations

import torch
from torch import nn


def shard_backbone(
    backbone: nn.Module, mesh=None, param_dtype: torch.dtype | None = None, reshard_after_forward: bool = True
) -> nn.Module:
    """Applies ``fully_shard`` to every block of ``backbone`` (a :class:`mmoe.model.MultiwayTransformer`) and then
    to the backbone; returns it. ``mesh``: the data-parallel mesh (default: all ranks); ``param_dtype``: the dtype
    the gathered parameters compute in (None: their own), gradients reduced in fp32."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    options: dict = {"reshard_after_forward": reshard_after_forward}
    if mesh is not None:
        options["mesh"] = mesh
    if param_dtype is not None:
        options["mp_policy"] = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    for block in backbone.layers:
        fully_shard(block, **options)
    fully_shard(backbone, **options)
    return backbone


def shard_task(task: nn.Module, mesh, param_dtype: torch.dtype | None = None) -> None:
    """:func:`shard_backbone` on ``task.backbone``, then the task itself (its heads) as the root unit. Expert
    parallelism and FSDP are not combined: ValueError (one line) for a backbone with ``expert_parallel`` > 1."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    plan = task.backbone.config.moe
    if plan is not None and plan.expert_parallel > 1:
        raise ValueError(
            f"model.backbone.moe.expert_parallel={plan.expert_parallel} with a fully sharded (FSDP) strategy: use "
            "one of the two (expert_parallel with --trainer.strategy ddp, or expert_parallel: 1 with FSDP)"
        )
    shard_backbone(task.backbone, mesh, param_dtype)
    options: dict = {"mesh": mesh}
    if param_dtype is not None:
        options["mp_policy"] = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    fully_shard(task, **options)
