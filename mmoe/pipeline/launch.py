"""How a pipeline trains and predicts: a :class:`mmoe.config.run_spec.RunSpec` of ``mmoe fit`` / ``predict`` over a
config shipped in ``mmoe/configs``, pointed at the run's corpus and run folder, with the steps and seed its stage
gives, run in this process (:func:`mmoe.config.run_spec.run_spec`)."""

from __future__ import annotations

import copy
import dataclasses
import functools
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import lightning as L

from mmoe.config.launch import read_config
from mmoe.config.run_spec import LOG_VERSION, DataSpec, ModelSpec, RunSpec, TrainerSpec, run_spec
from mmoe.model.config import config_to_dict
from mmoe.pipeline.layout import PipelineRun
from mmoe.pipeline.stages import PipelineError, print_progress
from mmoe.runtime.checkpoint import read_backbone_state
from mmoe.runtime.layout import RunLayout
from mmoe.tasks.finetuning import FineTuningTask, routes_over_the_batch
from mmoe.tasks.zero_shot_probes import DEFAULT_PROBE_PAIRS

#: The configs shipped with the package (``configs/`` at the repo root links here).
CONFIGS = Path(__file__).resolve().parents[1] / "configs"

#: The pre-training parts ``configs/pretrain/tiny/<variant>.yaml`` a pipeline runs (``dense``: none). Not
#: ``global_balance``: the pipelines train on one device, where the global-batch balance loss is Switch's own.
VARIANTS = (
    "dense",
    "switch",
    "xmoe",
    "mhmoe",
    "stratified",
    "fine_grained",
    "shared_experts",
    "loss_free",
    "expert_choice",
    "limoe",
    "moma",
    "deepseek",
)


def config_file(relative: str) -> Path:
    """A config shipped with the package (``mmoe/configs/<relative>``)."""
    path = CONFIGS / relative
    if not path.is_file():
        raise PipelineError(f"config {path} does not exist (pipelines read the configs shipped in the mmoe package)")
    return path


def pretrain_configs(variant: str) -> tuple[Path, ...]:
    """The tiny pre-training of ``variant``: ``configs/pretrain/tiny.yaml`` (dense), with the variant's part
    ``configs/pretrain/tiny/<variant>.yaml`` (its MoE layers, its run folder) over it."""
    tiny = config_file("pretrain/tiny.yaml")
    return (tiny,) if variant == "dense" else (tiny, config_file(f"pretrain/tiny/{variant}.yaml"))


def metrics_csv(layout: RunLayout) -> Path:
    """The ``metrics.csv`` a pipeline stage's training logs to."""
    return layout.csv_logs / f"version_{LOG_VERSION}" / "metrics.csv"


def configured_moe(variant: str):
    """The MoE plan of the tiny configs of ``variant`` as the CLI's parser reads it (a namespace; None for dense): a
    copy of the one read when this process first asked, since a parse costs about a second and the study's plan asks
    for every run."""
    return copy.deepcopy(_parsed_moe(variant))


@functools.cache
def _parsed_moe(variant: str):
    return read_config(pretrain_configs(variant)).fit.model.init_args.backbone.moe


def pretrain_spec(
    run: PipelineRun,
    variant: str,
    layout: RunLayout,
    steps: int,
    seed: int | None = None,
    moe: Mapping[str, Any] | None = None,
    callbacks: Sequence[L.Callback] = (),
    watched: bool = False,
) -> RunSpec:
    """``mmoe fit`` with the tiny configs of ``variant`` (:func:`pretrain_configs`) on the run's corpus (its codebook
    included) into ``layout`` for ``steps`` steps (``seed``: the config's when None); ``moe`` replaces fields of the
    backbone's MoE plan. ``watched``: TensorBoard logs beside the CSV ones (the routing callback's load heatmaps, the
    losses, the probes) and one validation after the last step, on the held-out batches that hold the zero-shot probes'
    pairs (:mod:`mmoe.tasks.zero_shot_probes`, read back by :func:`mmoe.pipeline.probes.logged_probes`)."""
    settings = run.settings
    arguments: dict[str, Any] = {"visual_codebook": run.codebook}
    if settings.contrastive_coefficient:
        arguments["contrastive_coefficient"] = settings.contrastive_coefficient
    if settings.pretrain_output_vocab:
        arguments["output_vocab"] = run.corpus.caption_tokens
    trainer = TrainerSpec(
        steps,
        settings.checkpoint_every,
        routing_every=50,
        progress_label=f"pretrain {layout.root.name}",
        precision=settings.precision,
        validation_batches=math.ceil(DEFAULT_PROBE_PAIRS / settings.batch_size) if watched else 0,
        tensorboard=watched,
    )
    learning_rate = settings.pretrain_learning_rate
    return RunSpec(
        "fit",
        pretrain_configs(variant),
        layout,
        ModelSpec(arguments, {**settings.backbone, "image_size": settings.image_size}, dict(moe or {})),
        DataSpec(run.data, settings.batch_size, batches_per_epoch=steps),
        trainer,
        optimizer={} if learning_rate is None else {"learning_rate": learning_rate},
        seed=seed,
        callbacks=tuple(callbacks),
    )


