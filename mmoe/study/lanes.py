"""The study's trainings run at once (``mmoe study claims --jobs N``): every pre-training as a job of a pool of
processes (:class:`mmoe.pipeline.pool.WorkerPool`), then (after the random inits, which train nothing) every
fine-tuning folder as a job of the same pool, each process running one job after another as it frees up. On
a GPU, several tiny runs share it (the ``--scale gpu`` estimate assumes 8); on the 2-core CPU, 2 processes at most help.
The measurements and the report then run in this process, every training reused."""

from __future__ import annotations

import contextlib
import functools
from pathlib import Path

from mmoe.pipeline.layout import RANDOM_INIT
from mmoe.pipeline.pool import Job, WorkerPool
from mmoe.pipeline.stages import Stage, is_done, quiet_lightning, run_stage
from mmoe.pipeline.standard_stages import codebook_stage, corpus_stage
from mmoe.study.plan_runs import under_plan
from mmoe.study.runs import StudyRun, finetune_stages, pretrain_stages, pretrainings
from mmoe.study.settings import StudySettings


def study_stages(study: StudyRun, settings: StudySettings) -> list[Stage]:
    """Every training stage of the study, in order: corpus, codebook, each pre-training and its export, then the
    fine-tunings with their random inits and scoring."""
    stages = [corpus_stage(study), codebook_stage(study)]
    for run in pretrainings(settings):
        stages += pretrain_stages(study, run, settings.pretraining_recipe)
    return stages + finetune_stages(study, settings)


def group_of(stage: Stage) -> str | None:
    """The lane group of a training stage (``pretrain/<run>``, ``finetune/<folder>``); None for the stages the main
    process runs (corpus, codebook, the random inits, which draw weights and train nothing)."""
    parts = stage.key.parts
    if len(parts) < 2 or parts[0] not in ("pretrain", "finetune"):
        return None
    if parts[0] == "pretrain" and len(parts) == 2 and RANDOM_INIT in parts[1]:
        return None
    return "/".join(parts[:2])


def run_group(out: Path, settings: StudySettings, digest: str, group: str) -> None:
    """A job of the pool's processes: the stages of ``group`` in turn, each recording the plan's hash ``digest``."""
    quiet_lightning()
    study = StudyRun(out, settings.training)
    for stage in study_stages(study, settings):
        if group_of(stage) == group:
            run_stage(study, under_plan(stage, digest))


def pending_groups(study: StudyRun, stages: list[Stage]) -> list[Job]:
    """The groups of ``stages`` with a stage not done yet, in order, each costing its count of stages."""
    costs: dict[str, float] = {}
    for stage in stages:
        if not is_done(study, stage):
            costs[group_of(stage)] = costs.get(group_of(stage), 0.0) + 1.0
    return [Job(group, cost) for group, cost in costs.items()]


def run_in_lanes(study: StudyRun, settings: StudySettings, digest: str, jobs: int) -> None:
    """Every training of the study not done yet, ``jobs`` at once: corpus and codebook here, the pre-trainings as jobs
    of a pool of ``jobs`` processes (:class:`mmoe.pipeline.pool.WorkerPool`), the random inits here, the fine-tunings
    as jobs of the same pool; PipelineError naming the first group that failed."""
    stages = study_stages(study, settings)
    here = [stage for stage in stages if group_of(stage) is None]
    for stage in here[:2]:  # corpus and codebook
        run_stage(study, under_plan(stage, digest), reused_by="")
    run_group_job = functools.partial(run_group, study.out, settings, digest)
    pretraining = pending_groups(study, [s for s in stages if (group_of(s) or "").startswith("pretrain/")])
    finetuning = pending_groups(study, [s for s in stages if (group_of(s) or "").startswith("finetune/")])
    with WorkerPool(jobs) if pretraining or finetuning else contextlib.nullcontext() as pool:
        if pretraining:
            pool.run(pretraining, run_group_job)
        for stage in here[2:]:  # random inits, from the pre-trained architecture
            run_stage(study, under_plan(stage, digest), reused_by="")
        if finetuning:
            pool.run(finetuning, run_group_job)
