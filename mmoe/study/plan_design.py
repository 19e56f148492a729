"""The plan of the study's current design (:func:`study_plan`): what ``mmoe study claims`` (and ``--fast``,
``--scale gpu``, ``--scale gpu-tasks``) run today, written down claim by claim, and its files (its human-readable
form: :func:`mmoe.study.plan_markdown.plan_markdown`).

``docs/claims/plan.json`` is :func:`study_plan` of the default settings (with the rule changes it records), written
by ``python -m mmoe.study.plan_design docs/claims --from-design``; ``plan.md`` beside it is rendered from that file
by ``python -m mmoe.study.plan_design docs/claims``; ``--preset gpu`` / ``--preset gpu-tasks`` write
``plan_gpu.json`` + ``.md`` / ``plan_gpu_tasks.json`` + ``.md`` the same way (:data:`PLAN_STEMS`); a test keeps each
equal to the design. The gates and rules below were the claim
code's constants before the plan existed: they are stated here, once, and the claims read them from the plan.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from pathlib import Path
from statistics import NormalDist

from mmoe.atomic import write_text_atomic
from mmoe.metrics.routing import DEFAULT_ACTIVATION_THRESHOLD
from mmoe.pipeline.benchmarks import trained_benchmarks
from mmoe.study.measure_runs import diversity_arms
from mmoe.study.plan import Arm, ClaimPlan, NoiseRule, StudyPlan, read_plan, write_plan
from mmoe.study.plan_gpu import DESIGN_NOTES_BY_PRESET, not_run_unit
from mmoe.study.plan_markdown import PLAN_STEMS, plan_markdown
from mmoe.study.runs import (
    CONSISTENCY_TASK,
    PRETRAINING_VARIANT,
    STRATIFIED,
    consistency_folder,
    recipe_run,
    routing_run,
    task_backbone,
)
from mmoe.study.settings import CONSISTENCY_RULES, DEFAULT, PRESETS, StudySettings

BOTH = ("language", "vision")
PRETRAIN_SCHEDULE = "AdamW, linear warm-up over 30 steps, then cosine decay to the run's last step (tiny configs)"
ROUTING_SCHEDULE = (
    "AdamW, linear warm-up over 30 steps, then the peak learning rate held constant to the run's last "
    "step (min_lr_ratio 1.0), the same steps on every side"
)
FINETUNE_SCHEDULE = "AdamW, linear warm-up over 30 steps, then cosine decay to the run's last step (tiny task configs)"
RECIPE_SCHEDULE = (
    "the demo's recipe: pre-training with the contrastive loss and the output vocabulary at peak learning rate 3e-4, "
    "VQA with head x2 and layer decay 0.4 at 3e-4, warm-up then cosine decay"
)
#: The task order MH-MoE Table 4 reports, each variant above the next.
TASK_ORDER = ("mhmoe", "xmoe", "dense")


def _over_runs(statistic: str, within: str) -> NoiseRule:
    return NoiseRule(f"training run (pre-training seed): per run {statistic}; Welch t over runs per arm", within)


def _one_run(unit_inside: str) -> NoiseRule:
    return NoiseRule("training run (Welch t over runs per arm)", unit_inside)


def _pretraining(name: str, steps: int, measured_at: int | None = None, label: str | None = None) -> Arm:
    return Arm(label or name, (f"pretrain/{name}",), (0,), steps, steps if measured_at is None else measured_at)


def _seeded(settings: StudySettings, arm: str, label: str) -> Arm:
    seeds = tuple(range(settings.routing_seeds))
    runs = tuple(f"pretrain/{routing_run(arm, settings.many_experts, seed)}" for seed in seeds)
    return Arm(label, runs, seeds, settings.router_steps, settings.router_steps)


def _fine_tuned(settings: StudySettings, router: str, rule: str) -> Arm:
    folder = consistency_folder(router, settings.many_experts, rule)
    seeds = tuple(range(settings.seeds))
    runs = tuple(f"finetune/{folder}/{CONSISTENCY_TASK}-seed{seed}" for seed in seeds)
    return Arm(f"{router} ({rule})", runs, seeds, settings.consistency_steps, settings.consistency_steps)


def _consistency(settings: StudySettings, rule: str) -> ClaimPlan:
    how = "both routers' routing frozen (X-MoE §3.3)" if rule == "frozen" else "both routers fine-tuned whole"
    noise = NoiseRule(
        "fine-tuning run (seed): Welch t over the seeds' leave-one-out jackknife pseudo-values of the "
        "mean correlation between runs, from each router's routing-seed-0 backbone",
        "load windows of the judged half",
    )
    arms = tuple(_fine_tuned(settings, router, rule) for router in ("xmoe", "switch"))
    claim_id = "consistency" if rule == "frozen" else "consistency_trained"
    return ClaimPlan(
        claim_id,
        arms,
        f"{FINETUNE_SCHEDULE}; {how}",
        "all",
        BOTH,
        "language",
        0.5,
        {"consistency_ceiling": 0.99},
        noise,
        "none",
    )


def _diversity_arm(runs: list[str], steps: int) -> Arm:
    name = runs[0].removesuffix("-seed0") if len(runs) > 1 else runs[0]
    return Arm(name, tuple(f"pretrain/{run}" for run in runs), tuple(range(len(runs))), steps, steps)


def _activation_claim(settings: StudySettings) -> ClaimPlan:
    """MH-MoE Fig. 1a: the activation ratio of MH-MoE's head counts against X-MoE."""
    mhmoe = [_seeded(settings, f"mhmoe-h{h}", f"mhmoe h={h}") for h in sorted(settings.heads)]
    xmoe = _seeded(settings, "xmoe", "xmoe")
    activation = _over_runs(
        "the share of choices activated at the run's end, the mean over the modality's MoE layers",
        "held-out batches of routing seed 0",
    )
    return ClaimPlan(
        "activation",
        (mhmoe[-1], *mhmoe[:-1], xmoe) if mhmoe else (xmoe,),
        ROUTING_SCHEDULE,
        "all",
        BOTH,
        "language",
        None,
        {"activation_threshold": DEFAULT_ACTIVATION_THRESHOLD, "activation_ceiling": 0.999},
        activation,
        "holm",
    )


