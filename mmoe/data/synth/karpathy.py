"""The synthetic corpus's Karpathy split files: ``dataset_coco.json`` (train2014 images for training, val2014's
thirds as val / test / restval) and ``dataset_flickr30k.json`` (the same images, val2014's halves as val / test), in
Karpathy's record layout (``imgid`` a running index, ``sentences`` with ``raw`` and ``tokens``)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol


class CaptionedImage(Protocol):
    """What a split file records of an image."""

    image_id: int
    subtype: str
    file_name: str
    captions: list[str]


def karpathy_records(
    images: Sequence[CaptionedImage], record: Callable[[int, CaptionedImage], dict[str, Any]]
) -> list[dict[str, Any]]:
    """One record per image, ``record(imgid, image)`` plus its ``imgid``, ``sentences`` and ``sentids`` (sentence
    ids running over the file)."""
    records, sentence_id = [], 0
    for index, image in enumerate(images):
        sentences = []
        for caption in image.captions:
            tokens = caption.replace(":", "").replace(",", "").split()
            sentences.append({"raw": caption, "tokens": tokens, "imgid": index, "sentid": sentence_id})
            sentence_id += 1
        sentence_ids = [s["sentid"] for s in sentences]
        records.append({**record(index, image), "imgid": index, "sentences": sentences, "sentids": sentence_ids})
    return records


def coco_document(train: Sequence[CaptionedImage], val: Sequence[CaptionedImage]) -> dict[str, Any]:
    """``dataset_coco.json``: images at ``<subtype>/<file name>``, id ``cocoid``."""
    thirds = max(1, len(val) // 3)

    def record(index: int, image: CaptionedImage) -> dict[str, Any]:
        position = index - len(train)
        split = (
            "train" if position < 0 else "val" if position < thirds else "test" if position < 2 * thirds else "restval"
        )
        return {"filepath": image.subtype, "filename": image.file_name, "split": split, "cocoid": image.image_id}

    return {"images": karpathy_records([*train, *val], record), "dataset": "coco"}


def flickr30k_document(train: Sequence[CaptionedImage], val: Sequence[CaptionedImage]) -> dict[str, Any]:
    """``dataset_flickr30k.json``: images named ``<imgid>.jpg`` in one folder."""
    half = max(1, len(val) // 2)

    def record(index: int, image: CaptionedImage) -> dict[str, Any]:
        position = index - len(train)
        split = "train" if position < 0 else "val" if position < half else "test"
        return {"filename": f"{index}.jpg", "split": split}

    return {"images": karpathy_records([*train, *val], record), "dataset": "flickr30k"}
