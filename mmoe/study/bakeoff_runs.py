"""The stages of ``mmoe study routers``, each a pipeline-kit stage done once and reused on a re-run (an interrupted
training resumed): the corpus and codebook, then per router and seed the pre-training on the same data and steps
(its held-out validation after the last step), the export of its backbone, the VQA fine-tuning of the plan's fixed
steps at the same seed and its scored prediction, and the run's results file ``results/<router>-seed<s>.json``,
written whole or absent, from which the report is made (:mod:`mmoe.study.bakeoff_report`)."""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path

from mmoe.config.run_spec import RunSpec
from mmoe.io import read_json, write_json
from mmoe.pipeline.benchmarks import benchmark_named
from mmoe.pipeline.launch import pretrain_spec
from mmoe.pipeline.layout import PipelineRun
from mmoe.pipeline.stages import Stage, StageKey
from mmoe.pipeline.standard_stages import (
    FineTuning,
    codebook_stage,
    corpus_stage,
    export_stage,
    pretrain_stage,
    scored_stages,
)
from mmoe.runtime.layout import RunLayout
from mmoe.study.bakeoff_measures import held_out_mim_loss, modality_means, routing_measures, validation_values
from mmoe.study.bakeoff_plan import FINETUNE_TASK, BakeoffPlan, PlannedRouter

#: The folder of the runs' results files.
RESULTS = "results"
#: The tiny configs every router's pre-training starts from: the dense backbone, the router's fields laid over it.
BASE_VARIANT = "dense"


def run_name(router: str, seed: int) -> str:
    return f"{router}-seed{seed}"


class BakeoffRun(PipelineRun):
    """The bake-off's work folder (:class:`mmoe.pipeline.layout.WorkLayout`) with ``results/`` and the report."""

    def results(self, router: str, seed: int) -> Path:
        return self.out / RESULTS / f"{run_name(router, seed)}.json"


def router_spec(run: BakeoffRun, router: PlannedRouter, layout: RunLayout, steps: int, seed: int) -> RunSpec:
    """The pre-training of ``router`` at ``seed``: the tiny dense configs with the router's backbone fields laid
    over them, one validation after the last step (the held-out losses and the probes), CSV logs only."""
    moe = router.backbone.get("moe") or {}
    spec = pretrain_spec(run, BASE_VARIANT, layout, steps, seed, moe, watched=True)
    others = {key: value for key, value in router.backbone.items() if key != "moe"}
    model = dataclasses.replace(spec.model, backbone={**spec.model.backbone, **others})
    return dataclasses.replace(spec, model=model, trainer=dataclasses.replace(spec.trainer, tensorboard=False))


def run_stages(run: BakeoffRun, plan: BakeoffPlan, router: PlannedRouter, seed: int) -> list[Stage]:
    """The stages of one (router, seed) run, its results file last."""
    name = run_name(router.name, seed)
    layout = run.pretraining(name)
    key = StageKey.of("pretrain", name)
    spec = functools.partial(router_spec, run, router, layout, plan.pretrain_steps, seed)
    stages = [
        pretrain_stage(key, spec, layout),
        export_stage(StageKey.of(*key.parts, "export"), layout.last_checkpoint, run.backbone(name)),
    ]
    finetuning = run.finetuning(name, FINETUNE_TASK, seed)
    tuning = FineTuning(run, benchmark_named(FINETUNE_TASK), run.backbone(name), finetuning, plan.finetune_steps, seed)
    stages += scored_stages(StageKey.of("finetune", name, f"{FINETUNE_TASK}-seed{seed}"), tuning)
    measure = functools.partial(write_results, run, plan, router.name, seed)
    return [*stages, Stage(StageKey.of(RESULTS, name), run.results(router.name, seed), measure)]


def bakeoff_stages(run: BakeoffRun, plan: BakeoffPlan) -> list[Stage]:
    """Every stage of the plan, in order: corpus, codebook, then each router at each seed."""
    stages = [corpus_stage(run), codebook_stage(run)]
    for router in plan.routers:
        for seed in plan.seeds:
            stages += run_stages(run, plan, router, seed)
    return stages


def write_results(run: BakeoffRun, plan: BakeoffPlan, router: str, seed: int) -> dict:
    """The results file of (``router``, ``seed``): every measure's value (None where the run has none: no MoE
    layer), its MoE layers' routing and where each value comes from."""
    from mmoe.study.measures import analysis_pairs

    name = run_name(router, seed)
    batches = analysis_pairs(run.corpus, run.settings.image_size, plan.analysis_batches, plan.analysis_batch_size)
    layers = routing_measures(run.backbone(name), batches)
    scores = read_json(run.finetuning(name, FINETUNE_TASK, seed).scores, "scores")
    values = validation_values(run.pretraining(name)) | {"vqa": scores["overall"]} | modality_means(layers)
    values["mim_loss"] = held_out_mim_loss(run.pretraining(name).last_checkpoint, batches)
    target = run.results(router, seed)
    write_json(target, {"router": router, "seed": seed, "values": values, "routing_layers": layers})
    return {"files": [str(target)]}
