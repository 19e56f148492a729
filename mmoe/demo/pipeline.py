"""The demo's stages, in order: corpus, codebook, and for each variant pre-training, backbone export, each benchmark's
fine-tuning and scored evaluation, and the routing figures."""

from __future__ import annotations

from pathlib import Path

from mmoe.data.shards import MANIFEST
from mmoe.data.synth.convert import (
    CAPTION_TEST_SPLIT,
    PRETRAIN_IMAGE_SPLIT,
    PRETRAIN_PAIR_SPLIT,
    PRETRAIN_TEXT_SPLIT,
)
from mmoe.data.synth.corpus import ChanceLevels
from mmoe.demo.benchmarks import Benchmark, trained_benchmarks
from mmoe.demo.settings import RANDOM_INIT, DemoRun
from mmoe.demo.stages import Stage, StageKey, run_command
from mmoe.demo.training import finetune_launch, predict_launch, pretrain_launch, train
from mmoe.io import write_json
from mmoe.tasks.layout import RunLayout

#: The name of each variant's routing-figures stage and of its folder.
FIGURES = "figures"


def corpus_stage(run: DemoRun) -> Stage:
    from mmoe.data.cli import data_command

    key = StageKey.of("corpus")

    def build() -> dict:
        run_command(key, "data", data_command, ["synth", "--out", str(run.data), "--shards", *run.settings.synth])
        return {"files": [str(run.corpus_summary), str(run.shards)]}

    return Stage(key, run.shards / PRETRAIN_TEXT_SPLIT / MANIFEST, build)


def codebook_stage(run: DemoRun) -> Stage:
    from mmoe.tasks.visual_codebook import tokenizer_command

    key = StageKey.of("codebook")

    def fit() -> dict:
        argv = ["fit", "--data", str(run.shards / PRETRAIN_IMAGE_SPLIT), str(run.shards / PRETRAIN_PAIR_SPLIT)]
        argv += ["--out", str(run.codebook), "--size", str(run.settings.codebook_size)]
        run_command(key, "tokenizer", tokenizer_command, argv + ["--image-size", str(run.settings.image_size)])
        return {"files": [str(run.codebook)]}

    return Stage(key, run.codebook, fit)


def pretrain_stage(run: DemoRun, variant: str) -> Stage:
    layout = run.pretraining(variant)
    key = StageKey.of(variant, "pretrain")

    def fit() -> dict:
        record = train(str(key), pretrain_launch(run, variant, layout), layout)
        return record | {"files": [*record["files"], str(layout.routing_stats)]}

    return Stage(key, layout.last_checkpoint, fit)


def export_stage(run: DemoRun, variant: str) -> Stage:
    return exporting(StageKey.of(variant, "export"), run.pretraining(variant).last_checkpoint, run.backbone(variant))


def exporting(key: StageKey, checkpoint: Path, target: Path) -> Stage:
    """The backbone of a training checkpoint as an exported backbone file."""

    def export() -> dict:
        from mmoe.tasks.checkpoint import export_backbone, load_backbone

        export_backbone(load_backbone(checkpoint), target)
        return {"files": [str(target)]}

    return Stage(key, target, export)


def finetune_stage(run: DemoRun, variant: str, benchmark: Benchmark) -> Stage:
    layout = run.finetuning(variant, benchmark.name)
    return fine_tuning(run, StageKey.of(variant, benchmark.name), benchmark, run.backbone(variant), layout)


def fine_tuning(
    run: DemoRun,
    key: StageKey,
    benchmark: Benchmark,
    backbone: Path,
    layout: RunLayout,
    seed: int | None = None,
    routing_every: int = 20,
    model_options: dict | None = None,
) -> Stage:
    """``mmoe fit`` of ``benchmark``'s task from ``backbone`` into ``layout`` (``seed``: the config's when None),
    routing statistics every ``routing_every`` steps; ``model_options`` add to the task's (e.g. ``frozen_routing``)."""

    def fit() -> dict:
        options = benchmark.model_options(run) | (model_options or {})
        launch = finetune_launch(run, benchmark.task, options, backbone, layout, seed, routing_every)
        return train(str(key), launch, layout)

    return Stage(key, layout.last_checkpoint, fit)


def evaluate_stage(run: DemoRun, variant: str, benchmark: Benchmark) -> Stage:
    layout = run.finetuning(variant, benchmark.name)
    return evaluation(run, StageKey.of(variant, benchmark.name, "eval"), benchmark, run.backbone(variant), layout)


def evaluation(
    run: DemoRun, key: StageKey, benchmark: Benchmark, backbone: Path, layout: RunLayout, seed: int | None = None
) -> Stage:
    """``mmoe predict`` of the fine-tuning in ``layout`` (from ``backbone``) on the benchmark's evaluation split,
    scored by the official scorers into ``layout.scores``."""

    def evaluate() -> dict:
        predictions = layout.predictions(benchmark.predictions)
        fit = finetune_launch(run, benchmark.task, benchmark.model_options(run), backbone, layout, seed)
        launch = predict_launch(fit, layout, run.shards / benchmark.eval_split, predictions)
        launch.run(str(key))
        scores = benchmark.score(run, predictions)
        write_json(layout.scores, scores)
        return {"scores": scores, "launch": launch.to_json(), "files": [str(predictions), str(layout.scores)]}

    return Stage(key, layout.scores, evaluate)


