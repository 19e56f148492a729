"""A straightforward per-token reference of :class:`mmoe.moe.MoELayer`, written from the papers' equations.

It reads the layer's parameters but none of its batched code paths: each scorer's scores are its module's per-token
form (:meth:`mmoe.moe.scorers.Scorer.reference_scores`, written expert by expert from its paper's equation), and
gates, top-k, capacity and the balance loss are recomputed token by token with plain loops, so the sort-based
dispatch can be checked against it.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from mmoe.moe import MoELayer


def reference_scores(router, config, x_D: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(gate logits, balance logits) of ``router`` for one (sub-)token, as its scorer's module writes them out from
    the paper's equation (:meth:`mmoe.moe.scorers.Scorer.reference_scores`; X-MoE's tau_0 as the layer stores it, 0.3
    rounded to float32 before .double(): its value is checked in test_layer.py)."""
    return router.scorer.reference_scores(x_D)


def reference_expert(experts, expert: int, x_D: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    """One expert on one (sub-)token; ``eps``: its Sub-LN's epsilon (the layer's ``MoEConfig.layernorm_eps``)."""
    hidden = F.gelu(x_D @ experts.fc1_weight[expert] + experts.fc1_bias[expert])
    if experts.ln_weight is not None:
        hidden = F.layer_norm(hidden, hidden.shape, experts.ln_weight[expert], experts.ln_bias[expert], eps)
    return hidden @ experts.fc2_weight[expert] + experts.fc2_bias[expert]


def reference_top_k(config, gate_logits: torch.Tensor, top_k: int, bias=None) -> list[tuple[int, torch.Tensor]]:
    """[(expert, weight)] best first; top-k weights renormalised to sum to one (GShard) unless the config keeps the raw
    gate values (MH-MoE Eq. 2 / 6, Stratified MoE Eq. 6). ``bias``: loss-free balancing's per-expert selection bias
    (Wang et al., 2024, Eq. 3), added for the ranking only."""
    scores = reference_gate_values(config, gate_logits)
    ranking = [float(scores[e].detach()) + (0.0 if bias is None else float(bias[e])) for e in range(scores.numel())]
    ranked = sorted(range(scores.numel()), key=lambda e: -ranking[e])[:top_k]
    weights = [scores[e] for e in ranked]
    if top_k > 1 and config.renormalize:
        total = sum(weights)
        weights = [w / total for w in weights]
    return list(zip(ranked, weights, strict=True))


def reference_gate_values(config, gate_logits: torch.Tensor) -> torch.Tensor:
    return gate_logits.softmax(-1) if config.gate == "softmax" else gate_logits.sigmoid()


def reference_expert_choice(scores: list[torch.Tensor], padded: list[bool], capacity_factor: float, num_experts: int):
    """Expert choice (Zhou et al., 2022) by brute force: every expert sorts the real sub-tokens by its gate value and
    takes the first C = ceil(c * n / E) (n all sub-tokens). Returns (per sub-token [(expert, weight)] highest weight
    first, load)."""
    capacity = min(len(scores), math.ceil(capacity_factor * len(scores) / num_experts))
    real = [index for index, pad in enumerate(padded) if not pad]
    taken = [[] for _ in scores]
    load = [0] * num_experts
    for expert in range(num_experts):
        for index in sorted(real, key=lambda i: -float(scores[i][expert].detach()))[:capacity]:
            taken[index].append((expert, scores[index][expert]))
            load[expert] += 1
    return [sorted(pairs, key=lambda pair: -float(pair[1].detach())) for pairs in taken], load


def reference_keep(choices, padded: list[bool], capacity: float, num_experts: int):
    """GShard capacity: first choices before second choices, then token order. Returns (kept flags, load)."""
    top_k = len(choices[0]) if choices else 0
    kept = [[False] * top_k for _ in choices]
    load = [0] * num_experts
    for rank in range(top_k):
        for index, token_choices in enumerate(choices):
            expert = token_choices[rank][0]
            if not padded[index] and load[expert] < capacity:
                load[expert] += 1
                kept[index][rank] = True
    return kept, load


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
    balance_probs, first_choices, gate_values = [], [], []
    for _, _, _, vector, padded in sub_tokens:
        gate_logits, balance_logits = reference_scores(layer.router, config, vector)
        gate_values.append(reference_gate_values(config, gate_logits))
        choices.append(reference_top_k(config, gate_logits, top_k, layer.router.selection_bias))
        if not padded:
            balance_probs.append(balance_logits.softmax(-1))
            first_choices.append(choices[-1][0][0])

    factor = config.active_capacity_factor(layer.training)
    padded_list = [padded for *_, padded in sub_tokens]
    if config.routing == "expert_choice":
        choices, load = reference_expert_choice(gate_values, padded_list, factor, num_experts)
        kept = [[True] * len(pairs) for pairs in choices]
        balance_probs, width = [], num_experts  # no balance loss; a sub-token may be taken by every expert
    else:
        # Capacity: first choices before second choices, then token order (GShard).
        num_valid = sum(1 for pad in padded_list if not pad)
        capacity = math.inf if factor is None else math.ceil(factor * top_k * num_valid / num_experts)
        kept, load = reference_keep(choices, padded_list, capacity, num_experts)
        width = top_k

    out = torch.zeros(batch, length, heads, config.head_dim, dtype=x.dtype)
    expert_index = torch.full((batch, length, heads, width), -1, dtype=torch.long)
    for index, (b, position, head, vector, _) in enumerate(sub_tokens):
        for rank, (expert, weight) in enumerate(choices[index]):
            if kept[index][rank]:
                out[b, position, head] = out[b, position, head] + weight * reference_expert(
                    layer.experts, expert, vector, config.layernorm_eps
                )
                expert_index[b, position, head, rank] = expert
    if layer.shared_experts is not None:  # DeepSeekMoE Eq. 9: every shared expert with weight 1
        for b, position, head, vector, padded in sub_tokens:
            if not padded:
                for expert in range(layer.shared_experts.num_experts):
                    out[b, position, head] = out[b, position, head] + reference_expert(
                        layer.shared_experts, expert, vector, config.layernorm_eps
                    )
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


def reference_stratified(layer, x: torch.Tensor, padding_mask: torch.Tensor | None = None):
    """Walk every token through the strata of a Stratified MoE (Xu et al., Eq. 4-11), gate by gate.

    Returns (y, balance_loss, expert_counts, requested_capacity, stratum_path).
    """
    config = layer.config
    batch, length, dim = x.shape
    strata, num_experts = config.strata, config.num_experts
    starts = [sum(strata[:i]) for i in range(len(strata))]
    stratum_of = [s for s, n in enumerate(strata) for _ in range(n)]
    tokens = [x[b, p] for b in range(batch) for p in range(length)]
    padded = [padding_mask is not None and bool(padding_mask[b, p]) for b in range(batch) for p in range(length)]
    gate = [-1 if pad else 0 for pad in padded]
    path = [[-1] * len(strata) for _ in tokens]
    counts = [0] * num_experts
    losses, passes = [], 0
    factor = config.active_capacity_factor(layer.training)
    for stratum, start in enumerate(starts):
        here = [t for t in range(len(tokens)) if gate[t] == stratum]
        if not here:
            losses.append(torch.zeros((), dtype=x.dtype))
            continue
        visible = num_experts - start
        normed, choices, probs, firsts = {}, [], [], []
        for t in here:
            normed[t] = F.layer_norm(
                tokens[t], (dim,), layer.norms[stratum].weight, layer.norms[stratum].bias, config.layernorm_eps
            )
            gate_logits, balance_logits = reference_scores(layer.routers[stratum], config, normed[t])
            choices.append([(start + e, w) for e, w in reference_top_k(config, gate_logits, 2)])
            probs.append(balance_logits.softmax(-1))
            firsts.append(choices[-1][0][0] - start)
        capacity = math.inf if factor is None else math.ceil(factor * 2 * len(here) / visible)
        kept, load = reference_keep(choices, [False] * len(here), capacity, num_experts)
        for e in range(num_experts):
            counts[e] += load[e]
        for position, t in enumerate(here):
            update = sum(
                (w * reference_expert(layer.experts, e, normed[t], config.layernorm_eps))
                for rank, (e, w) in enumerate(choices[position])
                if kept[position][rank]
            )
            tokens[t] = tokens[t] + update  # Eq. 7
            best = choices[position][0][0]
            path[t][stratum] = best
            gate[t] = -1 if stratum_of[best] == len(strata) - 1 else stratum_of[best] + 1
        fractions = torch.tensor([firsts.count(e) / len(here) for e in range(visible)], dtype=x.dtype)
        losses.append(visible * (fractions * torch.stack(probs).mean(0)).sum())  # Eq. 8-10
        passes += len(here)
    entering = sum(1 for pad in padded if not pad)
    y = torch.stack(tokens).view(batch, length, dim)
    return y, torch.stack(losses).mean(), torch.tensor(counts), passes / max(entering, 1), torch.tensor(path)


def assert_matches_reference(layer: MoELayer, x: torch.Tensor, padding_mask: torch.Tensor):
    """The layer equals :func:`reference_forward` on ``x``: outputs at real tokens, balance loss, counts, choices,
    and the gradients of the input and of every trainable parameter. Returns the layer's routing record."""
    x_layer = x.clone().requires_grad_(True)
    x_ref = x.clone().requires_grad_(True)
    grad = torch.randn_like(x)
    y, routing = layer(x_layer, padding_mask)
    y_ref, balance_ref, counts_ref, index_ref = reference_forward(layer, x_ref, padding_mask)

    valid = ~padding_mask
    torch.testing.assert_close(y[valid], y_ref[valid])
    torch.testing.assert_close(routing.balance_loss.double(), balance_ref.double())
    assert torch.equal(routing.expert_counts, counts_ref)
    assert torch.equal(routing.expert_index, index_ref)

    params = [p for p in layer.parameters() if p.requires_grad]
    loss = (y * grad)[valid].sum() + routing.balance_loss
    loss_ref = (y_ref * grad)[valid].sum() + balance_ref
    grads = torch.autograd.grad(loss, [x_layer, *params], allow_unused=True)
    grads_ref = torch.autograd.grad(loss_ref, [x_ref, *params], allow_unused=True)
    names = ["x"] + [name for name, p in layer.named_parameters() if p.requires_grad]
    for name, got, want in zip(names, grads, grads_ref, strict=True):
        got = torch.zeros_like(want) if got is None and want is not None else got
        want = torch.zeros_like(got) if want is None and got is not None else want
        if got is None:
            continue
        torch.testing.assert_close(got, want, msg=lambda m, name=name: f"gradient of {name}: {m}")
    return routing
