"""The demo's stages, in order: corpus, codebook, and for each variant pre-training, backbone export, each benchmark's
fine-tuning and scored evaluation, and the routing figures; with ``--random-init`` the fine-tunings again from a
randomly initialised backbone. Built from the pipeline kit's stages (:mod:`mmoe.pipeline.standard_stages`)."""

from __future__ import annotations

from mmoe.data.synth.chance import ChanceLevels
from mmoe.data.synth.layout import CAPTION_TEST_SPLIT
from mmoe.pipeline.benchmarks import trained_benchmarks
from mmoe.pipeline.layout import BACKBONE, RANDOM_INIT, PipelineRun, random_init_name
from mmoe.pipeline.pool import Job
from mmoe.pipeline.stages import Stage, StageKey
from mmoe.pipeline.standard_stages import (
    FineTuning,
    export_stage,
    random_backbone_stage,
    scored_stages,
    variant_pretrain_stage,
)
from mmoe.tasks.vqa import VQAFineTuning

#: The name of each variant's routing-figures stage and of its folder.
FIGURES = "figures"
#: The fine-tuning whose backbone the figures set beside the pre-trained one (MH-MoE Fig. 1b: before and after).
FIGURES_TASK = VQAFineTuning.name


def figures_stage(run: PipelineRun, variant: str) -> Stage:
    """``mmoe viz subtoken-map`` of the pre-trained and the :data:`FIGURES_TASK`-fine-tuned backbones and ``mmoe viz
    heatmap`` of the pre-training's routing statistics, under ``DIR/figures/<variant>``."""
    from mmoe.viz.cli import checkpoint_labels, subtoken_map_path

    out = run.out / FIGURES / variant
    finetuning = run.finetuning(variant, FIGURES_TASK)
    pretrained, finetuned = run.backbone(variant), finetuning.root / BACKBONE

    def draw() -> dict:
        from mmoe.runtime.checkpoint import export_backbone, load_backbone
        from mmoe.viz.cli import draw_stats_heatmaps, draw_subtoken_maps

        export_backbone(load_backbone(finetuning.last_checkpoint), finetuned)
        images = [run.corpus.shard(CAPTION_TEST_SPLIT)]
        draw_subtoken_maps([pretrained, finetuned], images, out, num_images=run.settings.figure_images)
        draw_stats_heatmaps([run.pretraining(variant).routing_stats], out)
        return {"files": [str(finetuned), *sorted(str(path) for path in out.glob("*.png"))]}

    return Stage(
        StageKey.of(variant, FIGURES), subtoken_map_path(out, checkpoint_labels([pretrained, finetuned])[0]), draw
    )


def fine_tunings(run: PipelineRun, start: str, group: tuple[str, ...]) -> list[Stage]:
    """Each benchmark fine-tuned from the backbone of ``start`` (a pre-training's name) for the settings' steps into
    ``DIR/finetune/<start>/<task>`` and scored, as the stages ``<group>/<task>`` and ``<group>/<task>/eval``."""
    stages = []
    for benchmark in trained_benchmarks(run.settings):
        layout, steps = run.finetuning(start, benchmark.name), run.settings.steps(benchmark.name)
        tuning = FineTuning(run, benchmark, run.backbone(start), layout, steps)
        stages += scored_stages(StageKey.of(*group, benchmark.name), tuning)
    return stages


def variant_stages(run: PipelineRun, variant: str) -> list[Stage]:
    """The stages of one variant, in order (a dense backbone has no routing to draw)."""
    checkpoint = run.pretraining(variant).last_checkpoint
    stages = [
        variant_pretrain_stage(run, variant),
        export_stage(StageKey.of(variant, "export"), checkpoint, run.backbone(variant)),
        *fine_tunings(run, variant, (variant,)),
    ]
    if variant != "dense":
        stages.append(figures_stage(run, variant))
    return stages


def random_init_stages(run: PipelineRun, variant: str, seed: int = 0) -> list[Stage]:
    """``mmoe demo --random-init``: a backbone of the pre-trained one's architecture (its exported config) with fresh
    weights from the backbone's own initialisation under ``seed``, as the start ``<variant>-random-init``, then each
    benchmark fine-tuned and scored as in :func:`variant_stages`, with the same steps and settings, from it (run after
    the variant's stages, whose exported backbone gives the architecture)."""
    start = random_init_name(variant)
    key = StageKey.of(variant, RANDOM_INIT, "init")
    stages = [random_backbone_stage(key, run.backbone(variant), run.backbone(start), seed)]
    return stages + fine_tunings(run, start, (variant, RANDOM_INIT))


#: The cost of an evaluation or of the routing figures among jobs whose fine-tunings cost their optimiser steps: seconds
#: against a fine-tuning's minutes, so each runs when no fine-tuning is ready to start.
SHORT_JOB = 1.0


def pool_jobs(run: PipelineRun, variant: str, random_init: bool = False) -> list[Job]:
    """The stages of ``variant`` that the pool's processes run (:class:`mmoe.pipeline.pool.WorkerPool`), in the
    benchmarks' order: each fine-tuning (its optimiser steps its cost) and after it its scored evaluation, from the
    pre-trained backbone (and from random init with ``random_init``), and the routing figures after the
    :data:`FIGURES_TASK` fine-tuning (a dense backbone has none). They need the exported backbones, which the stages
    before them make, and nothing of each other beyond what they wait for."""
    starts = [(variant,), (variant, RANDOM_INIT)] if random_init else [(variant,)]
    jobs = []
    for start in starts:
        for benchmark in trained_benchmarks(run.settings):
            fit = str(StageKey.of(*start, benchmark.name))
            jobs += [Job(fit, run.settings.steps(benchmark.name)), Job(f"{fit}/eval", SHORT_JOB, (fit,))]
    if variant != "dense":
        figures_after = str(StageKey.of(variant, FIGURES_TASK))
        jobs.append(Job(str(StageKey.of(variant, FIGURES)), SHORT_JOB, (figures_after,)))
    return jobs


def in_group(stage: Stage, group: str) -> bool:
    """Whether ``stage`` is ``group`` or under it (``mhmoe/nlvr2``: ``mhmoe/nlvr2`` and ``mhmoe/nlvr2/eval``)."""
    return str(stage.key) == group or str(stage.key).startswith(f"{group}/")


def variant_rows(
    run: PipelineRun, variant: str, records: dict[StageKey, dict], random_init: bool = False
) -> list[dict]:
    """The table rows of ``variant``'s scored benchmarks (``random_init``: of its fine-tunings from random init)."""
    chance = ChanceLevels.from_summary(run.chance())
    group = (variant, RANDOM_INIT) if random_init else (variant,)
    rows = []
    for benchmark in trained_benchmarks(run.settings):
        rows += benchmark.rows(records[StageKey.of(*group, benchmark.name, "eval")]["result"]["scores"], chance)
    return rows
