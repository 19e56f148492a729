"""VQAv2 (Goyal et al., 2017): the reader of the official questions / annotations JSON, whose
:class:`~mmoe.data.converters.records.VQAQuestion` records :mod:`.build_vqa` writes, one sample per question.

Input: ``v2_OpenEnded_mscoco_<subtype>_questions.json`` and, for train / val, ``v2_mscoco_<subtype>_annotations.json``;
images ``COCO_<image subtype>_<image_id:012d>.jpg`` in DIR or DIR/<image subtype>/ (test-dev2015 uses the test2015
images). Each sample's ``json`` has the question's ``data_subtype`` and, with annotations, the 10 human ``answers``
and their soft targets over the answer vocabulary (:mod:`.build_vqa`). The training split writes
``OUT/answers.json`` (a JSON list; index = class label), swapped in with its shards; other annotated splits read it
with ``answer_vocab``. A question id that appears twice in the questions file, or twice in the annotations, is an
error.

BEiT-3's VQAv2 recipe trains on train2014 plus most of val2014 with one answer vocabulary: :func:`answer_vocab_of`
(``mmoe data answers``) builds the vocabulary over several annotation files (train + val, answers seen at least 9
times), every split is converted with it (``--answer-vocab``), and ``holdout_images`` sets aside a seeded random
choice of a split's images (BEiT-3 / ViLT: 1,000 val2014 images, "rest_val") as a separate split for validation, the
rest ("trainable_val") training beside train2014. A DataModule's ``train_shards`` takes a list of split folders.
"""

from __future__ import annotations

import dataclasses
import os
import random
import re
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from mmoe.data.answers import build_answer_vocab
from mmoe.data.converters.build_vqa import check_min_answer_count, split_vocabulary, write_vqa_split
from mmoe.data.converters.common import (
    ConversionError,
    bounded_text,
    field,
    first_existing,
    images_folder,
    list_field,
    load_json,
)
from mmoe.data.converters.provenance import provenance
from mmoe.data.converters.records import ImageFile, VQAQuestion
from mmoe.data.shards import Manifest

_SUBTYPE_IN_NAME = re.compile(r"v2_OpenEnded_mscoco_(.+)_questions\.json$")


def image_subtype(data_subtype: str) -> str:
    """The COCO image folder of a VQA split: test-dev2015 questions are about test2015 images."""
    return "test2015" if data_subtype == "test-dev2015" else data_subtype


def image_path(images: Path, data_subtype: str, image_id: int) -> Path:
    subtype = image_subtype(data_subtype)
    name = f"COCO_{subtype}_{image_id:012d}.jpg"
    return first_existing([images / name, images / subtype / name])


def read_questions(path: Path) -> tuple[str, list[dict[str, Any]]]:
    """The split name and validated questions of a questions file."""
    data = load_json(path)
    questions = list_field(data, "questions", f"{path}")
    subtype = data.get("data_subtype")
    if subtype is None:
        match = _SUBTYPE_IN_NAME.search(path.name)
        if match is None:
            raise ConversionError(f"{path}: no 'data_subtype' field and the file name does not name the split")
        subtype = match.group(1)
    if not isinstance(subtype, str) or not subtype:
        raise ConversionError(f"{path}: field 'data_subtype' must be a non-empty string, got {subtype!r}")
    if not questions:
        raise ConversionError(f"{path}: field 'questions' is empty: no questions to convert")
    first_at: dict[int, int] = {}
    for index, question in enumerate(questions):
        where = f"{path}: questions[{index}]"
        question_id = field(question, "question_id", int, where)
        field(question, "image_id", int, where)
        bounded_text(field(question, "question", str, where), where, "field 'question'")
        if question_id in first_at:
            raise ConversionError(
                f"{where}: question_id {question_id} appears twice (first at questions[{first_at[question_id]}])"
            )
        first_at[question_id] = index
    return subtype, questions


