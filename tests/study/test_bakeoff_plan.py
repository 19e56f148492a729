"""The bake-off's plan (:mod:`mmoe.study.bakeoff_plan`): every router at the dense backbone's active FLOPs per token
as ``mmoe info`` counts them, the plan and its hash written and read back, a plan edited after it was fixed, one
with too few seeds and a router off the dense FLOPs refused in one line; the committed CPU plan is the design's."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import yaml

from mmoe.model.cost import ffn_flops_per_token
from mmoe.moe.cost import flops_per_token, router_flops
from mmoe.study.bakeoff_cost import router_flops as counted_flops
from mmoe.study.bakeoff_cost import trained_backbone
from mmoe.study.bakeoff_plan import check_plan, design, read_plan_file, write_plan_file
from mmoe.study.bakeoff_presets import PRESETS
from mmoe.study.bakeoff_routers import BASELINE, REMOE_L1_INITIAL, ROUTERS
from mmoe.study.plan import PlanError, plan_hash

COMMITTED = Path(__file__).resolve().parents[2] / "docs" / "routers_bakeoff" / "plan.json"


@pytest.fixture(scope="module")
def cpu_plan():
    return design(PRESETS["cpu"])


def test_every_routers_experts_take_the_dense_ffns_flops(cpu_plan):
    settings = PRESETS["cpu"].training
    dense = trained_backbone(settings, {})
    for router in ROUTERS[1:]:
        config = trained_backbone(settings, router.backbone)
        layer = config.moe.layer_config(config.dim, config.ffn_dim, config.subln)
        scored = layer.num_experts + layer.zero_computation_experts  # null experts are scored too
        experts = flops_per_token(layer) - router_flops(layer, scored)
        assert experts == ffn_flops_per_token(dense.dim, dense.ffn_dim), router.name
    assert [router.name for router in cpu_plan.routers] == [router.name for router in ROUTERS]
    gaps = {router.name: router.flops_gap for router in cpu_plan.routers}
    assert gaps["dense"] == 0 and 0 < gaps[BASELINE] < gaps["top2"] < cpu_plan.flops_tolerance


def test_a_plan_refuses_a_router_off_the_dense_flops(cpu_plan):
    top2 = cpu_plan.router("top2")
    # two full-width experts: twice the dense FFN in the MoE layers, every other layer
    wide = {"moe": {**top2.backbone["moe"], "beta": 1.0}}
    changed = dataclasses.replace(top2, backbone=wide, **counted_flops(PRESETS["cpu"].training, wide))
    routers = tuple(changed if r.name == "top2" else r for r in cpu_plan.routers)
    with pytest.raises(PlanError, match=r"router 'top2' has \+50\.\d+% .* at most ±3%"):
        check_plan(dataclasses.replace(cpu_plan, routers=routers), "plan.json")
    lying = dataclasses.replace(top2, active_flops_per_token=top2.active_flops_per_token - 1)
    routers = tuple(lying if r.name == "top2" else r for r in cpu_plan.routers)
    with pytest.raises(PlanError, match=r"routers\[2\]\.active_flops_per_token"):
        check_plan(dataclasses.replace(cpu_plan, routers=routers), "plan.json")


def test_the_plan_file_round_trips_and_an_edited_one_is_refused(cpu_plan, tmp_path):
    path = tmp_path / "plan.json"
    digest = write_plan_file(cpu_plan, path)
    assert read_plan_file(path) == (cpu_plan, digest) and digest == plan_hash(cpu_plan)
    stored = json.loads(path.read_text())
    stored["plan"]["training"]["pretrain_steps"] += 1  # more steps after the plan was fixed
    path.write_text(json.dumps(stored))
    with pytest.raises(PlanError, match=f"{path}: sha256 is .*{digest[:12]}.*, expected [0-9a-f]{{64}}") as error:
        read_plan_file(path)
    assert "\n" not in str(error.value)
    stored = {"sha256": digest, "plan": cpu_plan.to_json() | {"seeds": [0, 1]}}
    path.write_text(json.dumps(stored))
    with pytest.raises(PlanError, match=r"plan\.seeds is \[0, 1\], expected a list of at least 3"):
        read_plan_file(path)


def test_the_committed_cpu_plan_is_the_designs(cpu_plan):
    plan, digest = read_plan_file(COMMITTED)
    assert plan == cpu_plan and digest == plan_hash(cpu_plan)


def test_the_bakeoffs_remoe_starts_from_the_tiny_recipes_coefficient():
    recipe = yaml.safe_load((COMMITTED.parents[2] / "configs" / "pretrain" / "tiny" / "remoe.yaml").read_text())
    remoe = next(router for router in ROUTERS if router.name == "remoe")
    initial = recipe["model"]["init_args"]["backbone"]["moe"]["relu_l1_initial"]
    assert remoe.backbone["moe"]["relu_l1_initial"] == REMOE_L1_INITIAL == initial
