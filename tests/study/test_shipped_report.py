"""The shipped claims report (``docs/claims/report.json``) is what today's code computes from the shipped measures
(``docs/claims/measures.json``, the run's ``analysis/measures.json``) under the shipped plan: every claim, decision,
rule change, router row and chance level, each number within 1e-9 of the shipped one; and the plan's hash is the
one the report, ``plan.json`` and the default settings share."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from mmoe.study.command import claims_from, rule_change_verdicts
from mmoe.study.decisions import run_decisions
from mmoe.study.plan import plan_from_json, plan_hash, read_plan
from mmoe.study.plan_design import study_plan
from mmoe.study.routers import router_rows
from mmoe.study.runs import Measures
from mmoe.study.settings import DEFAULT

DOCS = Path(__file__).resolve().parents[2] / "docs" / "claims"
#: The default plan's SHA-256, as ``docs/claims.md`` and ``plan.md`` print it.
PLAN_SHA256 = "e71dac89b9d6cf8450dc1dccf4fefc82817e7bdedd692a6b99267ab5db505bd5"


def differences(got: Any, shipped: Any, path: str = "") -> list[str]:
    """Where ``got`` differs from ``shipped``: structure, strings, integers and booleans exactly, floats beyond 1e-9
    relative (absolute near zero)."""
    if isinstance(shipped, dict):
        if not isinstance(got, dict) or got.keys() != shipped.keys():
            return [f"{path}: keys {sorted(got) if isinstance(got, dict) else got} != {sorted(shipped)}"]
        return [d for key in shipped for d in differences(got[key], shipped[key], f"{path}.{key}")]
    if isinstance(shipped, list):
        if not isinstance(got, list) or len(got) != len(shipped):
            return [f"{path}: {got} != {shipped}"]
        return [d for i, (a, b) in enumerate(zip(got, shipped, strict=True)) for d in differences(a, b, f"{path}[{i}]")]
    if isinstance(shipped, float) and isinstance(got, float):
        return [] if math.isclose(got, shipped, rel_tol=1e-9, abs_tol=1e-12) else [f"{path}: {got} != {shipped}"]
    return [] if type(got) is type(shipped) and got == shipped else [f"{path}: {got!r} != {shipped!r}"]


def float_count(value: Any) -> int:
    if isinstance(value, dict):
        return sum(float_count(item) for item in value.values())
    if isinstance(value, list):
        return sum(float_count(item) for item in value)
    return isinstance(value, float)


def test_the_shipped_report_is_recomputed_from_the_shipped_measures():
    report = json.loads((DOCS / "report.json").read_text())
    measures = Measures.from_json(json.loads((DOCS / "measures.json").read_text()))
    stored = {key: value for key, value in report["plan"].items() if key != "sha256"}
    plan = plan_from_json(stored, "report.json's plan")
    claims = claims_from(measures, plan)
    decisions = run_decisions(claims, plan, measures)
    got = {
        "claims": [claim.to_json() for claim in claims],
        "decisions": decisions,
        "rule_changes": rule_change_verdicts(measures, plan, decisions),
        "routers": router_rows(measures.router_variants, tuple(report["settings"]["router_variants"])),
        "chance": measures.chance,
    }
    got = json.loads(json.dumps(got))  # as the report writes them: tuples as lists, keys as strings
    assert differences(got, {key: report[key] for key in got}) == []
    assert float_count(got) > 500  # the check reached the numbers, not only empty lists


def test_the_plan_s_hash_is_unchanged():
    report = json.loads((DOCS / "report.json").read_text())
    assert report["plan"]["sha256"] == PLAN_SHA256
    assert plan_hash(read_plan(DOCS / "plan.json")) == PLAN_SHA256
    assert plan_hash(study_plan(DEFAULT, "default")) == PLAN_SHA256
    assert PLAN_SHA256 in (DOCS / "plan.md").read_text()
