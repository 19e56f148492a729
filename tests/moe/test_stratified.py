"""Stratified MoE (Xu et al., 2023) against a per-token walk through the strata, and its special cases."""

from __future__ import annotations

import itertools

import pytest
import torch

from mmoe.model import MoEPlan, MultiwayConfig, MultiwayTransformer
from mmoe.model.cost import backbone_parameters
from mmoe.moe import MoEConfig, MoEFeedForward, MoELayer, StratifiedMoELayer, build_moe_layer
from mmoe.moe.cost import moe_parameter_count
from tests.moe.reference import reference_stratified


def make_layer(seed: int = 0, **overrides) -> StratifiedMoELayer:
    torch.manual_seed(seed)
    fields = dict(dim=16, ffn_dim=12, num_experts=6, top_k=2, strata=[2, 2, 2])
    fields.update(overrides)
    fields["num_experts"] = sum(fields["strata"])
    layer = build_moe_layer(MoEConfig(**fields)).double()
    with torch.no_grad():
        for norm in layer.norms:
            norm.weight.normal_(1.0, 0.2)
            norm.bias.normal_(0.0, 0.2)
        if layer.config.router == "linear":
            for router in layer.routers:
                router.scorer.weight.normal_(std=1.0)
    return layer


def padded_input(seed: int = 1, length: int = 7):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(2, length, 16, generator=generator, dtype=torch.double)
    padding = torch.zeros(2, length, dtype=torch.bool)
    padding[1, 4:] = True
    return x, padding


@pytest.mark.parametrize(
    "router,strata,capacity", list(itertools.product(("linear", "xmoe"), ([2, 2, 2], [4, 2], [3, 1, 2]), (None, 1.0)))
)
def test_matches_per_token_walk_through_strata(router, strata, capacity):
    layer = make_layer(router=router, strata=strata, capacity_factor=capacity)
    x, padding = padded_input()
    x_layer, x_ref = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    update, routing = layer(x_layer, padding)
    y = x_layer + update  # the layer returns the update; the block adds the residual
    y_ref, loss_ref, counts_ref, rc_ref, path_ref = reference_stratified(layer, x_ref, padding)
    valid = ~padding
    assert isinstance(layer, StratifiedMoELayer)
    torch.testing.assert_close(y[valid], y_ref[valid])
    torch.testing.assert_close(routing.balance_loss, loss_ref)
    assert torch.equal(routing.expert_counts, counts_ref)
    assert routing.requested_capacity.item() == pytest.approx(rc_ref)
    assert torch.equal(routing.stratum_path.view(-1, len(strata)), path_ref)
    assert 1.0 <= routing.requested_capacity.item() <= len(strata)

    grad = torch.randn_like(x)
    params = [p for p in layer.parameters() if p.requires_grad]
    got = torch.autograd.grad((y * grad)[valid].sum() + routing.balance_loss, [x_layer, *params], allow_unused=True)
    want = torch.autograd.grad((y_ref * grad)[valid].sum() + loss_ref, [x_ref, *params], allow_unused=True)
    for g, w in zip(got, want, strict=True):
        if g is None or w is None:
            assert (g is None or g.abs().sum() == 0) and (w is None or w.abs().sum() == 0)
        else:
            torch.testing.assert_close(g, w)


def test_one_stratum_is_layernorm_top2_moe_residual():
    torch.manual_seed(0)
    stratified = build_moe_layer(MoEConfig(dim=16, ffn_dim=12, num_experts=4, top_k=2, strata=[4])).double()
    plain = MoELayer(MoEConfig(dim=16, ffn_dim=12, num_experts=4, top_k=2)).double()
    plain.router.load_state_dict(stratified.routers[0].state_dict())
    plain.experts.load_state_dict(stratified.experts.state_dict())
    x, padding = padded_input()
    update, routing = stratified(x, padding)
    y_plain, routing_plain = plain(stratified.norms[0](x), padding)
    valid = ~padding
    torch.testing.assert_close(update[valid], y_plain[valid])
    torch.testing.assert_close(routing.balance_loss, routing_plain.balance_loss)
    assert torch.equal(routing.expert_counts, routing_plain.expert_counts)
    assert torch.equal(routing.expert_index, routing_plain.expert_index)
    assert routing.requested_capacity.item() == 1.0


