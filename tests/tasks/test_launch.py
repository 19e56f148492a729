"""Runs started from Python (:mod:`mmoe.config.launch`): configs read by the CLI's own parser, options as a nested
dict, callbacks as objects; and the run folder's files (:class:`mmoe.runtime.layout.RunLayout`)."""

from __future__ import annotations

import copy
import json
import sys
import sysconfig
import warnings
from pathlib import Path

import lightning as L
import pytest
import yaml

from mmoe.config.launch import read_config, run_lightning
from mmoe.model.config import PRESETS
from mmoe.runtime.layout import RunLayout
from tests.cli_fixtures import small_shards


class StepCounter(L.Callback):
    def __init__(self) -> None:
        self.steps = 0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.steps += 1


def nlvr2_config(shards, root) -> dict:
    backbone = PRESETS["test"] | {"moe": {"num_experts": 4, "every": 2}}
    return {
        "trainer": {"max_steps": 3, "accelerator": "cpu", "logger": False, "enable_progress_bar": False,
                    "limit_val_batches": 0, "default_root_dir": str(root)},
        "model": {"class_path": "mmoe.tasks.nlvr2.NLVR2FineTuning",
                  "init_args": {"backbone": backbone, "optimizer": {"warmup_steps": 1}}},
        "data": {"class_path": "mmoe.data.datamodules.NLVR2DataModule",
                 "init_args": {"data_root": str(shards), "train_shards": "nlvr2-train", "val_shards": "nlvr2-dev",
                               "batch_size": 4, "max_text_length": 32, "num_workers": 0}},
    }  # fmt: skip


def test_configs_merge_in_order_and_options_go_over_them_without_being_changed(tmp_path):
    first, second = tmp_path / "first.yaml", tmp_path / "second.yaml"
    first.write_text(yaml.safe_dump(nlvr2_config(tmp_path / "shards", tmp_path / "run")))
    second.write_text(yaml.safe_dump({"trainer": {"max_steps": 7}, "model": {"init_args": {"head_init_scale": 0.5}}}))
    options = {"trainer": {"max_steps": 9}, "model": {"init_args": {"optimizer": {"learning_rate": 0.25}}}}
    before = copy.deepcopy(options)
    config = read_config([first, second]).fit
    assert config.trainer.max_steps == 7 and config.model.init_args.head_init_scale == 0.5
    config = read_config([first, second], options).fit
    assert config.trainer.max_steps == 9 and config.model.init_args.head_init_scale == 0.5
    assert config.model.init_args.optimizer.learning_rate == 0.25 and config.model.init_args.optimizer.warmup_steps == 1
    assert options == before and json.dumps(options)  # the caller's dict is left as it was


def test_a_config_the_cli_would_refuse_is_a_one_line_value_error(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({"trainer": {"max_stepz": 3}}))
    with pytest.raises(ValueError, match=r"bad.yaml: .*max_stepz") as refused:
        read_config([bad])
    assert "\n" not in str(refused.value)
    good = tmp_path / "good.yaml"
    good.write_text(yaml.safe_dump(nlvr2_config(tmp_path / "shards", tmp_path / "run")))
    with pytest.raises(ValueError, match="good.yaml with"):
        read_config([good], {"model": {"init_args": {"no_such_argument": 1}}})


def test_run_lightning_trains_with_the_options_and_the_callback_objects(tmp_path):
    shards = small_shards(tmp_path)
    layout = RunLayout(tmp_path / "run")
    path = tmp_path / "nlvr2.yaml"
    path.write_text(yaml.safe_dump(nlvr2_config(shards, layout.root)))
    counter = StepCounter()
    options = {"trainer": {"max_steps": 2, "callbacks": [{"class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
                                                          "init_args": {"dirpath": str(layout.checkpoints),
                                                                        "save_last": True}}]}}  # fmt: skip
    cli = run_lightning("fit", [path], options, callbacks=[counter])
    assert counter.steps == 2 and cli.trainer.global_step == 2
    assert counter in cli.trainer.callbacks  # added to the config's callbacks, which stay
    assert layout.last_checkpoint.is_file()
    # The shard arguments were read under data_root.
    assert cli.datamodule.shards["train"] == str(shards / "nlvr2-train")


