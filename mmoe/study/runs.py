"""The study's stages: pre-training and fine-tuning runs (the pipeline kit's stages with the study's options), and the
measurements saved under ``DIR/analysis``. Each is a :class:`mmoe.pipeline.stages.Stage`: done once, reused on a re-run,
an interrupted training resumed."""

from __future__ import annotations

import dataclasses
import functools
import itertools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mmoe.config.run_spec import RunSpec
from mmoe.data.synth.chance import ChanceLevels
from mmoe.data.synth.layout import CAPTION_TEST_SPLIT
from mmoe.io import read_json
from mmoe.pipeline.benchmarks import Benchmark, benchmark_named, trained_benchmarks
from mmoe.pipeline.launch import configured_moe, pretrain_spec
from mmoe.pipeline.layout import RANDOM_INIT, PipelineRun
from mmoe.pipeline.settings import TrainingSettings
from mmoe.pipeline.stages import Stage, StageKey
from mmoe.pipeline.standard_stages import (
    FineTuning,
    export_stage,
    finetune_stage,
    pretrain_stage,
    random_backbone_stage,
    scored_stages,
)
from mmoe.study.settings import CONSISTENCY_RULES, StudySettings
from mmoe.tasks.vqa import VQAFineTuning

#: The measurements of the analysis stage, under ``DIR/analysis`` (the report is recomputed from it).
MEASURES_FILE = "measures.json"
#: The held-out split every routing measurement runs on (no run trains on it).
ANALYSIS_SHARDS = CAPTION_TEST_SPLIT
#: The variants compared through pre-training and fine-tuning (X-MoE §4.5: SMoE baseline vs X-MoE).
COMPARED_ROUTERS = ("switch", "xmoe")
#: The task of the seeds' fine-tuning runs (X-MoE Fig. 3b fine-tunes on one task, XNLI).
CONSISTENCY_TASK = VQAFineTuning.name
#: The variant of claim 7, pre-trained with the demo's recipe against random init (the demo's default variant).
PRETRAINING_VARIANT = "mhmoe"
#: The variant whose requested capacity is measured (Stratified MoE §5).
STRATIFIED = "stratified"


@dataclass(frozen=True)
class Measures:
    """What the analysis stage measures, saved as ``analysis/measures.json`` (the claims are computed from it).

    Attributes:
        activation: activation-ratio arm -> its heads, loads and tokens per MoE layer (:func:`expert_loads`), of
            routing seed 0 (the within-run term).
        diversity: MH-MoE run -> per MoE layer the object and background patches' distinct experts.
        snapshots: router -> RC and fluctuation through pre-training (:func:`snapshot_measures`), of routing seed 0.
        consistency: router -> inter-run consistency through fine-tuning, window by window, and (``leave_one_out``)
            the same windows with each seed left out in turn; both routers' routing frozen in fine-tuning.
        scores: variant -> task -> the seeds' ``scores.json`` (empty where the task order was not trained).
        random_init: task -> the seeds' ``scores.json`` from random init (a file made before claim 7's backbones).
        capacity: the Stratified MoE run's requested capacity per MoE layer and held-out batch.
        token_capacity: the Stratified MoE run's passes per held-out text token id (``passes``) and those ids'
            occurrences in the pre-training text (``training_counts``, ids as text).
        chance: task -> the chance level of its score on the corpus (:func:`chance_levels`).
        router_variants: router variant -> its loads, tokens, unrouted fractions and selection biases per MoE layer
            (:func:`mmoe.study.measures.router_variant_measures`); empty in a file made before they were measured.
        seeded: per routing seed, ``activation`` (arm -> loads at the run's end) and ``snapshots`` (router -> its
            snapshots' measures): what claims 1, 3 and 4 are decided over; empty in a file made before.
        consistency_trained: ``consistency`` with both routers fine-tuned whole.
        backbones: claim 7: ``pretrained`` and ``random_init``, task -> per backbone seed its ``scores.json``, and
            ``images``, task -> per arm and backbone the sum and count of the questions' accuracies per image (the
            within-run bootstrap's clusters).
        task_pretrainings: claim 6: variant -> task -> per pre-training seed its fine-tuning seeds' ``scores.json``
            (``scores`` holds the same runs in one list per cell); empty where the task order was not run or in a
            file made before.
    """

    activation: dict[str, Any]
    diversity: dict[str, Any]
    snapshots: dict[str, Any]
    consistency: dict[str, Any]
    scores: dict[str, Any]
    random_init: dict[str, Any]
    capacity: dict[str, Any]
    token_capacity: dict[str, Any]
    chance: dict[str, float]
    router_variants: dict[str, Any] = dataclasses.field(default_factory=dict)
    seeded: dict[str, Any] = dataclasses.field(default_factory=dict)
    consistency_trained: dict[str, Any] = dataclasses.field(default_factory=dict)
    backbones: dict[str, Any] = dataclasses.field(default_factory=dict)
    task_pretrainings: dict[str, Any] = dataclasses.field(default_factory=dict)

    @classmethod
    def from_json(cls, value: dict[str, Any]) -> Measures:
        """The measures of a ``measures.json``; a file missing a field without a default is an error naming it."""
        fields = dataclasses.fields(cls)
        required = [field.name for field in fields if field.default_factory is dataclasses.MISSING]
        missing = [name for name in required if name not in value]
        if missing:
            raise ValueError(f"measures.json lacks {', '.join(missing)}: made by another version? re-run the analysis")
        return cls(**{field.name: value[field.name] for field in fields if field.name in value})

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class Pretraining:
    """One pre-training run of the study.

    Attributes:
        name: folder under ``DIR/pretrain`` (the seed in it where the arm has several runs: ``xmoe-e32-seed1``).
        variant: the tiny configs' variant (:func:`mmoe.pipeline.launch.pretrain_configs`).
        steps: optimiser steps.
        moe: overrides of the config's ``backbone.moe`` (e.g. ``num_experts``, ``heads``).
        heads: MH-MoE heads h (1 without sub-tokens).
        snapshots: steps between backbone snapshots (0: none).
        seed: the training seed (``seed_everything``: initialisation and data order).
        min_lr_ratio: the final learning rate as a share of the peak (1.0: constant after the warm-up; None: the
            config's schedule).
        recipe: trained with the study's ``pretraining_recipe`` (the demo's) instead of its ``training`` settings.
    """

    name: str
    variant: str
    steps: int
    moe: tuple[tuple[str, int], ...] = ()
    heads: int = 1
    snapshots: int = 0
    seed: int = 0
    min_lr_ratio: float | None = None
    recipe: bool = False


