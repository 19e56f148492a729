"""The VQA sample builder: :class:`~mmoe.data.converters.records.VQAQuestion` records -> one sample per question,
whichever reader gave them (the official questions and annotations, HF parquet rows, a user's own table).

Each sample: the image, ``txt`` = the question, ``json`` = ``question_id``, ``image_id``, ``question``,
``data_subtype`` and, in an annotated split, the human ``answers``, ``multiple_choice_answer``, ``answer_type``,
``question_type`` and ``labels`` / ``scores``: the official VQA soft score of each answer of the split's answer
vocabulary (:func:`mmoe.data.answers.soft_targets`; class label = position in ``answers.json``).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

from mmoe.data.answers import ANSWERS_FILE, VocabIndex, build_answer_vocab, read_answer_vocab, soft_targets
from mmoe.data.converters.common import ConversionError, Skip, json_text, write_split
from mmoe.data.converters.records import ImageSource, VQAQuestion, with_image
from mmoe.data.shards import Manifest


def check_min_answer_count(min_answer_count: int) -> None:
    if min_answer_count < 1:
        raise ConversionError(f"--min-answer-count must be >= 1, got {min_answer_count}")


def split_vocabulary(
    questions: Sequence[VQAQuestion],
    answer_vocab: str | os.PathLike | None,
    min_answer_count: int,
    source: str,
    training: bool,
    subtype: str = "",
) -> list[str] | None:
    """The answer vocabulary of a split: read from ``answer_vocab``, else built from the questions' normalised
    ``multiple_choice_answer`` strings seen at least ``min_answer_count`` times; None for a split without answers.
    Only a ``training`` split builds one: another annotated split (``subtype``, read from ``source``) without
    ``answer_vocab`` is an error."""
    if answer_vocab is not None:
        return read_answer_vocab(answer_vocab, ConversionError, allow_empty=True)
    if not questions or questions[0].answers is None:
        return None
    if not training:
        raise ConversionError(
            f"{source}: split {subtype!r} has answers: pass --answer-vocab with the training split's {ANSWERS_FILE}"
        )
    vocab = build_answer_vocab((question.multiple_choice_answer for question in questions), min_answer_count)
    if not vocab:
        print(
            f"{source}: warning: no answer is the multiple-choice answer of {min_answer_count} or more questions, so "
            "the answer vocabulary is empty (no question has a target); lower --min-answer-count",
            file=sys.stderr,
        )
    return vocab


def question_sample(question: VQAQuestion, data_subtype: str, vocab_index: VocabIndex) -> dict[str, Any]:
    """The sample of one question without its image."""
    meta: dict[str, Any] = {
        "question_id": question.question_id,
        "image_id": question.image_id,
        "question": question.question,
        "data_subtype": data_subtype,
    }
    if question.answers is not None:
        labels, scores = soft_targets(question.answers, vocab_index)
        meta.update(answers=question.answers, multiple_choice_answer=question.multiple_choice_answer)
        meta.update(answer_type=question.answer_type, question_type=question.question_type)
        meta.update(labels=labels, scores=scores)
    return {"__key__": str(question.question_id), "txt": question.question, "json": meta}


def write_vqa_split(
    out: str | os.PathLike,
    name: str,
    questions: Iterable[tuple[VQAQuestion, ImageSource]],
    data_subtype: str,
    vocab: list[str] | None,
    shard_size: int,
    extra: dict[str, Any],
    write_vocab: bool,
) -> Manifest:
    """Writes one sample per question (with its image) as the split ``name`` in ``out``; the manifest's ``extra``
    gains ``answer_vocab_size``, and ``write_vocab`` writes the vocabulary as ``answers.json`` beside the shards."""
    vocab_index = VocabIndex.of({answer: label for label, answer in enumerate(vocab or [])})

    def samples() -> Iterator[dict[str, Any] | Skip]:
        for question, image in questions:
            yield with_image(question_sample(question, data_subtype, vocab_index), image)

    if vocab is not None:
        extra = {**extra, "answer_vocab_size": len(vocab)}
    files = {ANSWERS_FILE: json_text(vocab)} if vocab is not None and write_vocab else {}
    return write_split(out, name, samples(), shard_size, extra, files)
