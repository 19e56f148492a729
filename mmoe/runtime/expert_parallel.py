"""Expert parallelism in a Lightning run (``model.init_args.backbone.moe.expert_parallel: W``): the task's side of
:mod:`mmoe.moe.expert_parallel`.

At ``setup`` (after the process group exists, before DDP wraps the module and before the optimiser is built) every
MoE layer keeps E/W of its experts on each rank of an expert-parallel group of W consecutive ranks, and DDP is told to
leave the expert parameters out of its all-reduce. With more ranks than W (R = world / W replicas of each shard),
expert gradients are averaged over the R ranks that hold the same experts before each optimiser step; with the 1/W
scaling of the layer this makes a step equal one process on the same global batch (the balance loss excepted: as
under DDP, each rank's is over its own tokens).

Checkpoints hold every expert and the full optimiser state of every expert whatever W: the model state is gathered
by the layers' ``state_dict``, the optimiser state here (``on_save_checkpoint``), and both are sliced back to the
rank's experts when loaded (``on_load_checkpoint``), so a run resumes at another W or in one process. Stratified MoE
layers are not expert-sharded (``MoEPlan`` refuses ``strata`` with ``expert_parallel`` > 1, and
:func:`expert_parallel_layers` takes only the plain :class:`mmoe.moe.MoELayer` s).

The groups live in the task's declared ``expert_groups`` attribute (:class:`ExpertGroups`; None until sharded).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from mmoe.moe import MoELayer
from mmoe.moe.expert_parallel import EXPERT_PARALLEL_ATTRIBUTE, check_expert_parallel, expert_parallel_groups
from mmoe.runtime.torch_internals import keep_ddp_off


@dataclass(frozen=True)
class ExpertGroups:
    """The process groups of an expert-parallel run, as seen from this rank.

    Attributes:
        group: the W consecutive ranks that together hold every expert (the all-to-all group).
        replicas: the ranks that hold the same experts as this one (expert gradients are averaged over them).
        replica_count: R = world / W, the size of ``replicas``.
    """

    group: dist.ProcessGroup
    replicas: dist.ProcessGroup
    replica_count: int


def expert_parallel_size(task) -> int:
    plan = task.backbone.config.moe
    return 1 if plan is None else plan.expert_parallel


def expert_parallel_layers(backbone) -> list[MoELayer]:
    """The backbone's MoE layers that expert parallelism shards: the plain :class:`MoELayer` s (a Stratified layer
    is a different :class:`mmoe.moe.MoEFeedForward` and stays whole on every rank)."""
    return [slot.layer for slot in backbone.moe_layers() if isinstance(slot.layer, MoELayer)]


def shard_experts(task) -> None:
    """Shards the backbone's MoE layers over expert-parallel groups and keeps DDP off their experts (a no-op at
    ``expert_parallel: 1``). ValueError (one line) outside a distributed run or for sizes that do not divide."""
    size = expert_parallel_size(task)
    if size == 1 or task.expert_groups is not None:
        return
    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError(
            f"model.backbone.moe.expert_parallel={size} needs a distributed run (--trainer.devices / num_nodes with "
            "--trainer.strategy ddp); a single process holds every expert: set expert_parallel: 1"
        )
    world = dist.get_world_size()
    check_expert_parallel(task.backbone.config.moe.num_experts, size, world)
    group = expert_parallel_groups(size)
    replicas = None
    for residue in range(size):  # every rank creates every group, in the same order
        members = list(range(residue, world, size))
        made = dist.new_group(members)
        if dist.get_rank() % size == residue:
            replicas = made
    for layer in expert_parallel_layers(task.backbone):
        layer.shard_experts(group)
    task.expert_groups = ExpertGroups(group, replicas, world // size)
    ignored = [name for name, parameter in task.named_parameters() if is_expert_parallel(parameter)]
    keep_ddp_off(task, ignored)


def is_expert_parallel(parameter: torch.Tensor) -> bool:
    return getattr(parameter, EXPERT_PARALLEL_ATTRIBUTE, False)


def average_expert_gradients(task) -> None:
    """Averages expert gradients over the ranks that hold the same experts (nothing to do with one replica)."""
    groups = task.expert_groups
    if groups is None or groups.replica_count == 1:
        return
    for parameter in task.parameters():
        if is_expert_parallel(parameter) and parameter.grad is not None:
            dist.all_reduce(parameter.grad, group=groups.replicas)
            parameter.grad /= groups.replica_count


def _expert_states(task, optimizer_names: list[str]) -> dict[int, str]:
    """Optimiser state index -> name of the expert-parallel parameters (``optimizer_names`` in optimiser order)."""
    experts = {name for name, parameter in task.named_parameters() if is_expert_parallel(parameter)}
    return {index: name for index, name in enumerate(optimizer_names) if name in experts}


def gather_optimizer_states(task, checkpoint: dict[str, Any], optimizer_names: Callable[[], list[str]]) -> None:
    """Replaces each expert parameter's optimiser state tensors (E/W, ...) by the full (E, ...) stack gathered from
    the expert-parallel group (a collective: every rank saves). ``optimizer_names()``: parameter names in the
    optimiser's order."""
    if task.expert_groups is None:
        return
    optimizer_names = optimizer_names()
    group = task.expert_groups.group
    size = dist.get_world_size(group)
    for optimizer_state in checkpoint.get("optimizer_states", []):
        for index in sorted(_expert_states(task, optimizer_names)):
            if index not in optimizer_state["state"]:
                continue
            # A copy: optimizer.state_dict() hands out the live per-parameter state dicts.
            state = optimizer_state["state"][index] = dict(optimizer_state["state"][index])
            for key, value in state.items():
                if isinstance(value, torch.Tensor) and value.ndim > 0:
                    pieces = [torch.empty_like(value) for _ in range(size)]
                    dist.all_gather(pieces, value.contiguous(), group=group)
                    state[key] = torch.cat(pieces)


def slice_optimizer_states(task, checkpoint: dict[str, Any], optimizer_names: Callable[[], list[str]]) -> None:
    """The reverse of :func:`gather_optimizer_states` at load: each full expert state keeps this rank's slice."""
    if task.expert_groups is None:
        return
    optimizer_names = optimizer_names()
    group = task.expert_groups.group
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    num_experts = task.backbone.config.moe.num_experts
    local = num_experts // size
    for optimizer_state in checkpoint.get("optimizer_states", []):
        for index in _expert_states(task, optimizer_names):
            for key, value in optimizer_state["state"].get(index, {}).items():
                if isinstance(value, torch.Tensor) and value.ndim > 0 and value.shape[0] == num_experts:
                    optimizer_state["state"][index][key] = value[rank * local : (rank + 1) * local].clone()
