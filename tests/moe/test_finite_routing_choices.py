"""Routing choices where infinity or NaN means nothing are refused in one line (a bias update rate, an expert width, an
expert-choice capacity), from Python and from a YAML file given to ``mmoe fit``; token choice's infinite capacity
factor stays allowed and is dropless, as None is."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from mmoe.moe import MoEConfig
from tests.cli_fixtures import run_mmoe
from tests.moe.test_layer import make_layer, padded_input

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

CONFIGS = Path(__file__).resolve().parents[2] / "configs" / "pretrain"


@pytest.mark.parametrize(
    "fields,named",
    [
        (dict(bias_update_rate=math.inf), "MoEConfig.bias_update_rate must be a finite number >= 0, got inf"),
        (dict(bias_update_rate=math.nan), "MoEConfig.bias_update_rate must be a finite number >= 0, got nan"),
        (dict(beta=math.inf), "MoEConfig.beta must be a finite positive number, got inf"),
        (dict(beta=math.nan), "MoEConfig.beta must be a finite positive number, got nan"),
        (dict(capacity_factor=math.nan), "MoEConfig.capacity_factor must be positive or None, got nan"),
        (
            dict(routing="expert_choice", capacity_factor=math.inf),
            "MoEConfig.capacity_factor=inf with routing='expert_choice': each expert takes ceil(c * n / num_experts)",
        ),
        (
            dict(routing="expert_choice", capacity_factor=2.0, eval_capacity_factor=math.inf),
            "MoEConfig.eval_capacity_factor=inf with routing='expert_choice': ",
        ),
    ],
)
def test_non_finite_values_are_refused_in_one_line(fields, named):
    with pytest.raises(ValueError) as error:
        MoEConfig(dim=16, ffn_dim=32, num_experts=4, **fields)
    assert str(error.value).startswith(named) and "\n" not in str(error.value)


def test_an_infinite_token_choice_capacity_is_dropless():
    x, padding = padded_input()
    unlimited = make_layer(top_k=2, capacity_factor=math.inf, eval_capacity_factor=math.inf)
    dropless = make_layer(top_k=2)
    for training in (True, False):
        unlimited.train(training), dropless.train(training)
        y, routing = unlimited(x, padding)
        expected, expected_routing = dropless(x, padding)
        torch.testing.assert_close(y, expected)
        assert routing.dropped_fraction.item() == 0.0
        assert torch.equal(routing.expert_counts, expected_routing.expert_counts)


@pytest.mark.parametrize(
    "variant,moe,message",
    [
        ("loss_free", "bias_update_rate: .inf", "MoEPlan.bias_update_rate must be a finite number >= 0, got inf"),
        ("expert_choice", "capacity_factor: .inf", "MoEPlan.capacity_factor=inf with routing='expert_choice': "),
        ("xmoe", "beta: .inf", "MoEPlan.beta must be a finite positive number, got inf"),
    ],
)
def test_mmoe_fit_refuses_an_infinite_value_in_a_config_file(variant, moe, message, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    edited = tmp_path / "edited.yaml"
    edited.write_text(f"model:\n  init_args:\n    backbone:\n      moe:\n        {moe}\n")
    argv = ["fit", "--config", str(CONFIGS / "tiny.yaml"), "--config", str(CONFIGS / "tiny" / f"{variant}.yaml")]
    code, _, err = run_mmoe([*argv, "--config", str(edited)], capsys)
    assert code == 2, err
    assert "Traceback" not in err
    assert err.strip().splitlines()[-1].startswith(f"mmoe fit: error: {message}")
    assert list(tmp_path.iterdir()) == [edited]  # nothing trained, nothing written
