"""MoE++'s gating residuals (Jin et al., ICLR 2025; ``gating_residual``): a layer's logits plus W_g times the
(sub-)token's logits in its previous MoE layer, against the per-token reference of the null-expert tests; the backbone
hands each token's logits from MoE layer to MoE layer (zeros before the first, through a VL-FFN joined and split per
modality), and the combinations without one logit vector per token are refused in one line."""

from __future__ import annotations

import pytest
import torch

from mmoe.model import MoEPlan, MultiwayConfig, MultiwayTransformer
from mmoe.model.depth_router import DepthRouting
from mmoe.moe import MoEConfig
from mmoe.moe.cost import moe_parameter_count, router_flops
from tests.moe.test_null_experts import POOL, _config, _inputs, _layer, reference_forward


def _previous(heads: int) -> torch.Tensor:
    """Logits of a previous layer at the scale a trained router gives (order 1-3), so the residual moves choices."""
    torch.manual_seed(2)
    return (2 * torch.randn(2, 9, heads, POOL, dtype=torch.double)).requires_grad_()


def _residual_layer(heads: int, router: str):
    layer = _layer(heads, router, True, gating_residual=True)
    with torch.no_grad():  # W_g at a scale where a transposed map routes differently
        layer.router.gate_map.weight.normal_(0.0, 0.7)
    return layer


def _compare(layer, heads: int) -> None:
    x, padding = _inputs()
    previous = _previous(heads)
    y, routing = layer(x, padding, gate_residual=previous)
    want_y, want_balance, want_z, want_index = reference_forward(layer, x, padding, previous)
    torch.testing.assert_close(y, want_y)
    assert torch.equal(routing.expert_index, want_index)
    torch.testing.assert_close(routing.balance_loss, want_balance)
    torch.testing.assert_close(routing.z_loss, want_z)
    split = x if layer.multi_head is None else layer.multi_head(x)  # MH-MoE's sub-tokens
    scores = layer.router.scorer(split.reshape(-1, layer.config.head_dim))[0].view(2, 9, heads, POOL)
    carried = scores + previous @ layer.router.gate_map.weight.t()
    torch.testing.assert_close(routing.gate_logits, carried)  # what the next layer gets: this layer's logits
    weights, carry_weights = torch.randn_like(y), torch.randn_like(carried)
    inputs = [x, previous, *layer.parameters()]
    objective = (y * weights).sum() + routing.balance_loss + routing.z_loss
    got = torch.autograd.grad(objective + (routing.gate_logits * carry_weights).sum(), inputs)
    want_objective = (want_y * weights).sum() + want_balance + want_z
    want = torch.autograd.grad(want_objective + (carried * carry_weights).sum(), inputs)
    for name, g, w in zip(["x", "previous", *dict(layer.named_parameters())], got, want, strict=True):
        torch.testing.assert_close(g, w, msg=lambda message, name=name: f"{name}: {message}")


@pytest.mark.parametrize(("heads", "router"), [(1, "linear"), (2, "linear"), (1, "xmoe")])
def test_layer_with_the_residual_matches_the_per_token_reference(heads, router) -> None:
    layer = _residual_layer(heads, router)
    _compare(layer, heads)
    x, padding = _inputs()
    plain = layer(x, padding)[1].expert_index
    assert not torch.equal(layer(x, padding, gate_residual=_previous(heads))[1].expert_index, plain)  # it matters


def test_the_reference_comparison_fails_with_the_map_transposed() -> None:
    layer = _residual_layer(1, "linear")
    weight = layer.router.gate_map.weight
    layer.router.gate_map.forward = lambda logits: logits @ weight  # wrong: W_g^T G
    with pytest.raises(AssertionError):
        _compare(layer, 1)


def test_counts_add_the_map() -> None:
    config = _config(router="linear", gating_residual=True)
    layer_parameters = sum(p.numel() for p in _layer(1, "linear", True, gating_residual=True).parameters())
    assert moe_parameter_count(config) == layer_parameters
    plain = _config(router="linear")
    assert moe_parameter_count(config) - moe_parameter_count(plain) == POOL * POOL
    assert router_flops(config, POOL) - router_flops(plain, POOL) == 2 * POOL * POOL


