"""Converting a corpus laid out as ``data/README.md`` documents (the synthetic one, or the real datasets) into
shards: the same converter calls as the documented ``mmoe data convert`` commands, one output folder per split."""

from __future__ import annotations

import os
from collections.abc import Callable
from functools import partial
from pathlib import Path

from mmoe.data.answers import ANSWERS_FILE
from mmoe.data.converters import (
    convert_coco_captions,
    convert_images,
    convert_karpathy,
    convert_nlvr2,
    convert_text,
    convert_tsv,
    convert_vqav2,
)
from mmoe.data.processes import run_in_processes
from mmoe.data.shards import Manifest


def vqa_split(subtype: str) -> str:
    """The folder of a VQAv2 split (``train2014``, ``val2014``, ...), named as ``mmoe data convert vqav2`` names it."""
    return f"vqav2-{subtype}"


def karpathy_split(split: str) -> str:
    """The folder of a Karpathy COCO split (``"train,restval"`` joins its parts with ``-``)."""
    return f"coco-karpathy-{split.replace(',', '-')}"


def flickr30k_split(split: str) -> str:
    """The folder of a Flickr30K Karpathy split (``train``, ``val``, ``test``)."""
    return f"flickr30k-karpathy-{split}"


def nlvr2_split(split: str) -> str:
    """The folder of an NLVR2 split (``train``, ``dev``, ``test1``)."""
    return f"nlvr2-{split}"


#: The split folders :func:`convert_layout` writes that later stages name (the demo's benchmarks, the claims study).
VQA_TRAIN_SPLIT = vqa_split("train2014")
VQA_VAL_SPLIT = vqa_split("val2014")
NLVR2_DEV_SPLIT = nlvr2_split("dev")
CAPTION_TRAIN_SPLIT = karpathy_split("train,restval")
CAPTION_TEST_SPLIT = karpathy_split("test")
RETRIEVAL_TRAIN_SPLIT = flickr30k_split("train")
RETRIEVAL_TEST_SPLIT = flickr30k_split("test")
PRETRAIN_IMAGE_SPLIT = "pretrain-images"
PRETRAIN_PAIR_SPLIT = "pretrain-pairs"
PRETRAIN_TEXT_SPLIT = "pretrain-text"


def convert_layout(
    root: str | os.PathLike, out: str | os.PathLike, shard_size: int = 1000, workers: int = 1
) -> dict[str, Manifest]:
    """Converts every split found under ``root`` into ``out/<name>/``; returns name -> manifest.

    ``workers`` > 1 converts that many splits at once (:func:`mmoe.data.processes.run_in_processes`); the shards are
    the same. VQAv2 train2014 is converted before the other VQAv2 splits: it writes the answer vocabulary they use.
    """
    root, out = Path(root), Path(out)
    coco, vqa, nlvr2, pretrain = root / "coco", root / "vqav2", root / "nlvr2", root / "pretrain"
    flickr = root / "flickr30k"
    first: list[Callable[[], Manifest]] = []  # VQAv2 train2014 and the splits that need nothing of it
    after_vocabulary: list[Callable[[], Manifest]] = []

    vocab = out / VQA_TRAIN_SPLIT / ANSWERS_FILE
    for subtype in ("train2014", "val2014", "test2015", "test-dev2015"):
        questions = vqa / f"v2_OpenEnded_mscoco_{subtype}_questions.json"
        if not questions.exists():
            continue
        annotations = vqa / f"v2_mscoco_{subtype}_annotations.json"
        (first if subtype == "train2014" else after_vocabulary).append(
            partial(
                convert_vqav2,
                questions,
                coco,
                out / vqa_split(subtype),
                annotations=annotations if annotations.exists() else None,
                answer_vocab=vocab if annotations.exists() and subtype != "train2014" else None,
                shard_size=shard_size,
            )
        )
    for subtype in ("train2014", "val2014"):
        captions = coco / "annotations" / f"captions_{subtype}.json"
        if captions.exists():
            first.append(
                partial(convert_coco_captions, captions, coco, out / f"coco-captions-{subtype}", shard_size=shard_size)
            )
    karpathy = coco / "karpathy" / "dataset_coco.json"
    if karpathy.exists():
        for split in ("train,restval", "val", "test"):
            first.append(
                partial(convert_karpathy, karpathy, split, coco, out / karpathy_split(split), shard_size=shard_size)
            )
    if (flickr / "dataset_flickr30k.json").exists():
        for split in ("train", "val", "test"):
            first.append(
                partial(
                    convert_karpathy, flickr / "dataset_flickr30k.json", split, flickr / "images",
                    out / flickr30k_split(split), shard_size=shard_size,
                )
            )  # fmt: skip
    for split in ("train", "dev", "test1"):
        if (nlvr2 / f"{split}.json").exists():
            first.append(
                partial(
                    convert_nlvr2, nlvr2 / f"{split}.json", nlvr2 / "images", out / nlvr2_split(split),
                    shard_size=shard_size,
                )
            )  # fmt: skip
    if (coco / "train2014").is_dir():
        first.append(
            partial(convert_images, coco / "train2014", out / PRETRAIN_IMAGE_SPLIT, shard_size, PRETRAIN_IMAGE_SPLIT)
        )
    if (pretrain / "pairs.tsv").exists():
        first.append(
            partial(
                convert_tsv, pretrain / "pairs.tsv", coco, out / PRETRAIN_PAIR_SPLIT, shard_size, PRETRAIN_PAIR_SPLIT
            )
        )
    if (pretrain / "text.txt").exists():
        first.append(
            partial(convert_text, [pretrain / "text.txt"], out / PRETRAIN_TEXT_SPLIT, shard_size, PRETRAIN_TEXT_SPLIT)
        )
    manifests = run_in_processes(first, workers) + run_in_processes(after_vocabulary, workers)
    return {manifest.name: manifest for manifest in manifests}
