"""The study's trainings in lanes run at once (``mmoe study claims --jobs N``): every pre-training in one round of
lanes, then (after the random inits, which train nothing) every fine-tuning folder in a second round, each lane a
process of the pipeline kit (:func:`mmoe.pipeline.stages.run_parallel`) that runs its groups one after the other. On
a GPU, several tiny runs share it (the ``--scale gpu`` estimate assumes 8); on the 2-core CPU, 2 lanes at most help.
The measurements and the report then run in this process, every training reused."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from pathlib import Path

from mmoe.pipeline.layout import RANDOM_INIT
from mmoe.pipeline.stages import Stage, is_done, lanes_by_cost, quiet_lightning, run_parallel, run_stage
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


def run_groups(out: Path, settings: StudySettings, digest: str, groups: Sequence[str]) -> None:
    """A lane's process: the stages of ``groups`` in turn, each recording the plan's hash ``digest``."""
    quiet_lightning()
    study = StudyRun(out, settings.training)
    for stage in study_stages(study, settings):
        if group_of(stage) in groups:
            run_stage(study, under_plan(stage, digest))


def _round(study: StudyRun, settings: StudySettings, digest: str, stages: list[Stage], jobs: int) -> None:
    costs: dict[str, float] = {}
    for stage in stages:
        if not is_done(study, stage):
            costs[group_of(stage)] = costs.get(group_of(stage), 0.0) + 1.0
    if costs:
        lanes = lanes_by_cost(list(costs), costs.__getitem__, jobs)
        run_parallel(lanes, functools.partial(run_groups, study.out, settings, digest), jobs)


def run_in_lanes(study: StudyRun, settings: StudySettings, digest: str, jobs: int) -> None:
    """Every training of the study not done yet, in ``jobs`` lanes at once: corpus and codebook here, the
    pre-trainings in lanes, the random inits here, the fine-tunings in lanes; PipelineError naming the first lane
    that failed."""
    stages = study_stages(study, settings)
    here = [stage for stage in stages if group_of(stage) is None]
    for stage in here[:2]:  # corpus and codebook
        run_stage(study, under_plan(stage, digest), reused_by="")
    _round(study, settings, digest, [s for s in stages if (group_of(s) or "").startswith("pretrain/")], jobs)
    for stage in here[2:]:  # random inits, from the pre-trained architecture
        run_stage(study, under_plan(stage, digest), reused_by="")
    _round(study, settings, digest, [s for s in stages if (group_of(s) or "").startswith("finetune/")], jobs)
