"""The bake-off's statistics (:mod:`mmoe.study.bakeoff_statistics`) against a hand computation and SciPy's Welch
test, and its experts per token (:mod:`mmoe.study.bakeoff_measures`) counted from routing records: a hand-made
record, and real top-2 and expert-choice layers whose mean the routing fixes."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from mmoe.metrics.routing import RoutingTotals
from mmoe.moe import MoEConfig, build_moe_layer
from mmoe.moe.base import RoutingRecord
from mmoe.stats import NOT_SEPARATED
from mmoe.study.bakeoff_measures import layer_measures, modality_means
from mmoe.study.bakeoff_plan import MEASURES, design
from mmoe.study.bakeoff_presets import PRESETS
from mmoe.study.bakeoff_routers import ROUTERS
from mmoe.study.bakeoff_statistics import NOT_MEASURED, bakeoff_decisions, decision, measure_decisions

VQA = next(measure for measure in MEASURES if measure.name == "vqa")
LOAD_CV = next(measure for measure in MEASURES if measure.name == "load_cv_vision")
#: VQA per seed: top2 well above Switch, expert choice a little below, dense far below.
SCORES = {
    "switch": [40.0, 41.0, 42.5],
    "top2": [50.0, 51.5, 52.0],
    "expert_choice": [39.0, 41.5, 40.0],
    "dense": [30.0, 31.0, 29.0],
}


@pytest.fixture(scope="module")
def plan():
    """The CPU plan of the four routers the scores below are for."""
    return design(PRESETS["cpu"], presets=tuple(router for router in ROUTERS if router.name in SCORES))


def _results(scores, measure="vqa"):
    return [
        {"router": router, "seed": seed, "values": {measure: value}}
        for router, values in scores.items()
        for seed, value in enumerate(values)
    ]


def _hand_welch(a, b):
    va, vb = np.var(a, ddof=1) / len(a), np.var(b, ddof=1) / len(b)
    t = (np.mean(a) - np.mean(b)) / math.sqrt(va + vb)
    df = (va + vb) ** 2 / (va**2 / (len(a) - 1) + vb**2 / (len(b) - 1))
    return t, df


def test_each_router_is_tested_against_switch_with_holm_over_the_routers(plan):
    rows = {row["router"]: row for row in measure_decisions(plan, _results(SCORES), VQA)}
    assert list(rows) == ["dense", "top2", "expert_choice"]  # the plan's order, the baseline left out
    for router, row in rows.items():
        t, df = _hand_welch(SCORES[router], SCORES["switch"])
        welch = row["welch"]
        assert welch["difference"] == pytest.approx(np.mean(SCORES[router]) - np.mean(SCORES["switch"]))
        assert welch["degrees"] == pytest.approx(df) and welch["difference"] / welch["standard_error"] == pytest.approx(
            t
        )
        assert row["values"] == SCORES[router]
    p = {router: row["welch"]["p_value"] for router, row in rows.items()}
    order = sorted(p, key=p.get)  # Holm by hand: m = 3, then 2, then 1, never below the one before
    adjusted = {order[0]: 3 * p[order[0]]}
    adjusted[order[1]] = max(adjusted[order[0]], 2 * p[order[1]])
    adjusted[order[2]] = max(adjusted[order[1]], min(1.0, p[order[2]]))
    for router, row in rows.items():
        assert row["holm_p"] == pytest.approx(min(1.0, adjusted[router]))
    assert rows["top2"]["decision"] == "better" and rows["dense"]["decision"] == "worse"
    assert rows["expert_choice"]["decision"] == NOT_SEPARATED


def test_a_router_without_the_measure_leaves_the_family(plan):
    loads = {"switch": [0.5, 0.6, 0.55], "top2": [0.2, 0.25, 0.22], "expert_choice": [0.0, 0.01, 0.0]}
    results = _results(loads, LOAD_CV.name) + [{"router": "dense", "seed": s, "values": {}} for s in range(3)]
    rows = {row["router"]: row for row in measure_decisions(plan, results, LOAD_CV)}
    assert rows["dense"]["decision"] == NOT_MEASURED and rows["dense"]["welch"] is None
    p = sorted(rows[router]["welch"]["p_value"] for router in ("top2", "expert_choice"))
    assert sorted(rows[r]["holm_p"] for r in ("top2", "expert_choice")) == pytest.approx(
        [2 * p[0], max(2 * p[0], p[1])]
    )
    assert decision(-0.3, 0.01, 0.05, "lower") == "better" and decision(0.3, 0.01, 0.05, "none") == "above"
    assert decision(0.3, 0.2, 0.05, "higher") == NOT_SEPARATED
    tested = [measure.name for measure in plan.measures if measure.tested]
    assert {row["measure"] for row in bakeoff_decisions(plan, results)} == set(tested)


def test_the_welch_p_values_equal_scipys(plan):
    """Run where SciPy is installed (``.venv-eval/``, tests/test_eval_extra.py)."""
    stats = pytest.importorskip("scipy.stats", reason="SciPy is the independent reference (the eval extra's)")
    for row in measure_decisions(plan, _results(SCORES), VQA):
        reference = stats.ttest_ind(SCORES[row["router"]], SCORES["switch"], equal_var=False)
        assert row["welch"]["p_value"] == pytest.approx(reference.pvalue, rel=1e-9)
        bounds = reference.confidence_interval(confidence_level=0.95)
        assert row["welch"]["interval"] == pytest.approx([bounds.low, bounds.high], rel=1e-9)


def _record(index, mask, modality="vision"):
    zero = torch.zeros(())
    counts = torch.bincount(index[index >= 0], minlength=4)
    return RoutingRecord(zero, zero, counts, index, zero, zero, zero, layer=1, modality=modality, token_mask=mask)


def _experts_per_token(records):
    totals = RoutingTotals()
    totals.add(records)
    return [layer["experts_per_token"] for layer in layer_measures(totals).values()]


def test_experts_per_token_count_the_kept_choices_of_the_real_tokens():
    # (B=1, L=3, heads=1, slots=2): 2 experts, 1 (a drop), 0 (a token no expert took)
    index = torch.tensor([[[[0, 3]], [[2, -1]], [[-1, -1]]]])
    mask = torch.tensor([[True, True, True]])
    assert _experts_per_token([_record(index, mask)]) == [pytest.approx(1.0)]
    assert _experts_per_token([_record(index, torch.tensor([[True, True, False]]))]) == [pytest.approx(1.5)]
    assert _experts_per_token([_record(index, mask), _record(index[:, :2], mask[:, :2])]) == [pytest.approx(6 / 5)]
    # top-p trims the choices no token uses, so one layer's records may differ in width from batch to batch
    assert _experts_per_token([_record(index, mask), _record(index[..., :1], mask)]) == [pytest.approx(5 / 6)]
    totals = RoutingTotals()
    totals.add([_record(index, mask), _record(index[:, :2], mask[:, :2], "language")])
    means = modality_means(layer_measures(totals))
    assert means["experts_vision"] == pytest.approx(1.0) and means["experts_language"] == pytest.approx(1.5)
    counts = np.array([1, 0, 1, 1], dtype=float)
    assert means["load_cv_vision"] == pytest.approx(counts.std() / counts.mean())


@pytest.mark.parametrize(
    ("fields", "expected"),
    [({"top_k": 2, "num_experts": 16, "beta": 0.5}, 2.0), ({"routing": "expert_choice", "capacity_factor": 1.0}, 1.0)],
)
def test_real_layers_give_the_experts_their_routing_fixes(fields, expected):
    torch.manual_seed(0)
    config = MoEConfig(dim=16, ffn_dim=32, **({"num_experts": 8} | fields))
    layer = build_moe_layer(config)
    _, record = layer(torch.randn(2, 8, 16))
    assert _experts_per_token([record]) == [pytest.approx(expected)]
