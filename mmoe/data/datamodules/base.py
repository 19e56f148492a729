"""What every mmoe DataModule shares: the loader, image and text arguments, shard streams under ``data_root``,
resumable loaders, and the count of the samples they skipped."""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Callable
from pathlib import Path

import lightning as L
import torch
from lightning.fabric.utilities.rank_zero import rank_zero_only

from mmoe.data.accounting import SkipCount, add_skips, describe_skips
from mmoe.data.img2dataset import not_downloaded
from mmoe.data.loader import EpochDataLoader
from mmoe.data.remote import RemoteReading
from mmoe.data.samples import Collator, Decoder
from mmoe.data.shards import resolve_shards
from mmoe.data.streams import ShardStream
from mmoe.data.tokenizer import DEFAULT_MAX_TEXT_LENGTH, TextTokenizer
from mmoe.data.transforms import eval_transform, train_transform

ShardSpec = str | list[str] | None


def _min_side(image_size: int, crop_scale: tuple[float, float] | None) -> int:
    """Smallest decoded side that still gives ``image_size`` pixels for the smallest random crop."""
    return image_size if crop_scale is None else math.ceil(image_size / math.sqrt(crop_scale[0]))


def _say_not_downloaded(specs) -> None:
    """One stderr line per indexed img2dataset folder among ``specs`` that lost samples before the run (failed
    downloads: :func:`mmoe.data.img2dataset.not_downloaded`), said once, by the first process."""
    single = (str, os.PathLike)
    folders = {os.fspath(item) for spec in specs if spec for item in ([spec] if isinstance(spec, single) else spec)}
    for folder in sorted(item for item in folders if os.path.isdir(item)):
        line = not_downloaded(folder)
        if line and rank_zero_only.rank == 0:
            print(line, file=sys.stderr)


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
        shuffle_buffer: sample shuffle buffer per worker (0 = shard order); no batch of a pre-training stream, which
            repeats its corpus, holds one sample twice (data/README.md, DataModules).
        num_workers: DataLoader workers (0 = in the main process).
        seed: seeds shuffling and every random choice of the data (crops, flips, masks, the pre-training stream).
        data_root: the folder every relative shard argument lies under (a config's corpus: pointing the config at
            another corpus, e.g. a demo run's, is this one option); None = relative to the working directory.
        remote_retries: how often a remote shard (``s3://``, ``gs://``, ``hf://``, ``https://``) is reopened, in a
            row, after a transient error, continuing at the byte it stopped at (:mod:`mmoe.data.remote`); what still
            cannot be read is counted as lost.
        remote_read_timeout_s: the longest wait for the next bytes of an ``https://`` shard before the read counts
            as failed and is retried (a stalled server); a slow, steady transfer never times out.
        remote_max_member_mib: the largest tar member a remote shard may hold (MiB); a larger one is refused
            unread and the rest of its shard counted as lost (a body that never ends cannot fill the memory).
    """

    def __init__(
        self,
        batch_size: int = 32,
        image_size: int = 224,
        max_text_length: int = DEFAULT_MAX_TEXT_LENGTH,
        text_tokenizer: str | None = None,
        crop_scale: tuple[float, float] | None = (0.5, 1.0),
        hflip: bool = True,
        randaugment: bool = False,
        shuffle_buffer: int = 1000,
        num_workers: int = 2,
        seed: int = 0,
        data_root: str | None = None,
        remote_retries: int = 3,
        remote_read_timeout_s: float = 60.0,
        remote_max_member_mib: int = 256,
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
        self.remote = RemoteReading(
            retries=remote_retries, read_timeout_s=remote_read_timeout_s, max_member_bytes=remote_max_member_mib << 20
        )
        self.skipped: dict[str, dict[str, SkipCount]] = {}  # split -> its latest loader's counts

    def has_validation(self) -> bool:
        """Whether the DataModule was given a validation split."""
        raise NotImplementedError

    def setup(self, stage: str) -> None:
        """A fit without a validation split does not validate: the trainer's ``limit_val_batches`` is set to 0, the
        way Lightning turns validation off (an empty ``val_dataloader`` alone makes it warn that the loader's total
        length is zero)."""
        if stage == "fit" and self.trainer is not None and not self.has_validation():
            self.trainer.limit_val_batches = 0

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
        seed_offset: int = 0,
        reports: bool = True,
    ) -> ShardStream:
        """A stream over ``shards``; ``seed_offset`` gives a second stream over the same shards its own order, and
        ``reports=False`` leaves its skip counts to the stream that reports those shards."""
        return ShardStream(
            resolve_shards(shards),
            decode,
            collate,
            batch_size,
            drop_last=train,
            shuffle_buffer=self.shuffle_buffer if train else 0,
            repeat=repeat,
            seed=self.seed + seed_offset,
            name=split,
            reports=reports,
            remote=self.remote,
        )

    def _loader(self, split: str, dataset) -> EpochDataLoader:
        self.skipped[split] = {}
        if self.num_workers > 0:
            self.tokenizer.load()  # once per process, before the workers start: they inherit it
        return EpochDataLoader(
            dataset,
            batch_size=None,
            num_workers=self.num_workers,
            pin_memory=torch.cuda.is_available(),
            skipped=self.skipped[split],
        )

    def rooted(self, spec: ShardSpec) -> ShardSpec:
        """``spec`` with every relative path under ``data_root`` (as it is without one); URLs stay as they are."""
        if self.data_root is None or not spec:
            return spec
        if isinstance(spec, str):
            url = "://" in spec or spec.startswith("pipe:")
            return spec if url or Path(spec).is_absolute() else str(self.data_root / spec)
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
                except (ValueError, ImportError, OSError) as error:  # the package a URL needs; a refused request
                    raise ValueError(f"data.{name}: {error}") from None
        _say_not_downloaded(rooted.values())
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
        self.report_skips(stage)

    def report_skips(self, stage: str) -> None:
        """One stderr line: how many samples each stream skipped so far in ``stage`` (also said when a run is stopped
        by a signal, where Lightning calls no ``teardown``)."""
        stage = getattr(stage, "value", stage)  # Lightning passes its TrainerFn enum
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else None
        where = "" if rank is None else f" (rank {rank})"
        print(f"mmoe {stage}: samples skipped{where}: {describe_skips(self.skip_counts())}", file=sys.stderr)
