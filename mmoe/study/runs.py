"""The study's stages: pre-training and fine-tuning runs (the pipeline kit's stages with the study's options), and the
measurements saved under ``DIR/analysis``. Each is a :class:`mmoe.pipeline.stages.Stage`: done once, reused on a re-run,
an interrupted training resumed."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mmoe.data.synth.chance import ChanceLevels
from mmoe.data.synth.layout import CAPTION_TEST_SPLIT, PRETRAIN_PAIR_SPLIT, PRETRAIN_TEXT_SPLIT
from mmoe.data.tokenizer import CAPTION_MAX_TEXT_LENGTH
from mmoe.io import read_json, write_json
from mmoe.pipeline.benchmarks import benchmark_named, trained_benchmarks
from mmoe.pipeline.launch import configured_moe, pretrain_launch
from mmoe.pipeline.layout import RANDOM_INIT, PipelineRun
from mmoe.pipeline.stages import Stage, StageKey
from mmoe.pipeline.standard_stages import (
    evaluate_stage,
    export_stage,
    finetune_stage,
    pretrain_stage,
    random_backbone_stage,
)
from mmoe.study.settings import StudySettings
from mmoe.tasks.layout import RunLayout
from mmoe.tasks.vqa import VQAFineTuning

#: The measurements of the analysis stage, under ``DIR/analysis`` (the report is recomputed from it).
MEASURES_FILE = "measures.json"
#: The held-out split every routing measurement runs on (no run trains on it).
ANALYSIS_SHARDS = CAPTION_TEST_SPLIT
#: The variants compared through pre-training and fine-tuning (X-MoE §4.5: SMoE baseline vs X-MoE).
COMPARED_ROUTERS = ("switch", "xmoe")
#: The task of the seeds' fine-tuning runs (X-MoE Fig. 3b fine-tunes on one task, XNLI).
CONSISTENCY_TASK = VQAFineTuning.name
#: The routers whose routing is frozen in those fine-tunings (X-MoE §3.3 freezes X-MoE's routers and experts; the
#: SMoE baseline is fine-tuned whole).
FROZEN_IN_FINETUNING = ("xmoe",)
#: The variant fine-tuned from random init beside its pre-trained backbone (the claim that pre-training helps).
PRETRAINING_VARIANT = "xmoe"
#: The exported backbone of each pre-training, in its folder.
EXPORTED_BACKBONE = "backbone.pt"
#: The variant whose requested capacity is measured (Stratified MoE §5).
STRATIFIED = "stratified"


@dataclass(frozen=True)
class Measures:
    """What the analysis stage measures, saved as ``analysis/measures.json`` (the claims are computed from it).

    Attributes:
        activation: activation-ratio run -> its heads, loads and tokens per MoE layer (:func:`expert_loads`).
        diversity: MH-MoE run -> per MoE layer the object and background patches' distinct experts.
        snapshots: router run -> RC and fluctuation through pre-training (:func:`snapshot_measures`).
        consistency: router -> inter-run consistency through fine-tuning, window by window, and (``leave_one_out``)
            the same windows with each seed left out in turn.
        scores: variant -> task -> the seeds' ``scores.json``.
        random_init: task -> the seeds' ``scores.json`` of :data:`PRETRAINING_VARIANT` fine-tuned from random init.
        capacity: the Stratified MoE run's requested capacity per MoE layer and held-out batch.
        token_capacity: the Stratified MoE run's passes per held-out text token id (``passes``) and those ids'
            occurrences in the pre-training text (``training_counts``, ids as text).
        chance: task -> the chance level of its score on the corpus (:func:`chance_levels`).
        router_variants: router variant -> its loads, tokens, unrouted fractions and selection biases per MoE layer
            (:func:`mmoe.study.measures.router_variant_measures`); empty in a file made before they were measured.
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
        name: folder under ``DIR/pretrain``.
        variant: the tiny configs' variant (:func:`mmoe.pipeline.launch.pretrain_configs`).
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
    moe = configured_moe(variant)
    return 1 if moe is None else int(moe.heads)


