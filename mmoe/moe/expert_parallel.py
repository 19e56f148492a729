"""Expert parallelism over torch.distributed: each of the W ranks of an expert-parallel group holds E/W of a MoE
layer's experts, and the routed rows travel to them by all-to-all (as torchtitan, Tutel and DeepSpeed-MoE do).

Per forward, after the local routing and sort (:mod:`mmoe.moe.dispatch`), rows are in global expert order, so the
rows for rank w (experts ``w*E/W .. (w+1)*E/W - 1``) are one contiguous block:

1. one ``all_to_all_single`` exchanges the per-expert row counts (W x E/W integers);
2. a second, autograd-aware one (torch's functional ``all_to_all_single_autograd``) moves the rows with uneven
   splits; the received rows (source-major) are sorted by local expert and run through the same grouped path as a
   single-process layer;
3. the outputs go back through the inverse sort and the reverse all-to-all, and are combined as usual.

The splits are read to the host (``all_to_all_single`` takes Python lists), the one sync of the path.

Gradients: an expert's gradient sums the contributions of every rank's tokens; so that an expert-parallel step equals
a single-process step on the same global batch under data-parallel gradient averaging, each expert gradient is
scaled by 1/W (:meth:`mmoe.moe.GroupedExperts.keep_shard` registers the hook). Expert parameters carry
``expert_parallel = True``: data-parallel wrappers must not all-reduce them across the expert-parallel group (they are
different experts).

A layer is sharded by its own method, :meth:`mmoe.moe.MoELayer.shard_experts` (its experts keep their slice with
:meth:`mmoe.moe.GroupedExperts.keep_shard`); this module holds the shard description, the exchange and the hooks.
Stratified MoE layers are not expert-sharded.

Checkpoints hold every expert whatever the world size: the sharded layer's ``state_dict`` gathers the experts of all
ranks (a collective: every rank of the group must call it, as Lightning's checkpointing does), and ``load_state_dict``
takes a full set and keeps the local slice. A checkpoint saved with EP = 2 therefore loads in one process and the
reverse.

Shape legend: C rows (sorted choices), W ranks of the group, E experts, L = E/W local experts, D width.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as functional_collectives
from torch.profiler import record_function

#: Marks expert parameters of a sharded layer (data-parallel wrappers must leave them out of the all-reduce).
EXPERT_PARALLEL_ATTRIBUTE = "expert_parallel"


def check_expert_parallel(num_experts: int, expert_parallel: int, world_size: int) -> None:
    """ValueError (one line) unless ``expert_parallel`` divides both the experts and the world size."""
    if expert_parallel < 1:
        raise ValueError(f"expert_parallel must be >= 1, got {expert_parallel}")
    if num_experts % expert_parallel:
        raise ValueError(
            f"num_experts={num_experts} is not divisible by expert_parallel={expert_parallel}: each rank of the "
            "expert-parallel group holds num_experts / expert_parallel experts"
        )
    if world_size % expert_parallel:
        raise ValueError(
            f"expert_parallel={expert_parallel} does not divide the world size {world_size}: the ranks split into "
            "expert-parallel groups of that size"
        )


def expert_parallel_groups(expert_parallel: int) -> dist.ProcessGroup:
    """This rank's expert-parallel group: consecutive ranks ``[g*W, (g+1)*W)`` (every rank must call this, in the
    same order, after ``init_process_group``)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    if expert_parallel < 1 or world % expert_parallel:
        raise ValueError(f"expert_parallel={expert_parallel} does not divide the world size {world}")
    mine = None
    for start in range(0, world, expert_parallel):
        group = dist.new_group(list(range(start, start + expert_parallel)))
        if start <= rank < start + expert_parallel:
            mine = group
    return mine


