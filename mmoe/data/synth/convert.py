"""Converting a corpus laid out as ``data/README.md`` documents (the synthetic one, or the real datasets) into
shards: the same converter calls as the documented ``mmoe data convert`` commands, one output folder per split."""

from __future__ import annotations

import os
from pathlib import Path

from mmoe.data.converters import (
    convert_coco_captions,
    convert_images,
    convert_karpathy,
    convert_nlvr2,
    convert_text,
    convert_tsv,
    convert_vqav2,
)
from mmoe.data.shards import Manifest


def convert_layout(root: str | os.PathLike, out: str | os.PathLike, shard_size: int = 1000) -> dict[str, Manifest]:
    """Converts every split found under ``root`` into ``out/<name>/``; returns name -> manifest.

    VQAv2 train2014 comes first: it writes the answer vocabulary the other VQA splits use.
    """
    root, out = Path(root), Path(out)
    coco, vqa, nlvr2, pretrain = root / "coco", root / "vqav2", root / "nlvr2", root / "pretrain"
    done: dict[str, Manifest] = {}

    def keep(manifest: Manifest) -> None:
        done[manifest.name] = manifest

    vocab = out / "vqav2-train2014" / "answers.json"
    for subtype in ("train2014", "val2014", "test2015", "test-dev2015"):
        questions = vqa / f"v2_OpenEnded_mscoco_{subtype}_questions.json"
        if not questions.exists():
            continue
        annotations = vqa / f"v2_mscoco_{subtype}_annotations.json"
        keep(
            convert_vqav2(
                questions,
                coco,
                out / f"vqav2-{subtype}",
                annotations=annotations if annotations.exists() else None,
                answer_vocab=vocab if annotations.exists() and subtype != "train2014" else None,
                shard_size=shard_size,
            )
        )
    for subtype in ("train2014", "val2014"):
        captions = coco / "annotations" / f"captions_{subtype}.json"
        if captions.exists():
            keep(convert_coco_captions(captions, coco, out / f"coco-captions-{subtype}", shard_size=shard_size))
    karpathy = coco / "karpathy" / "dataset_coco.json"
    if karpathy.exists():
        for split in ("train,restval", "val", "test"):
            name = f"coco-karpathy-{split.replace(',', '-')}"
            keep(convert_karpathy(karpathy, split, coco, out / name, shard_size=shard_size))
    for split in ("train", "dev", "test1"):
        if (nlvr2 / f"{split}.json").exists():
            keep(
                convert_nlvr2(nlvr2 / f"{split}.json", nlvr2 / "images", out / f"nlvr2-{split}", shard_size=shard_size)
            )
    if (coco / "train2014").is_dir():
        keep(convert_images(coco / "train2014", out / "pretrain-images", shard_size, name="pretrain-images"))
    if (pretrain / "pairs.tsv").exists():
        keep(convert_tsv(pretrain / "pairs.tsv", coco, out / "pretrain-pairs", shard_size, name="pretrain-pairs"))
    if (pretrain / "text.txt").exists():
        keep(convert_text([pretrain / "text.txt"], out / "pretrain-text", shard_size, name="pretrain-text"))
    return done
