"""The routing analyses (activation ratio, load, representation collapse, sub-token diversity maps, fluctuation) on
the routers beyond top-1/top-2 token choice: fine-grained top-k with shared experts, loss-free bias, expert choice."""

from __future__ import annotations

import math

import pytest
import torch

from mmoe.metrics.routing import image_diversity_maps
from mmoe.metrics.routing_collect import fluctuation_between, routing_report, run_routing
from mmoe.model import MoEPlan, MultiwayConfig, MultiwayTransformer

PLANS = {
    "fine_grained_shared": MoEPlan(num_experts=8, top_k=3, beta=0.25, shared_experts=1, heads=2, every=1),
    "loss_free": MoEPlan(num_experts=4, bias_update_rate=1e-3, every=1),
    "expert_choice": MoEPlan(num_experts=4, routing="expert_choice", capacity_factor=1.0, heads=2, every=1),
}


def batches(count: int = 2) -> list[dict]:
    generator = torch.Generator().manual_seed(0)
    return [
        {
            "image": torch.randn(3, 3, 32, 32, generator=generator),
            "text": torch.randint(0, 100, (3, 6), generator=generator),
        }
        for _ in range(count)
    ]


@pytest.mark.parametrize("variant", sorted(PLANS))
def test_routing_report_and_maps(variant):
    torch.manual_seed(0)
    backbone = MultiwayTransformer(MultiwayConfig.preset("test", moe=PLANS[variant]))
    run = run_routing(backbone, batches(), capture_inputs=True)
    report = routing_report(run, threshold=0.5)
    assert set(report["activation_ratio"]) == {"layer0/vision", "layer0/language", "layer1/vision", "layer1/language"}
    for key, ratio in report["activation_ratio"].items():
        assert 0 < ratio <= 1, key
        assert report["representation_collapse"][key] is not None and math.isfinite(report["load_cv"][key])
    assert fluctuation_between(run, run)["overall"] == 0.0
    out = backbone(image=batches(1)[0]["image"])
    maps = image_diversity_maps(out.routing, out.image_len, choices="all")
    heads, choices = PLANS[variant].heads, 4 if variant == "expert_choice" else PLANS[variant].top_k
    for grid in maps.values():
        assert grid.shape == (3, 2, 2) and grid.max() <= min(heads * choices, PLANS[variant].num_experts)
