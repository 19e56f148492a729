"""A claim's noise rule decides its gaps over runs (:mod:`mmoe.study.decisions`): the plan's interval level, alpha
and power reach Welch's interval, the detectable effect and the multiplicity step, checked against the t quantiles
directly; the default plan's decisions over the shipped measures stay as they were."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from mmoe.stats import t_quantile
from mmoe.study.claims import Claim
from mmoe.study.command import claims_from
from mmoe.study.decisions import _pretraining_decision, decision_text, run_decisions
from mmoe.study.plan import ClaimPlan, read_plan, write_plan
from mmoe.study.plan_design import shipped_rules
from mmoe.study.runs import Measures
from mmoe.study.verdicts import NOT_SEPARATED, REPRODUCES

DOCS = Path(__file__).resolve().parents[2] / "docs" / "claims"
#: The measures of the default run made before the runs per arm (``docs/claims/measures.json`` until a run of today's
#: plan replaces it) and the plan they were made under.
SHIPPED_PLAN = Path(__file__).resolve().parent / "data" / "plan_before_seeds.json"
# Four seeds per arm whose gap has p = 0.038: inside alpha 0.05, outside alpha 0.01.
PRETRAINED, RANDOM_INIT = [1.0, 1.6, 0.4, 1.2], [0.0, 0.7, -0.3, 0.3]


def _rules(multiplicity: str, **noise) -> ClaimPlan:
    rules = shipped_rules("pretraining")
    return dataclasses.replace(
        rules, multiplicity=multiplicity, noise_rule=dataclasses.replace(rules.noise_rule, **noise)
    )


def _decided(rules: ClaimPlan) -> dict:
    measured = {"tasks": {"vqa": {"pretrained": {"values": PRETRAINED}, "random_init": {"values": RANDOM_INIT},
                                  "verdict": REPRODUCES}}}  # fmt: skip
    return _pretraining_decision(Claim("pretraining", "title", "paper", measured, REPRODUCES, "statement"), rules)


def test_the_default_rule_separates_the_gap_at_p_038():
    gap = _decided(_rules("holm"))["gaps"][0]
    assert 0.03 < gap["welch"]["p_value"] < 0.05 and gap["welch"]["interval"][0] > 0
    assert gap["verdict"] == REPRODUCES


def test_a_stricter_rule_widens_the_interval_and_does_not_separate_the_gap():
    decision = _decided(_rules("none", level=0.99, alpha=0.01, power=0.95))
    gap = decision["gaps"][0]
    welch = gap["welch"]
    assert decision["verdict"] == NOT_SEPARATED and gap["verdict"] == NOT_SEPARATED
    half = t_quantile(0.995, welch["degrees"]) * welch["standard_error"]
    assert welch["interval"] == pytest.approx([welch["difference"] - half, welch["difference"] + half], rel=1e-12)
    assert welch["interval"][0] < 0 < welch["interval"][1]
    detectable = (t_quantile(0.995, welch["degrees"]) + t_quantile(0.95, welch["degrees"])) * welch["standard_error"]
    assert gap["detectable"] == pytest.approx(detectable, rel=1e-12)
    assert (decision["level"], decision["alpha"], decision["power"]) == (0.99, 0.01, 0.95)


def test_without_a_correction_each_p_value_is_compared_with_the_plans_alpha():
    """At level 0.95 the interval excludes zero, but the plan's alpha 0.01 is below p: not separated."""
    strict = _decided(_rules("none", alpha=0.01))["gaps"][0]
    assert strict["welch"]["interval"][0] > 0 and strict["verdict"] == NOT_SEPARATED
    assert _decided(_rules("none"))["gaps"][0]["verdict"] == REPRODUCES


def test_holm_uses_the_plans_alpha():
    gap = _decided(_rules("holm", alpha=0.01))["gaps"][0]
    assert gap["holm_p"] == pytest.approx(gap["welch"]["p_value"]) and gap["verdict"] == NOT_SEPARATED


