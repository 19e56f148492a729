"""A loss weight, a backbone rate or a trainer number given as NaN or an infinity (``'1e999'``, ``.nan``, ``-inf``,
in a config file or on the command line) is refused when `mmoe fit` starts, in one line naming the field; it is not
left to end the first steps as a non-finite loss that names nothing."""

from __future__ import annotations

import pytest

from mmoe.model import MultiwayConfig
from mmoe.tasks.captioning import CaptioningFineTuning
from tests.cli.test_run_folder import error_line, tiny_config_file
from tests.cli_fixtures import run_mmoe


@pytest.mark.parametrize(
    ("option", "value", "expected"),
    [
        (
            "model.init_args.balance_coefficient",
            "1e999",
            "model.balance_coefficient must be a finite number >= 0, got inf",
        ),
        (
            "model.init_args.balance_coefficient",
            ".nan",
            "model.balance_coefficient must be a finite number >= 0, got nan",
        ),
        ("model.init_args.balance_coefficient", "-.inf", "model.balance_coefficient must be a finite number >= 0"),
        (
            "model.init_args.z_loss_coefficient",
            ".nan",
            "model.z_loss_coefficient must be a finite number >= 0, got nan",
        ),
        ("model.init_args.contrastive_coefficient", ".nan", "model.contrastive_coefficient must be a finite number"),
        ("model.init_args.backbone.drop_path", ".nan", "MultiwayConfig.drop_path must lie in [0, 1), got nan"),
        ("model.init_args.backbone.layernorm_eps", "1e999", "MultiwayConfig.layernorm_eps must be a finite number"),
        ("trainer.gradient_clip_val", ".nan", "trainer.gradient_clip_val=nan is not a finite number >= 0, or null"),
        ("trainer.gradient_clip_val", "-.inf", "trainer.gradient_clip_val=-inf is not a finite number >= 0, or null"),
        ("trainer.gradient_clip_val", "-1.0", "trainer.gradient_clip_val=-1.0 is not a finite number >= 0, or null"),
        ("trainer.limit_train_batches", ".nan", "trainer.limit_train_batches=nan is not a fraction in [0, 1]"),
        ("trainer.val_check_interval", "1e999", "trainer.val_check_interval=inf is not a fraction of an epoch"),
    ],
)
@pytest.mark.parametrize("given_in", ["file", "command line"])
def test_a_non_finite_number_is_refused_at_start_naming_its_field(
    option, value, expected, given_in, synthetic_corpus, tmp_path, capsys
):
    root = tmp_path / "run"
    config = tiny_config_file(synthetic_corpus, tmp_path, root)
    if given_in == "file":  # a quoted string, as the YAML part a user writes
        *path, leaf = option.split(".")
        lines = [f"{'  ' * depth}{key}:" for depth, key in enumerate(path)] + [f"{'  ' * len(path)}{leaf}: '{value}'"]
        (tmp_path / "part.yaml").write_text("\n".join(lines) + "\n")
        extra = ["--config", str(tmp_path / "part.yaml")]
    else:
        extra = [f"--{option}={value}"]
    code, _, stderr = run_mmoe(["fit", "--config", str(config), *extra], capsys)
    assert code == 2, stderr[-3000:]
    assert expected in error_line(stderr) and len(stderr.strip().splitlines()) == 1, stderr[-3000:]
    assert not (root / "checkpoints").exists()


@pytest.mark.parametrize(
    ("argument", "value", "expected"),
    [
        ("label_smoothing", float("nan"), "model.label_smoothing must lie in [0, 1), got nan"),
        ("label_smoothing", 1.0, "model.label_smoothing must lie in [0, 1), got 1.0"),
        ("length_penalty", float("inf"), "model.length_penalty must be a finite number, got inf"),
        ("length_penalty", float("-inf"), "model.length_penalty must be a finite number, got -inf"),
    ],
)
def test_captioning_refuses_a_non_finite_smoothing_or_length_penalty(argument, value, expected):
    with pytest.raises(ValueError) as raised:
        CaptioningFineTuning(backbone=MultiwayConfig.preset("test"), **{argument: value})
    assert str(raised.value) == expected