def _capture_router_inputs(backbone: MultiwayTransformer) -> dict:
    seen = {}
    for slot in backbone.moe_layers():

        def hook(module, args, key=(slot.index, slot.modality)):
            seen[key] = (args[0], args[3])  # the (sub-)tokens and the previous layer's logits

        slot.layer.router.register_forward_pre_hook(hook)
    return seen


def test_the_backbone_carries_each_tokens_logits_into_its_next_moe_layer() -> None:
    torch.manual_seed(0)
    plan = MoEPlan(
        num_experts=4, every=1, top_k=2, router="linear", null_experts=1, copy_experts=1, constant_experts=1,
        gating_residual=True,
    )  # fmt: skip
    backbone = MultiwayTransformer(MultiwayConfig.preset("test", moe=plan, vl_layers=1, depth=3))
    seen = _capture_router_inputs(backbone)
    image = torch.randn(2, 3, 32, 32)
    text = torch.randint(0, 1000, (2, 5))
    padding = torch.zeros(2, 5, dtype=torch.bool)
    padding[1, 3:] = True
    output = backbone(image=image, text=text, text_padding_mask=padding)
    records = {(r.layer, r.modality): r for r in output.routing}
    assert sorted(records) == [(0, "language"), (0, "vision"), (1, "language"), (1, "vision"), (2, "shared")]
    pool = 4 + 3
    for modality in ("vision", "language"):  # the first MoE layer: G_0 = 0
        assert not seen[0, modality][1].any()
        torch.testing.assert_close(seen[1, modality][1], records[0, modality].gate_logits.reshape(-1, pool))
    joined = torch.cat([records[1, "vision"].gate_logits, records[1, "language"].gate_logits], dim=1)
    torch.testing.assert_close(seen[2, "shared"][1], joined.reshape(-1, pool))  # the VL-FFN: image tokens first
    router = backbone.layers[2].vl_ffn.router
    tokens, previous = seen[2, "shared"]
    torch.testing.assert_close(
        records[2, "shared"].gate_logits.reshape(-1, pool), router.scorer(tokens)[0] + router.gate_map(previous)
    )
    # The carried logits are differentiable: layer 2's logits reach back to layer 0's image router.
    first = backbone.layers[0].ffn[0].router.scorer.weight
    (gradient,) = torch.autograd.grad(records[2, "shared"].gate_logits.square().sum(), first)
    assert gradient.abs().sum() > 0
    image_only = backbone(image=image)  # one modality present: its own logits carried, no joint FFN
    assert [(r.layer, r.modality) for r in image_only.routing] == [(0, "vision"), (1, "vision"), (2, "vision")]


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (
            lambda: MoEConfig(dim=16, ffn_dim=24, num_experts=4, top_k=2, strata=[2, 2], gating_residual=True),
            r"^MoEConfig.strata=\[2, 2\] with gating_residual=True: Stratified",
        ),
        (
            lambda: MoEConfig(
                dim=16, ffn_dim=24, num_experts=4, routing="expert_choice", capacity_factor=1.0, gating_residual=True
            ),
            r"^MoEConfig.routing='expert_choice' with gating_residual=True: ",
        ),
        (
            lambda: MoEPlan(num_experts=4, gating_residual=True, experts_by_modality={"vision": 2, "language": 4}),
            r"^MoEPlan.experts_by_modality=.* with gating_residual=True: the carried logits need one pool size",
        ),
        (
            lambda: MultiwayConfig.preset(
                "test", moe=MoEPlan(num_experts=4, gating_residual=True), depth_routing=DepthRouting(layers=[1])
            ),
            r"^MultiwayConfig.depth_routing with MoEPlan.gating_residual=True: ",
        ),
    ],
    ids=["strata", "expert_choice", "modality_pools", "depth_routing"],
)
def test_refused_in_one_line(build, message) -> None:
    with pytest.raises(ValueError, match=message):
        build()