@dataclass(frozen=True)
class ExpertShard:
    """Which experts this rank holds: ``[rank * local, (rank + 1) * local)`` of ``num_experts``."""

    group: dist.ProcessGroup
    size: int
    rank: int
    num_experts: int

    @classmethod
    def of_group(cls, group: dist.ProcessGroup, num_experts: int) -> ExpertShard:
        """This rank's share of ``num_experts`` experts over ``group``; ValueError (one line) for sizes that do not
        divide."""
        size = dist.get_world_size(group)
        check_expert_parallel(num_experts, size, dist.get_world_size())
        return cls(group, size, dist.get_rank(group), num_experts)

    @property
    def local(self) -> int:
        return self.num_experts // self.size

    @property
    def first(self) -> int:
        return self.rank * self.local


def exchange(rows_CD: torch.Tensor, offsets_E: torch.Tensor, shard: ExpertShard, experts) -> torch.Tensor:
    """Run rows sorted by global expert (slice ends ``offsets_E``) through the experts of their owners; returns the
    outputs in the same order. ``experts(rows, local_expert, local_offsets)`` runs this rank's experts."""
    size, local = shard.size, shard.local
    counts_E = torch.diff(offsets_E.long(), prepend=offsets_E.new_zeros(1, dtype=torch.long))
    with record_function("mmoe.moe.all_to_all"):
        received_counts = torch.empty_like(counts_E)
        dist.all_to_all_single(received_counts, counts_E, group=shard.group)  # (W, L): source s, local expert j
        send_splits = counts_E.view(size, local).sum(1).tolist()
        received_WL = received_counts.view(size, local)
        receive_splits = received_WL.sum(1).tolist()
        received = _all_to_all(rows_CD, receive_splits, send_splits, shard.group)
    # Source-major order -> local-expert order (stable: within an expert, sources keep their order).
    local_expert = torch.repeat_interleave(
        torch.arange(local, device=rows_CD.device).repeat(size), received_WL.flatten()
    )
    local_expert, order = torch.sort(local_expert, stable=True)
    offsets_L = torch.searchsorted(local_expert, torch.arange(local, device=rows_CD.device), right=True, out_int32=True)
    with record_function("mmoe.moe.experts"):
        outputs = experts(received.index_select(0, order), local_expert, offsets_L)
    back = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))
    outputs = outputs.index_select(0, back)
    with record_function("mmoe.moe.all_to_all"):
        return _all_to_all(outputs, send_splits, receive_splits, shard.group)


def _all_to_all(rows: torch.Tensor, output_splits: list[int], input_splits: list[int], group) -> torch.Tensor:
    """Autograd-aware uneven all-to-all of rows (its backward is the reverse exchange)."""
    exchanged = functional_collectives.all_to_all_single_autograd(rows.contiguous(), output_splits, input_splits, group)
    return functional_collectives.wait_tensor(exchanged)


def scale_gradient(factor: float):
    """A tensor hook that multiplies the gradient by ``factor``."""
    return lambda grad: grad * factor


def gather_full_experts(module, state_dict: dict, prefix: str, local_metadata) -> None:
    """state_dict post-hook of a sharded :class:`mmoe.moe.GroupedExperts`: every expert tensor as the full (E, ...)
    stack, gathered from the group's ranks."""
    shard: ExpertShard = module.shard
    for name, _ in module.named_parameters(recurse=False):
        key = prefix + name
        local = state_dict[key]
        pieces = [torch.empty_like(local) for _ in range(shard.size)]
        dist.all_gather(pieces, local.contiguous(), group=shard.group)
        state_dict[key] = torch.cat(pieces)


def keep_local_experts(module, state_dict: dict, prefix: str, *args) -> None:
    """load_state_dict pre-hook of a sharded :class:`mmoe.moe.GroupedExperts`: a full (E, ...) expert stack keeps
    this rank's slice (a local stack loads as is)."""
    shard: ExpertShard = module.shard
    for name, _ in module.named_parameters(recurse=False):
        key = prefix + name
        if key in state_dict and state_dict[key].shape[0] == shard.num_experts != shard.local:
            state_dict[key] = state_dict[key][shard.first : shard.first + shard.local]
