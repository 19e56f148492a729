"""The estimated cost of a study preset, from measured per-step costs (written into the plan and printed by ``mmoe
study claims --dry-run``): an estimate, not a measurement.

The CPU costs are the default study's under the previous plan (43 trainings, about 4,900 steps, in 41.9 min of stages
alone on the 2-core machine, about 0.5 s per step averaged over pre-training and fine-tuning) and the demo's (its
pre-training with the contrastive loss about 1.4 s per step; fine-tuning 0.35-0.5 s per step on one thread). The GPU
costs are the tiny configs' on one H100 in bf16 as docs/tutorials/demo_details.md reports them (pre-training about
0.2 s per step, captioning 0.07), divided over the runs that share the GPU at once: tiny models are launch-bound, so
``streams`` runs side by side add little to each other's step time (an estimate that has not been measured). The
default run under today's plan took 56.7 min wall clock alone on that machine against the 57 min estimated here
(``docs/claims.md``; docs/how-to/claims_study.md gives the command).

Runs at once on the GPU: 8. A launch-bound run keeps one CPU core busy issuing kernels, and each run is two busy
processes, its own and its data loader's worker (the tiny configs' ``num_workers: 1``), so the lent machine's 16 cores
hold 8 runs side by side (the audit's "8-10 concurrent processes" at its low end; ``--jobs 8``). The GPU presets'
estimates hold against their budgets (:data:`BUDGETS`) at that count, never a count chosen to meet them. The corpus and
codebook stages are outside every estimate."""

from __future__ import annotations

from dataclasses import dataclass

from mmoe.pipeline.benchmarks import trained_benchmarks
from mmoe.study.runs import STRATIFIED, pretrainings
from mmoe.study.settings import CONSISTENCY_RULES, StudySettings


@dataclass(frozen=True)
class StepCosts:
    """Seconds per step and per stage on one machine.

    Attributes:
        machine: what the costs were measured on, in words.
        pretrain: per pre-training step (masked data modelling).
        recipe_pretrain: per pre-training step with the demo's recipe (contrastive loss, output vocabulary).
        finetune: per fine-tuning step.
        per_training: a training's start (process, configs, data) and end (checkpoint, export).
        evaluation: a fine-tuning's prediction and scoring.
        snapshot: the routing measurements of one backbone snapshot (RC with its bootstrap, loads, fluctuation).
        measure: the measurements of one exported backbone on the held-out batches.
        streams: runs that share the machine at once (1: one after the other).
    """

    machine: str
    pretrain: float
    recipe_pretrain: float
    finetune: float
    per_training: float
    evaluation: float
    snapshot: float
    measure: float
    streams: int = 1


CPU_COSTS = StepCosts(
    "the 2-core CPU",
    pretrain=0.5,
    recipe_pretrain=1.4,
    finetune=0.45,
    per_training=8.0,
    evaluation=25.0,
    snapshot=3.0,
    measure=2.0,
)
GPU_COSTS = StepCosts(
    "one H100, 8 runs at once",
    pretrain=0.2,
    recipe_pretrain=0.3,
    finetune=0.07,
    per_training=15.0,
    evaluation=10.0,
    snapshot=1.0,
    measure=0.5,
    streams=8,
)
#: The machine each preset's estimate is on.
PRESET_COSTS = {"default": CPU_COSTS, "fast": CPU_COSTS, "gpu": GPU_COSTS, "gpu-tasks": GPU_COSTS}


@dataclass(frozen=True)
class Budget:
    """The time a preset is meant to fit, stated beside its estimate.

    Attributes:
        minutes: the budget.
        what: what it is, in words.
    """

    minutes: float
    what: str


#: The GPU presets' budgets (the default's 60 minutes is stated in its plan's design notes).
BUDGETS = {
    "gpu": Budget(10.0, "one GPU loan of 15 minutes, with room for the machine's start"),
    "gpu-tasks": Budget(35.0, "a loan longer than one GPU's 15 minutes: the audit estimates 20-35 min"),
}


def _pretraining_label(settings: StudySettings, stratified: bool) -> str:
    parts = {
        "task variants": settings.run_tasks,
        "routing arms": settings.routing_seeds > 0,
        "diversity": bool(settings.diversity_runs),
        "Stratified MoE": stratified,
        "router table": bool(settings.router_variants),
    }
    return f"pre-training ({', '.join(part for part, present in parts.items() if present) or 'none'})"


