"""The study's plan (:mod:`mmoe.study.plan`, :mod:`mmoe.study.plan_design`): the JSON round trip, its hash, one-line
errors for a bad hand-edited file, rule changes, and the shipped ``docs/claims/plan.json`` equal to the default
settings' plan."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from mmoe.study.plan import PlanError, RuleChange, plan_from_json, plan_hash, read_plan, write_plan
from mmoe.study.plan_design import PRESETS, plan_markdown, study_plan
from mmoe.study.settings import DEFAULT

DOCS = Path(__file__).resolve().parents[2] / "docs" / "claims"


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_plan_round_trips_through_json_with_the_same_hash(preset, tmp_path):
    plan = study_plan(PRESETS[preset], preset)
    write_plan(plan, tmp_path / "plan.json")
    again = read_plan(tmp_path / "plan.json")
    assert again == plan and plan_hash(again) == plan_hash(plan)
    assert len(plan_hash(plan)) == 64
    assert [claim.id for claim in plan.claims] == [
        "activation", "diversity", "collapse", "fluctuation", "consistency", "consistency_trained", "tasks",
        "pretraining", "capacity", "frequency",
    ]  # fmt: skip


def test_the_plan_describes_todays_design():
    plan = study_plan(DEFAULT, "default")
    activation = plan.claim("activation")
    # like with like: X-MoE and both MH-MoE arms, 3 seeds each, measured at the end of their own 100-step runs
    assert [arm.name for arm in activation.arms] == ["mhmoe h=8", "mhmoe h=4", "xmoe"]
    assert all(arm.steps == arm.measured_at == 100 and arm.seeds == (0, 1, 2) for arm in activation.arms)
    assert activation.arms[-1].runs == tuple(f"pretrain/xmoe-e32-seed{seed}" for seed in range(3))
    assert activation.multiplicity == "holm" and "constant" in activation.schedule
    for claim in ("collapse", "fluctuation"):
        assert plan.claim(claim).runs_per_arm() == [3, 3] and plan.claim(claim).layers == "all"
        assert plan.claim(claim).window_from == 0.3
    assert plan.claim("consistency").runs_per_arm() == plan.claim("consistency_trained").runs_per_arm() == [4, 4]
    assert plan.claim("consistency").arms[0].name == "xmoe (frozen)"
    # Claim 5's fine-tunings all start from one backbone per router, and the plan says so; claim 7's each from its own.
    assert plan.claim("consistency").runs_text() == "4 (fine-tunings of 1 backbone(s) per arm)"
    assert plan.claim("pretraining").backbones_per_arm() == [3, 3] and plan.claim("pretraining").runs_text() == "3"
    assert plan.claim("consistency_trained").arms[1].name == "switch (trained)"
    assert plan.claim("tasks").not_run and plan.claim("tasks").runs_per_arm() == [0] * 9
    pretraining = plan.claim("pretraining")
    assert pretraining.runs_per_arm() == [3, 3] and [arm.steps for arm in pretraining.arms] == [300, 300]
    assert plan.claim("diversity").gates == {"saturation_share": 0.97}
    assert plan.claim("capacity").runs_per_arm() == [1]
    assert (
        "undecidable" in plan.claim("frequency").noise_rule.unit
        and "85 token types" in plan.claim("frequency").noise_rule.unit
    )


def test_every_preset_plan_has_its_estimated_cost_and_the_default_fits_an_hour():
    from mmoe.study.cost import CPU_COSTS, GPU_COSTS, total_minutes

    assert total_minutes(DEFAULT, CPU_COSTS) <= 60
    assert total_minutes(PRESETS["fast"], CPU_COSTS) < total_minutes(DEFAULT, CPU_COSTS)
    assert total_minutes(PRESETS["gpu"], GPU_COSTS) > 0
    for preset, settings in PRESETS.items():
        text = plan_markdown(study_plan(settings, preset))
        assert "## Estimated cost" in text and "an estimate" in text


def test_a_changed_rule_changes_the_hash():
    plan = study_plan(DEFAULT, "default")
    claims = tuple(dataclasses.replace(c, window_from=0.25) if c.id == "collapse" else c for c in plan.claims)
    assert plan_hash(dataclasses.replace(plan, claims=claims)) != plan_hash(plan)


def _edited(change) -> dict:
    value = study_plan(DEFAULT, "default").to_json()
    change(value)
    return value


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda v: v["claims"][2].update(window_from=1.5), "claims[2].window_from is 1.5, expected a number in"),
        (lambda v: v["claims"][2].update(layers="some"), "claims[2].layers is \"some\", expected one of all"),
        (lambda v: v["claims"][0]["arms"][0].update(seeds=[0, 1]), "claims[0].arms[0].seeds is [0, 1], expected one"),
        (lambda v: v["claims"][1]["gates"].update(saturation_share="high"), "claims[1].gates.saturation_share"),
        (lambda v: v["claims"][5].update(multiplicity="bonferroni"), "claims[5].multiplicity is \"bonferroni\""),
        (lambda v: v["claims"][3].pop("gates"), "claims[3] lacks the field 'gates'"),
        (lambda v: v["claims"][3].update(extra=1), "claims[3].extra is 1, expected no such field"),
        (lambda v: v.update(version=7), "plan.version is 7, expected 1"),
        (lambda v: v["claims"].append(v["claims"][0]), "expected each claim once"),
        (lambda v: v["rule_changes"].append({"claim": "collapse", "rule": "gates.nothing", "old": 1, "new": 2,
                                             "why": "x", "date": "2026-11-28"}), "rule_changes[0].rule"),
        (lambda v: v["rule_changes"].append({"claim": "collapse", "rule": "window_from", "old": 0.25, "new": 0.4,
                                             "why": "x", "date": "2026-11-28"}), "rule_changes[0].new is 0.4"),
    ],
)  # fmt: skip
def test_a_bad_plan_file_is_one_line_naming_the_file_and_field(tmp_path, change, message):
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(_edited(change)))
    with pytest.raises(PlanError) as error:
        read_plan(path)
    text = str(error.value)
    assert "\n" not in text and text.startswith(f"{path}: ") and message in text


def test_a_file_that_is_not_json_is_one_line(tmp_path):
    path = tmp_path / "plan.json"
    path.write_text("{not json")
    with pytest.raises(PlanError) as error:
        read_plan(path)
    assert str(path) in str(error.value) and "\n" not in str(error.value)


def test_a_rule_change_is_kept_and_the_old_plan_restores_the_old_rule():
    change = {"claim": "collapse", "rule": "layers", "old": "defined_at_every_snapshot", "new": "defined_in_window",
              "why": "the kept layers depended on snapshots outside the window", "date": "2026-11-28"}  # fmt: skip
    value = _edited(lambda v: v["claims"][2].update(layers="defined_in_window"))
    value["rule_changes"].append(change)
    plan = plan_from_json(json.loads(json.dumps(value)))
    assert plan.rule_changes == (RuleChange(**change),)
    old = plan.under_old_rule(plan.rule_changes[0])
    assert old.claim("collapse").layers == "defined_at_every_snapshot" and old.rule_changes == ()
    assert "defined_in_window" in plan_markdown(plan) and "the kept layers depended" in plan_markdown(plan)


def test_the_shipped_plan_is_the_default_settings_plan_and_its_markdown():
    shipped = read_plan(DOCS / "plan.json")
    assert dataclasses.replace(shipped, rule_changes=()) == study_plan(DEFAULT, "default")
    assert (DOCS / "plan.md").read_text() == plan_markdown(shipped)
