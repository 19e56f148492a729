"""Image classification batches (ImageNet-1K as BEiT-3 fine-tunes on it) through timm's transforms."""

from __future__ import annotations

import dataclasses
import math

from mmoe.data.classification import (
    BEIT3_AUGMENTATION,
    Augmentation,
    ClassificationDecoder,
    SeededTransform,
    eval_transform,
    read_classes,
    train_transform,
)
from mmoe.data.collate import PlainCollator
from mmoe.data.datamodules.finetune import FinetuneDataModule
from mmoe.data.samples import Collator, Decoder

#: timm's RandomResizedCrop area range, BEiT-3's ImageNet default.
TIMM_CROP_SCALE = (0.08, 1.0)


class ClassificationDataModule(FinetuneDataModule):
    """Image classification batches from classification split folders (:mod:`mmoe.data.classification`: an image and
    ``cls`` per sample, ``classes.json`` beside the shards).

    Keys: ``image`` (B, 3, S, S) normalised with ImageNet's mean and std, ``label`` (B,) long, ``key`` and ``name``
    (lists: the samples' keys, the images' file names). Training images go through timm's ``create_transform`` as
    BEiT-3's recipe sets it; evaluation and prediction images through timm's resize and center crop. Mixup / CutMix
    are the task's (they mix a batch).

    Args:
        classes: the ``classes.json`` of the model's classes (the mmoe CLI sets it from ``model.init_args.classes``);
            a sample whose ``cls`` lies outside them is skipped and counted. None = not checked.
        augmentation: timm's RandAugment, random erasing and colour jitter (:class:`~mmoe.data.classification
            .Augmentation`; BEiT-3's ImageNet settings by default).
        crop_scale: RandomResizedCrop area range (timm and BEiT-3: 0.08..1); None = the whole image (scale 1).
        eval_crop_pct: evaluation resize to ``image_size / eval_crop_pct`` before the center crop (BEiT-3: 1).
        **shards: the splits' shards and the loader arguments of :class:`FinetuneDataModule` (``hflip``: timm's
            flip with probability 0.5; mmoe's vision-language ``randaugment`` is refused: give ``augmentation``).
    """

    def __init__(
        self,
        classes: str | None = None,
        augmentation: Augmentation | dict = BEIT3_AUGMENTATION,
        crop_scale: tuple[float, float] | None = TIMM_CROP_SCALE,
        eval_crop_pct: float = 1.0,
        **shards,
    ) -> None:
        if shards.get("randaugment"):
            raise ValueError("data.randaugment is the vision-language RandAugment: give data.augmentation (timm's)")
        if not 0.0 < eval_crop_pct <= 1.0:
            raise ValueError(f"data.eval_crop_pct must lie in (0, 1], got {eval_crop_pct!r}")
        super().__init__(crop_scale=crop_scale, **shards)
        self.num_classes = None if classes is None else len(read_classes(classes))
        if isinstance(augmentation, dict):  # a checkpoint's saved hyper-parameter
            augmentation = Augmentation(**augmentation)
        self.augmentation, self.eval_crop_pct = augmentation, eval_crop_pct
        self.hparams.augmentation = dataclasses.asdict(augmentation)  # checkpoints hold plain values

    def _decoder(self, train: bool) -> Decoder:
        size = self.image_size
        if not train:
            return ClassificationDecoder(eval_transform(size, self.eval_crop_pct), self.num_classes, size)
        scale, hflip = self.crop_scale or (1.0, 1.0), 0.5 if self.hflip else 0.0
        transform = SeededTransform(train_transform(size, self.augmentation, scale, hflip))
        min_side = math.ceil(size / math.sqrt(self.crop_scale[0])) if self.crop_scale else size
        return ClassificationDecoder(transform, self.num_classes, min_side)

    def _collator(self, train: bool) -> Collator:
        return PlainCollator(self.tokenizer)