def _finetuning_groups(settings: StudySettings, costs: StepCosts) -> list[tuple[str, int, int, float, int]]:
    """The fine-tuning groups of stages: (what, trainings, steps, seconds per step, evaluations)."""
    tasks = trained_benchmarks(settings.training) if settings.run_tasks else ()
    task_steps = sum(settings.training.steps(benchmark.name) for benchmark in tasks)
    backbones = len(settings.task_variants) * settings.task_pretraining_seeds
    task_runs = backbones * len(tasks) * settings.task_seeds
    consistency_runs = len(CONSISTENCY_RULES) * 2 * settings.seeds
    recipe_steps = sum(settings.pretraining_recipe.finetune_steps.values())
    recipe_runs = 2 * settings.pretraining_backbones * len(settings.pretraining_recipe.finetune_steps)
    return [
        (
            "VQA fine-tuning of the routers, both rules (claim 5)",
            consistency_runs,
            consistency_runs * settings.consistency_steps,
            costs.finetune,
            0,
        ),
        (
            "VQA fine-tuning of the pre-trained and random backbones (claim 7)",
            recipe_runs,
            2 * settings.pretraining_backbones * recipe_steps,
            costs.finetune,
            recipe_runs,
        ),
        (
            "task fine-tuning (claim 6)",
            task_runs,
            backbones * settings.task_seeds * task_steps,
            costs.finetune,
            task_runs,
        ),
    ]


def stage_costs(settings: StudySettings, costs: StepCosts) -> list[dict]:
    """Per group of stages: ``what``, ``trainings``, ``steps`` and estimated ``seconds`` on ``costs``' machine (a
    group's trainings shared over ``costs.streams`` at once; measurements one after the other)."""
    runs = pretrainings(settings)  # the list the stages train: the estimate and the run cannot disagree
    recipe = [run for run in runs if run.recipe]
    routing = [run for run in runs if not run.recipe]
    snapshots = 2 * settings.routing_seeds * (settings.router_steps // settings.snapshot_every + 1)
    stratified = any(run.name == STRATIFIED for run in routing)
    groups = [
        (_pretraining_label(settings, stratified), len(routing), sum(run.steps for run in routing), costs.pretrain, 0),
        (
            "pre-training with the demo's recipe (claim 7)",
            len(recipe),
            sum(run.steps for run in recipe),
            costs.recipe_pretrain,
            0,
        ),
        *_finetuning_groups(settings, costs),
    ]
    rows = []
    for what, trainings, steps, per_step, evaluations in groups:
        seconds = (steps * per_step + trainings * costs.per_training + evaluations * costs.evaluation) / costs.streams
        rows.append({"what": what, "trainings": trainings, "steps": steps, "seconds": seconds})
    measured = len(routing) + settings.routing_seeds * len(settings.heads)
    rows.append(
        {
            "what": "measurements (snapshots, backbones, scores)",
            "trainings": 0,
            "steps": 0,
            "seconds": snapshots * costs.snapshot + measured * costs.measure,
        }
    )
    return rows


def cost_lines(settings: StudySettings, costs: StepCosts, budget: Budget | None = None) -> list[str]:
    """The estimate as Markdown list lines, its total, then (where given) the budget and whether the total is in it."""
    rows = stage_costs(settings, costs)
    lines = [
        f"- {row['what']}: {row['trainings']} trainings, {row['steps']} steps, about {row['seconds'] / 60:.1f} min"
        for row in rows
    ]
    trainings = sum(row["trainings"] for row in rows)
    total = sum(row["seconds"] for row in rows) / 60
    lines.append(
        f"- **total: {trainings} trainings, about {total:.0f} min on {costs.machine} (an estimate from "
        "the per-step costs of `mmoe.study.cost`, not a measurement)**"
    )
    if budget is not None:
        fits = "within it" if total <= budget.minutes else f"**over it by about {total - budget.minutes:.0f} min**"
        lines.append(f"- budget: {budget.minutes:.0f} min ({budget.what}): the estimate is {fits}")
    return lines


def total_minutes(settings: StudySettings, costs: StepCosts) -> float:
    return sum(row["seconds"] for row in stage_costs(settings, costs)) / 60
