"""How a pipeline trains and predicts: ``mmoe fit`` / ``predict`` in this process (:func:`mmoe.config.launch
.run_lightning`) on a config shipped in ``mmoe/configs``, with typed options that point it at the run directory and
set the run's step counts, and the run's callbacks as objects."""

from __future__ import annotations

import copy
import dataclasses
import functools
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lightning as L
from jsonargparse import Namespace
from lightning.pytorch.callbacks import LearningRateMonitor, ModelCheckpoint

from mmoe.config.cli import TENSORBOARD_LOGGER
from mmoe.config.launch import read_config, run_lightning
from mmoe.model.config import config_to_dict
from mmoe.pipeline.layout import PipelineRun
from mmoe.pipeline.stages import PipelineError, print_progress
from mmoe.runtime.checkpoint import read_backbone_state
from mmoe.runtime.layout import RunLayout
from mmoe.runtime.routing_callback import RoutingStatsCallback
from mmoe.runtime.run_logs import CSV_LOGGER
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


@dataclasses.dataclass(frozen=True)
class Launch:
    """One ``mmoe fit`` / ``predict`` of a pipeline.

    Attributes:
        subcommand: ``fit`` or ``predict``.
        configs: the shipped config files, merged in order.
        overrides: options over them, nested as in a config file (``{"trainer": {"max_steps": 80}}``).
        callbacks: added to the trainer's (the configs' own callbacks are replaced by these).
    """

    subcommand: str
    configs: tuple[Path, ...]
    overrides: dict[str, Any]
    callbacks: tuple[L.Callback, ...] = ()

    def config(self) -> Namespace:
        """The config the subcommand runs, parsed by the CLI's own parser (nothing instantiated)."""
        return read_config(self.configs, self.overrides, self.subcommand)[self.subcommand]

    def run(self, stage: str) -> None:
        """Runs it; PipelineError naming ``stage`` when the CLI exits with an error."""
        try:
            run_lightning(self.subcommand, self.configs, self.overrides, self.callbacks)
        except SystemExit as stop:  # LightningCLI ends bad configs and bad input with exit 2
            if stop.code not in (0, None):
                raise PipelineError(f"stage {stage}: mmoe {self.subcommand} exited with status {stop.code}") from None

    def to_json(self) -> dict:
        """What a stage marker records: the subcommand, configs, options and callbacks."""
        return {
            "subcommand": self.subcommand,
            "configs": [str(path) for path in self.configs],
            "overrides": plain(self.overrides),
            "callbacks": [type(callback).__name__ for callback in self.callbacks],
        }