def pretrainings(settings: StudySettings) -> list[Pretraining]:
    """The task variants and Stratified MoE at the demo's size (claims 2 and 6, Stratified MoE §5), Switch and X-MoE
    with ``many_experts`` and snapshots (claims 1, 3-5), MH-MoE with ``many_experts`` and each of ``heads`` (claim 1),
    the diversity runs with headroom (claim 2), and each of ``router_variants`` with its tiny part's own plan for as
    many steps as the activation-ratio runs (the router table)."""
    runs = [Pretraining(variant, variant, settings.training.pretrain_steps, heads=config_heads(variant))
            for variant in (*settings.task_variants, STRATIFIED)]  # fmt: skip
    experts = settings.many_experts
    for router in COMPARED_ROUTERS:
        runs.append(Pretraining(router_run(router, experts), router, settings.router_steps,
                                (("num_experts", experts),), snapshots=settings.snapshot_every))  # fmt: skip
    for heads in settings.heads:
        moe = (("num_experts", experts), ("heads", heads))
        runs.append(Pretraining(f"mhmoe-e{experts}-h{heads}", "mhmoe", settings.many_experts_steps, moe, heads))
    for heads, few in settings.diversity_runs:
        moe = (("num_experts", few), ("heads", heads))
        runs.append(Pretraining(f"mhmoe-e{few}-h{heads}", "mhmoe", settings.many_experts_steps, moe, heads))
    for variant in settings.router_variants:
        runs.append(Pretraining(variant, variant, settings.many_experts_steps, heads=config_heads(variant)))
    return runs


def router_run(router: str, experts: int) -> str:
    """The name of a router's pre-training with ``experts`` experts and snapshots."""
    return f"{router}-e{experts}"


class StudyRun(PipelineRun):
    """The study's directory: ``data`` (corpus, codebook), ``pretrain/<run>``, ``finetune/<variant>/<task>-seed<s>``,
    ``analysis/*.json``, ``figures/``, ``report.md`` / ``report.json``."""

    def pretrain_run(self, run: Pretraining) -> RunLayout:
        return RunLayout(self.out / "pretrain" / run.name)

    def pretrained(self, name: str) -> Path:
        """The exported backbone of the pre-training ``name``."""
        return self.out / "pretrain" / name / EXPORTED_BACKBONE

    def snapshots(self, run: Pretraining) -> dict[int, Path]:
        """The pre-training's backbone snapshots by step."""
        return self.pretrain_run(run).saved_snapshots()

    def finetune_run(self, variant: str, task: str, seed: int) -> RunLayout:
        return RunLayout(self.out / "finetune" / variant / f"{task}-seed{seed}")

    @property
    def analysis(self) -> Path:
        return self.out / "analysis"


def pretrain_stages(study: StudyRun, run: Pretraining) -> list[Stage]:
    from mmoe.tasks.snapshots import BackboneSnapshots

    layout = study.pretrain_run(run)
    key = StageKey.of("pretrain", run.name)

    def launch():
        snapshots = [BackboneSnapshots(layout.snapshots, run.snapshots)] if run.snapshots else []
        return pretrain_launch(study, run.variant, layout, run.steps, snapshots, dict(run.moe))

    export = export_stage(StageKey.of(*key.parts, "export"), layout.last_checkpoint, study.pretrained(run.name))
    return [pretrain_stage(key, launch, layout), export]


