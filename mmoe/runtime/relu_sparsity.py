"""ReMoE's adaptive L1 coefficient in training (Wang et al., 2025, §3.2; thu-ml/ReMoE's training loop).

Routers with ReLU gates (``MoEConfig.gate="relu"``, :mod:`mmoe.moe.relu_routing`) weigh their L1 penalty by a
coefficient lambda kept in each router's ``relu_l1_coefficient`` buffer. As in ReMoE's released code, lambda is one
for the whole model and moves once per optimiser step: the task counts each ReLU router's used (non-empty) choices
and its non-padding (sub-)tokens over the step's micro-batches (gradient accumulation) and, with a process group, over
every data-parallel rank (one all-reduce), takes each router's sparsity ``S_l = 1 - used / (tokens * E)``, and moves
every router's lambda by ``alpha^sign(mean_l (S_target,l - S_l))`` (:func:`mmoe.moe.relu_routing.next_coefficient`),
so every rank and every layer keep the same lambda; with ``relu_l1_per_router`` each router's lambda moves by its
own ``S_l`` against its own target instead (every rank still the same). Evaluation never moves it. (Their code
averages the micro-batches' sparsities; summing the counts weighs each micro-batch by its tokens, the same for equal
micro-batches.)
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from mmoe.model import MultiwayTransformer
from mmoe.moe import Router, RoutingRecord
from mmoe.moe.relu_routing import next_coefficient, target_sparsity


class ReLUSparsity:
    """The used choices and (sub-)tokens of a backbone's ReLU-gated routers over one optimiser step.

    Args:
        backbone: the backbone whose MoE layers' routers are controlled (frozen layers are left alone).
    """

    def __init__(self, backbone: MultiwayTransformer) -> None:
        self.routers: dict[tuple[int, str], Router] = {
            (slot.index, slot.modality): slot.layer.gate_routers()[0]
            for slot in backbone.moe_layers()
            if slot.layer.config.gate == "relu" and not slot.layer.config.frozen
        }
        self.counts: dict[tuple[int, str], torch.Tensor] = {}
        #: The model's mean sparsity over the last step's routers (for logs); None before the first step.
        self.sparsity: float | None = None

    def add(self, routing: list[RoutingRecord]) -> None:
        """Count one micro-batch's routing records: (used choices, non-padding (sub-)tokens) per router."""
        for record in routing:
            key = (record.layer, record.modality)
            if key not in self.routers or record.token_mask is None:
                continue
            heads = self.routers[key].config.heads
            counts = torch.stack([record.expert_counts.sum(), record.token_mask.sum() * heads]).detach().double()
            self.counts[key] = counts + self.counts[key] if key in self.counts else counts

    @torch.no_grad()
    def update(self) -> None:
        """Sum the counts over the data-parallel ranks, move every router's lambda once (ReMoE §3.2) and start the
        next step's count. A collective where a process group exists: every rank calls it after each step."""
        if not self.routers:
            return
        lead = next(iter(self.routers.values()))  # every router shares the plan's choices and, model-wide, lambda
        zero = torch.zeros(2, dtype=torch.float64, device=lead.relu_l1_coefficient.device)
        counts = torch.stack([self.counts.get(key, zero).to(zero) for key in self.routers])
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(counts)
        self.counts = {}
        seen = counts[:, 1] > 0
        if not seen.any():
            return
        experts = torch.tensor([router.config.num_experts for router in self.routers.values()], dtype=torch.float64)
        targets = torch.tensor(
            [target_sparsity(r.config.top_k, r.config.num_experts) for r in self.routers.values()], dtype=torch.float64
        )
        sparsity = 1 - counts[:, 0].cpu() / (counts[:, 1].cpu().clamp_min(1) * experts)
        mask = seen.cpu()
        self.sparsity = float(sparsity[mask].mean())
        multiplier = lead.config.relu_l1_multiplier
        if lead.config.relu_l1_per_router:  # each router by its own sparsity
            for router, seen_here, own, target in zip(self.routers.values(), mask, sparsity, targets, strict=True):
                if seen_here:
                    coefficient = next_coefficient(
                        float(router.relu_l1_coefficient), float(own), float(target), multiplier
                    )
                    router.relu_l1_coefficient.fill_(coefficient)
            return
        mean_target = float(targets[mask].mean())
        coefficient = next_coefficient(float(lead.relu_l1_coefficient), self.sparsity, mean_target, multiplier)
        for router in self.routers.values():
            router.relu_l1_coefficient.fill_(coefficient)
