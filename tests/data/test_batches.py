"""The batch kinds and the joint / mixed decision of :mod:`mmoe.data.batches`, and the kind the pre-training
collator names."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mmoe.data.batches import BATCH_KINDS, is_joint, step_batches
from mmoe.data.collate import PretrainCollator


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
