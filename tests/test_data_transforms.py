"""Training and evaluation image transforms."""

from __future__ import annotations

import numpy as np
import torch
from PIL import Image

from mmoe.data.synth.scenes import render, sample_scene
from mmoe.data.transforms import eval_transform, train_transform


def scene_image(size: int = 80) -> Image.Image:
    return render(sample_scene(np.random.default_rng(3), min_objects=3, max_objects=3), size)


def test_train_transform_without_crop_keeps_the_whole_image():
    image = scene_image()
    kept = train_transform(64, scale=None, hflip=False)(image)
    assert kept.shape == (3, 64, 64)
    assert torch.equal(kept, eval_transform(64)(image))


def test_train_transform_without_crop_only_flips():
    image = scene_image()
    flipped = {tuple(train_transform(64, scale=None, hflip=True)(image).flatten()[:64].tolist()) for _ in range(40)}
    whole = eval_transform(64)(image)
    assert flipped == {tuple(whole.flatten()[:64].tolist()), tuple(whole.flip(-1).flatten()[:64].tolist())}


def test_train_transform_with_crop_changes_the_view():
    image = scene_image()
    torch.manual_seed(0)
    views = [train_transform(64, scale=(0.3, 0.5), hflip=False)(image) for _ in range(5)]
    whole = eval_transform(64)(image)
    assert all(view.shape == (3, 64, 64) for view in views)
    assert not any(torch.allclose(view, whole) for view in views)
