"""Fine-tuning batches: train / val / test loaders over one task's shards, for VQAv2, NLVR2, COCO captioning and
image-text retrieval."""

from __future__ import annotations

import torch

from mmoe.data.answers import read_answer_vocab
from mmoe.data.collate import CaptionCollator, PlainCollator, RetrievalCollator, VQACollator
from mmoe.data.datamodules.base import ShardDataModule, ShardSpec
from mmoe.data.decoders import CaptionDecoder, NLVR2Decoder, RetrievalDecoder, VQADecoder
from mmoe.data.loader import EpochDataLoader
from mmoe.data.overlap import warn_shared_images
from mmoe.data.samples import Collator, Decoder
from mmoe.data.shards import expected_samples, resolve_shards
from mmoe.data.tokenizer import CAPTION_MAX_TEXT_LENGTH


class FinetuneDataModule(ShardDataModule):
    """Train / val / test loaders over one task's shards (``predict`` reads the test shards).

    At its first ``setup`` it warns on stderr, one line per split, when the val or test split shares images with the
    training split, by id or by image digest (from the split folders' ``image_digests.json``; splits given as globs
    or without that file are not checked): :func:`mmoe.data.overlap.warn_shared_images`.

    Args:
        train_shards: training shards.
        val_shards: validation shards; None = a fit does not validate.
        test_shards: test shards (test / predict loaders).
        eval_batch_size: validation / test batch size (default: ``batch_size``).
        **loader: the loader, image and text arguments of :class:`ShardDataModule` (batch size, image size, ...).
    """

    def __init__(
        self,
        train_shards: ShardSpec = None,
        val_shards: ShardSpec = None,
        test_shards: ShardSpec = None,
        eval_batch_size: int | None = None,
        **loader,
    ) -> None:
        super().__init__(**loader)
        shards = self.checked_shards(train_shards=train_shards, val_shards=val_shards, test_shards=test_shards)
        self.shards = {"train": shards["train_shards"], "val": shards["val_shards"], "test": shards["test_shards"]}
        self.eval_batch_size = eval_batch_size or self.batch_size
        self.shared_image_warnings: list[str] | None = None  # set at the first setup

    def has_validation(self) -> bool:
        return bool(self.shards["val"])

    def setup(self, stage: str) -> None:
        """Warns once when the eval splits share images with the training split (rank 0 only)."""
        super().setup(stage)
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        if self.shared_image_warnings is None and rank == 0:
            evaluations = {"val": self.shards["val"], "test": self.shards["test"]}
            self.shared_image_warnings = warn_shared_images(self.shards["train"], evaluations)

    def _decoder(self, train: bool) -> Decoder:
        raise NotImplementedError

    def _collator(self, train: bool) -> Collator:
        raise NotImplementedError

    def _split_loader(self, split: str) -> EpochDataLoader | list:
        if not self.shards[split]:
            if split == "train":
                raise ValueError(f"{type(self).__name__} has no train_shards")
            return []
        train = split == "train"
        size = self.batch_size if train else self.eval_batch_size
        stream = self._stream(split, self.shards[split], self._decoder(train), self._collator(train), size, train)
        return self._loader(split, stream)

    def split_size(self, split: str) -> int | None:
        """Samples the ``split``'s shards hold by their manifests (``"train"``, ``"val"`` or ``"test"``); None when
        a shard has no manifest count."""
        if not self.shards[split]:
            return None
        shards = resolve_shards(self.shards[split])
        counts = expected_samples(shards)
        return sum(counts.values()) if len(counts) == len(shards) else None

    def train_dataloader(self):
        return self._split_loader("train")

    def val_dataloader(self):
        return self._split_loader("val")

    def test_dataloader(self):
        return self._split_loader("test")

    def predict_dataloader(self):
        return self._split_loader("test")


