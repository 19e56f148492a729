"""Lightning DataModules reading webdataset shards: pre-training (image / text / pair streams with BEiT-3 masks) and
fine-tuning on VQAv2, NLVR2, COCO captioning, image-text retrieval and image classification.

Shard arguments accept what :func:`mmoe.data.shards.resolve_shards` accepts: a converter's output folder, a glob, a
brace pattern, or a list of these. Loaders yield ready batches (``batch_size=None`` DataLoaders over iterable
datasets); each process and DataLoader worker reads a disjoint part of the shards. Batch keys are listed on each class
and in :mod:`mmoe.data.collate`.

The classes live in :mod:`~mmoe.data.datamodules.base` (what they share), :mod:`~mmoe.data.datamodules.pretrain` and
:mod:`~mmoe.data.datamodules.finetune`; configs name them here (``mmoe.data.datamodules.VQADataModule``).
"""

from mmoe.data.datamodules.base import ShardDataModule, ShardSpec
from mmoe.data.datamodules.classification import ClassificationDataModule
from mmoe.data.datamodules.finetune import (
    CaptioningDataModule,
    FinetuneDataModule,
    NLVR2DataModule,
    RetrievalDataModule,
    VQADataModule,
)
from mmoe.data.datamodules.pretrain import PretrainDataModule

__all__ = [
    "CaptioningDataModule",
    "ClassificationDataModule",
    "FinetuneDataModule",
    "NLVR2DataModule",
    "PretrainDataModule",
    "RetrievalDataModule",
    "ShardDataModule",
    "ShardSpec",
    "VQADataModule",
]
