"""The analysis stage's measurements of every run of the study (:func:`measure_runs`): the routing arms at each
routing seed (claims 1, 3 and 4 are decided over them), the diversity runs, the routers' fine-tunings under both
rules with each seed left out in turn (claim 5's jackknife), claim 7's backbones with their evaluation image by image,
the task cells, Stratified MoE and the router table."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from mmoe.data.synth.layout import PRETRAIN_PAIR_SPLIT, PRETRAIN_TEXT_SPLIT
from mmoe.data.tokenizer import CAPTION_MAX_TEXT_LENGTH
from mmoe.io import read_json, write_json
from mmoe.pipeline.benchmarks import trained_benchmarks
from mmoe.pipeline.items import VQA_EVAL_SUBTYPE
from mmoe.pipeline.stages import Stage, StageKey
from mmoe.study.runs import (
    COMPARED_ROUTERS,
    CONSISTENCY_TASK,
    MEASURES_FILE,
    STRATIFIED,
    Measures,
    Pretraining,
    StudyRun,
    chance_levels,
    collect_scores,
    consistency_folder,
    diversity_run,
    recipe_run,
    routing_arms,
    routing_run,
    task_backbones,
)
from mmoe.study.settings import StudySettings


def diversity_arms(settings: StudySettings) -> list[list[str]]:
    """Claim 2's arms, each its runs' names: MH-MoE at ``many_experts`` with each of ``heads`` (routing seed 0), then
    each diversity run with its seeds."""
    arms = [[routing_run(f"mhmoe-h{h}", settings.many_experts, 0)] for h in settings.heads]
    return arms + [
        [diversity_run(h, e, seed, settings.diversity_seeds) for seed in range(settings.diversity_seeds)]
        for h, e in settings.diversity_runs
    ]


def seeded_routing(study: StudyRun, settings: StudySettings, runs: list[Pretraining], batches: list) -> list[dict]:
    """Per routing seed: ``activation`` (X-MoE and each MH-MoE arm at the end of its own run, h = 1 for X-MoE; empty
    where claim 1 is not run) and ``snapshots`` (Switch and X-MoE through pre-training)."""
    from mmoe.study.measures import expert_loads, snapshot_measures

    by_name = {run.name: run for run in runs}
    experts = settings.many_experts
    per_seed = []
    for seed in range(settings.routing_seeds):
        activation = {}
        for arm in routing_arms(settings) if settings.runs_claim("activation") else ():
            if arm == "switch":
                continue
            run = by_name[routing_run(arm, experts, seed)]
            loads = expert_loads(study.backbone(run.name), batches)
            activation[arm_label(arm, experts)] = {"heads": run.heads} | loads
        snapshots = {}
        for router in COMPARED_ROUTERS:
            saved = study.snapshots(by_name[routing_run(router, experts, seed)])
            snapshots[router] = snapshot_measures(list(saved.values()), list(saved), batches, settings.analysis_rows)
        per_seed.append({"seed": seed, "activation": activation, "snapshots": snapshots})
    return per_seed


def arm_label(arm: str, experts: int) -> str:
    """The name an activation arm has in the measures: ``xmoe-e32``, ``mhmoe-e32-h8``."""
    return f"{arm}-e{experts}" if not arm.startswith("mhmoe-h") else f"mhmoe-e{experts}-h{arm.removeprefix('mhmoe-h')}"


def consistency_of(study: StudyRun, settings: StudySettings, rule: str) -> dict:
    """Router -> the inter-run consistency of its VQA fine-tunings under ``rule``, window by window, with each seed
    left out in turn (the jackknife over runs that decides claim 5)."""
    from mmoe.metrics.routing_collect import consistency_through_training
    from mmoe.metrics.routing_stats import read_stats, window_loads

    consistency: dict = {}
    if not settings.seeds:
        return consistency
    for router in COMPARED_ROUTERS:
        folder = consistency_folder(router, settings.many_experts, rule)
        folders = [study.finetuning(folder, CONSISTENCY_TASK, seed).root for seed in range(settings.seeds)]
        loads = [window_loads(read_stats(path)) for path in folders]
        names = [str(path) for path in folders]
        left_out = (
            [
                consistency_through_training(loads[:i] + loads[i + 1 :], names[:i] + names[i + 1 :])["windows"]
                for i in range(len(loads))
            ]
            if len(loads) > 2
            else []
        )
        consistency[router] = consistency_through_training(loads, names) | {
            "runs": len(folders),
            "frozen_routing": rule == "frozen",
            "leave_one_out": left_out,
        }
    return consistency


def image_sums(study: StudyRun, predictions: Path) -> dict[str, list]:
    """One VQA evaluation image by image: the image ids (sorted), each image's question count and the sum of its
    questions' official accuracies (fractions)."""
    from mmoe.metrics.vqa import load_vqa, vqa_accuracy

    corpus = study.corpus
    entries, answers = load_vqa(
        corpus.vqa_questions(VQA_EVAL_SUBTYPE), corpus.vqa_annotations(VQA_EVAL_SUBTYPE), predictions
    )
    sums: dict[str, float] = {}
    counts: dict[str, int] = {}
    for entry in entries:
        image = str(entry["image_id"])
        sums[image] = sums.get(image, 0.0) + vqa_accuracy(answers[entry["question_id"]], entry["answers"])
        counts[image] = counts.get(image, 0) + 1
    images = sorted(sums)
    return {"images": images, "questions": [counts[i] for i in images], "sums": [sums[i] for i in images]}


