"""A user's own image folder and table (:mod:`.own_rows`: CSV, JSON lines, LLaVA-style JSON): the reader of its
rows, whose records the benchmarks' builders write as the shards the benchmark converters write, one command per kind
of task.

* :func:`convert_own_pairs`: one pre-training pair per row (the image, ``txt`` = the caption, ``json`` = ``path``,
  ``line``), as ``mmoe data convert tsv`` writes them.
* :func:`convert_own_captions`: one sample per image with all its captions (captioning and retrieval), as the COCO
  converter writes them (:mod:`.build_captions`), with ``caption_tokens.json``. ``image_id`` is the rows' integer
  ``image_id`` or, without one, the image's position among the file's distinct images (from 0).
* :func:`convert_own_vqa`: one sample per question (``image``, ``question``, ``answers``), as ``convert vqav2``
  writes them (:mod:`.build_vqa`): the human answers scored with the official VQA soft score against the answer
  vocabulary, which the split builds (and writes as ``answers.json``) unless ``answer_vocab`` is given.

Image paths are relative to the image folder and stay inside it: an absolute path, ``..`` or a symbolic link out of
the folder is an error naming the file, the row and the field. A missing or unreadable image skips its sample and is
counted, as in the other converters. Every split's manifest records the table, its SHA-256 digest and the rule.
"""

from __future__ import annotations

import dataclasses
import os
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from mmoe.data.converters.build_captions import CaptionSet, write_caption_split
from mmoe.data.converters.build_vqa import check_min_answer_count, split_vocabulary, write_vqa_split
from mmoe.data.converters.common import ConversionError, Skip, images_folder, path_inside, write_split
from mmoe.data.converters.own_rows import (
    RowSkips,
    answers_of,
    caption_of,
    optional_int,
    read_rows,
    row_format,
    text_field,
)
from mmoe.data.converters.provenance import provenance
from mmoe.data.converters.records import CaptionedImage, ImageFile, VQAQuestion, with_image
from mmoe.data.shards import Manifest
from mmoe.data.tokenizer import TextTokenizer


def _image(row: dict[str, Any], root: Path, where: str) -> tuple[str, Path]:
    """The row's ``image`` path under ``root``, normalised (``./0.jpg`` and ``sub/../0.jpg`` are ``0.jpg``: one
    image), and the file it names inside ``root``."""
    path = path_inside(root, text_field(row, "image", where), f"{where}: field 'image'")
    return path.relative_to(root).as_posix(), path


def _extra(table: Path, root: Path, rows: str, answer_vocab: str | os.PathLike | None = None) -> dict[str, Any]:
    """The manifest's provenance: the table and image folder, the digests of the table (and answer vocabulary), and
    the rule: every ``rows`` row of the table."""
    source = {"table": str(table), "images": str(root)}
    rule = f"every {rows} row of {table.name} ({row_format(table)})"
    return {"source": source, **provenance([table, answer_vocab], rule)}


def _line(where: str) -> int | str:
    """The line number of a ``FILE:LINE`` row, else its ``record N``."""
    tail = where.rsplit(":", 1)[-1].strip()
    return int(tail) if tail.isdigit() else tail


def convert_own_pairs(
    table: str | os.PathLike,
    images: str | os.PathLike,
    out: str | os.PathLike,
    shard_size: int = 1000,
    name: str = "pairs",
) -> Manifest:
    """Pre-training pairs, one per row of ``table`` (``image``, ``caption``; or LLaVA caption rows)."""
    table, root = Path(table), images_folder(images)
    skips = RowSkips()
    pairs = []
    for where, row in read_rows(table):
        caption = caption_of(row, where, skips)
        if caption is not None:
            pairs.append((where, *_image(row, root, where), caption))
    if not pairs:
        raise ConversionError(f"{table}: no caption pairs to convert ({skips.report(table)['skipped_rows']})")

    def samples() -> Iterator[dict[str, Any] | Skip]:
        for index, (where, relative, path, caption) in enumerate(pairs):
            meta = {"path": relative, "line": _line(where)}
            sample = {"__key__": f"{index:09d}", "txt": caption, "json": meta}
            yield with_image(sample, ImageFile(path, root, relative))

    extra = {**_extra(table, root, "caption"), **skips.report(table)}
    return write_split(out, name, samples(), shard_size, extra)


class ImageIds:
    """The image id of each image path: the rows' own ``image_id`` (one per path, one path per id) or, for rows
    without one, the path's position among the distinct paths."""

    def __init__(self) -> None:
        self.of_path: dict[str, int] = {}
        self._path_of: dict[int, tuple[str, str]] = {}

    def add(self, row: dict[str, Any], relative: str, where: str) -> int:
        given = optional_int(row, "image_id", where)
        known = self.of_path.get(relative)
        image_id = given if given is not None else known if known is not None else len(self.of_path)
        if known is not None and image_id != known:
            raise ConversionError(f"{where}: field 'image_id' = {image_id}, but {relative!r} is image {known} above")
        first = self._path_of.setdefault(image_id, (relative, where))
        if first[0] != relative:
            raise ConversionError(f"{where}: field 'image_id' = {image_id} is also {first[0]!r} ({first[1]})")
        self.of_path[relative] = image_id
        return image_id