def read_annotations(path: Path, questions: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    """Validated annotations by question id; every question must have one with the same image id."""
    data = load_json(path)
    annotations = list_field(data, "annotations", f"{path}")
    by_question: dict[int, dict[str, Any]] = {}
    first_at: dict[int, int] = {}
    for index, annotation in enumerate(annotations):
        where = f"{path}: annotations[{index}]"
        question_id = field(annotation, "question_id", int, where)
        where = f"{path}: annotations[{index}] (question_id {question_id})"
        if question_id in first_at:
            raise ConversionError(
                f"{where}: a second annotation for question_id {question_id} (first at annotations"
                f"[{first_at[question_id]}])"
            )
        first_at[question_id] = index
        field(annotation, "image_id", int, where)
        field(annotation, "multiple_choice_answer", str, where)
        field(annotation, "answer_type", str, where)
        field(annotation, "question_type", str, where)
        answers = list_field(annotation, "answers", where)
        if not answers:
            raise ConversionError(f"{where}: field 'answers' is empty")
        for position, answer in enumerate(answers):
            field(answer, "answer", str, f"{where}: answers[{position}]")
        by_question[question_id] = annotation
    for index, question in enumerate(questions):
        annotation = by_question.get(question["question_id"])
        if annotation is None:
            question_id = question["question_id"]
            raise ConversionError(f"{path}: no annotation for question_id {question_id} (questions[{index}])")
        if annotation["image_id"] != question["image_id"]:
            raise ConversionError(
                f"{path}: question_id {question['question_id']} has image_id {annotation['image_id']} here but "
                f"{question['image_id']} in the questions file"
            )
    return by_question


def answer_vocab_of(annotations: Sequence[str | os.PathLike], min_answer_count: int = 9) -> list[str]:
    """One answer vocabulary over several annotation files (BEiT-3: train2014 + val2014): the normalised
    ``multiple_choice_answer`` strings of all their questions seen at least ``min_answer_count`` times
    (:func:`mmoe.data.answers.build_answer_vocab`)."""
    check_min_answer_count(min_answer_count)
    if not annotations:
        raise ConversionError("--annotations: give at least one annotations file")
    answers: list[str] = []
    for path in annotations:
        records = list_field(load_json(path), "annotations", f"{path}")
        for index, annotation in enumerate(records):
            answers.append(field(annotation, "multiple_choice_answer", str, f"{path}: annotations[{index}]"))
    return build_answer_vocab(answers, min_answer_count)


def held_out_images(questions: list[VQAQuestion], count: int, seed: int, where: str) -> set[int]:
    """``count`` image ids drawn at random (seeded) from the questions' images, all of whose questions go to the
    held-out split; at least one image must stay."""
    images = sorted({question.image_id for question in questions})
    if not 0 < count < len(images):
        raise ConversionError(
            f"{where}: --holdout-images {count} must lie between 1 and {len(images) - 1} (the split has "
            f"{len(images)} images)"
        )
    return set(random.Random(seed).sample(images, count))


def _check_options(min_answer_count: int, holdout_images: int, holdout_out: str | os.PathLike | None) -> None:
    check_min_answer_count(min_answer_count)
    if holdout_images and holdout_out is None:
        raise ConversionError("--holdout-images needs --holdout-out (the held-out split's folder)")
    if holdout_out is not None and not holdout_images:
        raise ConversionError("--holdout-out needs --holdout-images (how many images to hold out)")


def question_records(
    questions: list[dict[str, Any]], by_question: dict[int, dict[str, Any]] | None
) -> list[VQAQuestion]:
    """The checked questions (with their annotations) as records."""
    records = []
    for question in questions:
        record = VQAQuestion(question["question_id"], question["image_id"], question["question"])
        if by_question is not None:
            annotation = by_question[record.question_id]
            answers = [answer["answer"] for answer in annotation["answers"]]
            fields = {name: annotation[name] for name in ("multiple_choice_answer", "answer_type", "question_type")}
            record = dataclasses.replace(record, answers=answers, **fields)
        records.append(record)
    return records


def _with_images(images: Path, subtype: str, questions: list[VQAQuestion]) -> Iterator[tuple[VQAQuestion, ImageFile]]:
    for question in questions:
        yield question, ImageFile(image_path(images, subtype, question.image_id))


def split_parts(
    records: list[VQAQuestion],
    extra: dict[str, Any],
    out: str | os.PathLike,
    holdout_images: int,
    holdout_out: str | os.PathLike | None,
    seed: int,
    where: str,
) -> list[tuple[str | os.PathLike, str, list[VQAQuestion], dict[str, Any]]]:
    """(folder, shard name suffix, questions, manifest extra) of each split a conversion writes: the whole split, or
    the held-out split then the rest (``holdout_images`` > 0)."""
    if not holdout_images:
        return [(out, "", records, {**extra, "split_rule": "every question of the questions file"})]
    held = held_out_images(records, holdout_images, seed, where)
    rest = [question for question in records if question.image_id in held]
    kept = [question for question in records if question.image_id not in held]
    holdout = {"images": holdout_images, "seed": seed, "questions": len(rest), "trainable_questions": len(kept)}
    drawn = f"the questions of {holdout_images} images drawn by random.Random({seed}) from the sorted image ids"
    held_extra = {**extra, "holdout": {**holdout, "part": "held out", "other_split": str(out)}, "split_rule": drawn}
    kept_extra = {**extra, "holdout": {**holdout, "part": "trainable", "other_split": str(holdout_out)}}
    kept_extra["split_rule"] = f"every question but {drawn}"
    return [(holdout_out, "-rest", rest, held_extra), (out, "-trainable", kept, kept_extra)]


def _manifest_source(questions: Path, annotations: str | os.PathLike | None) -> dict[str, Any]:
    return {"source": {"questions": str(questions), "annotations": str(annotations) if annotations else None}}


def convert_vqav2(
    questions: str | os.PathLike,
    images: str | os.PathLike,
    out: str | os.PathLike,
    annotations: str | os.PathLike | None = None,
    answer_vocab: str | os.PathLike | None = None,
    min_answer_count: int = 9,
    shard_size: int = 1000,
    name: str | None = None,
    holdout_images: int = 0,
    holdout_out: str | os.PathLike | None = None,
    seed: int = 0,
) -> Manifest:
    """Converts one VQAv2 split (or splits it in two by image, ``holdout_images``).

    Args:
        questions: the questions JSON.
        images: COCO image folder (images directly in it, or in its ``<subtype>/`` sub-folders).
        out: output folder for this split.
        annotations: the annotations JSON; None = a test split (no answers).
        answer_vocab: ``answers.json`` of the training split; required for annotated non-training splits. A training
            split without it builds one from its ``multiple_choice_answer`` strings.
        min_answer_count: an answer enters a built vocabulary when at least this many training questions have it as
            their normalised ``multiple_choice_answer`` (ViLT / BEiT-3: 9).
        shard_size: samples per shard.
        name: shard name; default ``vqav2-<data_subtype>``.
        holdout_images: when > 0, this many images drawn at random (``seed``) and all their questions go to
            ``holdout_out`` (shards ``<name>-rest``), the other questions to ``out`` (``<name>-trainable``), as
            BEiT-3 splits val2014. Each split folder is written whole or not at all (the held-out one first).
        holdout_out: the held-out split's folder; required with ``holdout_images``.
        seed: seeds the held-out images' choice.

    Returns:
        The manifest of ``out``; with a hold-out its ``extra.holdout`` names the other split and its size.
    """
    _check_options(min_answer_count, holdout_images, holdout_out)
    questions, images = Path(questions), images_folder(images)
    subtype, question_list = read_questions(questions)
    by_question = read_annotations(Path(annotations), question_list) if annotations is not None else None
    records = question_records(question_list, by_question)
    training = subtype.startswith("train")
    vocab = split_vocabulary(records, answer_vocab, min_answer_count, str(questions), training, subtype)
    extra = {**_manifest_source(questions, annotations), **provenance([questions, annotations, answer_vocab], "")}
    name = name or f"vqav2-{subtype}"
    parts = split_parts(records, extra, out, holdout_images, holdout_out, seed, str(questions))
    for folder, suffix, part, part_extra in parts:
        samples = _with_images(images, subtype, part)
        manifest = write_vqa_split(folder, name + suffix, samples, subtype, vocab, shard_size, part_extra, training)
    return manifest  # the last part's: ``out``
