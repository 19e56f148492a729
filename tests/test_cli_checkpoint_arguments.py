"""``mmoe predict --ckpt_path``: the checkpoint's saved hyper-parameters apply over the config file (LightningCLI), and
a model argument named on the command line wins over both."""

from __future__ import annotations

import pytest
import torch
import yaml

from mmoe.tasks.cli import command_line_model_arguments
from tests.cli_fixtures import instantiate


@pytest.fixture
def config_and_checkpoint(tmp_path):
    backbone = {"dim": 32, "depth": 2, "num_heads": 4, "ffn_dim": 64, "image_size": 32, "patch_size": 16}
    config = {
        "trainer": {"accelerator": "cpu", "logger": False, "default_root_dir": str(tmp_path)},
        "model": {"class_path": "mmoe.tasks.nlvr2.NLVR2FineTuning",
                  "init_args": {"backbone": backbone, "learning_rate": 2.0e-4, "weight_decay": 0.05}},
        "data": {"class_path": "mmoe.data.datamodules.NLVR2DataModule", "init_args": {"image_size": 32}},
    }  # fmt: skip
    path = tmp_path / "nlvr2.yaml"
    path.write_text(yaml.safe_dump(config))
    checkpoint = tmp_path / "trained.ckpt"
    saved = {"_class_path": "mmoe.tasks.nlvr2.NLVR2FineTuning", "learning_rate": 1.0e-3, "weight_decay": 0.2}
    torch.save({"hyper_parameters": saved}, checkpoint)
    return str(path), str(checkpoint)


def test_command_line_model_arguments_win_over_the_checkpoint(config_and_checkpoint):
    config, checkpoint = config_and_checkpoint
    plain = instantiate(["predict", "--config", config, "--ckpt_path", checkpoint])
    assert (plain.model.hparams.learning_rate, plain.model.hparams.weight_decay) == (1.0e-3, 0.2)  # the checkpoint's
    predict = ["predict", "--config", config, "--ckpt_path", checkpoint]
    named = instantiate([*predict, "--model.init_args.learning_rate=5e-4"])
    assert (named.model.hparams.learning_rate, named.model.hparams.weight_decay) == (5.0e-4, 0.2)
    short = instantiate(["predict", "--config", config, "--ckpt_path", checkpoint, "--model.weight_decay", "0.01"])
    assert (short.model.hparams.learning_rate, short.model.hparams.weight_decay) == (1.0e-3, 0.01)


def test_command_line_model_arguments_are_read_from_option_names():
    options = "--model.init_args.num_beams 5 --model.length_penalty=1.0 --model.init_args.backbone.dim 64"
    argv = ["predict", *options.split(), "--data.init_args.batch_size", "8", "--ckpt_path", "c.ckpt"]
    assert command_line_model_arguments(argv) == {"num_beams", "length_penalty", "backbone"}
    assert command_line_model_arguments({"model": {"num_beams": 5}}) == set()


def test_checkpoint_hyper_parameters_that_do_not_parse_name_the_checkpoint(config_and_checkpoint, tmp_path, capsys):
    config, _ = config_and_checkpoint
    broken = tmp_path / "broken.ckpt"
    torch.save(
        {"hyper_parameters": {"_class_path": "mmoe.tasks.nlvr2.NLVR2FineTuning", "learning_rate": "fast"}}, broken
    )
    with pytest.raises(SystemExit):
        instantiate(["predict", "--config", config, "--ckpt_path", str(broken)])
    assert f"the hyper-parameters saved in {broken} do not parse" in capsys.readouterr().err
    instantiate(["predict", "--config", config, "--ckpt_path", str(broken), "--model.init_args.learning_rate", "1e-4"])