def config_heads(variant: str) -> int:
    """MH-MoE heads h of the tiny configs of ``variant`` (1 without sub-tokens), read by the CLI's parser."""
    moe = configured_moe(variant)
    return 1 if moe is None else int(moe.heads)


def routing_run(arm: str, experts: int, seed: int) -> str:
    """The pre-training of a routing arm (``xmoe``, ``switch``, ``mhmoe-h8``) with ``experts`` experts and ``seed``."""
    if arm.startswith("mhmoe-h"):
        return f"mhmoe-e{experts}-h{arm.removeprefix('mhmoe-h')}-seed{seed}"
    return f"{arm}-e{experts}-seed{seed}"


def diversity_run(heads: int, experts: int, seed: int = 0, seeds: int = 1) -> str:
    """A diversity run's name: the seed in it where the run has several seeds."""
    return f"mhmoe-e{experts}-h{heads}" + (f"-seed{seed}" if seeds > 1 else "")


def recipe_run(seed: int, random_init: bool = False) -> str:
    """Claim 7's pre-training (or random init) of :data:`PRETRAINING_VARIANT` with the demo's recipe and ``seed``."""
    return f"{PRETRAINING_VARIANT}-demo-{RANDOM_INIT + '-' if random_init else ''}seed{seed}"


def routing_arms(settings: StudySettings) -> tuple[str, ...]:
    """The routing arms pre-trained at every routing seed: X-MoE, Switch, MH-MoE at each of ``heads``."""
    return ("xmoe", "switch", *(f"mhmoe-h{h}" for h in settings.heads))


def _routing_pretrainings(settings: StudySettings) -> list[Pretraining]:
    experts, steps, ratio = settings.many_experts, settings.router_steps, settings.routing_min_lr_ratio
    runs = []
    for seed in range(settings.routing_seeds):
        for router in COMPARED_ROUTERS:
            runs.append(
                Pretraining(
                    routing_run(router, experts, seed),
                    router,
                    steps,
                    (("num_experts", experts),),
                    snapshots=settings.snapshot_every,
                    seed=seed,
                    min_lr_ratio=ratio,
                )
            )
        for heads in settings.heads:
            moe = (("num_experts", experts), ("heads", heads))
            name = routing_run(f"mhmoe-h{heads}", experts, seed)
            runs.append(Pretraining(name, "mhmoe", steps, moe, heads, seed=seed, min_lr_ratio=ratio))
    return runs


