"""A straightforward per-token reference of :class:`mmoe.moe.MoELayer`, written from the papers' equations.

It reads the layer's parameters but none of its code paths: scores, gates, top-k, capacity and the balance loss are
recomputed token by token with plain loops, so the sort-based dispatch can be checked against it.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from mmoe.moe import MoELayer


def reference_scores(layer: MoELayer, x_D: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(gate logits, balance logits) for one (sub-)token."""
    scorer = layer.router.scorer
    if layer.config.router == "xmoe":
        projected = scorer.projection.weight @ x_D  # W h
        cosines = torch.stack(
            [projected @ e / (projected.norm() * e.norm()) for e in scorer.expert_embeddings]
        )  # X-MoE Eq. 7
        return cosines / scorer.log_temperature.exp(), cosines / layer.config.initial_temperature
    logits = torch.stack([x_D @ e for e in scorer.weight])
    return logits, logits


def reference_expert(layer: MoELayer, expert: int, x_D: torch.Tensor) -> torch.Tensor:
    experts = layer.experts
    hidden = F.gelu(x_D @ experts.fc1_weight[expert] + experts.fc1_bias[expert])
    if experts.ln_weight is not None:
        hidden = F.layer_norm(hidden, hidden.shape, experts.ln_weight[expert], experts.ln_bias[expert])
    return hidden @ experts.fc2_weight[expert] + experts.fc2_bias[expert]


def reference_forward(layer: MoELayer, x: torch.Tensor, padding_mask: torch.Tensor | None = None):
    """Returns (y, balance_loss, expert_counts, expert_index) computed token by token."""
    config = layer.config
    batch, length, dim = x.shape
    heads, top_k, num_experts = config.heads, config.top_k, config.num_experts
    if layer.multi_head is not None:
        x = x @ layer.multi_head.weight.t() + layer.multi_head.bias
    sub_tokens = []  # (b, l, head, vector)
    for b in range(batch):
        for position in range(length):
            for head in range(heads):
                vector = x[b, position, head * config.head_dim : (head + 1) * config.head_dim]
                padded = padding_mask is not None and bool(padding_mask[b, position])
                sub_tokens.append((b, position, head, vector, padded))

    choices = []  # per sub-token: list of (expert, weight)
    balance_probs, first_choices = [], []
    for _, _, _, vector, padded in sub_tokens:
        gate_logits, balance_logits = reference_scores(layer, vector)
        scores = gate_logits.softmax(-1) if config.gate == "softmax" else gate_logits.sigmoid()
        ranked = sorted(range(num_experts), key=lambda e: -float(scores[e].detach()))[:top_k]
        weights = [scores[e] for e in ranked]
        if top_k > 1:
            total = sum(weights)
            weights = [w / total for w in weights]
        choices.append(list(zip(ranked, weights, strict=True)))
        if not padded:
            balance_probs.append(balance_logits.softmax(-1))
            first_choices.append(ranked[0])

    # Capacity: first choices before second choices, then token order (GShard).
    num_valid = sum(1 for *_, padded in sub_tokens if not padded)
    factor = config.active_capacity_factor(layer.training)
    capacity = math.inf if factor is None else math.ceil(factor * top_k * num_valid / num_experts)
    kept = [[False] * top_k for _ in sub_tokens]
    load = [0] * num_experts
    for rank in range(top_k):
        for index, (*_, padded) in enumerate(sub_tokens):
            expert = choices[index][rank][0]
            if not padded and load[expert] < capacity:
                load[expert] += 1
                kept[index][rank] = True

    out = torch.zeros(batch, length, heads, config.head_dim, dtype=x.dtype)
    expert_index = torch.full((batch, length, heads, top_k), -1, dtype=torch.long)
    for index, (b, position, head, vector, _) in enumerate(sub_tokens):
        for rank, (expert, weight) in enumerate(choices[index]):
            if kept[index][rank]:
                out[b, position, head] = out[b, position, head] + weight * reference_expert(layer, expert, vector)
                expert_index[b, position, head, rank] = expert
    y = out.reshape(batch, length, dim)
    if layer.merge is not None:
        y = y @ layer.merge.weight.t() + layer.merge.bias

    if balance_probs:
        mean_probs = torch.stack(balance_probs).mean(0)
        fractions = torch.tensor([first_choices.count(e) / len(first_choices) for e in range(num_experts)])
        balance_loss = num_experts * (fractions * mean_probs).sum()  # X-MoE Eq. 9
    else:
        balance_loss = torch.zeros(())
    return y, balance_loss, torch.tensor(load), expert_index
