"""mmoe's setting of each claim in one line (:func:`claim_settings`), from the study's settings: the report puts it
beside the paper's."""

from __future__ import annotations

from mmoe.study.plan_gpu import claim_runners
from mmoe.study.runs import PRETRAINING_VARIANT
from mmoe.study.settings import StudySettings


def _routing(settings: StudySettings) -> dict[str, str]:
    experts, steps, seeds = settings.many_experts, settings.router_steps, settings.routing_seeds
    pairs = f"{settings.analysis_batches * settings.analysis_batch_size} held-out image-caption pairs"
    schedule = f"{steps} pre-training steps, warm-up then a constant learning rate, {seeds} seeds per arm"
    return {
        "activation": f"{experts} experts, top-1; X-MoE and MH-MoE h = {', '.join(map(str, settings.heads))}, each "
        f"measured at the end of its own run; {schedule}; batch {settings.training.batch_size}; {pairs}",
        "diversity": f"MH-MoE at {experts} experts with h = {', '.join(map(str, settings.heads))} (routing seed 0) and "
        f"(h, E) = {list(settings.diversity_runs)}, {steps} steps; top-1 choices; object patches = a pixel channel > "
        f"120; {pairs}",
        "collapse": f"Switch and X-MoE, {experts} experts, top-1, {schedule}, a snapshot every "
        f"{settings.snapshot_every}; {settings.analysis_rows} router-input rows per MoE layer of {pairs}",
        "fluctuation": f"Switch and X-MoE, {experts} experts, {schedule}, snapshots {settings.snapshot_every} steps "
        f"apart; every (sub-)token of {pairs}",
    }


def claim_settings(settings: StudySettings, preset: str = "default") -> dict[str, str]:
    """Claim id -> mmoe's setting of the claim in one line; a claim the preset (named ``preset``) does not run says
    which preset runs it."""
    described = _described(settings)
    return {
        claim: text
        if settings.runs_claim(claim)
        else f"not run under this preset ({claim_runners(claim, preset)}): {text}"
        for claim, text in described.items()
    }


def _described(settings: StudySettings) -> dict[str, str]:
    training, recipe = settings.training, settings.pretraining_recipe
    pairs = f"{settings.analysis_batches * settings.analysis_batch_size} held-out image-caption pairs"
    steps = ", ".join(f"{task} {n}" for task, n in training.finetune_steps.items())
    fine_tuning = (
        f"{settings.seeds} VQA fine-tunings per router from each router's routing-seed-0 backbone, "
        f"{settings.consistency_steps} steps, loads over {settings.consistency_every}-step windows"
    )
    tasks = (
        f"{', '.join(settings.task_variants)} at the tiny config's experts, {training.pretrain_steps} pre-training "
        f"steps; fine-tuning {steps} steps; {settings.task_seeds} seeds per cell"
    )
    backbones = settings.pretraining_backbones
    return _routing(settings) | {
        "consistency": f"{fine_tuning}; both routers' routing frozen (X-MoE §3.3)",
        "consistency_trained": f"{fine_tuning}; both routers fine-tuned whole",
        "tasks": tasks,
        "pretraining": f"{PRETRAINING_VARIANT} with the demo's recipe (contrastive loss, output vocabulary, its "
        f"learning rates and VQA optimiser), {backbones} pre-trainings of {recipe.pretrain_steps} steps (seeds 0-"
        f"{backbones - 1}) against {backbones} random inits (the same seeds), each fine-tuned once on "
        + ", ".join(f"{task} {n} steps" for task, n in recipe.finetune_steps.items()),
        "capacity": f"Stratified MoE (the tiny config's strata), {training.pretrain_steps} pre-training steps; {pairs}",
        "frequency": f"the same Stratified MoE run: passes per text token of {pairs} against the token's count in the "
        "pre-training pairs and text",
    }
