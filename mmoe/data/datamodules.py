"""Lightning DataModules reading webdataset shards: pre-training (image / text / pair streams with BEiT-3 masks) and
fine-tuning on VQAv2, NLVR2 and COCO captioning.

Shard arguments accept what :func:`mmoe.data.shards.resolve_shards` accepts: a converter's output folder, a glob, a
brace pattern, or a list of these. Loaders yield ready batches (``batch_size=None`` DataLoaders over iterable
datasets); each process and DataLoader worker reads a disjoint part of the shards. Batch keys are listed on each class
and in :mod:`mmoe.data.collate`.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from pathlib import Path

import lightning as L
import torch

from mmoe.data.accounting import SkipCount, add_skips, describe_skips
from mmoe.data.answers import read_answer_vocab
from mmoe.data.batches import IMAGE, PAIR, TEXT, BatchKind
from mmoe.data.collate import CaptionCollator, PlainCollator, PretrainCollator, VQACollator
from mmoe.data.decoders import (
    CaptionDecoder,
    ImageDecoder,
    NLVR2Decoder,
    PairDecoder,
    TextDecoder,
    VQADecoder,
)
from mmoe.data.loader import EpochDataLoader
from mmoe.data.masking import MaskingConfig
from mmoe.data.mixture import StreamMixture
from mmoe.data.samples import Collator, Decoder
from mmoe.data.shards import expected_samples, resolve_shards
from mmoe.data.streams import ShardStream
from mmoe.data.tokenizer import TextTokenizer
from mmoe.data.transforms import eval_transform, train_transform

ShardSpec = str | list[str] | None


def _min_side(image_size: int, crop_scale: tuple[float, float] | None) -> int:
    """Smallest decoded side that still gives ``image_size`` pixels for the smallest random crop."""
    return image_size if crop_scale is None else math.ceil(image_size / math.sqrt(crop_scale[0]))


class ShardDataModule(L.LightningDataModule):
    """What every mmoe DataModule shares: the loader, image and text arguments, building shard streams and resumable
    loaders, and counting the samples they skipped.

    Loaders are resumable (:class:`EpochDataLoader`: Lightning saves the training loader's position in checkpoints).
    Skipped samples (corrupt, or lost from truncated shards) are counted per stream (``skipped_samples``) and
    reported on stderr when fit / validate / test / predict ends.

    Args:
        batch_size: training samples per batch (pre-training: per stream).
        image_size: image side S in pixels; the model's backbone's (the mmoe CLI sets it). BEiT-3 uses 224 for
            pre-training and NLVR2, 480 for VQA and captioning.
        max_text_length: longest text in tokens, start and end included.
        text_tokenizer: a SentencePiece model file with XLM-R's ids (BEiT-3's ``beit3.spm``); None = open_clip's BPE.
            The model's (the mmoe CLI sets it).
        crop_scale: RandomResizedCrop area range for training images; None = the whole image, no random crop.
        hflip: random horizontal flips of training images (NLVR2: each image separately; texts are not changed).
        randaugment: BEiT-3's RandAugment (2 operations, magnitude 7, no colour changes:
            :class:`mmoe.data.transforms.RandAugment`) on training images after the crop and flip, as its VQA, NLVR2
            and captioning recipes; evaluation and prediction images are never augmented.
        shuffle_buffer: sample shuffle buffer per worker.
        num_workers: DataLoader workers (0 = in the main process).
        seed: seeds shuffling and every random choice of the data (crops, flips, masks, the pre-training stream).
        data_root: the folder every relative shard argument lies under (a config's corpus: pointing the config at
            another corpus, e.g. a demo run's, is this one option); None = relative to the working directory.
    """

    def __init__(
        self,
        batch_size: int = 32,
        image_size: int = 224,
        max_text_length: int = 64,
        text_tokenizer: str | None = None,
        crop_scale: tuple[float, float] | None = (0.5, 1.0),
        hflip: bool = True,
        randaugment: bool = False,
        shuffle_buffer: int = 1000,
        num_workers: int = 2,
        seed: int = 0,
        data_root: str | None = None,
    ) -> None:
        super().__init__()
        if num_workers < 0:
            raise ValueError(f"num_workers must be >= 0, got {num_workers!r}")
        self.save_hyperparameters()  # the subclasses' arguments too
        self.batch_size, self.image_size = batch_size, image_size
        try:
            self.tokenizer = TextTokenizer(max_text_length, text_tokenizer)
        except (FileNotFoundError, ValueError) as error:
            raise type(error)(f"data.text_tokenizer: {error}") from None
        self.crop_scale, self.hflip, self.randaugment = crop_scale, hflip, randaugment
        self.num_workers, self.shuffle_buffer, self.seed = num_workers, shuffle_buffer, seed
        self.data_root = None if data_root is None else Path(data_root)
        self.skipped: dict[str, dict[str, SkipCount]] = {}  # split -> its latest loader's counts

    def _transform(self, train: bool) -> tuple[Callable, int]:
        """The image transform of training or evaluation, and the smallest decoded side it needs."""
        if not train:
            return eval_transform(self.image_size), self.image_size
        transform = train_transform(self.image_size, self.crop_scale, self.hflip, self.randaugment)
        return transform, _min_side(self.image_size, self.crop_scale)

    def _stream(
        self,
        split: str,
        shards: ShardSpec,
        decode: Decoder,
        collate: Collator,
        batch_size: int,
        train: bool,
        repeat: bool = False,
    ) -> ShardStream:
        return ShardStream(
            resolve_shards(shards),
            decode,
            collate,
            batch_size,
            drop_last=train,
            shuffle_buffer=self.shuffle_buffer if train else 0,
            repeat=repeat,
            seed=self.seed,
            name=split,
        )

    def _loader(self, split: str, dataset) -> EpochDataLoader:
        self.skipped[split] = {}
        return EpochDataLoader(
            dataset,
            batch_size=None,
            num_workers=self.num_workers,
            pin_memory=torch.cuda.is_available(),
            skipped=self.skipped[split],
        )

    def rooted(self, spec: ShardSpec) -> ShardSpec:
        """``spec`` with every relative path under ``data_root`` (as it is without one)."""
        if self.data_root is None or not spec:
            return spec
        if isinstance(spec, str):
            return spec if Path(spec).is_absolute() else str(self.data_root / spec)
        return [self.rooted(item) for item in spec]

    def checked_shards(self, **specs: ShardSpec) -> dict[str, ShardSpec]:
        """The shard arguments under ``data_root``; fails at construction, naming the argument and the path, when
        given shards do not exist or do not agree with their manifest."""
        rooted = {name: self.rooted(spec) for name, spec in specs.items()}
        for name, spec in rooted.items():
            if spec:
                try:
                    resolve_shards(spec)
                except FileNotFoundError as error:
                    raise FileNotFoundError(f"data.{name}: {error}") from None
                except ValueError as error:
                    raise ValueError(f"data.{name}: {error}") from None
        return rooted

    def skip_counts(self) -> dict[str, SkipCount]:
        """Stream name (``train/pair``, ``val``, ...) -> samples skipped on the way to the batches used so far."""
        totals: dict[str, SkipCount] = {}
        for counts in self.skipped.values():
            add_skips(totals, counts)
        return totals

    def skipped_samples(self) -> dict[str, int]:
        """Stream name -> number of samples skipped so far (corrupt or lost; DataLoader workers included)."""
        return {stream: count.total for stream, count in self.skip_counts().items()}

    def teardown(self, stage: str) -> None:
        """Says on stderr how many samples each stream skipped in this ``stage`` (fit, validate, test, predict)."""
        stage = getattr(stage, "value", stage)  # Lightning passes its TrainerFn enum
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else None
        where = "" if rank is None else f" (rank {rank})"
        print(f"mmoe {stage}: samples skipped{where}: {describe_skips(self.skip_counts())}", file=sys.stderr)


class PretrainDataModule(ShardDataModule):
    """BEiT-3 masked data modeling batches from image-only, text-only and image-text pair shards.

    Training batches come from one stream at a time, drawn with the given weights (or, with ``joint``, one batch of
    every stream per step as ``{kind: batch}``); streams repeat without end, and an epoch is ``batches_per_epoch``
    batches. Every batch has ``kind`` (``"image"``, ``"text"`` or ``"pair"``) and ``key`` (sample keys); the types are
    :mod:`mmoe.data.batches` (``ImageBatch``, ``TextBatch``, ``PairBatch``, ``JointBatch``):

    * image: ``image`` (B, 3, S, S), ``image_mask`` (B, N) bool, block-wise, ``image_ratio`` of the patches;
    * text: ``text_ids`` (B, T) masked input, ``text_targets`` (B, T) original ids, ``text_mask`` (B, T) bool,
      ``text_padding_mask`` (B, T) bool;
    * pair: all of the above; ``image_mask`` is all False unless ``masking.mask_pair_images``.

    Validation (optional val shards) reads each stream once with fixed masks.

    Args:
        image_shards: image-only shards (``mmoe data convert images``).
        text_shards: text-only shards (``mmoe data convert text``).
        pair_shards: image-text shards (``mmoe data convert tsv``, or caption shards).
        val_image_shards: validation image shards.
        val_text_shards: validation text shards.
        val_pair_shards: validation pair shards.
        image_weight: relative frequency of image batches.
        text_weight: relative frequency of text batches.
        pair_weight: relative frequency of pair batches.
        joint: one batch of every stream per training step instead of a weighted mixture.
        patch_size: the model's patch side; the mask grid is (S / patch_size)^2.
        masking: masking ratios (BEiT-3's) and replacement fractions (BERT's 80/10/10).
        batches_per_epoch: training batches (steps, with ``joint``) per epoch and process.
        **loader: the loader, image and text arguments of :class:`ShardDataModule` (batch size, image size, ...).
    """

    def __init__(
        self,
        image_shards: ShardSpec = None,
        text_shards: ShardSpec = None,
        pair_shards: ShardSpec = None,
        val_image_shards: ShardSpec = None,
        val_text_shards: ShardSpec = None,
        val_pair_shards: ShardSpec = None,
        image_weight: float = 1.0,
        text_weight: float = 1.0,
        pair_weight: float = 1.0,
        joint: bool = False,
        patch_size: int = 16,
        masking: MaskingConfig | None = None,
        batches_per_epoch: int | None = 1000,
        **loader,
    ) -> None:
        super().__init__(**loader)
        if self.image_size % patch_size:
            raise ValueError(f"image_size={self.image_size} is not divisible by patch_size={patch_size}")
        if not any((image_shards, text_shards, pair_shards)):
            raise ValueError("PretrainDataModule needs at least one of image_shards, text_shards, pair_shards")
        shards = self.checked_shards(
            image_shards=image_shards,
            text_shards=text_shards,
            pair_shards=pair_shards,
            val_image_shards=val_image_shards,
            val_text_shards=val_text_shards,
            val_pair_shards=val_pair_shards,
        )
        self.train_shards = {IMAGE: shards["image_shards"], TEXT: shards["text_shards"], PAIR: shards["pair_shards"]}
        self.val_shards = {
            IMAGE: shards["val_image_shards"],
            TEXT: shards["val_text_shards"],
            PAIR: shards["val_pair_shards"],
        }
        self.weights = {IMAGE: image_weight, TEXT: text_weight, PAIR: pair_weight}
        self.joint = joint
        self.grid = (self.image_size // patch_size, self.image_size // patch_size)
        self.masking = masking or MaskingConfig()
        self.batches_per_epoch = batches_per_epoch

    def _decoder(self, kind: BatchKind, train: bool) -> Decoder:
        transform, min_side = self._transform(train)
        if kind == IMAGE:
            return ImageDecoder(transform, min_side)
        if kind == TEXT:
            return TextDecoder(self.tokenizer)
        return PairDecoder(transform, self.tokenizer, min_side)

    def _mixture(self, shards: dict[BatchKind, ShardSpec], train: bool) -> StreamMixture:
        streams = {
            kind: self._stream(
                f"{'train' if train else 'val'}/{kind}",
                spec,
                self._decoder(kind, train),
                PretrainCollator(kind, self.grid, self.masking, self.tokenizer),
                self.batch_size,
                train=train,
                repeat=train,
            )
            for kind, spec in shards.items()
            if spec
        }
        return StreamMixture(
            streams,
            {kind: self.weights[kind] for kind in streams},
            seed=self.seed,
            batches_per_epoch=self.batches_per_epoch if train else None,
            joint=self.joint and train,
        )

    def train_dataloader(self) -> EpochDataLoader:
        return self._loader("train", self._mixture(self.train_shards, train=True))

    def val_dataloader(self) -> EpochDataLoader | list:
        if not any(self.val_shards.values()):
            return []
        return self._loader("val", self._mixture(self.val_shards, train=False))


class FinetuneDataModule(ShardDataModule):
    """Train / val / test loaders over one task's shards (``predict`` reads the test shards).

    Args:
        train_shards: training shards.
        val_shards: validation shards.
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
        max_text_length: longest caption in tokens (BEiT-3 captioning: 32).
        mask_ratio: share of caption tokens masked for training (BEiT-3 default 0.6, recipes 0.7).
        **shards: the splits' shards (e.g. ``coco-karpathy-train-restval``, ``coco-karpathy-val``,
            ``coco-karpathy-test``) and the loader arguments of :class:`FinetuneDataModule`.
    """

    def __init__(self, max_text_length: int = 32, mask_ratio: float = 0.6, **shards) -> None:
        super().__init__(max_text_length=max_text_length, **shards)
        if not 0.0 < mask_ratio <= 1.0:
            raise ValueError(f"mask_ratio must lie in (0, 1], got {mask_ratio!r}")
        self.mask_ratio = mask_ratio

    def _decoder(self, train: bool) -> Decoder:
        transform, min_side = self._transform(train)
        return CaptionDecoder(transform, self.tokenizer, "train" if train else "eval", min_side)

    def _collator(self, train: bool) -> Collator:
        return CaptionCollator(self.mask_ratio if train else 0.0, self.tokenizer)
