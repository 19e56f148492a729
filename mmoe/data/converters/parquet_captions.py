"""COCO captions (Karpathy split) and Flickr30K from HF parquet: the readers of their rows, whose
:class:`~mmoe.data.converters.records.CaptionedImage` records :mod:`.build_captions` writes as the shards
:func:`convert_karpathy` writes from Karpathy's split files: one sample per image with all its captions, byte for byte
the same when the rows hold the same records and image files.

COCO: the rows are Karpathy's image records (``cocoid``, ``filepath``, ``filename``, ``split``, ``sentences``) with
an ``image`` column. Some copies hold one row per image (``sentences`` a list of ``{raw, tokens, imgid, sentid}``),
some one row per sentence (``sentences`` one such struct; the rows of an image must agree on its file and split):
both give one sample per image, in the order of each image's first row, its captions in row order. ``split`` chooses
the rows by their ``split`` field, as ``--split`` chooses records of ``dataset_coco.json``. Karpathy's test split has
5,000 images; chosen ``test`` rows holding another count (some copies hold 5,006) are refused, naming the count:
their scores would not compare with published ones (``test_images`` sets the count for smaller corpora).

Flickr30K: ``lmms-lab/flickr30k`` holds every Flickr30K image (31,783 rows) in one ``test`` split, not Karpathy's
1,000-image test set, so the split is chosen from Karpathy's ``dataset_flickr30k.json`` (required): its records give
the image ids (``imgid``), splits and captions, read exactly as :func:`convert_karpathy` reads them, and the parquet
rows give the images, matched by ``filename`` (the rows' ``caption`` and ``img_id`` are not read). Samples follow the
rows' order; a chosen image no row holds is skipped and counted as missing.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mmoe.data.converters.build_captions import CaptionSet, write_caption_split
from mmoe.data.converters.coco import (
    KarpathyImage,
    karpathy_dataset,
    karpathy_images,
    karpathy_record,
    karpathy_splits,
)
from mmoe.data.converters.common import ConversionError, Skip, load_json
from mmoe.data.converters.parquet import (
    INTEGER,
    TEXT,
    ImageCell,
    ParquetRows,
    either,
    list_of,
    required,
    struct_with,
)
from mmoe.data.converters.records import CaptionedImage
from mmoe.data.shards import Manifest
from mmoe.data.tokenizer import TextTokenizer

#: Images in Karpathy's COCO test split.
KARPATHY_TEST_IMAGES = 5000
SENTENCE = struct_with("raw", TEXT)
KARPATHY_COLUMNS = {
    "cocoid": INTEGER,
    "filepath": TEXT,
    "filename": TEXT,
    "split": TEXT,
    "sentences": either(list_of(SENTENCE), SENTENCE),
}
FLICKR30K_NEEDS_SPLIT_FILE = (
    "flickr30k --parquet needs --karpathy dataset_flickr30k.json: the Hub's Flickr30K parquet (lmms-lab/flickr30k) "
    "holds all 31,783 images in one 'test' split, not Karpathy's 1,000-image test set, which the split file chooses"
)


@dataclass
class ImageRows:
    """One chosen image of a Karpathy parquet copy: its first row and its record fields."""

    where: str
    file_name: str
    split: str


def _sentences(row: dict[str, Any], where: str) -> list[tuple[str, str]]:
    """(``where`` of the sentence, its raw text) of a row: a list of sentences, or one sentence per row."""
    sentences = required(row, "sentences", where)
    if isinstance(sentences, list):
        found = [(f"{where}: sentences[{i}]", sentence) for i, sentence in enumerate(sentences)]
    else:
        found = [(f"{where}: sentences", sentences)]
    for sentence_where, sentence in found:
        if sentence is None or sentence.get("raw") is None:
            raise ConversionError(f"{sentence_where}: field 'raw' is null")
    return [(sentence_where, sentence["raw"]) for sentence_where, sentence in found]


def read_karpathy_rows(
    rows: ParquetRows, splits: list[str], captions: CaptionSet
) -> tuple[dict[int, ImageRows], list[int | None]]:
    """The chosen images by ``cocoid`` (their captions added to ``captions``), and for every row the image id whose
    image it gives (its image's first row) or None."""
    chosen: dict[int, ImageRows] = {}
    first_rows: list[int | None] = []
    files: dict[str, str] = {}
    for where, row in rows.rows():
        if required(row, "split", where) not in splits:
            first_rows.append(None)
            continue
        image_id = required(row, "cocoid", where)
        image = ImageRows(where, f"{required(row, 'filepath', where)}/{required(row, 'filename', where)}", row["split"])
        known = chosen.get(image_id)
        one_sentence = isinstance(row.get("sentences"), dict)
        if known is not None and not (
            one_sentence and (known.file_name, known.split) == (image.file_name, image.split)
        ):
            why = "" if one_sentence else "; a row per image holds all its sentences"
            raise ConversionError(
                f"{where}: cocoid {image_id} ({image.file_name}, {image.split}) is also {known.where} "
                f"({known.file_name}, {known.split}){why}"
            )
        if known is None and files.setdefault(image.file_name, where) != where:
            raise ConversionError(
                f"{where}: file {image.file_name!r} of cocoid {image_id} is also {files[image.file_name]}"
            )
        first_rows.append(None if known else image_id)
        chosen.setdefault(image_id, image)
        captions.by_image.setdefault(image_id, [])
        for sentence_where, raw in _sentences(row, f"{where} (cocoid {image_id})"):
            captions.add(image_id, raw, sentence_where)
    if not chosen:
        raise ConversionError(f"{rows}: no rows whose 'split' is {' or '.join(splits)}")
    return chosen, first_rows


def check_test_count(rows: ParquetRows, chosen: dict[int, ImageRows], test_images: int) -> None:
    """Refuses chosen ``test`` rows that do not hold Karpathy's test split's image count."""
    count = sum(image.split == "test" for image in chosen.values())
    if count and count != test_images:
        raise ConversionError(
            f"{rows}: the rows whose 'split' is 'test' hold {count:,} images, but Karpathy's COCO test split has "
            f"{test_images:,}: this copy's test split is not Karpathy's and its scores would not compare"
        )


def convert_karpathy_parquet(
    parquet: Sequence[str | os.PathLike],
    split: str | Sequence[str],
    out: str | os.PathLike,
    shard_size: int = 1000,
    name: str | None = None,
    tokenizer: TextTokenizer | None = None,
    test_images: int = KARPATHY_TEST_IMAGES,
) -> Manifest:
    """Converts the chosen Karpathy split(s) of a COCO parquet copy (one row per image or per sentence).

    Args:
        parquet: the copy's parquet files, read in this order (rows of other splits are passed over).
        split: ``train``, ``restval``, ``val`` or ``test``, or several (``"train,restval"``).
        out: output folder for this split.
        shard_size: samples per shard.
        name: shard name; default ``coco-karpathy-<split>`` (splits joined by ``-``).
        tokenizer: the tokenizer whose ids ``caption_tokens.json`` lists; None = open_clip's BPE.
        test_images: the images chosen ``test`` rows must hold (Karpathy's: 5,000).
    """
    splits = karpathy_splits(split)
    rows = ParquetRows(parquet, KARPATHY_COLUMNS, images=["image"])
    captions = CaptionSet()
    chosen, first_rows = read_karpathy_rows(rows, splits, captions)
    check_test_count(rows, chosen, test_images)

    def images() -> Iterator[tuple[CaptionedImage, ImageCell] | Skip]:
        for image_id, (where, cells) in zip(first_rows, rows.images(), strict=True):
            if image_id is None:
                continue
            image, image_captions = chosen[image_id], captions.by_image[image_id]
            if not image_captions:
                yield Skip(where, f"no caption (cocoid {image_id} has no sentences)")
                continue
            record = CaptionedImage(image_id, image_captions, image.file_name, image.split)
            yield record, ImageCell(cells["image"], "image", f"{where} (cocoid {image_id})")

    rule = f"rows whose 'split' is {' or '.join(splits)}"
    if "test" in splits:
        rule += f"; their test images checked to be {test_images:,}"
    extra = rows.provenance(rule)
    extra["source"]["split"] = splits
    name = name or f"coco-karpathy-{'-'.join(splits)}"
    return write_caption_split(out, name, images(), captions, str(rows), shard_size, extra, tokenizer)


def _flickr30k_rows(rows: ParquetRows, chosen: list[KarpathyImage]) -> list[KarpathyImage | None]:
    """For every row, the chosen image whose ``filename`` it holds, or None; a chosen file in two rows is an error."""
    by_name = {image.file_name: image for image in chosen}
    first_at: dict[str, str] = {}
    matched: list[KarpathyImage | None] = []
    for where, row in rows.rows():
        image = by_name.get(required(row, "filename", where))
        if image is not None and first_at.setdefault(image.file_name, where) != where:
            raise ConversionError(f"{where}: filename {image.file_name!r} is also {first_at[image.file_name]}")
        matched.append(image)
    return matched


def convert_flickr30k_parquet(
    parquet: Sequence[str | os.PathLike],
    karpathy: str | os.PathLike | None,
    split: str | Sequence[str],
    out: str | os.PathLike,
    shard_size: int = 1000,
    name: str | None = None,
    tokenizer: TextTokenizer | None = None,
) -> Manifest:
    """Converts the Karpathy split(s) of Flickr30K that ``dataset_flickr30k.json`` chooses, images from parquet.

    Args:
        parquet: parquet files holding the images (``filename``, ``image``), read in this order.
        karpathy: Karpathy's ``dataset_flickr30k.json``; required (None is refused).
        split: ``train``, ``val`` or ``test``, or several.
        out: output folder for this split.
        shard_size: samples per shard.
        name: shard name; default ``flickr30k-karpathy-<split>``.
        tokenizer: the tokenizer whose ids ``caption_tokens.json`` lists; None = open_clip's BPE.
    """
    if karpathy is None:
        raise ConversionError(FLICKR30K_NEEDS_SPLIT_FILE)
    karpathy, splits = Path(karpathy), karpathy_splits(split)
    data = load_json(karpathy)
    if karpathy_dataset(data, karpathy) != "flickr30k":
        raise ConversionError(f'{karpathy}: not Flickr30K\'s split file (it needs "dataset": "flickr30k")')
    captions = CaptionSet()
    chosen = karpathy_images(data, karpathy, "flickr30k", splits, Path(), captions)  # their paths are not used
    rows = ParquetRows(parquet, {"filename": TEXT}, images=["image"])
    matched = _flickr30k_rows(rows, chosen)

    def images() -> Iterator[tuple[CaptionedImage, ImageCell] | Skip]:
        for image, (where, cells) in zip(matched, rows.images(), strict=True):
            if image is None:
                continue
            if not captions.by_image[image.image_id]:
                yield Skip(where, f"no caption ({karpathy}: {image.entry} has no sentences)")
                continue
            yield karpathy_record(image, captions), ImageCell(cells["image"], "image", f"{where} ({image.file_name})")
        found = {image.file_name for image in matched if image is not None}
        for image in chosen:
            if image.file_name not in found:
                yield Skip(f"{karpathy}: {image.entry} {image.file_name}", "missing (no parquet row has this filename)")

    extra = rows.provenance(
        f"{karpathy} chooses split {', '.join(splits)}; rows matched by 'filename'", karpathy=karpathy
    )
    extra["source"]["split"] = splits
    name = name or f"flickr30k-karpathy-{'-'.join(splits)}"
    return write_caption_split(out, name, images(), captions, karpathy, shard_size, extra, tokenizer)