def python_default_warning_filters() -> None:
    """The warning filters of a plain ``python`` process (``sys.warnoptions`` empty): what a run prints."""
    warnings.resetwarnings()
    warnings.simplefilter("default")
    for hidden in (DeprecationWarning, PendingDeprecationWarning, ImportWarning, ResourceWarning):
        warnings.simplefilter("ignore", hidden)


def test_a_run_prints_no_library_warning(tmp_path):
    config = nlvr2_config(small_shards(tmp_path), tmp_path / "run") | {"seed_everything": 0}
    path = tmp_path / "nlvr2.yaml"
    path.write_text(yaml.safe_dump(config))
    with warnings.catch_warnings(record=True) as shown:
        python_default_warning_filters()
        run_lightning("fit", [path], {"trainer": {"max_steps": 1}})
    libraries = Path(sysconfig.get_paths()["purelib"])
    printed = [f"{w.filename}:{w.lineno}: {w.message}" for w in shown if Path(w.filename).is_relative_to(libraries)]
    assert printed == []


def test_a_config_read_inside_another_command_gives_no_warning(tmp_path, monkeypatch):
    """``mmoe demo`` and the pipeline give the CLI its arguments from Python while the process has a command line of
    its own, which LightningCLI warns about as a likely mistake; mmoe's CLI parses them without that warning."""
    path = tmp_path / "nlvr2.yaml"
    path.write_text(yaml.safe_dump(nlvr2_config(tmp_path / "shards", tmp_path / "run")))
    monkeypatch.setattr(sys, "argv", ["mmoe", "demo", "--fast"])
    with warnings.catch_warnings(record=True) as shown:
        python_default_warning_filters()
        assert read_config([path], {"trainer": {"max_steps": 5}}).fit.trainer.max_steps == 5
    assert [str(warning.message) for warning in shown] == []


def test_the_run_folder_is_stated_once_and_the_loggers_and_callbacks_write_there(tmp_path):
    shards = small_shards(tmp_path)
    layout = RunLayout(tmp_path / "run")
    config = nlvr2_config(shards, layout.root)
    del config["trainer"]["logger"]
    config["trainer"]["callbacks"] = [
        {"class_path": "lightning.pytorch.callbacks.ModelCheckpoint", "init_args": {"save_last": True}},
        {"class_path": "mmoe.runtime.routing_callback.RoutingStatsCallback", "init_args": {"every_n_steps": 1}},
    ]
    path = tmp_path / "nlvr2.yaml"
    path.write_text(yaml.safe_dump(config))
    cli = run_lightning("fit", [path], {"trainer": {"max_steps": 2}})
    assert [type(logger).__name__ for logger in cli.trainer.loggers] == ["TensorBoardLogger", "ContinuingCSVLogger"]
    assert layout.last_checkpoint.is_file() and layout.routing_stats.is_file()
    assert (layout.csv_logs / "version_0").is_dir() and (layout.tensorboard_logs / "version_0").is_dir()


def test_folders_a_config_gives_are_kept():
    from jsonargparse import Namespace

    from mmoe.config.cli import fill_run_folder

    checkpoint = Namespace(class_path="lightning.pytorch.callbacks.ModelCheckpoint", init_args=Namespace(dirpath="ck"))
    routing = Namespace(
        class_path="mmoe.runtime.routing_callback.RoutingStatsCallback", init_args=Namespace(save_dir="stats")
    )
    trainer = Namespace(default_root_dir="run", logger=False, callbacks=[checkpoint, routing])
    fill_run_folder(trainer)
    assert trainer.logger is False and checkpoint.init_args.dirpath == "ck" and routing.init_args.save_dir == "stats"
    untouched = Namespace(default_root_dir=None, logger=None, callbacks=[])
    fill_run_folder(untouched)
    assert untouched.logger is None
