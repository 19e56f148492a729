"""The study's stages: pre-training and fine-tuning runs (the demo's stages with the study's options), and the
measurements saved under ``DIR/analysis``. Each is a :class:`mmoe.demo.stages.Stage`: done once, reused on a re-run,
an interrupted training resumed."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mmoe.data.synth.convert import CAPTION_TEST_SPLIT
from mmoe.data.tokenizer import CAPTION_MAX_TEXT_LENGTH
from mmoe.demo.benchmarks import BENCHMARKS
from mmoe.demo.pipeline import evaluation, exporting, fine_tuning
from mmoe.demo.settings import VARIANTS, DemoRun
from mmoe.demo.stages import Stage, StageKey, run_command
from mmoe.demo.training import pretrain_configs, pretrain_launch, train
from mmoe.io import read_json, write_json
from mmoe.study.settings import StudySettings
from mmoe.tasks.launch import read_config
from mmoe.tasks.layout import RunLayout

#: The measurements of the analysis stage, under ``DIR/analysis`` (the report is recomputed from it).
MEASURES_FILE = "measures.json"
#: The held-out split every routing measurement runs on (no run trains on it).
ANALYSIS_SHARDS = CAPTION_TEST_SPLIT
#: The variants compared through pre-training and fine-tuning (X-MoE §4.5: SMoE baseline vs X-MoE).
ROUTERS = ("switch", "xmoe")
#: The task of the seeds' fine-tuning runs (X-MoE Fig. 3b fine-tunes on one task, XNLI).
CONSISTENCY_TASK = "vqav2"


@dataclass(frozen=True)
class Measures:
    """What the analysis stage measures, saved as ``analysis/measures.json`` (the claims are computed from it).

    Attributes:
        activation: activation-ratio run -> its heads, loads and tokens per MoE layer (:func:`expert_loads`).
        diversity: MH-MoE run -> per MoE layer the object and background patches' distinct experts.
        snapshots: router run -> RC and fluctuation through pre-training (:func:`snapshot_measures`).
        consistency: router -> inter-run consistency through fine-tuning, window by window.
        scores: variant -> task -> the seeds' ``scores.json``.
    """

    activation: dict[str, Any]
    diversity: dict[str, Any]
    snapshots: dict[str, Any]
    consistency: dict[str, Any]
    scores: dict[str, Any]

    @classmethod
    def from_json(cls, value: dict[str, Any]) -> Measures:
        """The measures of a ``measures.json``; a file missing a field is an error naming it."""
        missing = [field.name for field in dataclasses.fields(cls) if field.name not in value]
        if missing:
            raise ValueError(f"measures.json lacks {', '.join(missing)}: made by another version? re-run the analysis")
        return cls(**{field.name: value[field.name] for field in dataclasses.fields(cls)})

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class Pretraining:
    """One pre-training run of the study.

    Attributes:
        name: folder under ``DIR/pretrain``.
        variant: the tiny configs' variant (:func:`mmoe.demo.training.pretrain_configs`).
        steps: optimiser steps.
        moe: overrides of the config's ``backbone.moe`` (e.g. ``num_experts``, ``heads``).
        heads: MH-MoE heads h (1 without sub-tokens).
        snapshots: steps between backbone snapshots (0: none).
    """

    name: str
    variant: str
    steps: int
    moe: tuple[tuple[str, int], ...] = ()
    heads: int = 1
    snapshots: int = 0


def config_heads(variant: str) -> int:
    """MH-MoE heads h of the tiny configs of ``variant`` (1 without sub-tokens), read by the CLI's parser."""
    moe = read_config(pretrain_configs(variant)).fit.model.init_args.backbone.moe
    return 1 if moe is None else int(moe.heads)


def pretrainings(settings: StudySettings) -> list[Pretraining]:
    """Every variant at the demo's size (claims 2-5), and X-MoE / MH-MoE with ``many_experts`` (claim 1)."""
    runs = [
        Pretraining(
            variant,
            variant,
            settings.training.pretrain_steps,
            heads=config_heads(variant),
            snapshots=settings.snapshot_every if variant in ROUTERS else 0,
        )
        for variant in VARIANTS
    ]
    experts = settings.many_experts
    runs.append(Pretraining(f"xmoe-e{experts}", "xmoe", settings.many_experts_steps, (("num_experts", experts),)))
    for heads in settings.heads:
        moe = (("num_experts", experts), ("heads", heads))
        runs.append(Pretraining(f"mhmoe-e{experts}-h{heads}", "mhmoe", settings.many_experts_steps, moe, heads))
    return runs


class StudyRun(DemoRun):
    """The study's directory: ``data`` (corpus, codebook), ``pretrain/<run>``, ``finetune/<variant>/<task>-seed<s>``,
    ``analysis/*.json``, ``figures/``, ``report.md`` / ``report.json``."""

    def pretrain_run(self, run: Pretraining) -> RunLayout:
        return RunLayout(self.out / "pretrain" / run.name)

    def pretrained(self, run: Pretraining) -> Path:
        """The run's exported backbone."""
        return self.pretrain_run(run).root / "backbone.pt"

    def snapshots(self, run: Pretraining) -> list[Path]:
        return sorted(self.pretrain_run(run).snapshots.glob("step*.pt"))

    def finetune_run(self, variant: str, task: str, seed: int) -> RunLayout:
        return RunLayout(self.out / "finetune" / variant / f"{task}-seed{seed}")

    @property
    def analysis(self) -> Path:
        return self.out / "analysis"


