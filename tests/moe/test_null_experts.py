"""Null and zero-computation experts (AdaMoE; MoE++: :mod:`mmoe.moe.null_experts`) against a per-token loop written
from the papers' description and their released code: top-k over the E real and Z zero-computation experts, weights
renormalised over the choices that are not null experts, copy experts adding x and constant experts
``a_1 x + a_2 v`` with ``[a_1, a_2] = softmax(W x)``, the balance loss over all E + Z experts."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

import mmoe.moe.router as router_module
from mmoe.metrics.routing import active_experts_histogram
from mmoe.moe import MoEConfig, MoELayer
from mmoe.moe.cost import flops_per_token, moe_parameter_count, routed_experts, router_flops
from mmoe.moe.null_experts import split_choices
from tests.moe.reference import reference_expert

NUM_EXPERTS, NULL, COPY, CONSTANT = 4, 2, 1, 2
POOL = NUM_EXPERTS + NULL + COPY + CONSTANT
CASES = [(1, "linear", True), (2, "linear", False), (1, "xmoe", True)]


def _config(**overrides) -> MoEConfig:
    fields = {"num_experts": NUM_EXPERTS, "top_k": 3, "null_experts": NULL, "copy_experts": COPY}
    return MoEConfig(dim=12, ffn_dim=20, **(fields | {"constant_experts": CONSTANT} | overrides))


def _layer(heads: int, router: str, renormalize: bool, **overrides) -> MoELayer:
    torch.manual_seed(0)
    layer = MoELayer(_config(heads=heads, router=router, renormalize=renormalize, **overrides)).double()
    with torch.no_grad():
        if router == "linear":  # scores of order 1-4 over the pool: every kind of expert gets chosen
            layer.router.scorer.weight.normal_(0.0, 1.0)
        layer.zero_computation.mix_weight_C2D.normal_(0.0, 1.0)
    return layer


def reference_forward(layer: MoELayer, x: torch.Tensor, padding: torch.Tensor, previous=None):
    """(y, balance loss, z-loss, expert index) token by token: AdaMoE's and MoE++'s routing over the pool;
    ``previous`` (B, L, heads, pool): MoE++'s gating residual, W_g times these logits added to the (sub-)token's."""
    config = layer.config
    batch, length, dim = x.shape
    heads, width, k, real = config.heads, config.head_dim, config.top_k, config.num_experts
    if layer.multi_head is not None:
        x = x @ layer.multi_head.weight.t() + layer.multi_head.bias
    out = torch.zeros(batch, length, heads, width, dtype=x.dtype)
    index = torch.full((batch, length, heads, k), -1)
    probs, firsts, z_terms = [], [], []
    cheap = layer.zero_computation
    for b in range(batch):
        for t in range(length):
            for h in range(heads):
                if padding[b, t]:
                    continue
                vector = x[b, t, h * width : (h + 1) * width]
                gate_logits, balance_logits = layer.router.scorer.reference_scores(vector)
                if previous is not None:  # MoE++: G_j = W_j x + W_g G_{j-1}
                    residual = layer.router.gate_map.weight @ previous[b, t, h]
                    gate_logits, balance_logits = gate_logits + residual, balance_logits + residual
                p = gate_logits.softmax(-1)
                ranked = sorted(range(POOL), key=lambda e: -float(p[e].detach()))[:k]
                null = [real <= e < real + NULL for e in ranked]
                weights = [p[e] * (0.0 if is_null else 1.0) for e, is_null in zip(ranked, null, strict=True)]
                if config.renormalize:
                    weights = [w / sum(weights) for w in weights]
                probs.append(balance_logits.softmax(-1))
                firsts.append(ranked[0])
                z_terms.append(gate_logits.logsumexp(-1) ** 2)
                for rank, (e, w) in enumerate(zip(ranked, weights, strict=True)):
                    if e < real:
                        out[b, t, h] += w * reference_expert(layer.experts, e, vector)
                        index[b, t, h, rank] = e
                    elif e >= real + NULL + COPY:  # a constant expert
                        j = e - real - NULL - COPY
                        a = (cheap.mix_weight_C2D[j] @ vector).softmax(-1)
                        out[b, t, h] += w * (a[0] * vector + a[1] * cheap.constant_CD[j])
                    elif e >= real + NULL:  # a copy expert
                        out[b, t, h] += w * vector
    y = out.reshape(batch, length, dim)
    if layer.merge is not None:
        y = y @ layer.merge.weight.t() + layer.merge.bias
    fractions = torch.tensor([firsts.count(e) / len(firsts) for e in range(POOL)], dtype=x.dtype)
    balance = POOL * (fractions * torch.stack(probs).mean(0)).sum()  # the Switch loss over the whole pool (AdaMoE)
    return y, balance, torch.stack(z_terms).mean(), index


def _inputs():
    torch.manual_seed(1)
    x = torch.randn(2, 9, 12, dtype=torch.double, requires_grad=True)
    padding = torch.zeros(2, 9, dtype=torch.bool)
    padding[1, 6:] = True
    return x, padding


def _compare(layer: MoELayer) -> None:
    x, padding = _inputs()
    y, routing = layer(x, padding)
    want_y, want_balance, want_z, want_index = reference_forward(layer, x, padding)
    torch.testing.assert_close(y, want_y)
    assert torch.equal(routing.expert_index, want_index)
    torch.testing.assert_close(routing.balance_loss, want_balance)
    torch.testing.assert_close(routing.z_loss, want_z)
    weights = torch.randn_like(y)
    inputs = [x, *layer.parameters()]
    got = torch.autograd.grad((y * weights).sum() + routing.balance_loss + routing.z_loss, inputs)
    want = torch.autograd.grad((want_y * weights).sum() + want_balance + want_z, inputs)
    for name, g, w in zip(["x", *dict(layer.named_parameters())], got, want, strict=True):
        torch.testing.assert_close(g, w, msg=lambda message, name=name: f"{name}: {message}")


@pytest.mark.parametrize(("heads", "router", "renormalize"), CASES)
def test_layer_matches_the_per_token_reference(heads, router, renormalize) -> None:
    _compare(_layer(heads, router, renormalize))


def test_every_kind_of_choice_occurs_in_the_reference_case() -> None:
    layer = _layer(1, "linear", True)
    x, padding = _inputs()
    pool_SK = layer.router.scorer(x.reshape(-1, 12))[0].topk(3, dim=-1).indices[~padding.reshape(-1)]
    for low, high in [(0, NUM_EXPERTS), (NUM_EXPERTS, NUM_EXPERTS + NULL), (NUM_EXPERTS + NULL, POOL)]:
        assert ((pool_SK >= low) & (pool_SK < high)).any(), (low, high)
    _, routing = layer(x, padding)
    used = (routing.expert_index[~padding] >= 0).sum(-1).flatten()
    assert (used < 3).any() and (used > 0).any()  # some tokens use fewer real experts than top_k


def test_the_reference_comparison_fails_when_null_weights_are_kept_in_the_normaliser(monkeypatch) -> None:
    def plain_top_k_weights(expert_SK, weight_SK, config, renormalize):
        weight_SK = weight_SK / weight_SK.sum(dim=-1, keepdim=True)  # wrong: the null experts' weight stays in
        return split_choices(expert_SK, weight_SK, config, renormalize=False)

    monkeypatch.setattr(router_module, "split_choices", plain_top_k_weights)
    with pytest.raises(AssertionError):
        _compare(_layer(1, "linear", True))


def test_all_null_choices_give_zero_weights_not_nans() -> None:
    config = _config()
    expert_SK = torch.tensor([[4, 5, 1], [5, 4, 6], [7, 0, 8]])  # 4, 5 null; 6 copy; 7, 8 constant
    weight_SK = torch.tensor([[0.5, 0.3, 0.2], [0.4, 0.4, 0.2], [0.6, 0.3, 0.1]])
    real_SK, real_weight_SK, cheap = split_choices(expert_SK, weight_SK, config, renormalize=True)
    assert real_SK.tolist() == [[4, 4, 1], [4, 4, 4], [4, 0, 4]]
    torch.testing.assert_close(real_weight_SK, torch.tensor([[0.0, 0.0, 1.0], [0.0, 0.0, 0.0], [0.0, 0.3, 0.0]]))
    assert cheap.index_SK.tolist() == [[-1, -1, -1], [-1, -1, 0], [1, -1, 2]]
    torch.testing.assert_close(cheap.weight_SK, torch.tensor([[0.0, 0.0, 0.0], [0.0, 0.0, 1.0], [0.6, 0.0, 0.1]]))
    all_null = split_choices(torch.tensor([[4, 5]]), torch.tensor([[0.6, 0.4]]), config, renormalize=True)
    assert all_null[1].tolist() == [[0.0, 0.0]]


def test_records_and_active_experts_count_real_experts_only() -> None:
    layer = _layer(2, "linear", True)
    x, padding = _inputs()
    _, routing = layer(x, padding)
    real_SK = routing.expert_index[~padding]  # (tokens, heads, K): -1 at zero-computation choices
    assert int(routing.expert_counts.sum()) == int((real_SK >= 0).sum())
    assert routing.expert_counts.shape == (NUM_EXPERTS,)
    histogram = active_experts_histogram(routing, 4)
    used = (real_SK >= 0).sum(-1).flatten()
    assert histogram.tolist() == [int((used == n).sum()) for n in range(4)]


def test_counts_cover_the_pool_and_the_constant_experts() -> None:
    for heads, router, _ in CASES:
        config = _config(heads=heads, router=router)
        assert moe_parameter_count(config) == sum(p.numel() for p in MoELayer(config).parameters())
        plain = _config(heads=heads, router=router, null_experts=0, copy_experts=0, constant_experts=0)
        assert router_flops(config, POOL) > router_flops(plain, NUM_EXPERTS)
        assert routed_experts(config) == pytest.approx(3 * NUM_EXPERTS / POOL)
        assert flops_per_token(config) < flops_per_token(plain)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"null_experts": -1}, "MoEConfig.null_experts must be a non-negative integer, got -1"),
        ({"strata": [2, 2], "top_k": 2}, "MoEConfig.null_experts=2: Stratified MoE gates"),
        ({"routing": "expert_choice", "top_k": 1, "capacity_factor": 1.0}, "MoEConfig.null_experts=2: zero-comp"),
        ({"bias_update_rate": 1e-3}, "MoEConfig.null_experts=2: the loss-free bias"),
        ({"null_experts": 0, "expert_groups": 2}, "MoEConfig.copy_experts=1: group-limited"),
    ],
)
def test_refusals_name_the_field(overrides, message) -> None:
    with pytest.raises(ValueError, match="^" + message.replace("[", r"\[").replace("]", r"\]")):
        _config(**overrides)


def test_mmoe_info_refuses_null_experts_with_expert_choice_in_one_line(tmp_path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        "model:\n  init_args:\n    backbone:\n      moe:\n        num_experts: 4\n        null_experts: 2\n"
        "        routing: expert_choice\n        capacity_factor: 1.0\n        router: linear\n        every: 2\n"
    )
    command = [sys.executable, "-m", "mmoe.cli", "info", "--config", "configs/pretrain/tiny.yaml", "--config", str(bad)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1
    assert "null_experts=2: zero-computation experts are chosen by token choice" in lines[0]


def test_the_benchmark_balances_the_pool_and_floors_on_the_real_rows() -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    try:
        from moe_balanced import ExpertFloor, forced_balanced
    finally:
        sys.path.pop(0)
    layer = _layer(1, "linear", True)
    x, _ = _inputs()
    _, routing = forced_balanced(layer)(x.detach())
    # 18 tokens x 3 choices round-robin over the pool of 9: each real expert 6 rows, zero-computation ones off
    assert routing.expert_counts.tolist() == [18 * 3 // POOL] * NUM_EXPERTS
    assert ExpertFloor(layer, 18).routed == NUM_EXPERTS * 6  # 18 * 3 * 4 / 9 = 24 rows, a multiple of E


def test_copy_experts_alone_add_the_weighted_token_and_no_empty_parameters() -> None:
    torch.manual_seed(0)
    layer = MoELayer(_config(null_experts=0, constant_experts=0, router="linear")).double()
    with torch.no_grad():
        layer.router.scorer.weight.normal_(0.0, 1.0)
    assert [name for name, _ in layer.zero_computation.named_parameters()] == []
    x, padding = _inputs()
    y, _ = layer(x, padding)
    routed = layer.router(x.reshape(-1, 12), ~padding.reshape(-1))
    copy_weight = (routed.zero_computation.weight_SK.sum(-1).view(2, 9, 1) * ~padding[..., None]).detach()
    assert (copy_weight > 0).any()
    copies = layer.zero_computation
    layer.zero_computation = None  # the routed experts alone
    torch.testing.assert_close(y, layer(x, padding)[0] + copy_weight * x)
    layer.zero_computation = copies


def test_mmoe_info_names_the_pool_and_the_expected_real_experts() -> None:
    from mmoe.commands.info import variant_name
    from mmoe.model import MoEPlan, MultiwayConfig

    plan = MoEPlan(num_experts=8, top_k=2, null_experts=6, copy_experts=2, router="linear")
    assert variant_name(MultiwayConfig(moe=plan)) == "Switch, 8 experts + 8 zero-computation (1 real per token), top-2"


@pytest.mark.parametrize("adaptive", [{"top_p": 0.4}, {"gate": "relu", "renormalize": False}], ids=["top_p", "relu"])
def test_zero_computation_experts_are_refused_beside_another_adaptive_router(adaptive):
    with pytest.raises(ValueError, match=r"^MoEConfig.null_experts=2: .*not combined$"):
        MoEConfig(dim=16, ffn_dim=24, num_experts=4, router="linear", null_experts=2, **adaptive)