def _diversity_claim(settings: StudySettings) -> ClaimPlan:
    """MH-MoE Fig. 1b / 8 / 10: the distinct experts of an object's sub-tokens against the background's."""
    diversity = [_diversity_arm(runs, settings.router_steps) for runs in diversity_arms(settings)]
    regions = (
        NoiseRule(
            "training run (pre-training seed): per run object minus background distinct experts, the "
            "mean over the vision MoE layers; one-sample t over runs (an arm of one run is not decided)",
            "held-out images of each run",
        )
        if settings.diversity_seeds > 1
        else _one_run("held-out images")
    )
    return ClaimPlan(
        "diversity",
        tuple(diversity),
        ROUTING_SCHEDULE,
        "all",
        ("vision",),
        "vision",
        None,
        {"saturation_share": 0.97},
        regions,
        "none",
    )


def _xmoe_against_switch_claims(settings: StudySettings) -> list[ClaimPlan]:
    """X-MoE Eq. 11 and §4.5: representation collapse and routing fluctuation, X-MoE against Switch."""
    xmoe, switch = _seeded(settings, "xmoe", "xmoe"), _seeded(settings, "switch", "switch")
    collapse = _over_runs(
        "the mean over the window's snapshots of log RC, RC the geometric mean over every MoE layer "
        "of the modality (a run with RC undefined there leaves the arm, reported)",
        "router-input rows of routing seed 0, drawn per snapshot",
    )
    fluctuation = _over_runs(
        "the mean over the window's snapshot pairs of the share of (sub-)tokens that changed "
        "expert, pooled over the modality's MoE layers",
        "held-out batches of routing seed 0",
    )
    window = settings.routing_window
    return [
        ClaimPlan("collapse", (xmoe, switch), ROUTING_SCHEDULE, "all", BOTH, "language", window, {}, collapse, "none"),
        ClaimPlan(
            "fluctuation",
            (xmoe, switch),
            ROUTING_SCHEDULE,
            "all",
            BOTH,
            "language",
            window,
            {"random_fluctuation_share": 0.9},
            fluctuation,
            "none",
        ),
    ]


def _routing_claims(settings: StudySettings) -> list[ClaimPlan]:
    return [
        _activation_claim(settings),
        _diversity_claim(settings),
        *_xmoe_against_switch_claims(settings),
        *(_consistency(settings, rule) for rule in CONSISTENCY_RULES),
    ]