class VQADataModule(FinetuneDataModule):
    """VQAv2 batches (:class:`mmoe.data.batches.VQABatch`) from ``mmoe data convert vqav2`` shards.

    Keys: ``image`` (B, 3, S, S), ``text_ids`` / ``text_padding_mask`` (B, T) (the question), ``question_id`` and
    ``image_id`` (B,) long, ``question`` (list), ``answers`` (list of the 10 human answers, empty for test),
    ``answer_type`` and ``question_type`` (lists), and, when the split has answers, ``targets`` (B, num_answers)
    float: the official accuracy of each vocabulary answer (0.3 / 0.6 / 0.9 / 1.0 for 1 / 2 / 3 / >= 4 annotators),
    computed from the human answers with ``answer_vocab``. Training drops questions with no vocabulary answer
    (ViLT, BEiT-3).

    Args:
        answer_vocab: ``answers.json`` of the training split, read by :func:`mmoe.data.answers.read_answer_vocab` as
            the task reads it (class labels in its order); the model's (the mmoe CLI sets it).
        **shards: the splits' shards and the loader arguments of :class:`FinetuneDataModule` (e.g. ``train_shards``,
            ``batch_size``, ``image_size``).
    """

    def __init__(self, answer_vocab: str, **shards) -> None:
        super().__init__(**shards)
        self.answers = read_answer_vocab(answer_vocab)
        self.vocab = {answer: label for label, answer in enumerate(self.answers)}

    @property
    def num_answers(self) -> int:
        return len(self.answers)

    def _decoder(self, train: bool) -> Decoder:
        transform, min_side = self._transform(train)
        return VQADecoder(transform, self.tokenizer, self.vocab, drop_unanswerable=train, min_side=min_side)

    def _collator(self, train: bool) -> Collator:
        return VQACollator(self.num_answers, self.tokenizer)


class NLVR2DataModule(FinetuneDataModule):
    """NLVR2 batches (:class:`mmoe.data.batches.NLVR2Batch`) from ``mmoe data convert nlvr2`` shards.

    Keys: ``image_left``, ``image_right`` (B, 3, S, S), ``text_ids`` / ``text_padding_mask`` (B, T) (the sentence),
    ``label`` (B,) long (1 true, 0 false, -1 unlabelled), ``identifier`` and ``sentence`` (lists).

    Arguments: those of :class:`FinetuneDataModule` (``val_shards``: dev, ``test_shards``: test1).
    """

    def _decoder(self, train: bool) -> Decoder:
        transform, min_side = self._transform(train)
        return NLVR2Decoder(transform, self.tokenizer, min_side)

    def _collator(self, train: bool) -> Collator:
        return PlainCollator(self.tokenizer)


class CaptioningDataModule(FinetuneDataModule):
    """COCO captioning batches (:class:`mmoe.data.batches.CaptionBatch`) from ``mmoe data convert coco-captions``
    shards (one sample per image).

    Training yields one item per caption, masked the BEiT-3 way: ``image``, ``text_ids`` (masked),
    ``text_targets``, ``text_mask``, ``text_padding_mask``, ``image_id``. Evaluation yields one item per image:
    ``image``, ``image_id`` (B,) long and ``captions`` (list of each image's reference captions).

    Args:
        max_text_length: longest caption in tokens (BEiT-3 captioning: :data:`CAPTION_MAX_TEXT_LENGTH`).
        mask_ratio: share of caption tokens masked for training (BEiT-3 default 0.6, recipes 0.7).
        **shards: the splits' shards (e.g. ``coco-karpathy-train-restval``, ``coco-karpathy-val``,
            ``coco-karpathy-test``) and the loader arguments of :class:`FinetuneDataModule`.
    """

    def __init__(self, max_text_length: int = CAPTION_MAX_TEXT_LENGTH, mask_ratio: float = 0.6, **shards) -> None:
        super().__init__(max_text_length=max_text_length, **shards)
        if not 0.0 < mask_ratio <= 1.0:
            raise ValueError(f"mask_ratio must lie in (0, 1], got {mask_ratio!r}")
        self.mask_ratio = mask_ratio

    def _decoder(self, train: bool) -> Decoder:
        transform, min_side = self._transform(train)
        return CaptionDecoder(transform, self.tokenizer, "train" if train else "eval", min_side)

    def _collator(self, train: bool) -> Collator:
        return CaptionCollator(self.mask_ratio if train else 0.0, self.tokenizer)


class RetrievalDataModule(FinetuneDataModule):
    """Image-text retrieval batches (:class:`mmoe.data.batches.RetrievalBatch`) from caption shards (one sample per
    image with all its captions: ``mmoe data convert coco-karpathy`` / ``flickr30k-karpathy``).

    Training yields one item per image with one of its captions drawn at random: ``image``, ``text_ids``,
    ``text_padding_mask``, ``image_id``. Evaluation yields one item per image with every caption flattened into
    ``text_ids`` (``caption_image``: each caption's image row) and ``captions``.

    Arguments: those of :class:`FinetuneDataModule` (e.g. ``train_shards``, ``batch_size``, ``image_size``).
    """

    def _decoder(self, train: bool) -> Decoder:
        transform, min_side = self._transform(train)
        return RetrievalDecoder(transform, self.tokenizer, "train" if train else "eval", min_side)

    def _collator(self, train: bool) -> Collator:
        return RetrievalCollator(self.tokenizer)
