"""A :class:`mmoe.config.run_spec.RunSpec` means what the same values given to ``mmoe fit`` mean: each field reaches
the config the CLI parses (the MoE plan's changes keep the configured router), variants made by
``dataclasses.replace`` leave the original alone, and the model values a spec sets count as named on the command line
(a resumed checkpoint does not take them back)."""

from __future__ import annotations

import dataclasses
import functools
import json
from pathlib import Path

import pytest
from lightning.pytorch.callbacks import ModelCheckpoint

from mmoe.config.launch import read_config
from mmoe.config.overrides import model_argument_names
from mmoe.config.run_spec import (
    DataSpec,
    ModelSpec,
    RunSpec,
    TrainerSpec,
    cli_overrides,
    read_spec,
    spec_callbacks,
)
from mmoe.runtime.layout import RunLayout
from mmoe.runtime.routing_callback import RoutingStatsCallback

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
SWITCH = (CONFIGS / "pretrain" / "tiny.yaml", CONFIGS / "pretrain" / "tiny" / "switch.yaml")


def switch_spec(tmp_path: Path) -> RunSpec:
    return RunSpec(
        "fit",
        SWITCH,
        RunLayout(tmp_path / "switch"),
        ModelSpec({"visual_codebook": tmp_path / "codebook.pt"}, {"image_size": 32}, {"num_experts": 6}),
        DataSpec(tmp_path / "data", batch_size=8, batches_per_epoch=12),
        TrainerSpec(12, checkpoint_every=4, routing_every=3, progress_label="switch e6", tensorboard=True),
        optimizer={"learning_rate": 2.5e-4, "min_lr_ratio": 1.0},
        seed=7,
    )


def test_every_field_reaches_the_parsed_config(tmp_path):
    spec = switch_spec(tmp_path)
    config = read_spec(spec)
    model = config.model.init_args
    assert (model.backbone.image_size, model.visual_codebook) == (32, str(tmp_path / "codebook.pt"))
    moe = model.backbone.moe
    # Only the named field of the configured plan changes: Switch keeps its linear router and top-1.
    assert (moe.num_experts, moe.router, moe.top_k) == (6, "linear", 1)
    assert (model.optimizer.learning_rate, model.optimizer.min_lr_ratio) == (2.5e-4, 1.0)
    assert model.optimizer.warmup_steps == 30  # the config's, kept
    assert config.seed_everything == 7 and config.ckpt_path is None
    data = config.data.init_args
    assert (data.data_root, data.batch_size, data.batches_per_epoch) == (str(tmp_path / "data"), 8, 12)
    trainer = config.trainer
    assert (trainer.max_steps, trainer.val_check_interval, trainer.limit_val_batches) == (12, 12, 0)
    assert trainer.default_root_dir == str(tmp_path / "switch") and trainer.callbacks == []
    names = [(logger.class_path.rsplit(".", 1)[1], logger.init_args.name) for logger in trainer.logger]
    assert names == [("ContinuingCSVLogger", "csv"), ("TensorBoardLogger", "tensorboard")]
    assert (config.throughput.label, config.throughput.every_n_steps) == ("switch e6", 10)
    callbacks = {type(callback): callback for callback in spec_callbacks(spec)}
    assert Path(callbacks[ModelCheckpoint].dirpath) == tmp_path / "switch" / "checkpoints"
    assert callbacks[ModelCheckpoint]._every_n_train_steps == 4
    assert callbacks[RoutingStatsCallback].every_n_steps == 3


def test_a_variant_is_a_replace_and_the_original_is_unchanged(tmp_path):
    spec = switch_spec(tmp_path)
    before = spec.to_json()
    predict = dataclasses.replace(
        spec,
        subcommand="predict",
        trainer=dataclasses.replace(spec.trainer, logged=False),
        checkpoint=spec.run_folder.last_checkpoint,
        options={"trainer": {"profiler": "simple"}, "model": {"init_args": {"balance_coefficient": 0.5}}},
    )
    config = read_spec(predict)
    assert config.trainer.logger is False and config.ckpt_path == str(tmp_path / "switch" / "checkpoints" / "last.ckpt")
    # The options go over the spec's own values, field by field.
    assert config.trainer.profiler == "simple" and config.trainer.max_steps == 12
    assert config.model.init_args.balance_coefficient == 0.5 and config.model.init_args.backbone.moe.num_experts == 6
    assert spec.to_json() == before and json.loads(json.dumps(before)) == before  # JSON values, for a stage marker


def test_the_model_values_a_spec_sets_count_as_named_on_the_command_line(tmp_path):
    spec = switch_spec(tmp_path)
    parsed = read_config(spec.configs)["fit"]
    named = model_argument_names(cli_overrides(spec, parsed))
    assert {"optimizer.learning_rate", "optimizer.min_lr_ratio", "backbone.moe.num_experts"} <= named
    assert "balance_coefficient" not in named  # the config's value, not the spec's
    assert read_config(spec.configs, functools.partial(cli_overrides, spec)).fit.model.init_args.backbone.moe.top_k == 1


def test_no_backbone_argument_leaves_the_pretrained_file_s_architecture(tmp_path):
    finetune = CONFIGS / "finetune" / "vqav2_tiny.yaml"
    spec = RunSpec(
        "fit",
        (finetune,),
        RunLayout(tmp_path / "vqa"),
        ModelSpec(backbone=None, pretrained=tmp_path / "backbone.pt"),
        DataSpec(tmp_path / "data", batch_size=4, test_shards=tmp_path / "test"),
        TrainerSpec(5, checkpoint_every=5, routing_every=5, progress_label="vqa"),
    )
    config = read_spec(spec)
    model = config.model.init_args
    assert model.backbone is None and model.pretrained == str(tmp_path / "backbone.pt")
    assert config.data.init_args.test_shards == str(tmp_path / "test")


def test_an_optimizer_field_the_config_does_not_have_is_refused(tmp_path):
    with pytest.raises(ValueError, match="'lr' is not an OptimizerConfig field"):
        dataclasses.replace(switch_spec(tmp_path), optimizer={"lr": 1e-3})
