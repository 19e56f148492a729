"""Batching: stacking images, padding token ids, building soft VQA targets and applying pre-training masks.

Batch keys (all tasks): ``image`` (B, 3, H, W) float; ``text_ids`` (B, T) long; ``text_padding_mask`` (B, T) bool,
True = padding. Masked batches add ``text_targets`` (B, T) long (original ids), ``text_mask`` (B, T) bool (positions
to predict) and ``image_mask`` (B, num_patches) bool (True = replaced by the mask token); pre-training image batches
add ``image_targets`` (B, num_patches) long when the loader computes the visual tokens. Per-sample ids become long
tensors (``question_id``, ``image_id``, ``label``); strings and lists stay Python lists (``identifier``,
``answers``, ``captions``, ``key``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from mmoe.data.batches import (
    IMAGE,
    PAIR,
    TEXT,
    BatchKind,
    CaptionBatch,
    NLVR2Batch,
    PretrainBatch,
    RetrievalBatch,
    VQABatch,
)
from mmoe.data.masking import MaskingConfig, image_masks, mask_caption, mask_text
from mmoe.data.samples import Sample
from mmoe.data.tokenizer import TextTokenizer


def stack_items(items: list[Sample], tokenizer: TextTokenizer) -> Sample:
    """Generic collation: tensors stacked, ``text_ids`` padded (+ ``text_padding_mask``), ints and floats to
    tensors, everything else kept as a list."""
    batch: Sample = {}
    for name in items[0]:
        values = [item[name] for item in items]
        if name == "text_ids":
            batch["text_ids"], batch["text_padding_mask"] = tokenizer.pad(values)
        elif isinstance(values[0], torch.Tensor):
            batch[name] = torch.stack(values)
        elif isinstance(values[0], bool | int) and all(isinstance(v, int) for v in values):
            batch[name] = torch.tensor(values, dtype=torch.long)
        elif isinstance(values[0], float):
            batch[name] = torch.tensor(values, dtype=torch.float32)
        else:
            batch[name] = values
    return batch


@dataclass
class PretrainCollator:
    """Collates one pre-training stream and masks it (BEiT-3 masked data modeling): the
    :class:`mmoe.data.batches.ImageBatch`, ``TextBatch`` or ``PairBatch`` of ``kind``.

    Args:
        kind: ``"image"`` (block-wise image masks), ``"text"`` (MLM at ``text_ratio``) or ``"pair"`` (MVLM at
            ``pair_text_ratio``; images masked only with ``mask_pair_images``).
        grid: patch grid (rows, columns) of the model's images.
        masking: ratios and replacement fractions.
        tokenizer: pads the text.
        image_targets: the visual tokens (B, N) of a batch's images (B, 3, S, S), computed here, in the loader's
            workers, for a batch with masked patches (``image_targets`` of the batch); None = the task computes them.
    """

    kind: BatchKind
    grid: tuple[int, int]
    masking: MaskingConfig = field(default_factory=MaskingConfig)
    tokenizer: TextTokenizer = field(default_factory=TextTokenizer)
    image_targets: Callable[[torch.Tensor], torch.Tensor] | None = None

    def __call__(self, items: list[Sample], rng: np.random.Generator) -> PretrainBatch:
        batch = stack_items(items, self.tokenizer)
        batch["kind"] = self.kind
        config = self.masking
        if self.kind in (IMAGE, PAIR):
            size = len(items)
            if self.kind == IMAGE or config.mask_pair_images:
                batch["image_mask"] = image_masks(size, self.grid, config, rng)
            else:
                batch["image_mask"] = torch.zeros(size, self.grid[0] * self.grid[1], dtype=torch.bool)
            if self.image_targets is not None and bool(batch["image_mask"].any()):
                batch["image_targets"] = self.image_targets(batch["image"])
        if self.kind in (TEXT, PAIR):
            ratio = config.text_ratio if self.kind == TEXT else config.pair_text_ratio
            masked = mask_text(batch["text_ids"], ratio, rng, config, self.tokenizer.ids)
            batch["text_ids"], batch["text_targets"], batch["text_mask"] = masked
        return batch


@dataclass
class VQACollator:
    """VQAv2 batches (:class:`mmoe.data.batches.VQABatch`): adds ``targets`` (B, num_answers) float soft scores when
    the items carry labels."""

    num_answers: int
    tokenizer: TextTokenizer = field(default_factory=TextTokenizer)

    def __call__(self, items: list[Sample], rng: np.random.Generator) -> VQABatch:
        labels = [item.pop("labels", None) for item in items]
        scores = [item.pop("scores", None) for item in items]
        batch = stack_items(items, self.tokenizer)
        if all(label is not None for label in labels):
            targets = torch.zeros(len(items), self.num_answers)
            for row, (label, score) in enumerate(zip(labels, scores, strict=True)):
                targets[row, torch.as_tensor(label, dtype=torch.long)] = torch.as_tensor(score, dtype=torch.float32)
            batch["targets"] = targets
        return batch


@dataclass
class CaptionCollator:
    """Captioning batches (:class:`mmoe.data.batches.CaptionBatch`). Training batches (``mask_ratio`` > 0) are masked
    the BEiT-3 way (:func:`mmoe.data.masking.mask_caption`): ``text_ids`` corrupted, ``text_targets``, ``text_mask``."""

    mask_ratio: float = 0.0
    tokenizer: TextTokenizer = field(default_factory=TextTokenizer)
    masking: MaskingConfig = field(default_factory=MaskingConfig)

    def __call__(self, items: list[Sample], rng: np.random.Generator) -> CaptionBatch:
        batch = stack_items(items, self.tokenizer)
        if self.mask_ratio > 0 and "text_ids" in batch:
            masked = mask_caption(batch["text_ids"], self.mask_ratio, rng, self.masking, self.tokenizer.ids)
            batch["text_ids"], batch["text_targets"], batch["text_mask"] = masked
        return batch


@dataclass
class PlainCollator:
    """Batches with no task-specific step (NLVR2: :class:`mmoe.data.batches.NLVR2Batch`)."""

    tokenizer: TextTokenizer = field(default_factory=TextTokenizer)

    def __call__(self, items: list[Sample], rng: np.random.Generator) -> NLVR2Batch:
        return stack_items(items, self.tokenizer)


@dataclass
class RetrievalCollator:
    """Retrieval batches (:class:`mmoe.data.batches.RetrievalBatch`). Evaluation items (with ``caption_ids``) have
    their captions flattened into ``text_ids`` / ``text_padding_mask``, image by image, with ``caption_image``."""

    tokenizer: TextTokenizer = field(default_factory=TextTokenizer)

    def __call__(self, items: list[Sample], rng: np.random.Generator) -> RetrievalBatch:
        caption_ids = [item.pop("caption_ids", None) for item in items]
        batch = stack_items(items, self.tokenizer)
        if all(ids is not None for ids in caption_ids):
            flat = [ids for per_image in caption_ids for ids in per_image]
            batch["text_ids"], batch["text_padding_mask"] = self.tokenizer.pad(flat)
            rows = [row for row, per_image in enumerate(caption_ids) for _ in per_image]
            batch["caption_image"] = torch.tensor(rows, dtype=torch.long)
        return batch
