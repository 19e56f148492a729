"""``mmoe infer --routing``'s figure says what it draws: its title and colour bar name the same quantity, and experts
are numbered from 0 on the colour bar as in the printed token experts (and in ``mmoe viz heatmap``). The figure the
command writes is read back as matplotlib drew it."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

import mmoe.viz.maps
from mmoe.model import MoEPlan, MultiwayConfig
from tests.cli.test_infer import infer

EXPERTS = 4


@pytest.fixture
def drawn(monkeypatch):
    """The figures ``mmoe.viz.maps`` saves in this test, each still written to its file."""
    figures = []
    save = mmoe.viz.maps.save_figure

    def keep(figure, path):
        figures.append(figure)
        return save(figure, path)

    monkeypatch.setattr(mmoe.viz.maps, "save_figure", keep)
    return figures


def routing_run(tmp_path, heads: int, capsys) -> dict:
    """``mmoe infer nlvr2 ... --routing map.png --json`` on a fresh NLVR2 model of ``heads`` heads."""
    from mmoe.tasks.nlvr2 import NLVR2FineTuning

    config = MultiwayConfig.preset("test", moe=MoEPlan(num_experts=EXPERTS, every=1, heads=heads))
    task = NLVR2FineTuning(backbone=config)
    hyper = {**task.hparams, "_class_path": "mmoe.tasks.nlvr2.NLVR2FineTuning"}
    torch.save({"hyper_parameters": hyper, "state_dict": task.state_dict()}, tmp_path / "nlvr2.ckpt")
    rng = np.random.default_rng(0)
    for side in ("left", "right"):
        Image.fromarray(rng.integers(0, 256, (40, 50, 3), dtype=np.uint8)).save(tmp_path / f"{side}.png")
    pair = ["--left", str(tmp_path / "left.png"), "--right", str(tmp_path / "right.png")]
    argv = ["nlvr2", "--ckpt", str(tmp_path / "nlvr2.ckpt"), *pair, "--sentence", "two circles"]
    argv += ["--routing", str(tmp_path / "map.png")]
    code, result, err = infer(argv, capsys)
    assert code == 0, err
    assert (tmp_path / "map.png").stat().st_size > 0
    return result


def title_and_bar(figure) -> tuple[str, str, list[str]]:
    """The figure's title, its colour bar's label and tick labels."""
    bar = figure.axes[-1]
    return figure._suptitle.get_text(), bar.get_ylabel(), [tick.get_text() for tick in bar.get_yticklabels()]


def test_a_one_head_map_is_titled_and_numbered_as_the_top_1_expert_from_0(tmp_path, capsys, drawn):
    result = routing_run(tmp_path, heads=1, capsys=capsys)
    (figure,) = drawn
    title, label, ticks = title_and_bar(figure)
    assert "top-1 expert" in title and "top-1 expert" in label
    assert "distinct" not in title and "distinct" not in label
    assert ticks == [str(e) for e in range(EXPERTS)]  # the experts' numbers, 0-based
    printed = {e for token in result["text_tokens"] for heads in token["experts"].values() for k in heads for e in k}
    assert printed and printed <= set(range(EXPERTS))  # the token list's numbers are the colour bar's


def test_a_sub_token_map_is_titled_and_scaled_as_distinct_experts(tmp_path, capsys, drawn):
    routing_run(tmp_path, heads=2, capsys=capsys)
    (figure,) = drawn
    title, label, ticks = title_and_bar(figure)
    assert "distinct experts" in title and "distinct experts" in label and "sub-token" in title
    assert ticks == ["1", "2"]  # a count of distinct experts among 2 sub-tokens
