"""The batches the data modules yield and the tasks consume, defined once: the pre-training batch kinds and the batch
types (``TypedDict``; a batch is a plain dict at run time).

Pre-training (BEiT-3, Wang et al., 2023, §2.2): every single-kind batch carries ``kind`` (:data:`BATCH_KINDS`) and
``key`` (sample keys). In mixed mode (``PretrainDataModule(joint=False)``, and every validation batch) a step gets one
such batch; in joint mode (``joint=True``) a step gets :class:`JointBatch`, ``{kind: batch}`` with one batch of each
stream. :func:`step_batches` tells the two forms apart.

Shapes: B batch, T text tokens, N patches, S image side, A answers.
"""

from __future__ import annotations

from typing import Literal, NotRequired, TypedDict, TypeGuard

import torch

#: The kind of a pre-training batch: image-only (masked image modeling), text-only (masked language modeling) or
#: image-text pairs (masked vision-language modeling). Plain strings: they name the data streams (``train/image``),
#: the logged losses and the keys of a joint batch, and they are saved in loader positions.
BatchKind = Literal["image", "text", "pair"]
IMAGE: BatchKind = "image"
TEXT: BatchKind = "text"
PAIR: BatchKind = "pair"
BATCH_KINDS: tuple[BatchKind, ...] = (IMAGE, TEXT, PAIR)


class ImageBatch(TypedDict):
    """Masked image modeling batch (``kind == "image"``)."""

    kind: BatchKind
    key: list[str]
    image: torch.Tensor  # (B, 3, S, S) float
    image_mask: torch.Tensor  # (B, N) bool, True = masked patch (block-wise)
    image_targets: NotRequired[torch.Tensor]  # (B, N) long visual tokens, when the loader computes them


class TextBatch(TypedDict):
    """Masked language modeling batch (``kind == "text"``)."""

    kind: BatchKind
    key: list[str]
    text_ids: torch.Tensor  # (B, T) long, masked input ids
    text_padding_mask: torch.Tensor  # (B, T) bool, True = padding
    text_targets: torch.Tensor  # (B, T) long, original ids
    text_mask: torch.Tensor  # (B, T) bool, positions to predict


class PairBatch(TypedDict):
    """Masked vision-language modeling batch (``kind == "pair"``): ``image_mask`` is all False unless
    ``MaskingConfig.mask_pair_images``."""

    kind: BatchKind
    key: list[str]
    image: torch.Tensor  # (B, 3, S, S) float
    image_mask: torch.Tensor  # (B, N) bool
    image_targets: NotRequired[torch.Tensor]  # (B, N) long visual tokens, when the loader computes them
    text_ids: torch.Tensor  # (B, T) long, masked input ids
    text_padding_mask: torch.Tensor  # (B, T) bool
    text_targets: torch.Tensor  # (B, T) long
    text_mask: torch.Tensor  # (B, T) bool


#: One single-kind pre-training batch.
PretrainBatch = ImageBatch | TextBatch | PairBatch


class JointBatch(TypedDict, total=False):
    """One joint pre-training step: a batch of every stream the data module has, in stream order."""

    image: ImageBatch
    text: TextBatch
    pair: PairBatch


#: What a pre-training step receives.
PretrainStep = PretrainBatch | JointBatch


def is_joint(batch: PretrainStep) -> TypeGuard[JointBatch]:
    """Whether ``batch`` is the joint form ``{kind: batch}``; False for a single-kind batch; anything else is an
    error naming its keys."""
    if "kind" in batch:
        return False
    if batch and all(name in BATCH_KINDS for name in batch):
        return True
    raise ValueError(
        f"a pre-training batch has 'kind' (one of {BATCH_KINDS}) or maps kinds to such batches; "
        f"got keys {sorted(batch)}"
    )


def step_batches(batch: PretrainStep) -> list[PretrainBatch]:
    """The single-kind batches of one pre-training step: ``[batch]`` in mixed mode, the joint form's batches (in its
    order, absent streams left out) in joint mode."""
    if is_joint(batch):
        return [single for single in batch.values() if single is not None]
    return [batch]


# ---------------------------------------------------------------------------------------------------- fine-tuning
class _VQARequired(TypedDict):
    image: torch.Tensor  # (B, 3, S, S) float
    text_ids: torch.Tensor  # (B, T) long, the question
    text_padding_mask: torch.Tensor  # (B, T) bool
    question_id: torch.Tensor  # (B,) long
    image_id: torch.Tensor  # (B,) long


class VQABatch(_VQARequired, total=False):
    """VQAv2 batch (:class:`mmoe.data.collate.VQACollator`). ``targets`` only when the split has answers: the soft
    score of each vocabulary answer (0.3 / 0.6 / 0.9 / 1.0 for 1 / 2 / 3 / >= 4 of the ten annotators); ``answers``
    is empty for test questions."""

    targets: torch.Tensor  # (B, A) float
    question: list[str]
    answers: list[list[str]]  # the ten human answers of each question
    answer_type: list[str]
    question_type: list[str]


class NLVR2Batch(TypedDict, total=False):
    """NLVR2 batch (:class:`mmoe.data.collate.PlainCollator`); every key is present."""

    image_left: torch.Tensor  # (B, 3, S, S) float
    image_right: torch.Tensor  # (B, 3, S, S) float
    text_ids: torch.Tensor  # (B, T) long, the sentence
    text_padding_mask: torch.Tensor  # (B, T) bool
    label: torch.Tensor  # (B,) long: 1 true, 0 false, -1 unlabelled
    identifier: list[str]
    sentence: list[str]


class _CaptionRequired(TypedDict):
    image: torch.Tensor  # (B, 3, S, S) float
    image_id: torch.Tensor  # (B,) long


class CaptionBatch(_CaptionRequired, total=False):
    """Captioning batch (:class:`mmoe.data.collate.CaptionCollator`). Training (one item per caption, masked):
    ``text_ids`` (corrupted), ``text_targets``, ``text_mask``, ``text_padding_mask``. Evaluation (one item per image):
    ``captions``, the references (absent at prediction time on unlabelled images)."""

    text_ids: torch.Tensor  # (B, T) long
    text_padding_mask: torch.Tensor  # (B, T) bool
    text_targets: torch.Tensor  # (B, T) long
    text_mask: torch.Tensor  # (B, T) bool
    captions: list[list[str]]


class _RetrievalRequired(TypedDict):
    image: torch.Tensor  # (B, 3, S, S) float
    image_id: torch.Tensor  # (B,) long
    text_ids: torch.Tensor  # (B, T) training, (M, T) evaluation: long
    text_padding_mask: torch.Tensor  # like text_ids, bool


class RetrievalBatch(_RetrievalRequired, total=False):
    """Image-text retrieval batch (:class:`mmoe.data.collate.RetrievalCollator`). Training: one caption per image,
    ``text_ids`` row b is image b's. Evaluation: every caption of every image, ``caption_image`` (M,) long giving
    each caption's image row in the batch, and ``captions`` (the texts, image by image)."""

    caption_image: torch.Tensor  # (M,) long
    captions: list[list[str]]
