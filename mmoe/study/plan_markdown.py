"""A study plan as Markdown (:func:`plan_markdown`): per claim its arms, schedule, layers, window, gates, noise rule and
correction, then the design notes, the estimated cost and the rule changes (``docs/claims/plan*.md``, written by
``python -m mmoe.study.plan_design``)."""

from __future__ import annotations

from mmoe.study.cost import BUDGETS, CPU_COSTS, PRESET_COSTS, cost_lines
from mmoe.study.plan import ClaimPlan, StudyPlan, plan_hash
from mmoe.study.settings import PRESETS, StudySettings

#: Each preset's plan files under a folder (``<stem>.json``, ``<stem>.md``).
PLAN_STEMS = {"default": "plan", "gpu": "plan_gpu", "gpu-tasks": "plan_gpu_tasks"}


def _arms_text(claim: ClaimPlan) -> list[str]:
    lines = []
    for arm in claim.arms:
        at = "at its end" if arm.measured_at == arm.steps else f"at step {arm.measured_at}"
        runs = ", ".join(f"`{run}`" for run in arm.runs)
        lines.append(
            f"  - {arm.name}: {len(arm.runs)} run(s) (seeds {list(arm.seeds)}), {arm.steps} steps, measured "
            f"{at}: {runs}"
        )
    return lines


def plan_markdown(plan: StudyPlan, settings: StudySettings | None = None) -> str:
    """The plan as Markdown: per claim its arms, schedule, layers, window, gates, noise rule and correction; then the
    rule changes."""
    stem = PLAN_STEMS.get(plan.preset, "plan")
    lines = [
        f"# The claims study's plan (preset `{plan.preset}`)",
        "",
        f"SHA-256 of its canonical JSON: `{plan_hash(plan)}`. Written from `{stem}.json` by "
        "`mmoe.study.plan_design`; the study records this hash with every stage it runs and refuses a report "
        "over runs made under another plan.",
        "",
    ]
    for claim in plan.claims:
        window = "none" if claim.window_from is None else f"from {claim.window_from:.0%} of the snapshots or windows on"
        gates = ", ".join(f"{name} = {value:g}" for name, value in claim.gates.items()) or "none"
        runs = sorted(set(claim.runs_per_arm()))
        undecidable = " (undecidable: 1 run per arm)" if 1 in runs else ""
        undecidable = f" ({claim.noise_rule.unit})" if claim.not_run else undecidable
        lines += [
            f"## {claim.id}",
            "",
            "- arms:",
            *_arms_text(claim),
            f"- runs per arm: {claim.runs_text()}{undecidable}",
            f"- schedule: {claim.schedule}",
            f"- layers: {claim.layers}; modalities: "
            f"{', '.join(claim.modalities)} (the paper's: {claim.paper_modality})",
            f"- window: {window}",
            f"- gates: {gates}",
            f"- deciding unit: {claim.noise_rule.unit}; within-run (secondary): "
            f"{claim.noise_rule.within_run}; level {claim.noise_rule.level}, alpha {claim.noise_rule.alpha}, "
            f"power {claim.noise_rule.power}",
            f"- multiplicity: {claim.multiplicity}",
            "",
        ]
    lines += ["## Design", "", *(f"- {note}" for note in plan.design_notes), ""]
    settings = settings or PRESETS.get(plan.preset)
    if settings is not None:
        costs = PRESET_COSTS.get(plan.preset, CPU_COSTS)
        lines += ["## Estimated cost", "", *cost_lines(settings, costs, BUDGETS.get(plan.preset)), ""]
    lines += ["## Rule changes", ""]
    changes = [f"- {c.date}, {c.claim}: {c.rule} {c.old!r} -> {c.new!r}: {c.why}" for c in plan.rule_changes]
    lines += changes or ["None."]
    return "\n".join(lines) + "\n"
