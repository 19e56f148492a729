"""One ``mmoe fit`` or ``mmoe predict`` over shipped config files, as typed values: :class:`RunSpec` (its model,
data, optimizer, trainer and run folder), which the demo, the claims study and any script build, varied by
``dataclasses.replace``.

:func:`cli_overrides` is the one place that turns a spec into LightningCLI's config form (``class_path`` /
``init_args``): it is laid over the config files in the same parse that runs them (:func:`run_spec`), so a spec
means what the same values on the command line mean, and model values it sets count as named there (they keep their
value over a resumed checkpoint's).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import lightning as L
from jsonargparse import Namespace
from lightning.pytorch.callbacks import LearningRateMonitor, ModelCheckpoint

from mmoe.config.cli import TENSORBOARD_LOGGER, MMoECLI
from mmoe.config.extends import merged
from mmoe.config.launch import read_config, run_lightning
from mmoe.runtime.layout import RunLayout
from mmoe.runtime.optimizer import check_optimizer_fields
from mmoe.runtime.routing_callback import RoutingStatsCallback
from mmoe.runtime.run_logs import CSV_LOGGER

#: The version folder of a run's logs (``csv/version_0``, ``tensorboard/version_0``): one per run folder, continued
#: across a resume.
LOG_VERSION = 0


@dataclass(frozen=True)
class ModelSpec:
    """What a run sets of its task over the config's (the task's init arguments).

    Attributes:
        arguments: init arguments of the task laid over the config's (files, decoding settings, ``frozen_routing``,
            ...), as a config file gives them.
        backbone: :class:`mmoe.model.MultiwayConfig` fields laid over the config's backbone; None: no backbone
            argument, the architecture of the ``pretrained`` file.
        moe: :class:`mmoe.model.MoEPlan` fields laid over the config's MoE plan (e.g. ``num_experts``).
        pretrained: the backbone file the task starts from; None: the config's.
    """

    arguments: Mapping[str, Any] = field(default_factory=dict)
    backbone: Mapping[str, Any] | None = field(default_factory=dict)
    moe: Mapping[str, Any] = field(default_factory=dict)
    pretrained: Path | None = None


@dataclass(frozen=True)
class DataSpec:
    """The DataModule's values over the config's.

    Attributes:
        root: the corpus the config's split paths lie under (``data_root``).
        batch_size: the training batch size.
        batches_per_epoch: batches of one epoch where the DataModule takes it (the pre-training mixture).
        test_shards: the split ``mmoe predict`` reads.
    """

    root: Path
    batch_size: int
    batches_per_epoch: int | None = None
    test_shards: Path | None = None


@dataclass(frozen=True)
class TrainerSpec:
    """The trainer of a run: ``max_steps`` steps, one validation after the last where ``validation_batches`` > 0,
    CSV logs (and TensorBoard's with ``tensorboard``) in the run folder unless ``logged`` is False, the latest
    checkpoint every ``checkpoint_every`` steps, routing statistics every ``routing_every`` steps, progress lines
    starting with ``progress_label`` (no progress bar, no model summary)."""

    max_steps: int
    checkpoint_every: int
    routing_every: int
    progress_label: str
    precision: str = "32-true"
    validation_batches: int = 0
    tensorboard: bool = False
    logged: bool = True


@dataclass(frozen=True)
class RunSpec:
    """One run of ``mmoe fit`` / ``mmoe predict`` over the config files ``configs`` (merged in order).

    Attributes:
        subcommand: ``fit`` or ``predict``.
        configs: the config files.
        run_folder: where the run writes (checkpoints, logs, routing statistics).
        model: the task's values over the config's.
        data: the DataModule's values over the config's.
        trainer: the trainer.
        optimizer: :class:`mmoe.runtime.optimizer.OptimizerConfig` fields over the config's.
        seed: ``seed_everything``; None: the config's.
        checkpoint: the checkpoint a fit resumes from or a predict loads (``ckpt_path``).
        callbacks: added after the run's own (the latest checkpoint, the learning rate, routing statistics).
        options: options in a config file's form laid over the spec's last (:func:`mmoe.config.extends.merged`),
            for what the spec has no field for (``{"trainer": {"profiler": "simple"}}``).
    """

    subcommand: Literal["fit", "predict"]
    configs: tuple[Path, ...]
    run_folder: RunLayout
    model: ModelSpec
    data: DataSpec
    trainer: TrainerSpec
    optimizer: Mapping[str, Any] = field(default_factory=dict)
    seed: int | None = None
    checkpoint: Path | None = None
    callbacks: tuple[L.Callback, ...] = ()
    options: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        check_optimizer_fields(self.optimizer, "RunSpec.optimizer")

    def to_json(self) -> dict[str, Any]:
        """The spec as JSON values (what a pipeline's stage marker records), callbacks by class name."""
        fields = {spec.name: getattr(self, spec.name) for spec in dataclasses.fields(self)}
        fields["callbacks"] = [type(callback).__name__ for callback in self.callbacks]
        return plain(fields)


def plain(value: Any) -> Any:
    """``value`` as JSON values: dataclasses and mappings as dicts, tuples as lists, paths as strings."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {spec.name: plain(getattr(value, spec.name)) for spec in dataclasses.fields(value)}
    if isinstance(value, Mapping):
        return {str(key): plain(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [plain(item) for item in value]
    return str(value) if isinstance(value, Path) else value


def cli_overrides(spec: RunSpec, config: Namespace) -> dict[str, Any]:
    """The options ``spec`` lays over the parsed config files ``config`` (one subcommand's), in LightningCLI's config
    form; the MoE plan's fields go over the configured plan (a mapping in its place replaces a plan whole)."""
    overrides: dict[str, Any] = {
        "trainer": trainer_options(spec.trainer, spec.run_folder),
        "throughput": {"label": spec.trainer.progress_label, "every_n_steps": max(10, spec.trainer.max_steps // 6)},
        "model": {"init_args": model_arguments(spec, config)},
        "data": {"init_args": data_arguments(spec.data)},
    }
    if spec.seed is not None:
        overrides["seed_everything"] = spec.seed
    if spec.checkpoint is not None:
        overrides["ckpt_path"] = str(spec.checkpoint)
    return merged(overrides, dict(spec.options)) if spec.options else overrides


def trainer_options(trainer: TrainerSpec, layout: RunLayout) -> dict[str, Any]:
    """The ``trainer`` section of a spec: its callbacks are objects (:func:`spec_callbacks`), not the config's."""
    loggers: list[dict[str, Any]] | bool = False
    if trainer.logged:
        logs = [(CSV_LOGGER, layout.csv_logs)]
        if trainer.tensorboard:
            logs.append((TENSORBOARD_LOGGER, layout.tensorboard_logs))
        loggers = [
            {
                "class_path": logger,
                "init_args": {"save_dir": str(layout.root), "name": folder.name, "version": LOG_VERSION},
            }
            for logger, folder in logs
        ]
    return {
        "max_steps": trainer.max_steps,
        "val_check_interval": trainer.max_steps,
        "limit_val_batches": trainer.validation_batches,
        "default_root_dir": str(layout.root),
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "precision": trainer.precision,
        "callbacks": [],
        "logger": loggers,
    }


def model_arguments(spec: RunSpec, config: Namespace) -> dict[str, Any]:
    """The task's ``init_args`` a spec sets."""
    model = spec.model
    arguments = {key: str(value) if isinstance(value, Path) else value for key, value in model.arguments.items()}
    if model.backbone is None:
        arguments["backbone"] = None
    elif model.backbone or model.moe:
        arguments["backbone"] = dict(model.backbone)
        if model.moe:
            configured = config.model.init_args.backbone.moe
            arguments["backbone"]["moe"] = (configured.as_dict() if configured else {}) | dict(model.moe)
    if model.pretrained is not None:
        arguments["pretrained"] = str(model.pretrained)
    if spec.optimizer:
        arguments["optimizer"] = dict(spec.optimizer)
    return arguments


def data_arguments(data: DataSpec) -> dict[str, Any]:
    """The DataModule's ``init_args`` a spec sets."""
    arguments: dict[str, Any] = {"data_root": str(data.root), "batch_size": data.batch_size}
    if data.batches_per_epoch is not None:
        arguments["batches_per_epoch"] = data.batches_per_epoch
    if data.test_shards is not None:
        arguments["test_shards"] = str(data.test_shards)
    return arguments


def spec_callbacks(spec: RunSpec) -> tuple[L.Callback, ...]:
    """The run's callbacks: the latest checkpoint only (no validation metric to rank by) as
    ``run_folder.last_checkpoint``, the learning rate per step, routing statistics in the run folder, then
    ``spec.callbacks``."""
    layout, trainer = spec.run_folder, spec.trainer
    return (
        ModelCheckpoint(
            dirpath=layout.checkpoints, save_top_k=0, save_last=True, every_n_train_steps=trainer.checkpoint_every
        ),
        LearningRateMonitor(logging_interval="step"),
        RoutingStatsCallback(every_n_steps=trainer.routing_every, save_dir=layout.root),
        *spec.callbacks,
    )


def run_spec(spec: RunSpec) -> MMoECLI:
    """Runs ``spec`` in this process (:func:`mmoe.config.launch.run_lightning`); a bad config or input ends with
    ``SystemExit`` as ``mmoe fit`` does."""
    return run_lightning(spec.subcommand, spec.configs, functools.partial(cli_overrides, spec), spec_callbacks(spec))


def read_spec(spec: RunSpec) -> Namespace:
    """The config ``spec`` runs (its subcommand's), parsed and not run."""
    return read_config(spec.configs, functools.partial(cli_overrides, spec), spec.subcommand)[spec.subcommand]
