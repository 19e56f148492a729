"""The study's stages: pre-training and fine-tuning runs (the demo's stages with the study's options), and the
measurements saved under ``DIR/analysis``. Each is a :class:`mmoe.demo.stages.Stage`: done once, reused on a re-run,
an interrupted training resumed."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import yaml

from mmoe.atomic import write_json_atomic
from mmoe.demo.settings import VARIANTS, DemoRun
from mmoe.demo.stages import (
    TASKS,
    Stage,
    config_file,
    evaluation,
    exporting,
    fine_tuning,
    option,
    pretrain_arguments,
    quietly,
    train,
)
from mmoe.study.settings import StudySettings

#: The held-out split every routing measurement runs on (no run trains on it).
ANALYSIS_SHARDS = "coco-karpathy-test"
#: The variants compared through pre-training and fine-tuning (X-MoE §4.5: SMoE baseline vs X-MoE).
ROUTERS = ("switch", "xmoe")
#: The task of the seeds' fine-tuning runs (X-MoE Fig. 3b fine-tunes on one task, XNLI).
CONSISTENCY_TASK = "vqav2"


@dataclass(frozen=True)
class Pretraining:
    """One pre-training run of the study.

    Attributes:
        name: folder under ``DIR/pretrain``.
        variant: ``configs/pretrain/tiny_<variant>.yaml``.
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
    """MH-MoE heads h of ``configs/pretrain/tiny_<variant>.yaml`` (1 without sub-tokens)."""
    config = yaml.safe_load(config_file(f"pretrain/tiny_{variant}.yaml").read_text())
    backbone = config["model"]["init_args"]["backbone"]
    return int((backbone.get("moe") or {}).get("heads", 1))


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

    def pretrain_dir(self, run: Pretraining) -> Path:
        return self.out / "pretrain" / run.name

    def backbone(self, run: Pretraining) -> Path:
        return self.pretrain_dir(run) / "backbone.pt"

    def snapshots(self, run: Pretraining) -> list[Path]:
        return sorted((self.pretrain_dir(run) / "snapshots").glob("step*.pt"))

    def finetune_dir(self, variant: str, task: str, seed: int) -> Path:
        return self.out / "finetune" / variant / f"{task}-seed{seed}"

    @property
    def analysis(self) -> Path:
        return self.out / "analysis"


def pretrain_stages(study: StudyRun, run: Pretraining) -> list[Stage]:
    out = study.pretrain_dir(run)
    callbacks = []
    if run.snapshots:
        init = {"dirpath": str(out / "snapshots"), "every_n_steps": run.snapshots}
        callbacks.append({"class_path": "mmoe.tasks.snapshots.BackboneSnapshots", "init_args": init})
    arguments = pretrain_arguments(study, run.variant, out, run.steps, callbacks)
    arguments += [option(f"model.init_args.backbone.moe.{key}", value) for key, value in run.moe]
    name = f"pretrain/{run.name}"

    def fit() -> dict:
        return train(name, arguments, out) | {"routing_stats": str(out / "routing_stats.json")}

    last = out / "checkpoints" / "last.ckpt"
    return [Stage(name, last, fit), exporting(f"{name}/export", last, study.backbone(run))]


def seed_count(variant: str, task: str, settings: StudySettings) -> int:
    """Fine-tuning seeds of one cell: ``settings.seeds`` for the routers compared on the consistency task, else 1."""
    return settings.seeds if variant in ROUTERS and task == CONSISTENCY_TASK else 1


def finetune_stages(study: StudyRun, run: Pretraining, settings: StudySettings) -> list[Stage]:
    """Each task at seed 0, and for the routers compared (X-MoE §4.5) VQA at ``settings.seeds`` seeds, with a routing
    window every ``settings.consistency_every`` steps."""
    stages = []
    for task in TASKS:
        for seed in range(seed_count(run.variant, task.name, settings)):
            out = study.finetune_dir(run.name, task.name, seed)
            name = f"finetune/{run.name}/{task.name}-seed{seed}"
            every = settings.consistency_every
            stages.append(fine_tuning(study, name, task, study.backbone(run), out, seed, routing_every=every))
            stages.append(evaluation(study, f"{name}/eval", task, study.backbone(run), out, seed))
    return stages


def analysis_stage(study: StudyRun, settings: StudySettings, runs: list[Pretraining]) -> Stage:
    """Every routing measurement on the held-out batches, saved as ``analysis/measures.json``."""
    from mmoe.metrics.routing_collect import consistency_through_training
    from mmoe.metrics.routing_stats import read_stats, window_loads
    from mmoe.study.measures import diversity_by_region, expert_loads, held_out_batches, snapshot_measures

    target = study.analysis / "measures.json"

    def measure() -> dict:
        batches = held_out_batches(
            study.shards / ANALYSIS_SHARDS,
            settings.training.image_size,
            settings.analysis_batches,
            settings.analysis_batch_size,
            max_text_length=32,
        )
        many = [run for run in runs if run.moe]
        activation = {run.name: {"heads": run.heads} | expert_loads(study.backbone(run), batches) for run in many}
        sub_tokens = [run for run in runs if run.heads > 1]
        diversity = {run.name: diversity_by_region(study.backbone(run), batches) for run in sub_tokens}
        snapshots = {}
        for run in runs:
            if run.snapshots:
                paths = study.snapshots(run)
                steps = [int(path.stem.removeprefix("step")) for path in paths]
                snapshots[run.name] = snapshot_measures(paths, steps, batches, settings.analysis_rows)
        consistency = {}
        for variant in ROUTERS:
            folders = [study.finetune_dir(variant, CONSISTENCY_TASK, seed) for seed in range(settings.seeds)]
            loads = [window_loads(read_stats(folder)) for folder in folders]
            consistency[variant] = consistency_through_training(loads, [str(folder) for folder in folders])
        measures = {
            "activation": activation,
            "diversity": diversity,
            "snapshots": snapshots,
            "consistency": consistency,
            "scores": collect_scores(study, settings),
        }
        write_json_atomic(target, measures)
        return {"files": [str(target)]}

    return Stage("analysis", target, measure)


def collect_scores(study: StudyRun, settings: StudySettings) -> dict:
    """variant -> task -> the seeds' ``scores.json``."""
    scores = {}
    for variant in VARIANTS:
        scores[variant] = {}
        for task in TASKS:
            seeds = range(seed_count(variant, task.name, settings))
            files = [study.finetune_dir(variant, task.name, seed) / "scores.json" for seed in seeds]
            scores[variant][task.name] = [json.loads(path.read_text()) for path in files]
    return scores


def maps_stage(study: StudyRun, settings: StudySettings, runs: list[Pretraining]) -> Stage:
    """``mmoe viz subtoken-map`` of the MH-MoE runs on held-out images (MH-MoE Fig. 1b / 8's maps)."""
    from mmoe.viz.cli import viz_command

    out = study.out / "figures" / "maps"
    sub_tokens = [run for run in runs if run.heads > 1]
    target = out / f"subtoken_map_{study.backbone(sub_tokens[0]).parent.name}-backbone.png"

    def draw() -> dict:
        argv = ["subtoken-map", "--images", str(study.shards / ANALYSIS_SHARDS), "--out", str(out), "--no-text"]
        argv += ["--num-images", str(settings.training.figure_images)]
        for run in sub_tokens:
            argv += ["--ckpt", str(study.backbone(run))]
        quietly("maps", viz_command, argv)
        return {"files": sorted(str(path) for path in out.glob("*.png"))}

    return Stage("maps", target, draw)
