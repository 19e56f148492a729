"""``mmoe predict --ckpt_path``: the checkpoint's saved hyper-parameters apply over the config file (LightningCLI), and
a model argument named on the command line wins over both."""

from __future__ import annotations

import pytest
import torch
import yaml

from mmoe.config.cli import command_line_model_arguments, named_in, without_keys
from mmoe.model.config import PRESETS
from tests.cli_fixtures import instantiate


@pytest.fixture
def config_and_checkpoint(tmp_path):
    backbone = dict(PRESETS["test"])
    config = {
        "trainer": {"accelerator": "cpu", "logger": False, "default_root_dir": str(tmp_path)},
        "model": {"class_path": "mmoe.tasks.nlvr2.NLVR2FineTuning",
                  "init_args": {"backbone": backbone, "optimizer": {"learning_rate": 2.0e-4, "weight_decay": 0.05}}},
        "data": {"class_path": "mmoe.data.datamodules.NLVR2DataModule", "init_args": {"image_size": 32}},
    }  # fmt: skip
    path = tmp_path / "nlvr2.yaml"
    path.write_text(yaml.safe_dump(config))
    checkpoint = tmp_path / "trained.ckpt"
    saved = {
        "_class_path": "mmoe.tasks.nlvr2.NLVR2FineTuning",
        "optimizer": {"learning_rate": 1.0e-3, "weight_decay": 0.2},
    }
    torch.save({"hyper_parameters": saved}, checkpoint)
    return str(path), str(checkpoint)


def rate_and_decay(cli) -> tuple[float, float]:
    return cli.model.optimizer_config.learning_rate, cli.model.optimizer_config.weight_decay


def test_command_line_model_arguments_win_over_the_checkpoint(config_and_checkpoint):
    config, checkpoint = config_and_checkpoint
    predict = ["predict", "--config", config, "--ckpt_path", checkpoint]
    assert rate_and_decay(instantiate(predict)) == (1.0e-3, 0.2)  # the checkpoint's
    # One value of a config argument named on the command line: the rest of the checkpoint's optimiser stays.
    assert rate_and_decay(instantiate([*predict, "--model.init_args.optimizer.learning_rate=5e-4"])) == (5.0e-4, 0.2)
    assert rate_and_decay(instantiate([*predict, "--model.optimizer.weight_decay", "0.01"])) == (1.0e-3, 0.01)


def test_a_checkpoint_from_before_the_optimizer_config_is_read_with_its_values_moved_into_it(
    config_and_checkpoint, tmp_path, capsys
):
    config, _ = config_and_checkpoint
    flat = tmp_path / "flat.ckpt"
    saved = {"_class_path": "mmoe.tasks.nlvr2.NLVR2FineTuning", "learning_rate": 1.0e-3, "betas": [0.9, 0.98]}
    torch.save({"hyper_parameters": saved}, flat)
    cli = instantiate(["predict", "--config", config, "--ckpt_path", str(flat)])
    assert rate_and_decay(cli) == (1.0e-3, 0.05) and cli.model.optimizer_config.betas == (0.9, 0.98)
    assert "optimizer.learning_rate: checkpoint 0.001 used over config 0.0002" in capsys.readouterr().err


def test_command_line_model_arguments_are_read_from_option_names():
    options = "--model.init_args.num_beams 5 --model.length_penalty=1.0 --model.init_args.backbone.dim 64"
    argv = ["predict", *options.split(), "--data.init_args.batch_size", "8", "--ckpt_path", "c.ckpt"]
    assert command_line_model_arguments(argv) == {"num_beams", "length_penalty", "backbone.dim"}
    assert command_line_model_arguments({"model": {"num_beams": 5}}) == set()


def test_only_the_named_keys_leave_the_checkpoint_values():
    saved = {"optimizer": {"learning_rate": 1.0, "betas": [0.9, 0.9]}, "num_beams": 3, "backbone": None}
    assert without_keys(saved, {"optimizer.learning_rate", "num_beams"}) == {
        "optimizer": {"betas": [0.9, 0.9]},
        "backbone": None,
    }
    assert saved["optimizer"]["learning_rate"] == 1.0  # not changed in place
    assert named_in("optimizer.betas", {"optimizer"}) and not named_in("optimizers", {"optimizer"})


def test_checkpoint_hyper_parameters_that_do_not_parse_name_the_checkpoint(config_and_checkpoint, tmp_path, capsys):
    config, _ = config_and_checkpoint
    broken = tmp_path / "broken.ckpt"
    saved = {"_class_path": "mmoe.tasks.nlvr2.NLVR2FineTuning", "optimizer": {"learning_rate": "fast"}}
    torch.save({"hyper_parameters": saved}, broken)
    with pytest.raises(SystemExit):
        instantiate(["predict", "--config", config, "--ckpt_path", str(broken)])
    assert f"the hyper-parameters saved in {broken} do not parse" in capsys.readouterr().err
    named = ["--model.init_args.optimizer.learning_rate", "1e-4"]
    instantiate(["predict", "--config", config, "--ckpt_path", str(broken), *named])