def pretrain_stages(study: StudyRun, run: Pretraining) -> list[Stage]:
    from mmoe.tasks.snapshots import BackboneSnapshots

    layout = study.pretrain_run(run)
    key = StageKey.of("pretrain", run.name)

    def fit() -> dict:
        snapshots = [BackboneSnapshots(layout.snapshots, run.snapshots)] if run.snapshots else []
        launch = pretrain_launch(study, run.variant, layout, run.steps, snapshots, dict(run.moe))
        return train(str(key), launch, layout) | {"routing_stats": str(layout.routing_stats)}

    export = exporting(StageKey.of(*key.parts, "export"), layout.last_checkpoint, study.pretrained(run))
    return [Stage(key, layout.last_checkpoint, fit), export]


def seed_count(variant: str, task: str, settings: StudySettings) -> int:
    """Fine-tuning seeds of one cell: ``settings.seeds`` for the routers compared on the consistency task, else 1."""
    return settings.seeds if variant in ROUTERS and task == CONSISTENCY_TASK else 1


def finetune_stages(study: StudyRun, run: Pretraining, settings: StudySettings) -> list[Stage]:
    """Each task at seed 0, and for the routers compared (X-MoE §4.5) VQA at ``settings.seeds`` seeds, with a routing
    window every ``settings.consistency_every`` steps."""
    stages = []
    for benchmark in BENCHMARKS:
        for seed in range(seed_count(run.variant, benchmark.name, settings)):
            layout = study.finetune_run(run.name, benchmark.name, seed)
            key = StageKey.of("finetune", run.name, f"{benchmark.name}-seed{seed}")
            backbone, every = study.pretrained(run), settings.consistency_every
            stages.append(fine_tuning(study, key, benchmark, backbone, layout, seed, routing_every=every))
            stages.append(evaluation(study, StageKey.of(*key.parts, "eval"), benchmark, backbone, layout, seed))
    return stages


def analysis_stage(study: StudyRun, settings: StudySettings, runs: list[Pretraining]) -> Stage:
    """Every routing measurement on the held-out batches, saved as ``analysis/measures.json``."""
    from mmoe.metrics.routing_collect import consistency_through_training
    from mmoe.metrics.routing_stats import read_stats, window_loads
    from mmoe.study.measures import diversity_by_region, expert_loads, held_out_batches, snapshot_measures

    target = study.analysis / MEASURES_FILE

    def measure() -> dict:
        batches = held_out_batches(
            study.shards / ANALYSIS_SHARDS,
            settings.training.image_size,
            settings.analysis_batches,
            settings.analysis_batch_size,
            max_text_length=CAPTION_MAX_TEXT_LENGTH,
        )
        many = [run for run in runs if run.moe]
        activation = {run.name: {"heads": run.heads} | expert_loads(study.pretrained(run), batches) for run in many}
        sub_tokens = [run for run in runs if run.heads > 1]
        diversity = {run.name: diversity_by_region(study.pretrained(run), batches) for run in sub_tokens}
        snapshots = {}
        for run in runs:
            if run.snapshots:
                paths = study.snapshots(run)
                steps = [int(path.stem.removeprefix("step")) for path in paths]
                snapshots[run.name] = snapshot_measures(paths, steps, batches, settings.analysis_rows)
        consistency = {}
        for variant in ROUTERS:
            folders = [study.finetune_run(variant, CONSISTENCY_TASK, seed).root for seed in range(settings.seeds)]
            loads = [window_loads(read_stats(folder)) for folder in folders]
            consistency[variant] = consistency_through_training(loads, [str(folder) for folder in folders])
        measures = Measures(activation, diversity, snapshots, consistency, collect_scores(study, settings))
        write_json(target, measures.to_json())
        return {"files": [str(target)]}

    return Stage(StageKey.of("analysis"), target, measure)


def collect_scores(study: StudyRun, settings: StudySettings) -> dict:
    """variant -> task -> the seeds' ``scores.json``."""
    scores = {}
    for variant in VARIANTS:
        scores[variant] = {}
        for benchmark in BENCHMARKS:
            seeds = range(seed_count(variant, benchmark.name, settings))
            files = [study.finetune_run(variant, benchmark.name, seed).scores for seed in seeds]
            scores[variant][benchmark.name] = [read_json(path, "scores") for path in files]
    return scores


def maps_stage(study: StudyRun, settings: StudySettings, runs: list[Pretraining]) -> Stage:
    """``mmoe viz subtoken-map`` of the MH-MoE runs on held-out images (MH-MoE Fig. 1b / 8's maps)."""
    from mmoe.viz.cli import checkpoint_labels, subtoken_map_path, viz_command

    out = study.out / "figures" / "maps"
    backbones = [study.pretrained(run) for run in runs if run.heads > 1]
    key = StageKey.of("maps")

    def draw() -> dict:
        argv = ["subtoken-map", "--images", str(study.shards / ANALYSIS_SHARDS), "--out", str(out), "--no-text"]
        argv += ["--num-images", str(settings.training.figure_images)]
        for backbone in backbones:
            argv += ["--ckpt", str(backbone)]
        run_command(key, "viz", viz_command, argv)
        return {"files": sorted(str(path) for path in out.glob("*.png"))}

    return Stage(key, subtoken_map_path(out, checkpoint_labels(backbones)[0]), draw)