def convert_own_captions(
    table: str | os.PathLike,
    images: str | os.PathLike,
    out: str | os.PathLike,
    shard_size: int = 1000,
    name: str = "captions",
    tokenizer: TextTokenizer | None = None,
) -> Manifest:
    """A caption split (captioning, retrieval): one sample per image of ``table`` with all its captions, in the order
    of each image's first row."""
    table, root = Path(table), images_folder(images)
    skips, ids, captions = RowSkips(), ImageIds(), CaptionSet()
    files: dict[int, tuple[str, Path]] = {}
    for where, row in read_rows(table):
        caption = caption_of(row, where, skips)
        if caption is None:
            continue
        relative, path = _image(row, root, where)
        image_id = ids.add(row, relative, where)
        files.setdefault(image_id, (relative, path))
        captions.by_image.setdefault(image_id, [])
        captions.add(image_id, caption, where)
    if not files:
        raise ConversionError(f"{table}: no caption rows to convert ({skips.report(table)['skipped_rows']})")

    def images() -> Iterator[tuple[CaptionedImage, ImageFile]]:
        for image_id, (relative, path) in files.items():
            yield CaptionedImage(image_id, captions.by_image[image_id], relative), ImageFile(path, root, relative)

    extra = _extra(table, root, "caption")
    extra["split_rule"] += ", one sample per image"
    extra.update(skips.report(table))
    return write_caption_split(out, name, images(), captions, table, shard_size, extra, tokenizer)


def _question(row: dict[str, Any], where: str, ids: ImageIds, index: int, root: Path) -> tuple[VQAQuestion, ImageFile]:
    """One validated question record of a VQA row and its image."""
    relative, path = _image(row, root, where)
    question_id = optional_int(row, "question_id", where)
    image_id = ids.add(row, relative, where)
    record = VQAQuestion(index if question_id is None else question_id, image_id, text_field(row, "question", where))
    answers = answers_of(row, where)
    if answers is not None:
        counts = Counter(answers)
        most_common = max(counts, key=counts.__getitem__)  # the first of the most frequent, in the annotators' order
        record = dataclasses.replace(
            record,
            answers=answers,
            multiple_choice_answer=_optional_text(row, "multiple_choice_answer", where) or most_common,
            answer_type=_optional_text(row, "answer_type", where) or "",
            question_type=_optional_text(row, "question_type", where) or "",
        )
    return record, ImageFile(path, root, relative)


def _optional_text(row: dict[str, Any], name: str, where: str) -> str | None:
    return text_field(row, name, where) if name in row else None


def read_questions(table: Path, root: Path) -> list[tuple[VQAQuestion, ImageFile]]:
    """The validated questions of a VQA table and their images: question ids unique, answers in every row or in
    none."""
    ids, questions, first_at = ImageIds(), [], {}
    for index, (where, row) in enumerate(read_rows(table)):
        record, image = _question(row, where, ids, index, root)
        first = first_at.setdefault(record.question_id, where)
        if first != where:
            raise ConversionError(f"{where}: field 'question_id' = {record.question_id} appears twice (first: {first})")
        if questions and (record.answers is None) != (questions[0][0].answers is None):
            first_row = first_at[questions[0][0].question_id]
            raise ConversionError(
                f"{where}: field 'answers' is {'missing' if record.answers is None else 'given'} here but not in "
                f"{first_row}; a split has answers in every row or in none"
            )
        questions.append((record, image))
    return questions


def convert_own_vqa(
    table: str | os.PathLike,
    images: str | os.PathLike,
    out: str | os.PathLike,
    answer_vocab: str | os.PathLike | None = None,
    min_answer_count: int = 9,
    shard_size: int = 1000,
    name: str = "vqa",
    split: str = "own",
) -> Manifest:
    """A VQA split: one sample per row of ``table`` (``image``, ``question``, ``answers``; optional ``question_id``,
    ``image_id``, ``multiple_choice_answer``, ``answer_type``, ``question_type``). With answers and without
    ``answer_vocab`` the split is a training split: it builds the vocabulary from each question's
    ``multiple_choice_answer`` (given, else its most frequent answer) and writes ``answers.json``."""
    check_min_answer_count(min_answer_count)
    table, root = Path(table), images_folder(images)
    questions = read_questions(table, root)
    records = [record for record, _ in questions]
    vocab = split_vocabulary(records, answer_vocab, min_answer_count, str(table), training=True)
    extra = _extra(table, root, "question", answer_vocab)
    extra["source"]["answer_vocab"] = str(answer_vocab) if answer_vocab is not None else None
    return write_vqa_split(out, name, questions, split, vocab, shard_size, extra, write_vocab=answer_vocab is None)