def figures_stage(run: DemoRun, variant: str) -> Stage:
    from mmoe.viz.cli import checkpoint_labels, subtoken_map_path

    out = run.variant(variant) / FIGURES
    pretrained, finetuned = run.backbone(variant), run.variant(variant) / "backbone_vqav2.pt"
    key = StageKey.of(variant, FIGURES)

    def draw() -> dict:
        from mmoe.tasks.checkpoint import export_backbone, load_backbone
        from mmoe.viz.cli import viz_command

        export_backbone(load_backbone(run.finetuning(variant, "vqav2").last_checkpoint), finetuned)
        images = str(run.shards / CAPTION_TEST_SPLIT)
        argv = ["subtoken-map", "--ckpt", str(pretrained), "--ckpt", str(finetuned), "--images", images]
        argv += ["--out", str(out), "--num-images", str(run.settings.figure_images)]
        run_command(key, "viz", viz_command, argv)
        run_command(key, "viz", viz_command, ["heatmap", "--stats", str(run.pretraining(variant).routing_stats),
                                              "--out", str(out)])  # fmt: skip
        return {"files": [str(finetuned), *sorted(str(path) for path in out.glob("*.png"))]}

    return Stage(key, subtoken_map_path(out, checkpoint_labels([pretrained, finetuned])[0]), draw)


def variant_stages(run: DemoRun, variant: str) -> list[Stage]:
    """The stages of one variant, in order (a dense backbone has no routing to draw)."""
    stages = [pretrain_stage(run, variant), export_stage(run, variant)]
    for benchmark in trained_benchmarks(run.settings):
        stages += [finetune_stage(run, variant, benchmark), evaluate_stage(run, variant, benchmark)]
    if variant != "dense":
        stages.append(figures_stage(run, variant))
    return stages


def fine_tuning_groups(run: DemoRun, variant: str, random_init: bool = False) -> dict[str, int]:
    """The stage-name prefixes of ``variant``'s fine-tunings (each a fit and its evaluation; from random init too when
    ``random_init``) and their fine-tuning steps: they need the exported backbones and nothing of each other, so they
    may run at once. In the benchmarks' order, the pre-trained start's first (:func:`mmoe.demo.stages.lanes_by_cost`
    deals them by steps, this order settling ties)."""
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


def random_backbone_stage(run: DemoRun, variant: str, seed: int = 0) -> Stage:
    """A backbone of the pre-trained one's architecture (its exported config) with fresh weights from the backbone's
    own initialisation under ``seed``: the start of the fine-tunings that show what pre-training adds."""
    return random_initialisation(StageKey.of(variant, RANDOM_INIT, "init"), run.backbone(variant),
                                 run.random_backbone(variant), seed)  # fmt: skip


def random_initialisation(key: StageKey, source: Path, target: Path, seed: int = 0) -> Stage:
    """``target``: a backbone with the architecture of the exported backbone ``source`` and fresh weights from the
    backbone's own initialisation under ``seed``."""

    def initialise() -> dict:
        import torch

        from mmoe.model import MultiwayTransformer
        from mmoe.tasks.checkpoint import export_backbone, read_backbone_state

        config, _ = read_backbone_state(source)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            backbone = MultiwayTransformer(config)
        target.parent.mkdir(parents=True, exist_ok=True)
        export_backbone(backbone, target)
        return {"files": [str(target)], "seed": seed}

    return Stage(key, target, initialise)


def random_init_stages(run: DemoRun, variant: str) -> list[Stage]:
    """``mmoe demo --random-init``: each benchmark fine-tuned and scored as in :func:`variant_stages`, with the same
    steps and settings, from :func:`random_backbone_stage` instead of the pre-trained backbone (run after the
    variant's stages, whose exported backbone gives the architecture)."""
    backbone = run.random_backbone(variant)
    stages = [random_backbone_stage(run, variant)]
    for benchmark in trained_benchmarks(run.settings):
        layout = run.finetuning_from_random(variant, benchmark.name)
        key = StageKey.of(variant, RANDOM_INIT, benchmark.name)
        stages += [
            fine_tuning(run, key, benchmark, backbone, layout),
            evaluation(run, StageKey.of(str(key), "eval"), benchmark, backbone, layout),
        ]
    return stages


def variant_rows(run: DemoRun, variant: str, records: dict[StageKey, dict], random_init: bool = False) -> list[dict]:
    """The table rows of ``variant``'s scored benchmarks (``random_init``: of its fine-tunings from random init)."""
    chance = ChanceLevels.from_summary(run.chance())
    group = (variant, RANDOM_INIT) if random_init else (variant,)
    rows = []
    for benchmark in trained_benchmarks(run.settings):
        rows += benchmark.rows(records[StageKey.of(*group, benchmark.name, "eval")]["result"]["scores"], chance)
    return rows
