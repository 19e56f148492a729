"""BEiT-3 pre-training batches: image-only, text-only and image-text pair streams with their masks, mixed per step."""

from __future__ import annotations

import sys
from collections.abc import Callable

import torch

from mmoe.data.batches import IMAGE, PAIR, TEXT, BatchKind
from mmoe.data.collate import PretrainCollator
from mmoe.data.datamodules.base import ShardDataModule, ShardSpec
from mmoe.data.decoders import ImageDecoder, PairDecoder, TextDecoder
from mmoe.data.loader import EpochDataLoader
from mmoe.data.masking import MaskingConfig
from mmoe.data.mixture import StreamMixture
from mmoe.data.samples import Decoder


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

    A corpus of pairs alone pre-trains every objective (``objectives_from_pairs``): the image-only and text-only
    objectives draw from ``pair_shards`` (their images, or their captions), as BEiT-3's data mixes allow, each in its
    own shuffled order; the run says so on stderr when the DataModule is made. Skipped and left-out samples of the
    pair shards are counted once, under ``train/pair``.

    Args:
        image_shards: image-only shards (``mmoe data convert images``).
        text_shards: text-only shards (``mmoe data convert text``).
        pair_shards: image-text shards (``mmoe data convert tsv``, or caption shards).
        val_image_shards: validation image shards.
        val_text_shards: validation text shards.
        val_pair_shards: validation pair shards. With no validation shards at all, a fit does not validate.
        image_weight: relative frequency of image batches.
        text_weight: relative frequency of text batches.
        pair_weight: relative frequency of pair batches.
        joint: one batch of every stream per training step instead of a weighted mixture.
        objectives_from_pairs: whether the image-only and text-only objectives without shards of their own draw
            from ``pair_shards``: None = when pairs are the only training shards and ``joint`` is on (a pairs-only
            corpus such as CC3M, CC12M or LAION); True = whenever one of them has no shards; False = never.
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
        objectives_from_pairs: bool | None = None,
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
        #: The objectives whose training batches come from the pair shards (no shards of their own given).
        self.from_pairs = self._objectives_from_pairs(objectives_from_pairs, joint)
        self.joint = joint
        self.grid = (self.image_size // patch_size, self.image_size // patch_size)
        self.masking = masking or MaskingConfig()
        self.batches_per_epoch = batches_per_epoch
        #: The visual tokens of a batch's images, computed by the loader's collators when the task hands it over
        #: before the loaders are made (the VQ-KD codes of a CPU run with workers); None = the task computes them.
        self.image_targets: Callable[[torch.Tensor], torch.Tensor] | None = None

    def _objectives_from_pairs(self, wanted: bool | None, joint: bool) -> list[BatchKind]:
        """The objectives without shards that draw from the pairs (``objectives_from_pairs``), said on stderr."""
        if wanted is None:
            wanted = joint and not (self.train_shards[IMAGE] or self.train_shards[TEXT])
        kinds = [kind for kind in (IMAGE, TEXT) if wanted and self.train_shards[PAIR] and not self.train_shards[kind]]
        for kind in kinds:
            self.train_shards[kind] = self.train_shards[PAIR]
        if kinds:
            objectives = " and ".join(f"{kind}-only" for kind in kinds)
            print(
                f"mmoe: no {' or '.join(f'{kind}_shards' for kind in kinds)} given: the {objectives} objective"
                f"{'s' if len(kinds) > 1 else ''} draw{'' if len(kinds) > 1 else 's'} from pair_shards, in "
                "their own shuffled order (skips of the pair shards are counted under train/pair)",
                file=sys.stderr,
            )
        return kinds

    def _decoder(self, kind: BatchKind, train: bool) -> Decoder:
        transform, min_side = self._transform(train)
        if kind == IMAGE:
            return ImageDecoder(transform, min_side)
        if kind == TEXT:
            return TextDecoder(self.tokenizer)
        return PairDecoder(transform, self.tokenizer, min_side)

    def _mixture(self, shards: dict[BatchKind, ShardSpec], train: bool) -> StreamMixture:
        drawn = self.from_pairs if train else []
        streams = {
            kind: self._stream(
                f"{'train' if train else 'val'}/{kind}",
                spec,
                self._decoder(kind, train),
                PretrainCollator(kind, self.grid, self.masking, self.tokenizer, self.image_targets),
                self.batch_size,
                train=train,
                repeat=train,
                seed_offset=1 + drawn.index(kind) if kind in drawn else 0,
                reports=kind not in drawn,
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

    def has_validation(self) -> bool:
        return any(self.val_shards.values())

    def val_dataloader(self) -> EpochDataLoader | list:
        if not self.has_validation():
            return []
        return self._loader("val", self._mixture(self.val_shards, train=False))
