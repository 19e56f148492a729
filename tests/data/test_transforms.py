"""Training and evaluation image transforms."""

from __future__ import annotations

import numpy as np
import torch
from PIL import Image

from mmoe.data.synth.scenes import render, sample_scene
from mmoe.data.transforms import RandAugment, denormalize, eval_transform, normalize, train_transform


def scene_image(size: int = 80) -> Image.Image:
    return render(sample_scene(np.random.default_rng(3), min_objects=3, max_objects=3), size)


def test_denormalize_undoes_the_transforms_normalisation():
    image = scene_image(64)
    pixels = torch.from_numpy(np.array(image)).permute(2, 0, 1).float() / 255.0  # (3, H, W) in [0, 1]
    normalised = eval_transform(64)(image)
    assert torch.equal(normalize(pixels), normalised)  # the same normalisation as the transforms
    assert torch.allclose(denormalize(normalised), pixels, atol=1e-6)
    assert normalised.min() < -0.5 and denormalize(normalised).min() >= 0  # it does change the values
    batch = torch.stack([normalised, normalised.flip(-1)])  # (B, 3, H, W) too
    assert torch.allclose(denormalize(batch), torch.stack([pixels, pixels.flip(-1)]), atol=1e-6)
    assert torch.allclose(normalize(denormalize(batch)), batch, atol=1e-6)


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


def test_randaugment_changes_training_images_repeatably_under_a_seed():
    image = scene_image()
    plain = train_transform(64, scale=None, hflip=False)(image)
    augment = train_transform(64, scale=None, hflip=False, randaugment=True)
    views = []
    for seed in range(12):
        torch.manual_seed(seed)
        views.append(augment(image))
        torch.manual_seed(seed)
        assert torch.equal(views[-1], augment(image))  # the data loader's per-sample seed fixes the draw
    changed = [not torch.equal(view, plain) for view in views]
    assert any(changed) and not all(changed)  # each op is applied with p = 0.5: some draws leave the image as is


def test_every_randaugment_operation_runs_and_all_but_identity_change_the_image():
    image = scene_image()
    augment = RandAugment(num_ops=1, magnitude=7)
    for name in RandAugment.OPERATIONS:
        for sign in (1.0, -1.0):
            out = augment.apply(name, image, sign)
            assert out.size == image.size and out.mode == "RGB"
            same = np.array_equal(np.asarray(out), np.asarray(image))
            assert same == (name == "identity"), (name, sign)


def test_randaugment_never_touches_evaluation_images():
    from mmoe.data.datamodules import NLVR2DataModule

    module = NLVR2DataModule(image_size=32, randaugment=True)
    train, _ = module._transform(train=True)
    evaluation, _ = module._transform(train=False)
    assert any(isinstance(stage, RandAugment) for stage in train.transforms)
    assert not any(isinstance(stage, RandAugment) for stage in evaluation.transforms)
