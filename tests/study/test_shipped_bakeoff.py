"""The shipped bake-off (``docs/routers_bakeoff.md``) is what today's code writes from the shipped results files
(``docs/routers_bakeoff/results/``, the runs' ``results/<router>-seed<s>.json``) under the committed plan: the report's
JSON recomputed from them (every value, interval, test and decision, floats within 1e-9), its Markdown equal to the
page, and the plan's hash the committed plan's."""

from __future__ import annotations

import json
from pathlib import Path

from mmoe.study.bakeoff_plan import read_plan_file
from mmoe.study.bakeoff_report import report_markdown, report_of
from tests.study.test_shipped_report import differences

REPO = Path(__file__).resolve().parents[2]
DOCS = REPO / "docs" / "routers_bakeoff"


def test_the_shipped_bakeoff_is_generated_from_its_results_under_the_committed_plan():
    plan, digest = read_plan_file(DOCS / "plan.json")
    shipped = json.loads((DOCS / "report.json").read_text())
    assert shipped["plan"]["sha256"] == digest
    results = [
        json.loads((DOCS / "results" / f"{router.name}-seed{seed}.json").read_text())
        for router in plan.routers
        for seed in plan.seeds
    ]
    assert {(result["router"], result["seed"]) for result in results} == {
        (router.name, seed) for router in plan.routers for seed in plan.seeds
    }
    report = report_of(plan, digest, results, shipped["command"]) | {"decision_code": shipped["decision_code"]}
    assert differences(json.loads(json.dumps(report)), shipped) == []
    assert report_markdown(shipped) == (REPO / "docs" / "routers_bakeoff.md").read_text()