def task_backbone(variant: str, seed: int, seeds: int) -> str:
    """The pre-training of a task variant under ``seed`` (the seed in its name where the variant has several)."""
    return f"{variant}-seed{seed}" if seeds > 1 else variant


def task_backbones(settings: StudySettings) -> list[tuple[str, str, int]]:
    """The task order's pre-trainings (claim 6, where run): (name, variant, seed), each variant once per pre-training
    seed."""
    if not settings.runs_claim("tasks"):
        return []
    seeds = settings.task_pretraining_seeds
    return [(task_backbone(v, seed, seeds), v, seed) for v in settings.task_variants for seed in range(seeds)]


def pretrainings(settings: StudySettings) -> list[Pretraining]:
    """Every pre-training the preset's claims need, the one list the stages train and the cost model counts: the task
    variants once per pre-training seed where the task order is run (claim 6), Stratified MoE where claim 8 or 9 is
    (§5), every routing arm at each routing seed (claims 1, 3-5: the same steps and schedule on every side), the
    diversity runs with headroom (claim 2), the router table's routers with their own tiny parts, and claim 7's
    pre-trainings with the demo's recipe."""
    steps = settings.training.pretrain_steps
    runs = [Pretraining(name, v, steps, heads=config_heads(v), seed=seed) for name, v, seed in task_backbones(settings)]
    if settings.runs_claim("capacity") or settings.runs_claim("frequency"):
        runs.append(Pretraining(STRATIFIED, STRATIFIED, steps, heads=config_heads(STRATIFIED)))
    runs += _routing_pretrainings(settings)
    for (heads, few), seed in itertools.product(settings.diversity_runs, range(settings.diversity_seeds)):
        moe = (("num_experts", few), ("heads", heads))
        name = diversity_run(heads, few, seed, settings.diversity_seeds)
        runs.append(
            Pretraining(
                name, "mhmoe", settings.router_steps, moe, heads, seed=seed, min_lr_ratio=settings.routing_min_lr_ratio
            )
        )
    for variant in settings.router_variants:
        runs.append(Pretraining(variant, variant, settings.router_table_steps, heads=config_heads(variant)))
    recipe = settings.pretraining_recipe
    for seed in range(settings.pretraining_backbones):
        runs.append(
            Pretraining(
                recipe_run(seed),
                PRETRAINING_VARIANT,
                recipe.pretrain_steps,
                heads=config_heads(PRETRAINING_VARIANT),
                seed=seed,
                recipe=True,
            )
        )
    return runs


class StudyRun(PipelineRun):
    """The study's work folder (:class:`mmoe.pipeline.layout.WorkLayout`: ``data``, ``pretrain/<run>`` with its
    ``backbone.pt``, ``finetune/<variant>/<task>-seed<s>``) with the study's own files: ``analysis/*.json``,
    ``figures/``, ``report.md`` / ``report.json``."""

    def snapshots(self, run: Pretraining) -> dict[int, Path]:
        """The pre-training's backbone snapshots by step."""
        return self.pretraining(run.name).saved_snapshots()

    @property
    def analysis(self) -> Path:
        return self.out / "analysis"


def pretrain_stages(study: StudyRun, run: Pretraining, recipe: TrainingSettings | None = None) -> list[Stage]:
    """The pre-training ``run`` (with ``recipe``'s settings where ``run.recipe``) and the export of its backbone."""
    layout = study.pretraining(run.name)
    key = StageKey.of("pretrain", run.name)
    export = export_stage(StageKey.of(*key.parts, "export"), layout.last_checkpoint, study.backbone(run.name))
    return [pretrain_stage(key, functools.partial(pretraining_spec, study, run, recipe), layout), export]


def pretraining_spec(study: StudyRun, run: Pretraining, recipe: TrainingSettings | None = None) -> RunSpec:
    """What the pre-training ``run`` trains: its variant's tiny configs for its steps at its seed, its MoE plan's
    changes, its backbone snapshots and, where given, its schedule's ``min_lr_ratio``; with ``recipe``'s settings
    where ``run.recipe``."""
    from mmoe.runtime.snapshots import BackboneSnapshots

    layout = study.pretraining(run.name)
    trained_by = StudyRun(study.out, recipe) if run.recipe and recipe is not None else study
    snapshots = [BackboneSnapshots(layout.snapshots, run.snapshots)] if run.snapshots else []
    spec = pretrain_spec(trained_by, run.variant, layout, run.steps, run.seed, dict(run.moe), snapshots)
    if run.min_lr_ratio is None:
        return spec
    return dataclasses.replace(spec, optimizer={**spec.optimizer, "min_lr_ratio": run.min_lr_ratio})


