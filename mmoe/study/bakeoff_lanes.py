"""The bake-off's runs at once (``mmoe study routers --jobs N``): the corpus and codebook in this process, then each
(router, seed) run, its pre-training, export, VQA fine-tuning, scored prediction and results, a job of a pool of ``N``
processes (:class:`mmoe.pipeline.pool.WorkerPool`), each running one run after another as it frees up, every stage
recording the plan's hash. On the 2-core CPU two processes take about half the time of one (a tiny training's step
takes about as long on one thread as on two: the demo's measurement)."""

from __future__ import annotations

import functools
from pathlib import Path

from mmoe.pipeline.pool import Job, WorkerPool
from mmoe.pipeline.stages import is_done, quiet_lightning, run_stage
from mmoe.study.bakeoff_plan import BakeoffPlan
from mmoe.study.bakeoff_runs import BakeoffRun, bakeoff_stages, run_name, run_stages
from mmoe.study.plan_runs import under_plan


def run_group(out: Path, plan: BakeoffPlan, digest: str, name: str) -> None:
    """A job of the pool's processes: the stages of the run ``name`` (``<router>-seed<s>``) in turn."""
    quiet_lightning()
    run = BakeoffRun(out, plan.settings())
    for router in plan.routers:
        for seed in plan.seeds:
            if run_name(router.name, seed) == name:
                for stage in run_stages(run, plan, router, seed):
                    run_stage(run, under_plan(stage, digest))


def run_in_lanes(run: BakeoffRun, plan: BakeoffPlan, digest: str, jobs: int) -> None:
    """Every stage of the plan not done yet: corpus and codebook here, the runs as jobs of a pool of ``jobs``
    processes; PipelineError naming the first run that failed."""
    for stage in bakeoff_stages(run, plan)[:2]:  # corpus and codebook
        run_stage(run, under_plan(stage, digest), reused_by="")
    pending = [
        Job(run_name(router.name, seed), 1.0)
        for router in plan.routers
        for seed in plan.seeds
        if not all(is_done(run, stage) for stage in run_stages(run, plan, router, seed))
    ]
    if pending:
        with WorkerPool(jobs) as pool:
            pool.run(pending, functools.partial(run_group, run.out, plan, digest))
