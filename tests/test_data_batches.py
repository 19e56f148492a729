"""The batch kinds and the joint / mixed decision of :mod:`mmoe.data.batches`, the prediction writers of the
fine-tuning base, and the head builders of :mod:`mmoe.model.heads`."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn

from mmoe.data.batches import BATCH_KINDS, is_joint, step_batches
from mmoe.data.collate import PretrainCollator
from mmoe.model.heads import init_head, nlvr2_head, vqa_pooler_and_head
from mmoe.model.initialization import init_beit3_
from mmoe.tasks.nlvr2 import NLVR2FineTuning
from mmoe.tasks.predictions import unique_entries


def test_step_batches_of_mixed_and_joint_steps():
    image, text = {"kind": "image", "image": torch.zeros(2, 3, 4, 4)}, {"kind": "text", "text_ids": torch.ones(2, 3)}
    assert not is_joint(image) and step_batches(image) == [image]
    joint = {"image": image, "text": text}
    assert is_joint(joint) and step_batches(joint) == [image, text]
    assert step_batches({"image": image, "text": None, "pair": text}) == [image, text]  # absent streams left out
    with pytest.raises(ValueError, match="got keys \\['image_ids'\\]"):
        is_joint({"image_ids": image})


def test_the_pretrain_collator_names_its_kind():
    items = [{"text_ids": [1, 5, 6, 2], "key": "a"}, {"text_ids": [1, 7, 2], "key": "b"}]
    batch = PretrainCollator("text", (2, 2))(items, np.random.default_rng(0))
    assert batch["kind"] == "text" and batch["kind"] in BATCH_KINDS and batch["key"] == ["a", "b"]


def test_unique_entries_keeps_the_first_entry_of_each_sample_in_order():
    entries = [{"id": 2, "a": "x"}, {"id": 1, "a": "y"}, {"id": 2, "a": "z"}]
    assert unique_entries(entries, "id") == [{"id": 2, "a": "x"}, {"id": 1, "a": "y"}]
    assert unique_entries([("b", True), ("a", False), ("b", False)], 0) == [("b", True), ("a", False)]


def test_nlvr2_predictions_are_identifier_lines(tmp_path):
    task = NLVR2FineTuning.__new__(NLVR2FineTuning)  # the writer needs no backbone
    path = tmp_path / "predictions.csv"
    task.write_predictions([("dev-1-0-0", True), ("dev-1-0-1", False), ("dev-1-0-0", False)], path)
    assert path.read_text() == "dev-1-0-0,True\ndev-1-0-1,False\n"


def test_head_builders_match_beit3_initialisation():
    torch.manual_seed(0)
    pooler, head = vqa_pooler_and_head(8, 5, eps=1e-6)
    assert [type(m) for m in head] == [nn.Linear, nn.LayerNorm, nn.GELU, nn.Linear] and head[3].out_features == 5
    assert all(bool((m.bias == 0).all()) for m in (pooler.dense, head[0], head[3]))
    torch.manual_seed(1)
    scaled = nlvr2_head(8, init_scale=1e-3)
    torch.manual_seed(1)
    reference = nlvr2_head(8, init_scale=1.0)
    assert torch.allclose(scaled[1].weight, reference[1].weight * 1e-3) and bool((scaled[0].weight == 1).all())
    layer = nn.LayerNorm(4)
    nn.init.constant_(layer.weight, 3.0)
    init_head(layer)
    assert bool((layer.weight == 1).all())


def test_heads_draw_beit3_truncated_normal_cut_at_one_std():
    """BEiT-3 (unilm beit3/modeling_utils.py) truncates its std-0.02 normal at ±std: every weight within ±0.02 and
    the std that of N(0, 0.02²) cut at ±1 std, 0.02 * sqrt(1 - 2 φ(1) / (Φ(1) - Φ(-1))) ≈ 0.0108 (not 0.02)."""
    torch.manual_seed(0)
    _, head = vqa_pooler_and_head(256, 3129)
    weight = head[3].weight  # (3129, 512)
    phi, mass = math.exp(-0.5) / math.sqrt(2 * math.pi), math.erf(1 / math.sqrt(2))
    truncated_std = 0.02 * math.sqrt(1 - 2 * phi / mass)
    assert float(weight.abs().max()) <= 0.02
    assert float(weight.std()) == pytest.approx(truncated_std, rel=0.02)
    assert float(init_beit3_(torch.empty(1000, 1000)).abs().max()) <= 0.02
