"""The demo's stages, in order: corpus, codebook, and for each variant pre-training, backbone export, each benchmark's
fine-tuning and scored evaluation, and the routing figures; with ``--random-init`` the fine-tunings again from a
randomly initialised backbone. Built from the pipeline kit's stages (:mod:`mmoe.pipeline.standard_stages`)."""

from __future__ import annotations

from mmoe.data.synth.chance import ChanceLevels
from mmoe.data.synth.layout import CAPTION_TEST_SPLIT
from mmoe.pipeline.benchmarks import trained_benchmarks
from mmoe.pipeline.layout import RANDOM_INIT, PipelineRun
from mmoe.pipeline.stages import Stage, StageKey
from mmoe.pipeline.standard_stages import (
    evaluate_stage,
    export_stage,
    finetune_stage,
    random_backbone_stage,
    variant_pretrain_stage,
)
from mmoe.tasks.vqa import VQAFineTuning

#: The name of each variant's routing-figures stage and of its folder.
FIGURES = "figures"
#: The fine-tuning whose backbone the figures set beside the pre-trained one (MH-MoE Fig. 1b: before and after).
FIGURES_TASK = VQAFineTuning.name


def figures_stage(run: PipelineRun, variant: str) -> Stage:
    """``mmoe viz subtoken-map`` of the pre-trained and the :data:`FIGURES_TASK`-fine-tuned backbones and ``mmoe viz
    heatmap`` of the pre-training's routing statistics, under ``DIR/<variant>/figures``."""
    from mmoe.viz.cli import checkpoint_labels, subtoken_map_path

    out = run.variant_folder(variant) / FIGURES
    pretrained, finetuned = run.backbone(variant), run.finetuned_backbone(variant, FIGURES_TASK)

    def draw() -> dict:
        from mmoe.runtime.checkpoint import export_backbone, load_backbone
        from mmoe.viz.cli import draw_stats_heatmaps, draw_subtoken_maps

        export_backbone(load_backbone(run.finetuning(variant, FIGURES_TASK).last_checkpoint), finetuned)
        images = [run.corpus.shard(CAPTION_TEST_SPLIT)]
        draw_subtoken_maps([pretrained, finetuned], images, out, num_images=run.settings.figure_images)
        draw_stats_heatmaps([run.pretraining(variant).routing_stats], out)
        return {"files": [str(finetuned), *sorted(str(path) for path in out.glob("*.png"))]}

    return Stage(
        StageKey.of(variant, FIGURES), subtoken_map_path(out, checkpoint_labels([pretrained, finetuned])[0]), draw
    )


def variant_stages(run: PipelineRun, variant: str) -> list[Stage]:
    """The stages of one variant, in order (a dense backbone has no routing to draw)."""
    checkpoint = run.pretraining(variant).last_checkpoint
    stages = [
        variant_pretrain_stage(run, variant),
        export_stage(StageKey.of(variant, "export"), checkpoint, run.backbone(variant)),
    ]
    for benchmark in trained_benchmarks(run.settings):
        finetuning = run.finetuning(variant, benchmark.name)
        key = StageKey.of(variant, benchmark.name)
        steps = run.settings.steps(benchmark.name)
        stages += [
            finetune_stage(run, key, benchmark, run.backbone(variant), finetuning, steps),
            evaluate_stage(run, StageKey.of(*key.parts, "eval"), benchmark, run.backbone(variant), finetuning, steps),
        ]
    if variant != "dense":
        stages.append(figures_stage(run, variant))
    return stages


def random_init_stages(run: PipelineRun, variant: str, seed: int = 0) -> list[Stage]:
    """``mmoe demo --random-init``: a backbone of the pre-trained one's architecture (its exported config) with fresh
    weights from the backbone's own initialisation under ``seed``, then each benchmark fine-tuned and scored as in
    :func:`variant_stages`, with the same steps and settings, from it (run after the variant's stages, whose exported
    backbone gives the architecture)."""
    backbone = run.random_backbone(variant)
    stages = [random_backbone_stage(StageKey.of(variant, RANDOM_INIT, "init"), run.backbone(variant), backbone, seed)]
    for benchmark in trained_benchmarks(run.settings):
        layout = run.finetuning_from_random(variant, benchmark.name)
        key = StageKey.of(variant, RANDOM_INIT, benchmark.name)
        steps = run.settings.steps(benchmark.name)
        stages += [
            finetune_stage(run, key, benchmark, backbone, layout, steps),
            evaluate_stage(run, StageKey.of(*key.parts, "eval"), benchmark, backbone, layout, steps),
        ]
    return stages


def fine_tuning_groups(run: PipelineRun, variant: str, random_init: bool = False) -> dict[str, int]:
    """The stage-name prefixes of ``variant``'s fine-tunings (each a fit and its evaluation; from random init too when
    ``random_init``) and their fine-tuning steps: they need the exported backbones and nothing of each other, so they
    may run at once. In the benchmarks' order, the pre-trained start's first (:func:`mmoe.pipeline.stages
    .lanes_by_cost` deals them by steps, this order settling ties)."""
    starts = [(variant,), (variant, RANDOM_INIT)] if random_init else [(variant,)]
    return {
        str(StageKey.of(*start, benchmark.name)): run.settings.steps(benchmark.name)
        for start in starts
        for benchmark in trained_benchmarks(run.settings)
    }


def in_group(stage: Stage, group: str) -> bool:
    """Whether ``stage`` is ``group`` or under it (``mhmoe/nlvr2``: ``mhmoe/nlvr2`` and ``mhmoe/nlvr2/eval``)."""
    return str(stage.key) == group or str(stage.key).startswith(f"{group}/")


def needs_fine_tunings(stage: Stage) -> bool:
    """Whether ``stage`` reads a fine-tuning's output (the routing figures read the VQA fine-tuning)."""
    return stage.key.parts[-1] == FIGURES


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
