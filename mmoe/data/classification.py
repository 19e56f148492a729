"""Image classification data (ImageNet-1K as BEiT-3 fine-tunes on it): the class-index file of a split, the sample
decoder, and timm's transforms.

* A classification split is a shard folder whose samples hold an image (``jpg`` / ``jpeg`` / ``png`` / ``webp``) and
  ``cls``, the class index, with ``classes.json`` beside the shards: ``{"classes": [{"index": 0, "wnid":
  "n01440764", "name": "tench"}, ...]}`` (:func:`read_classes`).
* Transforms are timm's ``create_transform``, as BEiT-3's ``build_imagenet_transform`` calls it: for training
  RandomResizedCrop (bicubic), flip, RandAugment (``rand-m9-mstd0.5-inc1``), random erasing (0.25, per pixel); for
  evaluation a resize of the shorter side to ``size / crop_pct`` and a center crop (BEiT-3: crop_pct 1); both
  normalised with timm's ImageNet mean and std (not the 0.5 / 0.5 of mmoe's vision-language transforms).
* timm's augmentations draw from Python's and numpy's generators; :class:`SeededTransform` seeds both from torch's,
  which the shard stream seeds per sample, so a sample's augmentation is the same on a rerun or a resume.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

import numpy as np
import torch
from timm.data import create_transform
from timm.data.constants import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD

from mmoe.data.decoders import ImageTransform, entry, image_entry, json_entry
from mmoe.data.samples import CorruptSampleError, Sample
from mmoe.io import read_json

#: The name of the class-index file in a classification split's folder.
CLASSES_FILE = "classes.json"


@dataclass(frozen=True)
class ClassEntry:
    """One class of a split: its index (the ``cls`` of its samples), WordNet id and readable name."""

    index: int
    wnid: str
    name: str


def read_classes(path: str | Path) -> list[ClassEntry]:
    """The classes of ``classes.json``, in index order; ValueError (one line, naming the file and the entry) unless
    its indices are exactly 0..n-1 and every entry has a string ``wnid`` and ``name``."""
    value = read_json(path, "class-index file")
    entries = value.get("classes") if isinstance(value, dict) else None
    if not isinstance(entries, list) or not entries:
        raise ValueError(f'{path}: expected {{"classes": [{{"index", "wnid", "name"}}, ...]}} with at least one class')
    classes = []
    for position, item in enumerate(entries):
        fields = item if isinstance(item, dict) else {}
        index, wnid, name = fields.get("index"), fields.get("wnid"), fields.get("name")
        if (
            not isinstance(index, int)
            or isinstance(index, bool)
            or not isinstance(wnid, str)
            or not isinstance(name, str)
        ):
            raise ValueError(f"{path}: classes[{position}] = {item!r} (expected index: int, wnid: str, name: str)")
        classes.append(ClassEntry(index, wnid, name))
    classes.sort(key=lambda c: c.index)
    wrong = next((c for position, c in enumerate(classes) if c.index != position), None)
    if wrong is not None:
        raise ValueError(f"{path}: class index {wrong.index} out of order (expected indices 0..{len(classes) - 1})")
    return classes


#: What timm's training and evaluation transforms share here: bicubic resizing, ImageNet's mean and std.
IMAGENET_BICUBIC = {"interpolation": "bicubic", "mean": IMAGENET_DEFAULT_MEAN, "std": IMAGENET_DEFAULT_STD}


@dataclass(frozen=True)
class Augmentation:
    """timm's training augmentation beyond the crop and the flip, with BEiT-3's ImageNet settings (its
    ``run_beit3_finetuning.py`` defaults), the fields named as ``create_transform``'s arguments.

    Args:
        auto_augment: timm's policy string (``rand-m9-mstd0.5-inc1``: RandAugment, 2 operations of magnitude 9, std
            0.5, increasing); None = none.
        re_prob: probability of timm's random erasing (in pixel mode, one region) per image.
        color_jitter: colour jitter strength; timm ignores it while a RandAugment policy is on (BEiT-3 passes 0.4).
    """

    auto_augment: str | None = "rand-m9-mstd0.5-inc1"
    re_prob: float = 0.25
    color_jitter: float | None = 0.4

    def __post_init__(self) -> None:
        if not 0.0 <= self.re_prob <= 1.0:
            raise ValueError(f"data.augmentation.re_prob must lie in [0, 1], got {self.re_prob!r}")


#: BEiT-3's ImageNet augmentation.
BEIT3_AUGMENTATION = Augmentation()


def train_transform(
    size: int, augmentation: Augmentation, scale: tuple[float, float] | None = None, hflip: float = 0.5
) -> Callable:
    """timm's training transform (``create_transform(is_training=True)``) as BEiT-3's ImageNet recipe sets it:
    bicubic RandomResizedCrop (area share ``scale``; None = timm's 0.08..1), flip with probability ``hflip``, the
    ``augmentation``, ImageNet mean and std."""
    options = dataclasses.asdict(augmentation) | IMAGENET_BICUBIC
    return create_transform(input_size=size, is_training=True, scale=scale, hflip=hflip, re_mode="pixel", **options)


def eval_transform(size: int, crop_pct: float = 1.0) -> Callable:
    """timm's evaluation transform: bicubic resize of the shorter side to ``size / crop_pct``, center crop ``size``,
    ImageNet mean and std (BEiT-3: crop_pct 1, the whole shorter side)."""
    return create_transform(input_size=size, is_training=False, crop_pct=crop_pct, **IMAGENET_BICUBIC)


@dataclass
class SeededTransform:
    """``transform`` with Python's and numpy's global generators seeded from torch's for the call and put back after
    it (timm's augmentations draw from them)."""

    transform: Callable

    def __call__(self, image: Any) -> torch.Tensor:
        seed = int(torch.randint(2**31 - 1, ()))
        python_state, numpy_state = random.getstate(), np.random.get_state()
        random.seed(seed)
        np.random.seed(seed)
        try:
            return self.transform(image)
        finally:
            random.setstate(python_state)
            np.random.set_state(numpy_state)


@dataclass
class ClassificationDecoder:
    """Classification samples -> ``{"image", "label", "key", "name"}``; a ``cls`` that is not an integer in
    ``0..num_classes - 1`` makes the sample corrupt (skipped and counted). ``num_classes`` None = not checked.
    ``name`` is the image's file name without its suffix when the sample's ``json`` gives its ``path`` (ImageNet's
    ``ILSVRC2012_val_00000001``, the image id of its solution file), else the sample's key."""

    transform: ImageTransform
    num_classes: int | None = None
    min_side: int | None = None

    def __call__(self, sample: Sample) -> Sample:
        where = str(sample.get("__url__", "?")), str(sample.get("__key__", "?"))
        text = entry(sample, "cls")
        try:
            label = int(text.decode("ascii").strip())
        except (UnicodeDecodeError, ValueError):
            raise CorruptSampleError(*where, f"cls {text[:20]!r} is not an integer") from None
        if label < 0 or (self.num_classes is not None and label >= self.num_classes):
            raise CorruptSampleError(*where, f"cls {label} is outside the classes 0..{(self.num_classes or 0) - 1}")
        image = image_entry(sample, self.transform, min_side=self.min_side)
        path = json_entry(sample, "path")["path"] if "json" in sample else None
        name = PurePosixPath(str(path)).stem if path else sample["__key__"]
        return {"image": image, "label": label, "key": sample["__key__"], "name": name}