def finetune_spec(
    run: PipelineRun,
    task: type[FineTuningTask],
    model_options: Mapping[str, Any],
    backbone: Path,
    layout: RunLayout,
    steps: int,
    seed: int | None = None,
    routing_every: int = 20,
) -> RunSpec:
    """``mmoe fit`` with ``configs/finetune/<task>_tiny.yaml`` on the run's corpus into ``layout`` for ``steps`` steps,
    starting from ``backbone`` (whose architecture it keeps), with the task's ``model_options`` (files in the run's
    corpus, decoding settings); ``seed`` replaces the config's ``seed_everything``; routing statistics every
    ``routing_every`` steps; the optimiser settings of ``run``'s settings for the task."""
    settings = run.settings
    trainer = TrainerSpec(
        steps, settings.checkpoint_every, routing_every, f"fine-tune {task.name}", precision=settings.precision
    )
    return RunSpec(
        "fit",
        (config_file(f"finetune/{task.name}_tiny.yaml"),),
        layout,
        ModelSpec(dict(model_options), causal_text_backbone(task, backbone), pretrained=backbone),
        DataSpec(run.data, settings.batch_size),
        trainer,
        optimizer=dict(settings.finetune_optimizer.get(task.name, {})),
        seed=seed,
    )


def causal_text_backbone(task: type[FineTuningTask], backbone: Path) -> dict[str, Any] | None:
    """The backbone config a task whose text is causal (:attr:`FineTuningTask.causal_text`: captioning) is fine-tuned
    with from the exported ``backbone``: the backbone's own routed by dropless token choice when it routes by expert
    choice, drops by batch priority or routes top-k > 1 under a finite capacity, which such a task refuses (each
    decides over the whole batch, later caption tokens included); its weights load unchanged. None, the backbone's
    own config, otherwise (and before it is exported)."""
    if not task.causal_text or not backbone.is_file():
        return None
    config, _ = read_backbone_state(backbone)
    if not routes_over_the_batch(config):
        return None
    fields = config_to_dict(config)
    fields["moe"] |= {
        "routing": "token_choice",
        "capacity_factor": None,
        "eval_capacity_factor": None,
        "capacity_priority": "position",
    }
    return fields


def predict_spec(fit: RunSpec, shards: Path, predictions: Path) -> RunSpec:
    """``mmoe predict`` of the fine-tuning ``fit`` from its latest checkpoint on ``shards`` into ``predictions``."""
    model = dataclasses.replace(fit.model, arguments={**fit.model.arguments, "predictions_file": predictions})
    return dataclasses.replace(
        fit,
        subcommand="predict",
        model=model,
        data=dataclasses.replace(fit.data, test_shards=shards),
        trainer=dataclasses.replace(fit.trainer, logged=False),
        checkpoint=fit.run_folder.last_checkpoint,
    )


def run_in_stage(stage: str, spec: RunSpec) -> None:
    """Runs ``spec``; PipelineError naming ``stage`` when the CLI exits with an error."""
    try:
        run_spec(spec)
    except SystemExit as stop:  # LightningCLI ends bad configs and bad input with exit 2
        if stop.code not in (0, None):
            raise PipelineError(f"stage {stage}: mmoe {spec.subcommand} exited with status {stop.code}") from None


def train(stage: str, spec: RunSpec) -> dict:
    """Runs the ``fit`` ``spec``, resumed from its run folder's latest checkpoint when an earlier run left one; returns
    what ran and the files it wrote."""
    layout = spec.run_folder
    if layout.last_checkpoint.is_file():
        print_progress(f"    resuming from {layout.last_checkpoint}")
        spec = dataclasses.replace(spec, checkpoint=layout.last_checkpoint)
    run_in_stage(stage, spec)
    return {"launch": spec.to_json(), "files": [str(layout.last_checkpoint), str(layout.csv_logs)]}