def test_token_whose_best_expert_is_in_the_last_stratum_exits_after_one_pass():
    layer = make_layer(router="linear", strata=[2, 2])
    with torch.no_grad():
        layer.routers[0].scorer.weight.zero_()
        layer.routers[0].scorer.weight[3, 0] = 10.0  # feature 0 > 0 -> expert 3 (last stratum) wins at gate 1
        layer.routers[0].scorer.weight[0, 0] = -10.0  # feature 0 < 0 -> expert 0 (first stratum) wins
    x = torch.zeros(1, 4, 16, dtype=torch.double)
    x[0, :, 0] = torch.tensor([1.0, -1.0, 2.0, -2.0])
    x[0, :, 1] = torch.tensor([0.5, 0.3, -0.2, 0.1])  # break LayerNorm symmetry
    _, routing = layer(x)
    path = routing.stratum_path[0]
    assert path[0, 0] == 3 and path[0, 1] == -1 and path[2, 0] == 3 and path[2, 1] == -1
    assert path[1, 0] == 0 and path[1, 1] >= 2 and path[3, 0] == 0 and path[3, 1] >= 2
    assert routing.requested_capacity.item() == pytest.approx(6 / 4)  # two tokens 1 pass, two tokens 2 passes


def test_skipped_stratum_adds_nothing():
    layer = make_layer(router="linear", strata=[2, 2, 2])
    x, _ = padded_input()
    update, routing = layer(x)
    path = routing.stratum_path.view(-1, 3)
    skipped_middle = (path[:, 1] == -1) & (path[:, 2] != -1)
    assert skipped_middle.any()  # the case occurs for this seed
    y_ref, *_ = reference_stratified(layer, x)
    torch.testing.assert_close(x + update, y_ref)


def test_capacity_per_stratum_uses_visible_experts():
    layer = make_layer(router="linear", strata=[2, 2], capacity_factor=0.5)
    x, _ = padded_input(length=16)
    _, routing = layer(x)
    assert routing.dropped_fraction.item() > 0
    # Gate 1: 32 tokens, 4 visible experts -> at most ceil(0.5 * 2 * 32 / 4) = 8 choices per expert in that pass.
    first_pass = routing.expert_index.view(-1, 2)
    for expert in range(4):
        assert (first_pass == expert).sum().item() <= 8
    _, loss_ref, counts_ref, _, _ = reference_stratified(layer, x)
    assert torch.equal(routing.expert_counts, counts_ref)


def test_requested_capacity_by_hand():
    layer = make_layer(router="linear", strata=[1, 1, 1])
    with torch.no_grad():
        for router in layer.routers:
            router.scorer.weight.zero_()
        # Gate 1 scores (e0, e1, e2) = (0, 5 f, -5 f) with f = LN(x)[0]: f > 0 -> e1, f < 0 -> e2 (last stratum).
        layer.routers[0].scorer.weight[1, 0] = 5.0
        layer.routers[0].scorer.weight[2, 0] = -5.0
    x = torch.zeros(1, 3, 16, dtype=torch.double)
    x[0, :, 0] = torch.tensor([3.0, -3.0, 4.0])
    x[0, :, 1] = 0.1
    _, routing = layer(x)
    # Tokens 0 and 2: e1 (stratum 2) at gate 1, then gate 3, which sees only e2: 2 passes. Token 1: e2, exits: 1 pass.
    assert routing.stratum_path[0].tolist() == [[1, -1, 2], [2, -1, -1], [1, -1, 2]]
    assert routing.requested_capacity.item() == pytest.approx(5 / 3)
    # Gate 1 (top-2): tokens 0, 2 -> (e1, e0), token 1 -> (e2, e0); gate 3 (one visible expert, top-1): e2 twice.
    assert routing.expert_counts.tolist() == [3, 2, 3]