def plain(value: Any) -> Any:
    """``value`` with paths as strings (JSON-able)."""
    if isinstance(value, dict):
        return {key: plain(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [plain(item) for item in value]
    return str(value) if isinstance(value, Path) else value


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


#: The version folder of a stage's logs (``csv/version_0``, ``tensorboard/version_0``): one per run folder, continued
#: across a resume.
CSV_VERSION = 0


def metrics_csv(layout: RunLayout) -> Path:
    """The ``metrics.csv`` a pipeline stage's training logs to."""
    return layout.csv_logs / f"version_{CSV_VERSION}" / "metrics.csv"


def trainer_options(
    run: PipelineRun, layout: RunLayout, steps: int, routing_every: int, extra: Sequence[L.Callback] = ()
) -> tuple[dict[str, Any], tuple[L.Callback, ...]]:
    """The trainer of a pipeline stage and its callbacks: ``steps`` steps without validation, one CSV logger, the latest
    checkpoint as ``layout.last_checkpoint``, routing statistics every ``routing_every`` steps in ``layout``, no
    progress bar (:func:`progress_lines` instead), and ``extra`` callbacks."""
    csv = {"save_dir": str(layout.root), "name": layout.csv_logs.name, "version": CSV_VERSION}
    trainer = {
        "max_steps": steps,
        "val_check_interval": steps,
        "limit_val_batches": 0,
        "default_root_dir": str(layout.root),
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "precision": run.settings.precision,
        "callbacks": [],
        "logger": [{"class_path": CSV_LOGGER, "init_args": csv}],
    }
    callbacks = (
        # No validation metric: keep only the latest checkpoint.
        ModelCheckpoint(
            dirpath=layout.checkpoints, save_top_k=0, save_last=True, every_n_train_steps=run.settings.checkpoint_every
        ),
        LearningRateMonitor(logging_interval="step"),
        RoutingStatsCallback(every_n_steps=routing_every, save_dir=layout.root),
        *extra,
    )
    return trainer, callbacks


def progress_lines(label: str, steps: int) -> dict[str, Any]:
    """The options of a pipeline stage's progress lines (:class:`mmoe.runtime.throughput.Throughput`, which every run
    has): about six lines for ``steps`` steps, each starting with ``label``."""
    return {"label": label, "every_n_steps": max(10, steps // 6)}


def configured_moe(variant: str):
    """The MoE plan of the tiny configs of ``variant`` as the CLI's parser reads it (a namespace; None for dense): a
    copy of the one read when this process first asked, since a parse costs about a second and the study's plan asks
    for every run."""
    return copy.deepcopy(_parsed_moe(variant))


@functools.cache
def _parsed_moe(variant: str):
    return read_config(pretrain_configs(variant)).fit.model.init_args.backbone.moe


def pretrain_launch(
    run: PipelineRun,
    variant: str,
    layout: RunLayout,
    steps: int | None = None,
    extra_callbacks: Sequence[L.Callback] = (),
    moe: dict[str, Any] | None = None,
    watched: bool = False,
) -> Launch:
    """``mmoe fit`` with the tiny configs of ``variant`` (:func:`pretrain_configs`) on the run's corpus (its codebook
    included) into ``layout``, for ``steps`` (default the settings' ``pretrain_steps``); ``moe`` replaces fields of the
    backbone's MoE plan. ``watched``: TensorBoard logs beside the CSV ones (the routing callback's load heatmaps, the
    losses, the probes) and one validation after the last step, on the held-out batches that hold the zero-shot probes'
    pairs (:mod:`mmoe.tasks.zero_shot_probes`, read back by :func:`mmoe.pipeline.probes.logged_probes`)."""
    steps = run.settings.pretrain_steps if steps is None else steps
    label = f"pretrain {layout.root.name if layout.root.name != 'pretrain' else variant}"
    trainer, callbacks = trainer_options(run, layout, steps, 50, extra_callbacks)
    if watched:
        trainer["limit_val_batches"] = math.ceil(DEFAULT_PROBE_PAIRS / run.settings.batch_size)
        tensorboard = {"save_dir": str(layout.root), "name": layout.tensorboard_logs.name, "version": CSV_VERSION}
        trainer["logger"].append({"class_path": TENSORBOARD_LOGGER, "init_args": tensorboard})
    backbone = {**run.settings.backbone, "image_size": run.settings.image_size}
    if moe:
        # A dict for the MoE plan replaces the config's whole plan (its router too): start from the configured one.
        backbone["moe"] = configured_moe(variant).as_dict() | moe
    model: dict[str, Any] = {"backbone": backbone, "visual_codebook": str(run.codebook)}
    if run.settings.pretrain_learning_rate is not None:
        model["optimizer"] = {"learning_rate": run.settings.pretrain_learning_rate}
    if run.settings.contrastive_coefficient:
        model["contrastive_coefficient"] = run.settings.contrastive_coefficient
    if run.settings.pretrain_output_vocab:
        model["output_vocab"] = str(run.corpus.caption_tokens)
    overrides = {
        "trainer": trainer,
        "throughput": progress_lines(label, steps),
        "model": {"init_args": model},
        "data": {
            "init_args": {"data_root": str(run.data), "batch_size": run.settings.batch_size, "batches_per_epoch": steps}
        },
    }
    return Launch("fit", pretrain_configs(variant), overrides, callbacks)


def finetune_launch(
    run: PipelineRun,
    task: type[FineTuningTask],
    model_options: dict[str, Any],
    backbone: Path,
    layout: RunLayout,
    seed: int | None = None,
    routing_every: int = 20,
) -> Launch:
    """``mmoe fit`` with ``configs/finetune/<task>_tiny.yaml`` on the run's corpus into ``layout``, starting from
    ``backbone`` (whose architecture it keeps), with the task's ``model_options`` (files in the run's corpus, decoding
    settings); ``seed`` replaces the config's ``seed_everything``; routing statistics every ``routing_every`` steps."""
    steps = run.settings.steps(task.name)
    trainer, callbacks = trainer_options(run, layout, steps, routing_every)
    model = {"backbone": causal_text_backbone(task, backbone), "pretrained": str(backbone), **model_options}
    if task.name in run.settings.finetune_optimizer:
        model["optimizer"] = dict(run.settings.finetune_optimizer[task.name])
    overrides = {
        "trainer": trainer,
        "throughput": progress_lines(f"fine-tune {task.name}", steps),
        "model": {"init_args": model},
        "data": {"init_args": {"data_root": str(run.data), "batch_size": run.settings.batch_size}},
    }
    if seed is not None:
        overrides["seed_everything"] = seed
    return Launch("fit", (config_file(f"finetune/{task.name}_tiny.yaml"),), overrides, callbacks)


def causal_text_backbone(task: type[FineTuningTask], backbone: Path) -> dict[str, Any] | None:
    """The backbone config a task whose text is causal (:attr:`FineTuningTask.causal_text`: captioning) is fine-tuned
    with from the exported ``backbone``: the backbone's own routed by dropless token choice when it routes by expert
    choice or drops by batch priority, which such a task refuses (either decides over the whole batch, later caption
    tokens included); its weights load unchanged. None, the backbone's own config, otherwise (and before it is
    exported)."""
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


def predict_launch(fit: Launch, layout: RunLayout, shards: Path, predictions: Path) -> Launch:
    """``mmoe predict`` of the fine-tuning ``fit`` from its latest checkpoint on ``shards`` into ``predictions``."""
    overrides = dict(fit.overrides)
    overrides["trainer"] = fit.overrides["trainer"] | {"logger": False}
    overrides["model"] = {"init_args": fit.overrides["model"]["init_args"] | {"predictions_file": str(predictions)}}
    overrides["data"] = {"init_args": fit.overrides["data"]["init_args"] | {"test_shards": str(shards)}}
    overrides["ckpt_path"] = str(layout.last_checkpoint)
    return Launch("predict", fit.configs, overrides, fit.callbacks)


def train(stage: str, launch: Launch, layout: RunLayout) -> dict:
    """Runs the ``fit`` ``launch``, resumed from ``layout.last_checkpoint`` when an earlier run left one; returns what
    ran and the files it wrote."""
    if layout.last_checkpoint.is_file():
        print_progress(f"    resuming from {layout.last_checkpoint}")
        launch = dataclasses.replace(launch, overrides=launch.overrides | {"ckpt_path": str(layout.last_checkpoint)})
    launch.run(stage)
    return {"launch": launch.to_json(), "files": [str(layout.last_checkpoint), str(layout.csv_logs)]}
