"""The plan's hash beside the study's runs: every stage's marker records the hash of the plan it ran under
(:func:`under_plan`), the study's folder keeps the plan (``plan.json``), and a report over stages made under another
plan is refused (:func:`check_runs_plan`), unless the difference is exactly the rule changes the plan declares."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from mmoe.study.plan import PlanError, StudyPlan, plan_hash, read_plan, write_plan
from mmoe.study.plan_design import study_plan
from mmoe.study.settings import StudySettings

#: The field of a stage's result (kept in its marker) that holds the plan's hash.
PLAN_FIELD = "plan_sha256"
#: The plan a study's folder was run under, beside its ``stages/`` markers.
PLAN_FILE = "plan.json"


class PlanMismatch(PlanError):
    """Runs made under another plan than the report's."""


def under_plan(stage, digest: str):
    """``stage`` (a :class:`mmoe.pipeline.stages.Stage`) whose result, kept in its marker, records ``digest``."""
    run = stage.run
    return dataclasses.replace(stage, run=lambda: dict(run() or {}) | {PLAN_FIELD: digest})


def accepted_hashes(plan: StudyPlan) -> list[str]:
    """The hashes of ``plan`` and of each earlier plan its rule changes undo, newest first: runs made under any of
    them are the plan's runs (the rules changed, the runs did not)."""
    hashes, current = [plan_hash(plan)], plan
    while current.rule_changes:
        *earlier, last = current.rule_changes
        current = dataclasses.replace(current.under_old_rule(last), rule_changes=tuple(earlier))
        hashes.append(plan_hash(current))
    return hashes


def check_runs_plan(records: dict, plan: StudyPlan) -> str:
    """The plan's hash when every stage record (``run_stage``'s markers, by stage key) was made under it or under a
    plan its rule changes undo; PlanMismatch naming the first other stage, its hash and the plan's otherwise."""
    accepted = accepted_hashes(plan)
    for key, record in records.items():
        recorded = (record.get("result") or {}).get(PLAN_FIELD)
        if recorded not in accepted:
            made = f"plan {recorded}" if recorded else "no plan (made before plans were recorded)"
            raise PlanMismatch(
                f"stage {key} was run under {made}, this report's plan is {accepted[0]}: rerun in "
                "another --out, or report with the plan those runs were made under"
            )
    return accepted[0]


def plan_of_run(settings: StudySettings, preset: str, path: Path | None) -> StudyPlan:
    """The plan of a study run: ``path``'s (a hand-edited plan, checked) or the design's of ``settings``. A plan's
    arms and schedules must be the settings' (the runs follow the settings); its rules may differ."""
    design = study_plan(settings, preset)
    if path is None:
        return design
    plan = read_plan(path)
    for claim in design.claims:
        given = plan.claim(claim.id) if claim.id in {c.id for c in plan.claims} else None
        if given is None or (given.arms, given.schedule) != (claim.arms, claim.schedule):
            option = {"default": "default", "fast": "--fast"}.get(preset, f"--scale {preset}")
            raise PlanError(
                f"{path}: the arms or schedule of claim {claim.id} are not those of the {option} "
                "settings (the runs follow the settings; a plan may change rules only)"
            )
    return plan


def refuse_other_plan(out: Path, plan: StudyPlan) -> None:
    """PlanMismatch naming both hashes when ``out`` was run under a plan that ``plan`` is not (nor one its rule
    changes undo); nothing where ``out`` holds no plan yet."""
    if not (out / PLAN_FILE).is_file():
        return
    recorded = plan_hash(read_plan(out / PLAN_FILE))
    accepted = accepted_hashes(plan)
    if recorded not in accepted:
        raise PlanMismatch(
            f"{out} holds runs made under plan {recorded} ({out / PLAN_FILE}), this plan is "
            f"{accepted[0]}: use another --out, or that plan"
        )


def record_plan(out: Path, plan: StudyPlan) -> None:
    """``out/plan.json``: the plan the study's folder is being run under (its hash: :func:`plan_hash` of it)."""
    write_plan(plan, out / PLAN_FILE)