def finetune_stages(study: StudyRun, settings: StudySettings) -> list[Stage]:
    """Every task of every task variant at ``task_seeds`` seeds, and of :data:`PRETRAINING_VARIANT` from random
    init at as many (MH-MoE Table 4; what pre-training adds), each scored; and the routers' VQA fine-tunings at
    ``seeds`` seeds with a routing window every ``consistency_every`` steps (X-MoE Fig. 3b), X-MoE's routing frozen."""
    stages = []
    random = study.pretrained(f"{PRETRAINING_VARIANT}-{RANDOM_INIT}")  # the architecture, fresh weights
    source = study.pretrained(PRETRAINING_VARIANT)
    stages.append(
        random_backbone_stage(StageKey.of("pretrain", f"{PRETRAINING_VARIANT}-{RANDOM_INIT}"), source, random)
    )
    cells = [(variant, study.pretrained(variant)) for variant in settings.task_variants]
    cells.append((f"{PRETRAINING_VARIANT}-{RANDOM_INIT}", random))
    for name, backbone in cells:
        for benchmark in trained_benchmarks(settings.training):
            for seed in range(settings.task_seeds):
                layout = study.finetune_run(name, benchmark.name, seed)
                key = StageKey.of("finetune", name, f"{benchmark.name}-seed{seed}")
                stages.append(finetune_stage(study, key, benchmark, backbone, layout, seed))
                stages.append(evaluate_stage(study, StageKey.of(*key.parts, "eval"), benchmark, backbone, layout, seed))
    consistency = StudyRun(study.out, settings.training.replace(
        finetune_steps={**settings.training.finetune_steps, CONSISTENCY_TASK: settings.consistency_steps}))  # fmt: skip
    benchmark = benchmark_named(CONSISTENCY_TASK)
    for router in COMPARED_ROUTERS:
        name = router_run(router, settings.many_experts)
        backbone = study.pretrained(name)
        options = {"frozen_routing": router in FROZEN_IN_FINETUNING}
        for seed in range(settings.seeds):
            layout = study.finetune_run(name, CONSISTENCY_TASK, seed)
            key = StageKey.of("finetune", name, f"{CONSISTENCY_TASK}-seed{seed}")
            stages.append(finetune_stage(consistency, key, benchmark, backbone, layout, seed,
                                      routing_every=settings.consistency_every, model_options=options))  # fmt: skip
    return stages


def analysis_stage(study: StudyRun, settings: StudySettings, runs: list[Pretraining]) -> Stage:
    """Every routing measurement on the held-out batches and every score, saved as ``analysis/measures.json``."""
    from mmoe.study.measures import held_out_batches

    target = study.analysis / MEASURES_FILE

    def measure() -> dict:
        batches = held_out_batches(
            study.corpus.shard(ANALYSIS_SHARDS),
            settings.training.image_size,
            settings.analysis_batches,
            settings.analysis_batch_size,
            max_text_length=CAPTION_MAX_TEXT_LENGTH,
        )
        measures = measure_runs(study, settings, runs, batches)
        write_json(target, measures.to_json())
        return {"files": [str(target)]}

    return Stage(StageKey.of("analysis"), target, measure)