def backbone_measures(study: StudyRun, settings: StudySettings) -> dict:
    """Claim 7: per arm (pre-trained, random init) and task, each backbone seed's ``scores.json``; for VQA also its
    evaluation image by image (:func:`image_sums`)."""
    if not settings.pretraining_backbones:
        return {}
    recipe = StudyRun(study.out, settings.pretraining_recipe)
    arms = {"pretrained": False, "random_init": True}
    measured: dict = {arm: {} for arm in arms} | {"images": {}}
    for benchmark in trained_benchmarks(settings.pretraining_recipe):
        for arm, random_init in arms.items():
            layouts = [
                recipe.finetuning(recipe_run(seed, random_init), benchmark.name, seed)
                for seed in range(settings.pretraining_backbones)
            ]
            measured[arm][benchmark.name] = [read_json(layout.scores, "scores") for layout in layouts]
            if benchmark.name == CONSISTENCY_TASK:
                per_image = [image_sums(recipe, layout.predictions(benchmark.predictions)) for layout in layouts]
                measured["images"].setdefault(benchmark.name, {})[arm] = per_image
    return measured


def stratified_measures(study: StudyRun, batches: Sequence) -> tuple[dict, dict]:
    """Claims 8 and 9: the Stratified MoE run's requested capacity per MoE layer and held-out batch, and its passes
    per held-out text token id beside those ids' occurrences in the pre-training text."""
    from mmoe.study.measures import requested_capacity, token_passes, training_token_counts

    stratified = study.backbone(STRATIFIED)
    passes = token_passes(stratified, batches)
    training = training_token_counts(
        [study.corpus.shard(PRETRAIN_PAIR_SPLIT), study.corpus.shard(PRETRAIN_TEXT_SPLIT)], CAPTION_MAX_TEXT_LENGTH
    )
    seen = {token for entry in passes.values() for token in entry["ids"]}
    token_capacity = {"passes": passes, "training_counts": {str(t): training.get(t, 0) for t in sorted(seen)}}
    return requested_capacity(stratified, batches), token_capacity


def task_scores_by_pretraining(study: StudyRun, settings: StudySettings) -> dict:
    """Claim 6: variant -> task -> per pre-training seed of the variant, its fine-tuning seeds' ``scores.json`` (empty
    where the task order is not run)."""
    by_variant: dict = {}
    for name, variant, _ in task_backbones(settings):
        for task, runs in collect_scores(study, name, settings.task_seeds).items():
            by_variant.setdefault(variant, {}).setdefault(task, []).append(runs)
    return by_variant


def measure_runs(study: StudyRun, settings: StudySettings, runs: list[Pretraining], batches: Sequence) -> Measures:
    """Every measurement of the study's runs on the held-out ``batches`` (:class:`mmoe.study.runs.Measures`)."""
    from mmoe.study.measures import diversity_by_region, router_variant_measures

    seeded = seeded_routing(study, settings, runs, list(batches))
    diversity_names = {name for arm in diversity_arms(settings) for name in arm}
    diverse = [run for run in runs if run.name in diversity_names]
    diversity = {run.name: diversity_by_region(study.backbone(run.name), batches) for run in diverse}
    by_pretraining = task_scores_by_pretraining(study, settings)
    scores = {
        variant: {task: [score for seeds in per_seed for score in seeds] for task, per_seed in tasks.items()}
        for variant, tasks in by_pretraining.items()
    }
    trained_stratified = any(run.name == STRATIFIED for run in runs)
    capacity, token_capacity = stratified_measures(study, batches) if trained_stratified else ({}, {})
    routers = {name: router_variant_measures(study.backbone(name), batches) for name in settings.router_variants}
    first = seeded[0] if seeded else {"activation": {}, "snapshots": {}}
    return Measures(
        activation=first["activation"],
        diversity=diversity,
        snapshots=first["snapshots"],
        consistency=consistency_of(study, settings, "frozen"),
        scores=scores,
        random_init={},
        capacity=capacity,
        token_capacity=token_capacity,
        chance=chance_levels(study),
        router_variants=routers,
        seeded={"seeds": seeded},
        consistency_trained=consistency_of(study, settings, "trained"),
        backbones=backbone_measures(study, settings),
        task_pretrainings=by_pretraining,
    )


def per_image_mean(images: list[dict]) -> np.ndarray:
    """(backbones, images) each backbone's mean accuracy per image, in percent."""
    return np.asarray([np.asarray(b["sums"]) / np.asarray(b["questions"]) for b in images]) * 100


def analysis_stage(study: StudyRun, settings: StudySettings, runs: list[Pretraining]) -> Stage:
    """Every routing measurement on the held-out batches and every score, saved as ``analysis/measures.json``."""
    from mmoe.study.measures import analysis_pairs

    target = study.analysis / MEASURES_FILE

    def measure() -> dict:
        training = settings.training
        batches = analysis_pairs(
            study.corpus, training.image_size, settings.analysis_batches, settings.analysis_batch_size
        )
        measures = measure_runs(study, settings, runs, batches)
        write_json(target, measures.to_json())
        return {"files": [str(target)]}

    return Stage(StageKey.of("analysis"), target, measure)
