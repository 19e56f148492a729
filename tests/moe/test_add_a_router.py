"""A router added as ``docs/how-to/add_a_router.md`` says, in its three edits: the module
(``tests/moe/biased_scorer.py``), its line in :data:`mmoe.moe.scorers.SCORERS` (set here for the test's length) and
this reference test. Nothing else is edited, yet configs take its name, the layer matches the per-token reference,
a backbone trains with it, and the cost formulas, ``mmoe moe-info`` and ``mmoe info``'s label count and name it."""

from __future__ import annotations

import json

import pytest
import torch

from mmoe.commands.info import variant_name
from mmoe.model import MoEPlan, MultiwayConfig, MultiwayTransformer
from mmoe.moe import MoEConfig, MoELayer
from mmoe.moe.cost import flops_per_token, moe_parameter_count
from mmoe.moe.scorers import SCORERS
from tests.cli_fixtures import run_mmoe
from tests.moe.biased_scorer import BiasedScorer
from tests.moe.reference import assert_matches_reference


@pytest.fixture(autouse=True)
def registered(monkeypatch):
    monkeypatch.setitem(SCORERS, "biased", BiasedScorer)  # the registry line


def test_an_unregistered_name_is_refused_in_one_line(monkeypatch):
    monkeypatch.delitem(SCORERS, "biased")
    with pytest.raises(ValueError, match=r"^MoEConfig.router must be one of \('linear', 'xmoe'\), got 'biased'$"):
        MoEConfig(dim=16, ffn_dim=12, router="biased")


@pytest.mark.parametrize("top_k,heads,capacity", [(1, 1, None), (2, 1, None), (2, 4, None), (2, 2, 1.0)])
def test_the_new_router_matches_the_per_token_reference(top_k, heads, capacity):
    torch.manual_seed(0)
    layer = MoELayer(MoEConfig(dim=16, ffn_dim=12, num_experts=4, router="biased", top_k=top_k, heads=heads,
                               capacity_factor=capacity)).double()  # fmt: skip
    assert isinstance(layer.router.scorer, BiasedScorer)
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(2, 7, 16, generator=generator, dtype=torch.double)
    padding = torch.zeros(2, 7, dtype=torch.bool)
    padding[1, 4:] = True
    routing = assert_matches_reference(layer, x, padding)
    assert routing.expert_counts.sum() > 0


def test_a_backbone_with_the_new_router_trains():
    torch.manual_seed(0)
    plan = MoEPlan(num_experts=4, top_k=2, router="biased", every=1)
    backbone = MultiwayTransformer(MultiwayConfig.preset("test", moe=plan))
    scorer = backbone.layers[0].ffn[0].router.scorer
    assert isinstance(scorer, BiasedScorer)
    before = scorer.bias.detach().clone()
    optimizer = torch.optim.SGD(backbone.parameters(), lr=0.1)
    image = torch.randn(2, 3, 32, 32)
    text = torch.randint(0, 100, (2, 5))
    for _ in range(2):
        out = backbone(image=image, text=text)
        loss = out.hidden.square().mean() + sum(record.balance_loss for record in out.routing)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    assert torch.isfinite(loss)
    assert not torch.equal(scorer.bias, before)  # the scorer's own parameters are trained


def test_cost_formulas_and_the_commands_count_and_name_it(capsys):
    config = MoEConfig(dim=16, ffn_dim=12, num_experts=4, router="biased", heads=2)
    layer = MoELayer(config)
    assert moe_parameter_count(config) == sum(p.numel() for p in layer.parameters())
    linear = MoEConfig(dim=16, ffn_dim=12, num_experts=4, router="linear", heads=2)
    assert moe_parameter_count(config) == moe_parameter_count(linear) + 4  # the bias of each expert
    assert flops_per_token(config) == flops_per_token(linear)
    code, out, _ = run_mmoe(["moe-info", "--moe.dim", "16", "--moe.ffn_dim", "12", "--moe.num_experts", "4",
                             "--moe.router", "biased"], capsys)  # fmt: skip
    report = json.loads(out)
    assert code == 0 and report["config"]["router"] == "biased"
    assert report["parameters"] == report["parameters_counted"]
    backbone = MultiwayConfig.preset("test", moe=MoEPlan(num_experts=4, router="biased", heads=2))
    assert variant_name(backbone).startswith("Biased linear MH-MoE h=2, 4 experts")