def _task_arm(settings: StudySettings, variant: str, task: str) -> Arm:
    """Every fine-tuning of ``task`` from each pre-training of ``variant`` (seeds: the fine-tunings')."""
    backbones, seeds = settings.task_pretraining_seeds, range(settings.task_seeds)
    runs = [(task_backbone(variant, b, backbones), seed) for b in range(backbones) for seed in seeds]
    steps = settings.training.finetune_steps[task]
    return Arm(
        f"{variant} {task}",
        tuple(f"finetune/{backbone}/{task}-seed{seed}" for backbone, seed in runs),
        tuple(seed for _, seed in runs),
        steps,
        steps,
    )


def _task_noise_rule(settings: StudySettings) -> NoiseRule:
    if settings.task_pretraining_seeds > 1:
        return NoiseRule(
            f"pre-training run (seed): per variant and task, each pre-training's mean score over its "
            f"{settings.task_seeds} fine-tuning seeds; Welch t over the {settings.task_pretraining_seeds} "
            "pre-trainings per arm; a task where a variant is not above its baseline (the corpus's "
            "chance level) uninformative",
            "the fine-tuning seeds of one pre-training (averaged)",
        )
    return NoiseRule(
        "fine-tuning run (seed): Welch t over seeds per arm, one pre-training per variant (conditional on that draw)",
        "none (each run is one score)",
    )


def _backbone_arm(settings: StudySettings, task: str, random_init: bool) -> Arm:
    seeds = tuple(range(settings.pretraining_backbones))
    runs = tuple(f"finetune/{recipe_run(seed, random_init)}/{task}-seed{seed}" for seed in seeds)
    steps = settings.pretraining_recipe.finetune_steps[task]
    return Arm(f"{'random init' if random_init else 'pre-trained'} {task}", runs, seeds, steps, steps)


def _task_claims(settings: StudySettings) -> list[ClaimPlan]:
    tasks = [benchmark.name for benchmark in trained_benchmarks(settings.training)]
    seeds = _task_noise_rule(settings)
    order = tuple(_task_arm(settings, v, task) for task in tasks for v in TASK_ORDER if v in settings.task_variants)
    recipe_tasks = list(settings.pretraining_recipe.finetune_steps)
    backbones = tuple(_backbone_arm(settings, task, random) for task in recipe_tasks for random in (False, True))
    unit = NoiseRule(
        f"backbone: each {PRETRAINING_VARIANT} pre-training (seed b) and random init (seed b) fine-tuned "
        "once (seed b); Welch t over the backbones per arm",
        "paired bootstrap over the evaluation's images (a cluster of questions), the arms' mean accuracies",
    )
    stratified = _pretraining(STRATIFIED, settings.training.pretrain_steps)
    frequency = NoiseRule(f"none: undecidable on the synthetic corpus ({FREQUENCY_POWER})", "token ids")
    return [
        ClaimPlan("tasks", order, FINETUNE_SCHEDULE, "all", BOTH, "language", None, {}, seeds, "holm"),
        ClaimPlan("pretraining", backbones, RECIPE_SCHEDULE, "all", BOTH, "language", None, {}, unit, "holm"),
        ClaimPlan(
            "capacity",
            (stratified,),
            PRETRAIN_SCHEDULE,
            "all",
            BOTH,
            "language",
            None,
            {},
            _one_run("held-out batches"),
            "none",
        ),
        ClaimPlan(
            "frequency",
            (stratified,),
            PRETRAIN_SCHEDULE,
            "all",
            ("language",),
            "language",
            None,
            {"min_occurrences": 3.0},
            frequency,
            "none",
        ),
    ]


def frequency_types_needed(rho: float = -0.3, alpha: float = 0.05, power: float = 0.8) -> int:
    """Token types a two-sided test of Spearman's rho = ``rho`` needs at ``alpha`` and ``power`` (Fisher's z: n = ((z
    _{1-alpha/2} + z_power) / atanh|rho|)^2 + 3)."""
    normal = NormalDist()
    needed = ((normal.inv_cdf(1 - alpha / 2) + normal.inv_cdf(power)) / math.atanh(abs(rho))) ** 2 + 3
    return math.ceil(needed)


FREQUENCY_POWER = (
    f"35 token ids over 1.4 decades of frequency; Spearman rho = -0.3 at power 0.8 and alpha 0.05 needs "
    f"{frequency_types_needed()} token types (Fisher z); real captions (thousands of types over 4+ "
    "decades, e.g. COCO) and 3 Stratified MoE seeds would decide it"
)

