"""The backbone's MoE plan: one set of routing choices with the layer configs it builds, errors that name the config
holding the choice, and a saved config read back."""

from __future__ import annotations

import dataclasses

import pytest

from mmoe.model import MoEPlan, MultiwayConfig
from mmoe.model.config import config_from_dict, config_to_dict
from mmoe.moe import MoEConfig, RoutingChoices


def test_a_layer_config_takes_every_routing_choice_of_its_plan():
    """The plan and each layer's config are one set of RoutingChoices: every choice, changed from its default in
    one of these plans, reaches the layer as the plan states it; the layer adds its widths."""
    routing = [field.name for field in dataclasses.fields(RoutingChoices)]
    plans = [
        MoEPlan(num_experts=6, top_k=3, renormalize=False, router="linear", gate="sigmoid", heads=2,
                capacity_factor=1.5, eval_capacity_factor=2.0, frozen=True, routing_dim=4, beta=0.5,
                shared_experts=1, bias_update_rate=1e-3, bias_update_rule="z_score", balance_batch="global",
                expert_kernels="triton", every=1),
        MoEPlan(num_experts=4, top_k=2, strata=[1, 3], routing_dim=8),
        MoEPlan(num_experts=4, routing="expert_choice", capacity_factor=2.0, routing_dim=8),
        MoEPlan(num_experts=8, top_k=4, capacity_factor=1.0, routing_dim=8, local_entropy_weight=0.1,
                global_entropy_weight=0.2, global_entropy_min_experts=2.0, capacity_priority="batch_priority",
                balance_choices="all", routed_scaling_factor=2.5, expert_groups=4, top_groups=2,
                group_score="top_sum", router_jitter=0.01),
        MoEPlan(num_experts=4, routing="soft", slots_per_expert=2, routing_dim=8),
        MoEPlan(num_experts=8, router="linear", top_p=0.3, target_active_experts=2.0, top_p_rate=0.2, routing_dim=8,
                dynamic_loss_weight=1e-4),
        MoEPlan(num_experts=4, router="linear", gate="relu", renormalize=False, relu_l1_initial=1e-4,
                relu_l1_multiplier=1.1, relu_l1_balanced=False, relu_l1_per_router=True, routing_dim=8),
        MoEPlan(num_experts=4, top_k=2, router="linear", null_experts=2, copy_experts=1, constant_experts=1,
                gating_residual=True,
                routing_dim=8),
    ]  # fmt: skip
    defaults = RoutingChoices()
    changed = {name for plan in plans for name in routing if getattr(plan, name) != getattr(defaults, name)}
    assert changed == set(routing)
    for plan in plans:
        layer = plan.layer_config(dim=32, ffn_dim=64, subln=True)
        assert isinstance(layer, MoEConfig) and (layer.dim, layer.ffn_dim, layer.subln) == (32, 64, True)
        assert {name: getattr(layer, name) for name in routing} == {name: getattr(plan, name) for name in routing}
    assert MoEPlan().routing_dim is None and MoEPlan().layer_config(32, 64, False).routing_dim == 16


def test_routing_errors_name_the_config_that_holds_the_choice():
    with pytest.raises(ValueError, match="MoEPlan.top_k=9 exceeds MoEPlan.num_experts=8"):
        MoEPlan(top_k=9)
    with pytest.raises(ValueError, match="MoEConfig.top_k=9 exceeds MoEConfig.num_experts=8"):
        MoEConfig(dim=32, ffn_dim=64, top_k=9)
    with pytest.raises(ValueError, match="MultiwayConfig.dim=32 is not divisible by MoEPlan.heads=3"):
        MultiwayConfig.preset("test", moe=MoEPlan(heads=3))
    with pytest.raises(dataclasses.FrozenInstanceError):
        MoEPlan().num_experts = 4  # a plan is a value: change it with dataclasses.replace, which checks it again


def test_a_saved_config_comes_back_holding_every_expert():
    """A checkpoint holds every expert whatever the expert-parallel size it was trained with (mmoe.moe.expert_parallel
    keeps the saved weights whole), so its config comes back with expert_parallel 1, every other field as saved:
    reading it needs no expert-parallel group, and a run that shards sets its own size."""
    config = MultiwayConfig.preset("test", moe=MoEPlan(num_experts=4, top_k=2, every=1, expert_parallel=2))
    saved = config_to_dict(config)
    assert saved["moe"]["expert_parallel"] == 2
    assert config_from_dict(saved) == dataclasses.replace(
        config, moe=dataclasses.replace(config.moe, expert_parallel=1)
    )
