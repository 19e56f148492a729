"""VQAv2 (Goyal et al., 2017) questions / annotations JSON -> shards, one sample per question.

Input: ``v2_OpenEnded_mscoco_<subtype>_questions.json`` and, for train / val, ``v2_mscoco_<subtype>_annotations.json``;
images ``COCO_<image subtype>_<image_id:012d>.jpg`` in DIR or DIR/<image subtype>/ (test-dev2015 uses the test2015
images). Each sample: the image, ``txt`` = the question, ``json`` = ``question_id``, ``image_id``, ``question``,
``data_subtype`` and, with annotations, the 10 human ``answers``, ``multiple_choice_answer``, ``answer_type``,
``question_type``, and ``labels`` / ``scores`` (soft targets over the answer vocabulary). The training split writes
``OUT/answers.json`` (a JSON list; index = class label), swapped in with its shards; other annotated splits read it
with ``answer_vocab``. A question id that appears twice in the questions file, or twice in the annotations, is an
error.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from mmoe.data.answers import VocabIndex, build_answer_vocab, soft_targets
from mmoe.data.converters.common import (
    ConversionError,
    Skip,
    field,
    first_existing,
    images_folder,
    json_text,
    list_field,
    load_json,
    with_image,
    write_split,
)
from mmoe.data.shards import Manifest

ANSWERS_FILE = "answers.json"
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
        field(question, "question", str, where)
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


def read_answer_vocab(path: Path) -> list[str]:
    vocab = load_json(path)
    if not isinstance(vocab, list) or not all(isinstance(answer, str) for answer in vocab):
        raise ConversionError(f"{path}: an answer vocabulary is a JSON list of strings (index = class label)")
    if len(set(vocab)) != len(vocab):
        raise ConversionError(f"{path}: the answer vocabulary repeats answers")
    return vocab


def convert_vqav2(
    questions: str | os.PathLike,
    images: str | os.PathLike,
    out: str | os.PathLike,
    annotations: str | os.PathLike | None = None,
    answer_vocab: str | os.PathLike | None = None,
    min_answer_count: int = 9,
    shard_size: int = 1000,
    name: str | None = None,
) -> Manifest:
    """Converts one VQAv2 split.

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
    """
    if min_answer_count < 1:
        raise ConversionError(f"--min-answer-count must be >= 1, got {min_answer_count}")
    questions, images = Path(questions), images_folder(images)
    subtype, question_list = read_questions(questions)
    by_question = read_annotations(Path(annotations), question_list) if annotations is not None else None
    vocab: list[str] | None = None
    if answer_vocab is not None:
        vocab = read_answer_vocab(Path(answer_vocab))
    elif by_question is not None:
        if not subtype.startswith("train"):
            raise ConversionError(
                f"{questions}: split {subtype!r} has annotations: pass --answer-vocab with the training split's "
                f"{ANSWERS_FILE}"
            )
        vocab = build_answer_vocab((a["multiple_choice_answer"] for a in by_question.values()), min_answer_count)
        if not vocab:
            print(
                f"{annotations}: warning: no answer is the multiple-choice answer of {min_answer_count} or more "
                "questions, so the answer vocabulary is empty (no question has a target); lower --min-answer-count",
                file=sys.stderr,
            )
    vocab_index = VocabIndex.of({answer: label for label, answer in enumerate(vocab or [])})

    def samples() -> Iterator[dict[str, Any] | Skip]:
        for question in question_list:
            meta: dict[str, Any] = {
                "question_id": question["question_id"],
                "image_id": question["image_id"],
                "question": question["question"],
                "data_subtype": subtype,
            }
            if by_question is not None:
                annotation = by_question[question["question_id"]]
                answers = [answer["answer"] for answer in annotation["answers"]]
                labels, scores = soft_targets(answers, vocab_index)
                meta.update(
                    answers=answers,
                    multiple_choice_answer=annotation["multiple_choice_answer"],
                    answer_type=annotation["answer_type"],
                    question_type=annotation["question_type"],
                    labels=labels,
                    scores=scores,
                )
            sample = {"__key__": str(question["question_id"]), "txt": question["question"], "json": meta}
            yield with_image(sample, image_path(images, subtype, question["image_id"]))

    extra = {"source": {"questions": str(questions), "annotations": str(annotations) if annotations else None}}
    if vocab is not None:
        extra["answer_vocab_size"] = len(vocab)
    files = {ANSWERS_FILE: json_text(vocab)} if vocab is not None and subtype.startswith("train") else {}
    return write_split(out, name or f"vqav2-{subtype}", samples(), shard_size, extra, files)