DESIGN_NOTES = (
    "The training run is the unit: claims 1, 3 and 4 are decided over the routing seeds of each arm, claim 5 over "
    "the fine-tuning seeds (jackknife), claim 7 over the backbones; resampling inside a run is a secondary term.",
    "Like with like: every routing arm (X-MoE, Switch, MH-MoE h = 4 and 8, all at the same experts) trains the same "
    "steps with the same schedule, a constant learning rate after the warm-up; claim 1's X-MoE is measured at the end "
    "of its own run.",
    "Claims 3 and 4 read every MoE layer of each modality over the snapshots from the warm-up's end on (30%); both "
    "modalities' verdicts are reported, the paper's first.",
    "Claim 5 is two rows, each under one fine-tuning rule on both sides: both routers frozen, both trained.",
    f"Claim 7 uses the demo's recipe (contrastive loss, output vocabulary, its learning rates and VQA optimiser) on "
    f"the study's corpus and 64-token codebook, VQA only: {PRETRAINING_VARIANT} pre-trainings against random inits of "
    "the same seeds.",
    "Budget: the default must fit 60 minutes alone on the 2-core CPU. The task order (claim 6: 3 variants x 3 tasks "
    "x 2 seeds, about 20 more minutes) does not fit beside the runs per arm above and runs under --scale gpu only; "
    "the router table (a table, not a claim) is pre-trained 60 steps instead of 100.",
    f"Claim 9 is undecidable on the synthetic corpus: {FREQUENCY_POWER}.",
    "Changed from plan 5f7cffac (before any run of this plan): runs per arm 1 -> routing_seeds for claims 1, 3, 4; "
    "X-MoE 200 steps cosine -> 100 steps constant like MH-MoE, measured at its end (claim 1 compared a step-100 "
    "snapshot of a 200-step cosine run with annealed 100-step runs); claim 3 layers defined_at_every_snapshot -> all "
    "(a layer was dropped after the fact); claims 3 and 4 window 0.5 -> 0.3 (the constant-rate part of the run); "
    "claim 1 multiplicity none -> holm over its two gaps; claim 5 X-MoE frozen vs Switch trained -> two rows under "
    "one rule each; claim 7 MDM-only recipe, one backbone per arm -> the demo's recipe, 3 backbones per arm; claim 6 "
    "-> --scale gpu only.",
)


def _not_run(claim: ClaimPlan, preset: str) -> ClaimPlan:
    """``claim`` with no runs in its arms, its deciding unit saying which preset runs it."""
    arms = tuple(dataclasses.replace(arm, runs=(), seeds=()) for arm in claim.arms)
    noise = dataclasses.replace(claim.noise_rule, unit=not_run_unit(claim.id, preset))
    return dataclasses.replace(claim, arms=arms, noise_rule=noise)


def study_plan(settings: StudySettings, preset: str) -> StudyPlan:
    """The plan of the study's design under ``settings`` (one of :data:`PRESETS`, named ``preset``): the claims the
    settings do not run (:meth:`StudySettings.runs_claim`) without runs, each saying which preset runs it."""
    claims = tuple(
        claim if settings.runs_claim(claim.id) else _not_run(claim, preset)
        for claim in _routing_claims(settings) + _task_claims(settings)
    )
    return StudyPlan(preset, claims, design_notes=DESIGN_NOTES_BY_PRESET.get(preset, DESIGN_NOTES))


def shipped_rules(claim_id: str) -> ClaimPlan:
    """The default plan's rules of one claim (what a claim computed without a plan is judged by)."""
    return study_plan(DEFAULT, "default").claim(claim_id)


def write_plan_files(folder: Path, from_design: bool, preset: str = "default") -> None:
    """``folder/<stem>.md`` rendered from ``folder/<stem>.json`` (:data:`PLAN_STEMS`), that file first written from
    ``preset``'s design where ``from_design`` (or where it is absent)."""
    plan_file = folder / f"{PLAN_STEMS[preset]}.json"
    if from_design or not plan_file.is_file():
        write_plan(study_plan(PRESETS[preset], preset), plan_file)
    write_text_atomic(plan_file.with_suffix(".md"), plan_markdown(read_plan(plan_file)))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m mmoe.study.plan_design", description=write_plan_files.__doc__)
    parser.add_argument("folder", type=Path, help="where the plan files are (docs/claims)")
    parser.add_argument("--from-design", action="store_true", help="write the JSON from the design first")
    parser.add_argument("--preset", choices=tuple(PLAN_STEMS), default="default", help="whose plan (default: default)")
    args = parser.parse_args(argv)
    write_plan_files(args.folder, args.from_design, args.preset)


if __name__ == "__main__":
    main()
