"""The plan's hash beside the runs (:mod:`mmoe.study.plan_runs`): every stage's marker records it, a report over
stages made under another plan is refused in one line naming both hashes, unless the plan declares the change as a
rule change; ``mmoe study claims --plan`` refuses a plan of another design and a folder run under another plan."""

from __future__ import annotations

import dataclasses
import json

import pytest

from mmoe.cli import main
from mmoe.pipeline.stages import Stage, StageKey, run_stage
from mmoe.study.plan import RuleChange, plan_hash, read_plan, write_plan
from mmoe.study.plan_design import study_plan
from mmoe.study.plan_runs import (
    PLAN_FIELD,
    PlanMismatch,
    accepted_hashes,
    check_runs_plan,
    record_plan,
    refuse_other_plan,
    under_plan,
)
from mmoe.study.settings import DEFAULT, FAST


class Folder:
    def __init__(self, out):
        self.out = out


def _with_window(plan, value, changes=()):
    claims = tuple(dataclasses.replace(c, window_from=value) if c.id == "collapse" else c for c in plan.claims)
    return dataclasses.replace(plan, claims=claims, rule_changes=tuple(changes))


def _run_stages(tmp_path, digest):
    folder = Folder(tmp_path)

    def stage(name):
        output = tmp_path / f"{name}.txt"
        return Stage(StageKey.of("pretrain", name), output, lambda: output.write_text(name) and {"files": [name]})

    return {s.key: run_stage(folder, under_plan(s, digest), "") for s in (stage("a"), stage("b"))}


def test_a_plan_changed_after_the_runs_refuses_the_report(tmp_path):
    plan = study_plan(DEFAULT, "default")
    records = _run_stages(tmp_path, plan_hash(plan))
    marker = json.loads((tmp_path / "stages" / "pretrain-a.json").read_text())
    assert marker["result"] == {"files": ["a"], PLAN_FIELD: plan_hash(plan)}  # the marker keeps the hash
    assert check_runs_plan(records, plan) == plan_hash(plan)
    changed = _with_window(plan, 0.25)  # the window moved after the results were seen, undeclared
    with pytest.raises(PlanMismatch) as error:
        check_runs_plan(records, changed)
    message = str(error.value)
    assert "\n" not in message and plan_hash(plan) in message and plan_hash(changed) in message
    # reused stages keep the hash they ran under
    reused = _run_stages(tmp_path, plan_hash(changed))
    assert {record["result"][PLAN_FIELD] for record in reused.values()} == {plan_hash(plan)}


def test_a_declared_rule_change_keeps_the_runs_and_a_changed_design_does_not(tmp_path):
    plan = study_plan(DEFAULT, "default")
    records = _run_stages(tmp_path, plan_hash(plan))
    change = RuleChange("collapse", "window_from", 0.3, 0.25, "the paper's window starts at 12% of training",
                        "2026-11-28")  # fmt: skip
    declared = _with_window(plan, 0.25, [change])
    assert accepted_hashes(declared) == [plan_hash(declared), plan_hash(plan)]
    assert check_runs_plan(records, declared) == plan_hash(declared)
    fewer_seeds = study_plan(dataclasses.replace(DEFAULT, seeds=3), "default")
    with pytest.raises(PlanMismatch):
        check_runs_plan(records, fewer_seeds)


def test_runs_without_a_recorded_plan_are_refused():
    records = {StageKey.of("pretrain", "a"): {"result": {"files": []}}}
    with pytest.raises(PlanMismatch, match="no plan"):
        check_runs_plan(records, study_plan(DEFAULT, "default"))


def test_a_folder_run_under_another_plan_is_refused_before_any_stage(tmp_path, capsys):
    plan = study_plan(FAST, "fast")
    record_plan(tmp_path, plan)
    refuse_other_plan(tmp_path, plan)  # the same plan: nothing to refuse
    changed = _with_window(plan, 0.25)
    write_plan(changed, tmp_path.parent / "changed.json")
    assert (
        main(["study", "claims", "--fast", "--out", str(tmp_path), "--plan", str(tmp_path.parent / "changed.json")])
        == 2
    )
    error = capsys.readouterr().err.strip()
    assert "\n" not in error and error.startswith("mmoe study: error:")
    assert plan_hash(plan) in error and plan_hash(changed) in error
    assert not (tmp_path / "stages").exists() and read_plan(tmp_path / "plan.json") == plan


def test_a_plan_of_another_design_or_a_bad_file_is_one_line(tmp_path, capsys):
    write_plan(study_plan(DEFAULT, "default"), tmp_path / "default.json")
    assert (
        main(["study", "claims", "--fast", "--out", str(tmp_path / "out"), "--plan", str(tmp_path / "default.json")])
        == 2
    )
    error = capsys.readouterr().err.strip()
    assert "\n" not in error and "not those of the --fast settings" in error
    (tmp_path / "bad.json").write_text(json.dumps({"preset": "fast"}))
    assert (
        main(["study", "claims", "--fast", "--out", str(tmp_path / "out"), "--plan", str(tmp_path / "bad.json")]) == 2
    )
    error = capsys.readouterr().err.strip()
    assert "\n" not in error and "bad.json" in error and "lacks the field 'claims'" in error
    assert not (tmp_path / "out").exists()


def test_a_rule_change_shows_the_verdict_under_the_old_rule_beside_the_new(tmp_path):
    """On the shipped measures: keeping the collapse claim's layers over the judged window (both language layers)
    instead of over every snapshot turns its within-run verdict from reproduces to not separated; the report shows
    both, and neither is decided over runs (1 run per router)."""
    from pathlib import Path

    from mmoe.study.command import claims_from, rule_change_verdicts
    from mmoe.study.decisions import run_decisions
    from mmoe.study.report import RULE_CHANGES_HEADING, write_report
    from mmoe.study.run_statistics import UNDECIDABLE
    from mmoe.study.runs import Measures

    data = Path(__file__).resolve().parent / "data"  # a default run's measures from before the runs per arm
    measures = Measures.from_json(json.loads((data / "measures_before_seeds.json").read_text()))
    base = read_plan(Path(__file__).resolve().parent / "data" / "plan_before_seeds.json")  # the measures' plan
    change = RuleChange("collapse", "layers", "defined_at_every_snapshot", "defined_in_window",
                        "a layer undefined before the window was dropped", "2026-11-28")  # fmt: skip
    claims = tuple(dataclasses.replace(c, layers="defined_in_window") if c.id == "collapse" else c for c in base.claims)
    plan = dataclasses.replace(base, claims=claims, rule_changes=(change,))
    judged = claims_from(measures, plan)
    decisions = run_decisions(judged, plan, measures)
    (entry,) = rule_change_verdicts(measures, plan, decisions)
    assert entry["old_verdicts"] == {"within_run": "reproduces", "over_runs": UNDECIDABLE}
    assert entry["new_verdicts"] == {"within_run": "not separated", "over_runs": UNDECIDABLE}
    collapse = next(claim for claim in judged if claim.id == "collapse")
    assert collapse.measured["by_modality"]["language"]["keys"] == ["layer1/language", "layer3/language"]
    write_report(judged, tmp_path, "# header", {}, measures.chance, {}, None, decisions, [entry])
    markdown = (tmp_path / "report.md").read_text()
    assert RULE_CHANGES_HEADING in markdown and "a layer undefined before the window was dropped" in markdown
    assert json.loads((tmp_path / "report.json").read_text())["rule_changes"] == [entry]