def measure_runs(study: StudyRun, settings: StudySettings, runs: list[Pretraining], batches: list) -> Measures:
    from mmoe.metrics.routing_collect import consistency_through_training
    from mmoe.metrics.routing_stats import read_stats, window_loads
    from mmoe.study.measures import (
        diversity_by_region,
        expert_loads,
        requested_capacity,
        router_variant_measures,
        snapshot_measures,
        token_passes,
        training_token_counts,
    )

    by_name = {run.name: run for run in runs}
    experts = settings.many_experts
    xmoe = by_name[router_run("xmoe", experts)]
    xmoe_snapshot = study.pretrain_run(xmoe).snapshot(settings.many_experts_steps)
    activation = {f"{xmoe.name}-step{settings.many_experts_steps}": {"heads": 1} | expert_loads(xmoe_snapshot, batches)}
    for run in runs:
        if run.variant == "mhmoe" and dict(run.moe).get("num_experts") == experts:
            activation[run.name] = {"heads": run.heads} | expert_loads(study.pretrained(run.name), batches)
    diversity = {run.name: diversity_by_region(study.pretrained(run.name), batches) for run in runs if run.heads > 1}
    snapshots, consistency = {}, {}
    for router in COMPARED_ROUTERS:
        run = by_name[router_run(router, experts)]
        saved = study.snapshots(run)
        snapshots[router] = snapshot_measures(list(saved.values()), list(saved), batches, settings.analysis_rows)
        folders = [study.finetune_run(run.name, CONSISTENCY_TASK, seed).root for seed in range(settings.seeds)]
        loads = [window_loads(read_stats(folder)) for folder in folders]
        names = [str(folder) for folder in folders]
        result = consistency_through_training(loads, names)
        # each seed left out in turn: the jackknife over runs that decides the claim (mmoe.study.decisions)
        left_out = [consistency_through_training(loads[:i] + loads[i + 1 :], names[:i] + names[i + 1 :])["windows"]
                    for i in range(len(loads))] if len(loads) > 2 else []  # fmt: skip
        consistency[router] = result | {"runs": len(folders), "frozen_routing": router in FROZEN_IN_FINETUNING,
                                        "leave_one_out": left_out}  # fmt: skip
    scores = {variant: collect_scores(study, variant, settings.task_seeds) for variant in settings.task_variants}
    random_init = collect_scores(study, f"{PRETRAINING_VARIANT}-{RANDOM_INIT}", settings.task_seeds)
    stratified = study.pretrained(by_name[STRATIFIED].name)
    capacity = requested_capacity(stratified, batches)
    passes = token_passes(stratified, batches)
    training = training_token_counts([study.corpus.shard(PRETRAIN_PAIR_SPLIT), study.corpus.shard(PRETRAIN_TEXT_SPLIT)],
                                     CAPTION_MAX_TEXT_LENGTH)  # fmt: skip
    seen = {token for entry in passes.values() for token in entry["ids"]}
    token_capacity = {"passes": passes, "training_counts": {str(t): training.get(t, 0) for t in sorted(seen)}}
    routers = {name: router_variant_measures(study.pretrained(name), batches) for name in settings.router_variants}
    return Measures(activation, diversity, snapshots, consistency, scores, random_init, capacity, token_capacity,
                    chance_levels(study), routers)  # fmt: skip


def chance_levels(study: StudyRun) -> dict[str, float]:
    """Each trained task's chance level on its main score (:attr:`mmoe.pipeline.benchmarks.Benchmark.chance`: the VQA
    per-question-type prior, the constant NLVR2 answer, the constant caption's CIDEr)."""
    levels = ChanceLevels.from_summary(study.chance())
    return {b.name: b.chance(levels) for b in trained_benchmarks(study.settings) if b.chance is not None}


def collect_scores(study: StudyRun, name: str, seeds: int) -> dict:
    """task -> the ``scores.json`` of the fine-tunings of ``name`` at each seed."""
    return {
        benchmark.name: [read_json(study.finetune_run(name, benchmark.name, seed).scores, "scores") for seed in
                         range(seeds)]
        for benchmark in trained_benchmarks(study.settings)
    }  # fmt: skip


def maps_stage(study: StudyRun, settings: StudySettings, runs: list[Pretraining]) -> Stage:
    """The sub-token maps of the MH-MoE runs on held-out images (MH-MoE Fig. 1b / 8's maps), images only."""
    from mmoe.viz.cli import checkpoint_labels, subtoken_map_path

    out = study.out / "figures" / "maps"
    backbones = [study.pretrained(run.name) for run in runs if run.heads > 1]

    def draw() -> dict:
        from mmoe.viz.cli import draw_subtoken_maps

        images = [study.corpus.shard(ANALYSIS_SHARDS)]
        draw_subtoken_maps(backbones, images, out, num_images=settings.training.figure_images, text=False)
        return {"files": sorted(str(path) for path in out.glob("*.png"))}

    return Stage(StageKey.of("maps"), subtoken_map_path(out, checkpoint_labels(backbones)[0]), draw)
