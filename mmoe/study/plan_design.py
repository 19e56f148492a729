"""The plan of the study's current design (:func:`study_plan`): what ``mmoe study claims`` (and ``--fast``,
``--scale``) run today, written down claim by claim, and its human-readable form (:func:`plan_markdown`).

``docs/claims/plan.json`` is :func:`study_plan` of the default settings (with the rule changes it records), written
by ``python -m mmoe.study.plan_design docs/claims --from-design``; ``plan.md`` beside it is rendered from that file
by ``python -m mmoe.study.plan_design docs/claims``; a test keeps them equal. The gates and rules below were the claim
code's constants before the plan existed: they are stated here, once, and the claims read them from the plan.
"""

from __future__ import annotations

import sys
from pathlib import Path

from mmoe.atomic import write_text_atomic
from mmoe.metrics.routing import DEFAULT_ACTIVATION_THRESHOLD
from mmoe.pipeline.benchmarks import trained_benchmarks
from mmoe.pipeline.layout import RANDOM_INIT
from mmoe.study.plan import Arm, ClaimPlan, NoiseRule, StudyPlan, plan_hash, read_plan, write_plan
from mmoe.study.runs import (
    CONSISTENCY_TASK,
    FROZEN_IN_FINETUNING,
    PRETRAINING_VARIANT,
    STRATIFIED,
    router_run,
)
from mmoe.study.settings import DEFAULT, FAST, SCALE, StudySettings

PRESETS = {"default": DEFAULT, "fast": FAST, "scale": SCALE}
BOTH = ("language", "vision")
PRETRAIN_SCHEDULE = "AdamW, linear warm-up over 30 steps, then cosine decay to the run's last step (tiny configs)"
FINETUNE_SCHEDULE = "AdamW, linear warm-up over 30 steps, then cosine decay to the run's last step (tiny task configs)"
#: The task order MH-MoE Table 4 reports, each variant above the next.
TASK_ORDER = ("mhmoe", "xmoe", "dense")


def _one_run(unit_inside: str) -> NoiseRule:
    return NoiseRule("training run (Welch t over runs per arm)", unit_inside)


def _pretraining(name: str, steps: int, measured_at: int | None = None, label: str | None = None) -> Arm:
    return Arm(label or name, (f"pretrain/{name}",), (0,), steps, steps if measured_at is None else measured_at)


def _routing_claims(settings: StudySettings) -> list[ClaimPlan]:
    experts, steps = settings.many_experts, settings.many_experts_steps
    mhmoe = [_pretraining(f"mhmoe-e{experts}-h{h}", steps, label=f"mhmoe h={h}") for h in sorted(settings.heads)]
    xmoe_at = _pretraining(router_run("xmoe", experts), settings.router_steps, steps, "xmoe (snapshot)")
    diversity = [_pretraining(name, settings.training.pretrain_steps if name == "mhmoe" else steps)
                 for name in ("mhmoe", *(f"mhmoe-e{experts}-h{h}" for h in settings.heads),
                              *(f"mhmoe-e{e}-h{h}" for h, e in settings.diversity_runs))]  # fmt: skip
    routers = [_pretraining(router_run(r, experts), settings.router_steps, label=r) for r in ("xmoe", "switch")]
    fine_tuned = [
        Arm(router, tuple(f"finetune/{router_run(router, experts)}/{CONSISTENCY_TASK}-seed{s}" for s in
                          range(settings.seeds)), tuple(range(settings.seeds)), settings.consistency_steps,
            settings.consistency_steps)
        for router in ("xmoe", "switch")
    ]  # fmt: skip
    return [
        ClaimPlan("activation", (mhmoe[-1], *mhmoe[:-1], xmoe_at), PRETRAIN_SCHEDULE, "all", BOTH, "language", None,
                  {"activation_threshold": DEFAULT_ACTIVATION_THRESHOLD, "activation_ceiling": 0.999},
                  _one_run("held-out batches"), "none"),
        ClaimPlan("diversity", tuple(diversity), PRETRAIN_SCHEDULE, "all", ("vision",), "vision", None,
                  {"saturation_share": 0.97}, _one_run("held-out images"), "none"),
        ClaimPlan("collapse", tuple(routers), PRETRAIN_SCHEDULE, "defined_at_every_snapshot", BOTH, "language", 0.5,
                  {}, _one_run("router-input rows, drawn per snapshot"), "none"),
        ClaimPlan("fluctuation", tuple(routers), PRETRAIN_SCHEDULE, "all", BOTH, "language", 0.5,
                  {"random_fluctuation_share": 0.9}, _one_run("held-out batches"), "none"),
        ClaimPlan("consistency", tuple(fine_tuned), FINETUNE_SCHEDULE + f"; routing frozen for "
                  f"{', '.join(FROZEN_IN_FINETUNING)}, not for switch", "all", BOTH, "language", 0.5,
                  {"consistency_ceiling": 0.99},
                  NoiseRule("fine-tuning run (seed): Welch t over the seeds' leave-one-out jackknife pseudo-values of "
                            "the mean correlation between runs, one pre-trained backbone per arm",
                            "load windows of the judged half"), "none"),
    ]  # fmt: skip


