"""VQAv2 (Goyal et al., 2017) from HF parquet (``lmms-lab/VQAv2``): the reader of its rows, whose
:class:`~mmoe.data.converters.records.VQAQuestion` records :mod:`.build_vqa` writes as the shards
:func:`convert_vqav2` writes from the official files: one sample per row, byte for byte the same when the rows hold
the same questions, answers and image files.

Columns read (the public schema): ``question_id``, ``image_id``, ``question``, ``image`` and, in an annotated split,
``answers`` (``[{answer, answer_confidence, answer_id}]``), ``multiple_choice_answer``, ``answer_type``,
``question_type``. ``split`` names the files' split by the Hub's name (``validation``, ``testdev``, ``test``,
``train``) or COCO's (``val2014``, ``test-dev2015``, ``test2015``, ``train2014``); the COCO name is each sample's
``data_subtype`` and the default shard name (``vqav2-val2014``). Test splits are converted without answers, whatever
the rows hold. As with the official files, an annotated split other than the training one needs the training
split's ``answers.json`` (``answer_vocab``), a training split builds one, and a question id twice is an error.
``lmms-lab/VQAv2`` has no training split: converting one of its splits prints a note that the rows are for
evaluation.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterator, Sequence
from typing import Any

from mmoe.data.converters.build_vqa import check_min_answer_count, split_vocabulary, write_vqa_split
from mmoe.data.converters.common import ConversionError, bounded_text
from mmoe.data.converters.parquet import (
    INTEGER,
    TEXT,
    ImageCell,
    ParquetRows,
    evaluation_note,
    list_of,
    required,
    struct_with,
)
from mmoe.data.converters.records import VQAQuestion
from mmoe.data.shards import Manifest

#: The Hub's VQAv2 split names -> COCO's data subtypes, which the official files and the shards use.
HUB_SPLITS = {"train": "train2014", "validation": "val2014", "testdev": "test-dev2015", "test": "test2015"}
QUESTION_COLUMNS = {"question_id": INTEGER, "image_id": INTEGER, "question": TEXT}
ANSWER_COLUMNS = {
    "answers": list_of(struct_with("answer", TEXT)),
    "multiple_choice_answer": TEXT,
    "answer_type": TEXT,
    "question_type": TEXT,
}
_ANSWER_FIELDS = ("multiple_choice_answer", "answer_type", "question_type")


def data_subtype(split: str) -> str:
    """COCO's name of a VQAv2 split given by the Hub's name or COCO's."""
    if split in HUB_SPLITS.values():
        return split
    if split not in HUB_SPLITS:
        names = ", ".join([*HUB_SPLITS, *HUB_SPLITS.values()])
        raise ConversionError(f"--split {split!r}: expected the parquet files' VQAv2 split, one of {names}")
    return HUB_SPLITS[split]


def read_question_rows(rows: ParquetRows, annotated: bool) -> list[VQAQuestion]:
    """The validated question records of the rows (with their answers in an annotated split): question ids unique,
    answers non-empty, no null where a value is needed."""
    questions: list[VQAQuestion] = []
    first_at: dict[int, str] = {}
    for where, row in rows.rows():
        question_id = required(row, "question_id", where)
        if question_id in first_at:
            first = first_at[question_id]
            raise ConversionError(f"{where}: question_id {question_id} appears twice (first at {first})")
        first_at[question_id] = where
        where = f"{where} (question_id {question_id})"
        question = bounded_text(required(row, "question", where), where, "field 'question'")
        record = VQAQuestion(question_id, required(row, "image_id", where), question)
        if annotated:
            answers = required(row, "answers", where)
            if not answers:
                raise ConversionError(f"{where}: field 'answers' is empty")
            found = [_answer(answer, position, where) for position, answer in enumerate(answers)]
            fields = {name: required(row, name, where) for name in _ANSWER_FIELDS}
            record = dataclasses.replace(record, answers=found, **fields)
        questions.append(record)
    if not questions:
        raise ConversionError(f"{rows}: no rows to convert")
    return questions


def _answer(answer: dict[str, Any] | None, position: int, where: str) -> str:
    if answer is None or answer.get("answer") is None:
        raise ConversionError(f"{where}: field 'answers[{position}].answer' is null")
    return answer["answer"]


def _with_images(rows: ParquetRows, questions: list[VQAQuestion]) -> Iterator[tuple[VQAQuestion, ImageCell]]:
    for question, (where, cells) in zip(questions, rows.images(), strict=True):
        yield question, ImageCell(cells["image"], "image", f"{where} (question_id {question.question_id})")


def convert_vqav2_parquet(
    parquet: Sequence[str | os.PathLike],
    split: str,
    out: str | os.PathLike,
    answer_vocab: str | os.PathLike | None = None,
    min_answer_count: int = 9,
    shard_size: int = 1000,
    name: str | None = None,
) -> Manifest:
    """Converts one VQAv2 split held in HF parquet files.

    Args:
        parquet: the split's parquet files, read in this order.
        split: which split they hold (:data:`HUB_SPLITS`: the Hub's name or COCO's).
        out: output folder for this split.
        answer_vocab: ``answers.json`` of the training split; required for annotated non-training splits.
        min_answer_count: a training split's vocabulary keeps answers seen at least this often (ViLT / BEiT-3: 9).
        shard_size: samples per shard.
        name: shard name; default ``vqav2-<data_subtype>``.
    """
    check_min_answer_count(min_answer_count)
    subtype = data_subtype(split)
    annotated, training = not subtype.startswith("test"), subtype.startswith("train")
    rows = ParquetRows(parquet, {**QUESTION_COLUMNS, **(ANSWER_COLUMNS if annotated else {})}, images=["image"])
    questions = read_question_rows(rows, annotated)
    vocab = split_vocabulary(questions, answer_vocab, min_answer_count, str(rows), training, subtype)
    if not training:
        evaluation_note(rows, "VQAv2", subtype, "the official train2014 questions and annotations")
    extra = rows.provenance(f"every row: the files hold VQAv2 {subtype} (--split {split})")
    samples = _with_images(rows, questions)
    return write_vqa_split(out, name or f"vqav2-{subtype}", samples, subtype, vocab, shard_size, extra, training)
