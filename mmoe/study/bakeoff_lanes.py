"""The bake-off's runs in lanes run at once (``mmoe study routers --jobs N``): the corpus and codebook in this
process, then each (router, seed) run, its pre-training, export, VQA fine-tuning, scored prediction and results, dealt
to one of ``N`` lanes, each a process of the pipeline kit (:func:`mmoe.pipeline.stages.run_parallel`) that runs its
runs one after the other, every stage recording the plan's hash. On the 2-core CPU two lanes take about half the time
of one (a tiny training's step takes about as long on one thread as on two: the demo's measurement)."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from pathlib import Path

from mmoe.pipeline.stages import is_done, lanes_by_cost, quiet_lightning, run_parallel, run_stage
from mmoe.study.bakeoff_plan import BakeoffPlan
from mmoe.study.bakeoff_runs import BakeoffRun, bakeoff_stages, run_name, run_stages
from mmoe.study.plan_runs import under_plan


def run_groups(out: Path, plan: BakeoffPlan, digest: str, names: Sequence[str]) -> None:
    """A lane's process: the stages of the runs ``names`` (``<router>-seed<s>``) in turn."""
    quiet_lightning()
    run = BakeoffRun(out, plan.settings())
    for router in plan.routers:
        for seed in plan.seeds:
            if run_name(router.name, seed) in names:
                for stage in run_stages(run, plan, router, seed):
                    run_stage(run, under_plan(stage, digest))


def run_in_lanes(run: BakeoffRun, plan: BakeoffPlan, digest: str, jobs: int) -> None:
    """Every stage of the plan not done yet: corpus and codebook here, the runs in ``jobs`` lanes; PipelineError
    naming the first lane that failed."""
    for stage in bakeoff_stages(run, plan)[:2]:  # corpus and codebook
        run_stage(run, under_plan(stage, digest), reused_by="")
    pending = [
        run_name(router.name, seed)
        for router in plan.routers
        for seed in plan.seeds
        if not all(is_done(run, stage) for stage in run_stages(run, plan, router, seed))
    ]
    if pending:
        lanes = lanes_by_cost(pending, lambda name: 1.0, jobs)
        run_parallel(lanes, functools.partial(run_groups, run.out, plan, digest), jobs)
