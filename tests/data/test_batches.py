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


def test_the_pretrain_collator_computes_image_targets_of_masked_batches_only():
    """Given a function of the images (the task's VQ-KD tokenizer on a CPU run), the collator adds its tokens to a
    batch with masked patches; a pair batch whose images are not masked gets none."""

    def brightest_channel(images: torch.Tensor) -> torch.Tensor:  # (B, 3, S, S) -> (B, 4) on a 2 x 2 grid
        return images.unflatten(2, (2, -1)).unflatten(4, (2, -1)).mean((3, 5)).argmax(1).flatten(1)

    generator = torch.Generator().manual_seed(0)
    items = [{"image": torch.randn(3, 8, 8, generator=generator), "key": str(i)} for i in range(3)]
    batch = PretrainCollator("image", (2, 2), image_targets=brightest_channel)(items, np.random.default_rng(0))
    assert batch["image_mask"].any()
    assert torch.equal(batch["image_targets"], brightest_channel(batch["image"]))
    assert batch["image_targets"].shape == (3, 4) and len(batch["image_targets"].unique()) > 1
    pairs = [item | {"text_ids": [1, 5, 2]} for item in items]
    pair_batch = PretrainCollator("pair", (2, 2), image_targets=brightest_channel)(pairs, np.random.default_rng(0))
    assert not pair_batch["image_mask"].any() and "image_targets" not in pair_batch
    assert "image_targets" not in PretrainCollator("image", (2, 2))(items, np.random.default_rng(0))