def test_parameter_count_and_frozen_routing():
    config = MoEConfig(dim=16, ffn_dim=12, num_experts=6, top_k=2, strata=[2, 2, 2], router="xmoe", frozen=True)
    layer = build_moe_layer(config)
    assert moe_parameter_count(config) == sum(p.numel() for p in layer.parameters())
    x = torch.randn(2, 5, 16, requires_grad=True)
    y, routing = layer(x)
    (y.sum() + routing.balance_loss).backward()
    assert all(p.grad is None for p in layer.routers.parameters())
    assert all(p.grad is None for p in layer.experts.parameters())
    assert layer.norms[0].weight.grad is not None


def test_empty_input_gives_zero_loss_and_unit_capacity():
    layer = make_layer()
    x = torch.randn(1, 3, 16, dtype=torch.double)
    update, routing = layer(x, torch.ones(1, 3, dtype=torch.bool))
    assert torch.equal(update, torch.zeros_like(x))
    assert routing.balance_loss.item() == 0.0 and routing.requested_capacity.item() == 1.0


@pytest.mark.parametrize("mode", ["per_modality", "shared"])
def test_inside_the_multiway_backbone(mode):
    plan = MoEPlan(num_experts=4, top_k=2, strata=[2, 2], every=2, mode=mode)
    config = MultiwayConfig.preset("test", vocab_size=100, moe=plan, drop_path=0.1)
    backbone = MultiwayTransformer(config)
    assert backbone_parameters(config) == sum(p.numel() for p in backbone.parameters())
    # Layer 1's Stratified FFNs normalise their own input: its pre-FFN norms are parameter-free identities.
    assert all(isinstance(norm, torch.nn.Identity) for norm in backbone.layers[1].ffn_norm)
    assert all(isinstance(norm, torch.nn.LayerNorm) for norm in backbone.layers[0].ffn_norm)
    image, text = torch.randn(2, 3, 32, 32), torch.randint(0, 100, (2, 6))
    padding = torch.zeros(2, 6, dtype=torch.bool)
    padding[0, 3:] = True
    out = backbone(image=image, text=text, text_padding_mask=padding)
    assert all(r.stratum_path is not None for r in out.routing)
    assert all(1.0 <= r.requested_capacity.item() <= 2.0 for r in out.routing)
    (out.hidden.sum() + sum(r.balance_loss for r in out.routing)).backward()
    assert backbone.layers[1].ffn[0].norms[0].weight.grad is not None


def test_build_moe_layer_picks_the_layer_kind():
    plain = MoEConfig(dim=16, ffn_dim=12, num_experts=4, top_k=2)
    stratified = MoEConfig(dim=16, ffn_dim=12, num_experts=4, top_k=2, strata=[2, 2])
    assert type(build_moe_layer(plain)) is MoELayer
    assert type(build_moe_layer(stratified)) is StratifiedMoELayer
    assert len(build_moe_layer(plain).gate_routers()) == 1 and len(build_moe_layer(stratified).gate_routers()) == 2
    with pytest.raises(ValueError, match="build_moe_layer"):
        MoELayer(stratified)


def test_stratified_layer_is_a_sibling_of_the_plain_layer():
    """Both are MoE layers (MoEFeedForward); a Stratified layer is no MoELayer, so nothing that means "the shardable
    plain layer" (expert parallelism, fused kernels, the multi-head split) takes it for one."""
    layer = make_layer()
    assert isinstance(layer, MoEFeedForward) and not isinstance(layer, MoELayer)
    assert not hasattr(layer, "shard_experts") and not hasattr(layer, "multi_head")
    plan = MoEPlan(num_experts=4, top_k=2, strata=[2, 2], layers=[1])
    config = MultiwayConfig.preset("test", vocab_size=100, max_text_positions=16, moe=plan)
    backbone = MultiwayTransformer(config)
    assert [type(slot.layer) for slot in backbone.moe_layers()] == [StratifiedMoELayer, StratifiedMoELayer]


def test_raw_gate_values_as_stratified_moe_eq6():
    layer = make_layer(router="linear", strata=[2, 2], renormalize=False)
    x, padding = padded_input()
    update, _ = layer(x, padding)
    y_ref, *_ = reference_stratified(layer, x, padding)
    valid = ~padding
    torch.testing.assert_close((x + update)[valid], y_ref[valid])