def consistency_folder(router: str, experts: int, rule: str) -> str:
    """The fine-tunings' folder of claim 5 under ``finetune``: the router's seed-0 backbone and the rule."""
    return f"{routing_run(router, experts, 0)}-{rule}"


def finetune_stages(study: StudyRun, settings: StudySettings) -> list[Stage]:
    """The task order's cells (where trained: every task from each task pre-training at ``task_seeds`` seeds, scored),
    the routers' VQA fine-tunings of claim 5 (``seeds`` per router and rule, from each router's seed-0 backbone, a
    routing window every ``consistency_every`` steps, the routing frozen under ``frozen``), and claim 7's VQA
    fine-tunings of each pre-trained backbone and random init (the backbone's seed as the fine-tuning's), scored."""
    stages = []
    for name, _, _ in task_backbones(settings):
        for benchmark in trained_benchmarks(settings.training):
            for seed in range(settings.task_seeds):
                stages += _scored(study, name, benchmark, seed)
    benchmark = benchmark_named(CONSISTENCY_TASK)
    for rule in CONSISTENCY_RULES:
        for router in COMPARED_ROUTERS:
            backbone = study.backbone(routing_run(router, settings.many_experts, 0))
            folder = consistency_folder(router, settings.many_experts, rule)
            for seed in range(settings.seeds):
                layout = study.finetuning(folder, CONSISTENCY_TASK, seed)
                key = StageKey.of("finetune", folder, f"{CONSISTENCY_TASK}-seed{seed}")
                steps, every = settings.consistency_steps, settings.consistency_every
                options = {"frozen_routing": rule == "frozen"}
                tuning = FineTuning(study, benchmark, backbone, layout, steps, seed, every, options)
                stages.append(finetune_stage(key, tuning))
    recipe = StudyRun(study.out, settings.pretraining_recipe)
    source = study.backbone(recipe_run(0))
    for seed in range(settings.pretraining_backbones):
        random = study.backbone(recipe_run(seed, random_init=True))
        stages.append(random_backbone_stage(StageKey.of("pretrain", recipe_run(seed, True)), source, random, seed))
        for name in (recipe_run(seed), recipe_run(seed, True)):
            for benchmark in trained_benchmarks(settings.pretraining_recipe):
                stages += _scored(recipe, name, benchmark, seed)
    return stages


def _scored(run: StudyRun, name: str, benchmark: Benchmark, seed: int) -> list[Stage]:
    """The fine-tuning of ``benchmark`` from the backbone of ``name`` into ``finetune/<name>/<task>-seed<seed>`` and its
    scoring."""
    layout, steps = run.finetuning(name, benchmark.name, seed), run.settings.steps(benchmark.name)
    tuning = FineTuning(run, benchmark, run.backbone(name), layout, steps, seed)
    return scored_stages(StageKey.of("finetune", name, f"{benchmark.name}-seed{seed}"), tuning)


def chance_levels(study: StudyRun) -> dict[str, float]:
    """Each trained task's chance level on its main score (:attr:`mmoe.pipeline.benchmarks.Benchmark.chance`: the VQA
    per-question-type prior, the constant NLVR2 answer, the constant caption's CIDEr)."""
    levels = ChanceLevels.from_summary(study.chance())
    return {b.name: b.chance(levels) for b in trained_benchmarks(study.settings) if b.chance is not None}


def collect_scores(study: StudyRun, name: str, seeds: int) -> dict:
    """task -> the ``scores.json`` of the fine-tunings of ``name`` at each seed."""
    return {
        benchmark.name: [
            read_json(study.finetuning(name, benchmark.name, seed).scores, "scores") for seed in range(seeds)
        ]
        for benchmark in trained_benchmarks(study.settings)
    }


def maps_stage(study: StudyRun, settings: StudySettings, runs: list[Pretraining]) -> Stage:
    """The sub-token maps of the MH-MoE runs on held-out images (MH-MoE Fig. 1b / 8's maps), images only."""
    from mmoe.viz.cli import checkpoint_labels, subtoken_map_path

    out = study.out / "figures" / "maps"
    backbones = [study.backbone(run.name) for run in runs if run.heads > 1]

    def draw() -> dict:
        from mmoe.viz.cli import draw_subtoken_maps

        images = [study.corpus.shard(ANALYSIS_SHARDS)]
        draw_subtoken_maps(backbones, images, out, num_images=settings.training.figure_images, text=False)
        return {"files": sorted(str(path) for path in out.glob("*.png"))}

    return Stage(StageKey.of("maps"), subtoken_map_path(out, checkpoint_labels(backbones)[0]), draw)