def _task_arm(settings: StudySettings, variant: str, task: str, label: str) -> Arm:
    seeds = tuple(range(settings.task_seeds))
    steps = settings.training.finetune_steps[task]
    return Arm(f"{label} {task}", tuple(f"finetune/{variant}/{task}-seed{s}" for s in seeds), seeds, steps, steps)


def _task_claims(settings: StudySettings) -> list[ClaimPlan]:
    tasks = [benchmark.name for benchmark in trained_benchmarks(settings.training)]
    seeds = NoiseRule("fine-tuning run (seed): Welch t over seeds per arm, one pre-training per variant",
                      "none (each run is one score)")  # fmt: skip
    order = tuple(_task_arm(settings, v, task, v) for task in tasks for v in TASK_ORDER if v in settings.task_variants)
    random = f"{PRETRAINING_VARIANT}-{RANDOM_INIT}"
    pretraining = tuple(arm for task in tasks for arm in (
        _task_arm(settings, PRETRAINING_VARIANT, task, "pre-trained"), _task_arm(settings, random, task, "random init")
    ))  # fmt: skip
    stratified = _pretraining(STRATIFIED, settings.training.pretrain_steps)
    return [
        ClaimPlan("tasks", order, FINETUNE_SCHEDULE, "all", BOTH, "language", None, {}, seeds, "holm"),
        ClaimPlan("pretraining", pretraining, FINETUNE_SCHEDULE, "all", BOTH, "language", None, {}, seeds, "holm"),
        ClaimPlan("capacity", (stratified,), PRETRAIN_SCHEDULE, "all", BOTH, "language", None, {},
                  _one_run("held-out batches"), "none"),
        ClaimPlan("frequency", (stratified,), PRETRAIN_SCHEDULE, "all", ("language",), "language", None,
                  {"min_occurrences": 3.0}, _one_run("token ids"), "none"),
    ]  # fmt: skip


def study_plan(settings: StudySettings, preset: str) -> StudyPlan:
    """The plan of the study's design under ``settings`` (one of :data:`PRESETS`, named ``preset``)."""
    return StudyPlan(preset, tuple(_routing_claims(settings) + _task_claims(settings)))


def shipped_rules(claim_id: str) -> ClaimPlan:
    """The default plan's rules of one claim (what a claim computed without a plan is judged by)."""
    return study_plan(DEFAULT, "default").claim(claim_id)


def _arms_text(claim: ClaimPlan) -> list[str]:
    lines = []
    for arm in claim.arms:
        at = "at its end" if arm.measured_at == arm.steps else f"at step {arm.measured_at}"
        runs = ", ".join(f"`{run}`" for run in arm.runs)
        lines.append(f"  - {arm.name}: {len(arm.runs)} run(s) (seeds {list(arm.seeds)}), {arm.steps} steps, measured "
                     f"{at}: {runs}")  # fmt: skip
    return lines


def plan_markdown(plan: StudyPlan) -> str:
    """The plan as Markdown: per claim its arms, schedule, layers, window, gates, noise rule and correction; then the
    rule changes."""
    lines = [f"# The claims study's plan (preset `{plan.preset}`)", "",
             f"SHA-256 of its canonical JSON: `{plan_hash(plan)}`. Written from `plan.json` by "
             "`mmoe.study.plan_design`; the study records this hash with every stage it runs and refuses a report "
             "over runs made under another plan.", ""]  # fmt: skip
    for claim in plan.claims:
        window = "none" if claim.window_from is None else f"from {claim.window_from:.0%} of the snapshots or windows on"
        gates = ", ".join(f"{name} = {value:g}" for name, value in claim.gates.items()) or "none"
        runs = sorted(set(claim.runs_per_arm()))
        undecidable = " (undecidable: 1 run per arm)" if 1 in runs else ""
        lines += [f"## {claim.id}", "", "- arms:", *_arms_text(claim),
                  f"- runs per arm: {', '.join(map(str, runs))}{undecidable}",
                  f"- schedule: {claim.schedule}", f"- layers: {claim.layers}; modalities: "
                  f"{', '.join(claim.modalities)} (the paper's: {claim.paper_modality})", f"- window: {window}",
                  f"- gates: {gates}", f"- deciding unit: {claim.noise_rule.unit}; within-run (secondary): "
                  f"{claim.noise_rule.within_run}; level {claim.noise_rule.level}, alpha {claim.noise_rule.alpha}, "
                  f"power {claim.noise_rule.power}", f"- multiplicity: {claim.multiplicity}", ""]  # fmt: skip
    lines += ["## Rule changes", ""]
    changes = [f"- {c.date}, {c.claim}: {c.rule} {c.old!r} -> {c.new!r}: {c.why}" for c in plan.rule_changes]
    lines += changes or ["None."]
    return "\n".join(lines) + "\n"


def write_plan_files(folder: Path, from_design: bool) -> None:
    """``folder/plan.md`` rendered from ``folder/plan.json``, that file first written from the default settings'
    design where ``from_design`` (or where it is absent)."""
    if from_design or not (folder / "plan.json").is_file():
        write_plan(study_plan(DEFAULT, "default"), folder / "plan.json")
    write_text_atomic(folder / "plan.md", plan_markdown(read_plan(folder / "plan.json")))


if __name__ == "__main__":
    write_plan_files(Path(sys.argv[1]), "--from-design" in sys.argv[2:])
