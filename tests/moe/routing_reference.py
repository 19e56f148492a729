"""A per-token reference of the routing details (:mod:`mmoe.moe.choices`), written from the papers.

Plain loops over (sub-)tokens: LIMoE's per-modality entropy losses (thresholded), V-MoE's
batch-priority capacity, DeepSeekMoE's all-choices balance loss (Eq. 12-14), DeepSeek-V3's sequence-wise
balance loss (Eq. 17-20; a sigmoid gate's normalised affinities, Eq. 19), the routed scaling factor, group-limited
top-k (DeepSeek-V2 / V3) and Switch Transformer's router jitter. It reads the layer's parameters
and none of its code paths.
"""

from __future__ import annotations

import math

import torch

from mmoe.moe import MoEConfig, MoELayer
from tests.moe.reference import reference_expert, reference_gate_values, reference_scores


def make_detail_layer(seed: int = 0, **fields) -> MoELayer:
    """A float64 layer (D 16, 4 experts unless told) with realistic routing: linear router logits of order 1-4, so
    routing is neither uniform nor tied, and a selection bias that changes choices, as after some training."""
    torch.manual_seed(seed)
    layer = MoELayer(MoEConfig(**{"dim": 16, "ffn_dim": 12, "num_experts": 4, **fields})).double()
    if layer.config.router == "linear":
        torch.nn.init.normal_(layer.router.scorer.weight, std=1.0)
    if layer.router.selection_bias is not None:
        layer.router.selection_bias.copy_(0.2 * torch.randn(layer.config.num_experts, dtype=torch.double))
    return layer