def test_the_decision_text_names_the_rules_level_alpha_and_power():
    text = decision_text(_decided(_rules("none", level=0.99, alpha=0.01, power=0.95)))
    assert "level 0.99, alpha 0.01" in text and "detectable at power 0.95:" in text
    assert "detectable at power 0.8:" in decision_text(_decided(_rules("holm")))


def _shipped() -> Measures:
    return Measures.from_json(json.loads((SHIPPED_PLAN.parent / "measures_before_seeds.json").read_text()))


def _gaps(decisions: list[dict]) -> list[tuple]:
    return [(d["id"], g["verdict"], g["welch"]["p_value"], g["holm_p"], g["detectable"], *g["welch"]["interval"])
            for d in decisions for g in d.get("gaps", [])]  # fmt: skip


# The shipped plan's decisions over the shipped measures: (claim, verdict, p, Holm p, detectable, interval).
SHIPPED_GAPS = [
    ("tasks", NOT_SEPARATED, 0.4716884850946539, 1.0, 34.61856912163185, -28.28426352968075, 33.89998755695709),
    ("tasks", NOT_SEPARATED, 0.3170165551153312, 1.0, 23.018498653533438, -23.976600842908304, 15.340419535246888),
    ("tasks", NOT_SEPARATED, 0.9028783614359897, 1.0, 0.22373816073918165, -0.2039492012873341, 0.1989492012873342),
    ("tasks", NOT_SEPARATED, 0.024400368332194944, 0.14640220999316966, 0.03811805465170157, 0.026819727776132424,
     0.09318027222386768),
    ("tasks", NOT_SEPARATED, 0.42585892963598004, 1.0, 1.301757425889585, -1.2902458007860105, 1.016244321298588),
    ("tasks", NOT_SEPARATED, 0.7458173972937812, 1.0, 1.1463607220462257, -0.9531059554214933, 1.0472838117881964),
    ("pretraining", NOT_SEPARATED, 0.28112465625247074, 0.8433739687574122, 36.32582400534372, -38.23272526721592,
     27.314153265611502),
    ("pretraining", NOT_SEPARATED, 0.3612191625161416, 0.8433739687574122, 0.15126443455989086, -0.1533889529002509,
     0.11838895290025075),
    ("pretraining", NOT_SEPARATED, 0.7705872439859367, 0.8433739687574122, 0.931652697619938, -0.8308160242617275,
     0.7447641891456978),
]  # fmt: skip


def test_the_shipped_plans_decisions_over_the_shipped_measures_are_unchanged():
    plan = read_plan(SHIPPED_PLAN)
    measures = _shipped()
    decisions = run_decisions(claims_from(measures, plan), plan, measures)
    for got, expected in zip(_gaps(decisions), SHIPPED_GAPS, strict=True):
        assert got[:2] == expected[:2]
        assert list(got[2:]) == pytest.approx(list(expected[2:]), rel=1e-9, abs=1e-12)
    assert {d["id"]: d["verdict"] for d in decisions}["consistency"].startswith("undecidable")


def test_a_plan_file_with_another_level_decides_the_shipped_measures_at_that_level(tmp_path):
    """The noise rule read back from a plan file reaches the decisions: a 0.99 level widens every interval."""
    plan = read_plan(SHIPPED_PLAN)
    claims = tuple(dataclasses.replace(c, noise_rule=dataclasses.replace(c.noise_rule, level=0.99, alpha=0.01))
                   for c in plan.claims)  # fmt: skip
    write_plan(dataclasses.replace(plan, claims=claims), tmp_path / "plan.json")
    strict = read_plan(tmp_path / "plan.json")
    measures = _shipped()
    decisions = run_decisions(claims_from(measures, strict), strict, measures)
    assert all(d["level"] == 0.99 and d["alpha"] == 0.01 for d in decisions)
    for got, shipped in zip(_gaps(decisions), SHIPPED_GAPS, strict=True):
        assert got[5] < shipped[5] and got[6] > shipped[6]
        assert got[1] == NOT_SEPARATED
