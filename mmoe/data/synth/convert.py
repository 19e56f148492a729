"""Converting a corpus laid out as ``data/README.md`` documents (the synthetic one, or the real datasets) into
shards: the same converter calls as the documented ``mmoe data convert`` commands, one output folder per split."""

from __future__ import annotations

import os
from collections.abc import Callable
from functools import partial
from pathlib import Path

from mmoe.data.converters import (
    convert_coco_captions,
    convert_imagenet,
    convert_images,
    convert_karpathy,
    convert_nlvr2,
    convert_text,
    convert_tsv,
    convert_vqav2,
)
from mmoe.data.processes import run_in_processes
from mmoe.data.shards import Manifest
from mmoe.data.synth.layout import (
    PRETRAIN_IMAGE_SPLIT,
    PRETRAIN_PAIR_SPLIT,
    PRETRAIN_TEXT_SPLIT,
    CorpusLayout,
    answer_vocab_in,
    classification_split,
    coco_captions_split,
    flickr30k_split,
    karpathy_split,
    nlvr2_split,
    vqa_split,
)

__all__ = ["convert_layout"]

Job = Callable[[], Manifest]


def _vqa_jobs(layout: CorpusLayout, out: Path, shard_size: int) -> tuple[list[Job], list[Job]]:
    """The VQAv2 splits present: (train2014, the others); the others read the answer vocabulary train2014 writes."""
    training: list[Job] = []
    after_vocabulary: list[Job] = []
    for subtype in ("train2014", "val2014", "test2015", "test-dev2015"):
        questions = layout.vqa_questions(subtype)
        if not questions.exists():
            continue
        annotations = layout.vqa_annotations(subtype)
        (training if subtype == "train2014" else after_vocabulary).append(
            partial(
                convert_vqav2,
                questions,
                layout.vqa_images,
                out / vqa_split(subtype),
                annotations=annotations if annotations.exists() else None,
                answer_vocab=answer_vocab_in(out) if annotations.exists() and subtype != "train2014" else None,
                shard_size=shard_size,
            )
        )
    return training, after_vocabulary


def _caption_jobs(layout: CorpusLayout, out: Path, shard_size: int) -> list[Job]:
    """The official COCO captions splits, then the Karpathy COCO and Flickr30K splits present."""
    jobs: list[Job] = []
    for subtype in ("train2014", "val2014"):
        captions = layout.coco_captions(subtype)
        if captions.exists():
            folder = out / coco_captions_split(subtype)
            jobs.append(partial(convert_coco_captions, captions, layout.coco_images, folder, shard_size=shard_size))
    karpathy_files = (
        (layout.karpathy_coco, layout.coco_images, karpathy_split, ("train,restval", "val", "test")),
        (layout.karpathy_flickr, layout.flickr_images, flickr30k_split, ("train", "val", "test")),
    )
    for karpathy, images, folder_of, splits in karpathy_files:
        if karpathy.exists():
            jobs += [
                partial(convert_karpathy, karpathy, split, images, out / folder_of(split), shard_size=shard_size)
                for split in splits
            ]
    return jobs


def _nlvr2_jobs(layout: CorpusLayout, out: Path, shard_size: int) -> list[Job]:
    """The NLVR2 splits present."""
    records = {split: layout.nlvr2_records(split) for split in ("train", "dev", "test1")}
    return [
        partial(convert_nlvr2, path, layout.nlvr2_images, out / nlvr2_split(split), shard_size=shard_size)
        for split, path in records.items()
        if path.exists()
    ]


def _pretrain_jobs(layout: CorpusLayout, out: Path, shard_size: int) -> list[Job]:
    """The pre-training images (COCO train2014), image-text pairs and texts present."""
    jobs: list[Job] = []
    images, folder = layout.coco_split_images("train2014"), out / PRETRAIN_IMAGE_SPLIT
    if images.is_dir():
        jobs.append(partial(convert_images, images, folder, shard_size, PRETRAIN_IMAGE_SPLIT))
    pairs, folder = layout.pretrain_pairs, out / PRETRAIN_PAIR_SPLIT
    if pairs.exists():
        jobs.append(partial(convert_tsv, pairs, layout.coco_images, folder, shard_size, PRETRAIN_PAIR_SPLIT))
    texts, folder = layout.pretrain_text, out / PRETRAIN_TEXT_SPLIT
    if texts.exists():
        jobs.append(partial(convert_text, [texts], folder, shard_size, PRETRAIN_TEXT_SPLIT))
    return jobs


def _classification_jobs(layout: CorpusLayout, out: Path, shard_size: int) -> list[Job]:
    """The classification train and val folders present, both labelled in the class list's index."""
    synsets = layout.imagenet_synsets
    if not synsets.exists():
        return []
    jobs: list[Job] = []
    for split in ("train", "val"):
        images, name = layout.imagenet_images(split), classification_split(split)
        solution = layout.imagenet_val_solution if split == "val" else None
        if images.is_dir():
            convert = partial(convert_imagenet, images, out / name, synsets=synsets, val_solution=solution)
            jobs.append(partial(convert, shard_size=shard_size, name=name))
    return jobs


def convert_layout(
    root: str | os.PathLike, out: str | os.PathLike, shard_size: int = 1000, workers: int = 1
) -> dict[str, Manifest]:
    """Converts every split found under ``root`` (laid out as :class:`~mmoe.data.synth.layout.CorpusLayout` names it)
    into ``out/<name>/``; returns name -> manifest.

    ``workers`` > 1 converts that many splits at once (:func:`mmoe.data.processes.run_in_processes`); the shards are
    the same. VQAv2 train2014 is converted before the other VQAv2 splits: it writes the answer vocabulary they use.
    """
    layout, out = CorpusLayout(Path(root)), Path(out)
    vqa_training, vqa_after_vocabulary = _vqa_jobs(layout, out, shard_size)
    first = vqa_training + _caption_jobs(layout, out, shard_size)
    first += _nlvr2_jobs(layout, out, shard_size) + _pretrain_jobs(layout, out, shard_size)
    first += _classification_jobs(layout, out, shard_size)
    manifests = run_in_processes(first, workers) + run_in_processes(vqa_after_vocabulary, workers)
    return {manifest.name: manifest for manifest in manifests}