def reference_choices(config, scores: torch.Tensor, bias) -> list[int]:
    """Top-k experts best first, inside the best ``top_groups`` groups (DeepSeek-V2: a group's best score; V3: the sum
    of its top_k // top_groups best)."""
    ranking = [float(scores[e].detach()) + (0.0 if bias is None else float(bias[e])) for e in range(scores.numel())]
    allowed = list(range(scores.numel()))
    if config.expert_groups > 1 and config.top_groups is not None:
        size = scores.numel() // config.expert_groups
        groups = [sorted(ranking[g * size : (g + 1) * size], reverse=True) for g in range(config.expert_groups)]
        take = 1 if config.group_score == "max" else config.top_k // config.top_groups
        group_scores = [sum(values[:take]) for values in groups]
        best = sorted(range(config.expert_groups), key=lambda g: -group_scores[g])[: config.top_groups]
        allowed = [e for e in allowed if e // size in best]
    return sorted(allowed, key=lambda e: -ranking[e])[: config.top_k]


def reference_keep_by_priority(choices, priority, padded, capacity, num_experts):
    """Capacity with first choices before second choices, then tokens by priority, highest first (V-MoE's batch
    priority)."""
    order = sorted(range(len(choices)), key=lambda i: -priority[i])
    kept = [[False] * len(choices[0]) for _ in choices]
    load = [0] * num_experts
    for rank in range(len(choices[0])):
        for index in order:
            expert = choices[index][rank]
            if not padded[index] and load[expert] < capacity:
                load[expert] += 1
                kept[index][rank] = True
    return kept, load


def reference_balance_terms(config, balance_logits: torch.Tensor, chosen: list[int]):
    """(P's terms, the choices f counts) of one (sub-)token. A sigmoid gate under DeepSeek's losses follows
    DeepSeek-V3 Eq. 18-20: s' = s / sum_j s_j with s the sigmoid affinities, and f counts the top-K of s (Eq. 18's
    indicator reads s, not s + b, over all experts); every other loss reads a softmax and the experts selected."""
    deepseek = config.balance_choices == "all" or config.balance_batch == "sequence"
    if config.gate != "sigmoid" or not deepseek:
        return balance_logits.softmax(-1), chosen
    affinities = [torch.sigmoid(value) for value in balance_logits]
    total = sum(affinities)
    top = sorted(range(len(affinities)), key=lambda e: -float(affinities[e].detach()))[: config.top_k]
    return torch.stack([a / total for a in affinities]), top


def reference_balance(config, rows, num_experts) -> torch.Tensor:
    """``rows``: (sequence, balance probabilities, choices) of each real (sub-)token."""
    counted = 1 if config.balance_choices == "first" else config.top_k
    sequences = sorted({sequence for sequence, _, _ in rows})
    groups = [rows] if config.balance_batch != "sequence" else [[r for r in rows if r[0] == b] for b in sequences]
    losses = []
    for group in groups:
        mean_probs = torch.stack([probs for _, probs, _ in group]).mean(0)
        counts = [sum(chosen[:counted].count(e) for _, _, chosen in group) for e in range(num_experts)]
        f = torch.tensor([num_experts / (counted * len(group)) * c for c in counts], dtype=mean_probs.dtype)
        losses.append((f * mean_probs).sum())  # DeepSeekMoE Eq. 12-14 (counted = 1: X-MoE Eq. 9)
    return torch.stack(losses).mean()


def reference_entropy(config, rows, num_segments) -> dict[str, torch.Tensor]:
    """``rows``: (segment, gate probabilities) of each real (sub-)token; LIMoE's local and global losses summed over
    the segments."""
    local, spread = [], []
    for segment in range(num_segments):
        probs = [p for m, p in rows if m == segment]
        if not probs:
            continue
        local.append(torch.stack([-(p * p.log()).sum() for p in probs]).mean())  # local entropy
        mean = torch.stack(probs).mean(0)
        entropy = -(mean * mean.log()).sum()  # H of the modality's mean distribution
        if config.global_entropy_min_experts is None:
            spread.append(-entropy)
        else:
            spread.append(torch.clamp(math.log(config.global_entropy_min_experts) - entropy, min=0.0))
    losses = {}
    if config.local_entropy_weight > 0:
        losses["local_entropy_loss"] = config.local_entropy_weight * torch.stack(local).sum()
    if config.global_entropy_weight > 0:
        losses["global_entropy_loss"] = config.global_entropy_weight * torch.stack(spread).sum()
    return losses


def reference_details_forward(layer: MoELayer, x, padding_mask, segment_lengths=None, noise=None):
    """(y, balance loss, auxiliary losses, expert counts, expert index) token by token; ``noise`` (S, D/h): the
    router jitter drawn for each sub-token (the router sees ``vector * noise``, the experts the clean vector)."""
    config = layer.config
    batch, length, dim = x.shape
    heads, num_experts = config.heads, config.num_experts
    if layer.multi_head is not None:  # MH-MoE Eq. 3
        x = x @ layer.multi_head.weight.t() + layer.multi_head.bias
    segments = [0] * length if segment_lengths is None else [m for m, n in enumerate(segment_lengths) for _ in range(n)]
    subs, balance_rows, entropy_rows, choices, weights, priority = [], [], [], [], [], []
    for b in range(batch):
        for position in range(length):
            for head in range(heads):
                vector = x[b, position, head * config.head_dim : (head + 1) * config.head_dim]
                padded = bool(padding_mask[b, position])
                routed = vector if noise is None else vector * noise[len(subs)]
                gate_logits, balance_logits = reference_scores(layer.router, config, routed)
                scores = reference_gate_values(config, gate_logits)
                chosen = reference_choices(config, scores, layer.router.selection_bias)
                raw = [scores[e] for e in chosen]
                total = sum(raw) if config.top_k > 1 and config.renormalize else 1.0
                weights.append([w / total * config.routed_scaling_factor for w in raw])
                choices.append(chosen)
                priority.append(float(raw[0].detach()))
                subs.append((b, position, head, vector, padded))
                if not padded:
                    balance_rows.append((b, *reference_balance_terms(config, balance_logits, chosen)))
                    entropy_rows.append((segments[position], gate_logits.softmax(-1)))
    factor = config.active_capacity_factor(layer.training)
    num_valid = sum(1 for *_, padded in subs if not padded)
    capacity = math.inf if factor is None else math.ceil(factor * config.top_k * num_valid / num_experts)
    if config.capacity_priority == "batch_priority":
        scores_order = priority
    else:
        scores_order = [-float(i) for i in range(len(subs))]  # GShard: earlier tokens first
    kept, load = reference_keep_by_priority(choices, scores_order, [p for *_, p in subs], capacity, num_experts)
    out = torch.zeros(batch, length, heads, config.head_dim, dtype=x.dtype)
    index = torch.full((batch, length, heads, config.top_k), -1, dtype=torch.long)
    for i, (b, position, head, vector, _) in enumerate(subs):
        for rank, expert in enumerate(choices[i]):
            if kept[i][rank]:
                update = weights[i][rank] * reference_expert(layer.experts, expert, vector, config.layernorm_eps)
                out[b, position, head] = out[b, position, head] + update
                index[b, position, head, rank] = expert
    y = out.reshape(batch, length, dim)
    if layer.merge is not None:
        y = y @ layer.merge.weight.t() + layer.merge.bias
    num_segments = 1 if segment_lengths is None else len(segment_lengths)
    balance = reference_balance(config, balance_rows, num_experts)
    return y, balance, reference_entropy(config, entropy_rows, num_segments), torch.tensor(load), index


def assert_details_match_reference(layer: MoELayer, x, padding_mask, segment_lengths=None, jitter_seed=None):
    """Outputs, balance and auxiliary losses, counts, choices and every gradient (input, router, experts) equal the
    reference; with ``jitter_seed`` the layer runs in training with that seed and the reference redraws its noise."""
    x_layer, x_ref = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    noise = None
    if jitter_seed is not None:
        torch.manual_seed(jitter_seed)
    y, routing = layer(x_layer, padding_mask, segment_lengths)
    if jitter_seed is not None:
        eps = layer.config.router_jitter
        torch.manual_seed(jitter_seed)
        noise = torch.empty(x.shape[0] * x.shape[1] * layer.config.heads, layer.config.head_dim, dtype=x.dtype)
        noise = noise.uniform_(1 - eps, 1 + eps)
    y_ref, balance_ref, auxiliary_ref, counts_ref, index_ref = reference_details_forward(
        layer, x_ref, padding_mask, segment_lengths, noise
    )
    valid = ~padding_mask
    torch.testing.assert_close(y[valid], y_ref[valid])
    torch.testing.assert_close(routing.balance_loss, balance_ref)
    assert routing.auxiliary_losses.keys() == auxiliary_ref.keys()
    for name, value in auxiliary_ref.items():
        torch.testing.assert_close(routing.auxiliary_losses[name], value, msg=lambda m, name=name: f"{name}: {m}")
    assert torch.equal(routing.expert_counts, counts_ref)
    assert torch.equal(routing.expert_index, index_ref)
    grad = torch.randn_like(x)
    loss = (y * grad)[valid].sum() + routing.balance_loss + sum(routing.auxiliary_losses.values())
    loss_ref = (y_ref * grad)[valid].sum() + balance_ref + sum(auxiliary_ref.values())
    names, params = zip(*[(n, p) for n, p in layer.named_parameters() if p.requires_grad], strict=True)
    grads = torch.autograd.grad(loss, [x_layer, *params], allow_unused=True)
    grads_ref = torch.autograd.grad(loss_ref, [x_ref, *params], allow_unused=True)
    for name, got, want in zip(["x", *names], grads, grads_ref, strict=True):
        got = torch.zeros_like(want) if got is None and want is not None else got
        want = torch.zeros_like(got) if want is None and got is not None else want
        if got is not None:
            torch.testing.assert_close(got, want, msg=lambda m, name=name: f"gradient of {name}: {m}")
    return routing
