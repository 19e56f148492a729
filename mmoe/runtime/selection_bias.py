"""Auxiliary-loss-free load balancing in training (Wang et al., 2024, §3, Algorithm 1).

Routers with ``MoEConfig.bias_update_rate > 0`` select experts on their scores plus a per-expert bias
(:class:`mmoe.moe.Router`). The task counts each such router's load (the choices its experts processed, from the
routing records) over the micro-batches of one optimiser step, sums the counts over every data-parallel rank, and
after the step moves each bias by the sign of its load error (:meth:`mmoe.moe.Router.update_selection_bias`), so
every rank keeps the same biases. The same step's routing records move ReMoE's L1 coefficient of ReLU-gated routers
(:mod:`mmoe.runtime.relu_sparsity`), which this class runs beside the biases.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from mmoe.model import MultiwayTransformer
from mmoe.moe import Router, RoutingRecord
from mmoe.runtime.relu_sparsity import ReLUSparsity


class SelectionLoads:
    """The expert loads of a backbone's biased routers, summed over one optimiser step's micro-batches.

    Args:
        backbone: the backbone whose MoE layers' routers are updated (frozen layers are left alone).
    """

    def __init__(self, backbone: MultiwayTransformer) -> None:
        self.routers: dict[tuple[int, str], Router] = {}
        for slot in backbone.moe_layers():
            routers = slot.layer.gate_routers()  # none in a Soft MoE layer
            if not routers or routers[0].selection_bias is None or slot.layer.config.frozen:
                continue
            router = routers[0]
            key = (slot.index, slot.modality)
            if key in self.routers:
                raise ValueError(
                    f"MoEPlan.bias_update_rate with two MoE FFNs named {key} (mode 'shared' with vl_layers): their "
                    "routing records are not told apart; use mode per_modality or bias_update_rate: 0"
                )
            self.routers[key] = router
        self.loads: dict[tuple[int, str], torch.Tensor] = {}
        self.relu_sparsity = ReLUSparsity(backbone)

    def add(self, routing: list[RoutingRecord]) -> None:
        """Count one micro-batch's routing records."""
        self.relu_sparsity.add(routing)
        for record in routing:
            key = (record.layer, record.modality)
            if key in self.routers:
                counts = record.expert_counts.detach()
                self.loads[key] = counts + self.loads[key] if key in self.loads else counts

    @torch.no_grad()
    def update(self) -> None:
        """Sum the loads over the data-parallel ranks, move every bias (Algorithm 1) and start the next step's count.
        A collective where a process group exists: every rank calls it after each optimiser step."""
        self.relu_sparsity.update()
        if not self.routers:
            return
        zero = {key: torch.zeros_like(router.selection_bias) for key, router in self.routers.items()}
        loads = torch.stack([self.loads.get(key, zero[key]).to(zero[key]) for key in self.routers])
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(loads)
        for router, load in zip(self.routers.values(), loads, strict=True):
            router.update_selection_bias(load)
        self.loads = {}

    def non_finite(self) -> list[tuple[int, str]]:
        """The (layer, modality) of each router whose selection bias holds a NaN or an infinity: one ``isfinite``
        over the few small buffers and one host sync (none without biased routers). A huge ``bias_update_rate``
        overflows the biases in a few steps while the loss stays finite, so the loss alone never shows it."""
        if not self.routers:
            return []
        finite = torch.stack([torch.isfinite(router.selection_bias).all() for router in self.routers.values()])
        return [key for key, ok in zip(self.routers, finite.tolist(), strict=True) if not ok]

    def bias_spread(self) -> torch.Tensor:
        """Mean over the routers of max(b) - min(b): how far the biases have moved the selection apart (for logs)."""
        spreads = [router.selection_bias.max() - router.selection_bias.min() for router in self.routers.values()]
        return torch.stack(spreads).mean()
