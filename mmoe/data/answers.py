"""VQA answers for training: the answer vocabulary and soft targets, on top of :mod:`mmoe.metrics.vqa`.

The official answer normalisation (punctuation, digit/article/contraction tables and functions,
:mod:`mmoe.metrics.vqa_normalize`) and the official accuracy (:mod:`mmoe.metrics.vqa`) live there only; this module
adds what is specific to the data pipeline. The names ``normalize_answer``, ``process_punctuation``,
``process_digit_article``, ``answer_scores`` and ``answer_accuracy`` are re-exported from there.

Rule for the soft targets: the target of class ``c`` for a question is exactly the official accuracy that
``mmoe eval vqa`` gives the prediction ``c`` against the question's human answers,
``mmoe.metrics.vqa.vqa_accuracy(c, answers)``. That is:

* when the whitespace-cleaned human answers are not all identical, the answers and ``c`` are compared after
  :func:`normalize_answer` (punctuation, lower-casing, number words to digits, no articles, contractions), so "two",
  "Two" and "2" are all votes for class "2";
* when all human answers are identical, nothing else is done to either side, as in the official script: ten "two"
  credit a class "two" only, and give the class "2" (the vocabulary form) a target of 0;
* an answer matched by 1 / 2 / 3 / >= 4 of ten annotators scores the mean over the ten leave-one-annotator-out subsets
  of ``min(1, matches / 3)``: 0.3 / 0.6 / 0.9 / 1.0 (BEiT-3's ``get_score``), bit-identical to the evaluation's float.

BEiT-3 and ViLT instead normalise the human answers of every question; the two rules differ on the questions whose
annotators all typed the same string when that string is not in normalised form. Each string answer counts as its own
annotator, as each record of the released annotations does (every one has its own ``answer_id``).

The answer vocabulary holds :func:`normalize_answer` forms of the training ``multiple_choice_answer`` strings. Its
file, :data:`ANSWERS_FILE` in a training split's folder, is read by :func:`read_answer_vocab` only (the converters, the
DataModule and the VQA task all call it), with one rule set: a JSON list of distinct non-empty answers (index = class
label, what mmoe writes), or an object answer -> label (BEiT-3's ``answer2label``) whose labels are 0..n-1, each once;
at least one answer, except where the converter reads back the empty vocabulary it may write.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from mmoe.io import read_json
from mmoe.metrics.vqa import answer_accuracy, answer_scores
from mmoe.metrics.vqa_normalize import (
    answers_differ,
    clean_whitespace,
    normalize_answer,
    process_digit_article,
    process_punctuation,
)

__all__ = [
    "ANSWERS_FILE",
    "VocabIndex",
    "answer_accuracy",
    "answer_scores",
    "build_answer_vocab",
    "normalize_answer",
    "process_digit_article",
    "process_punctuation",
    "read_answer_vocab",
    "soft_targets",
]

#: The answer vocabulary's file in a VQAv2 training split's folder (``mmoe data convert vqav2``, ``mmoe data answers``).
ANSWERS_FILE = "answers.json"


@dataclass(frozen=True)
class VocabIndex:
    """An answer vocabulary's labels by the form in which the official evaluation compares each entry.

    Build it once per vocabulary (:meth:`of`) and pass it to :func:`soft_targets`; a plain mapping works too but is
    indexed again on every call.

    Attributes:
        as_given: ``clean_whitespace(entry)`` -> labels; used when a question's human answers are all identical.
        normalized: ``normalize_answer(entry)`` -> labels; used when they differ.
    """

    as_given: Mapping[str, tuple[int, ...]]
    normalized: Mapping[str, tuple[int, ...]]

    @classmethod
    def of(cls, vocab: Mapping[str, int]) -> VocabIndex:
        """Indexes a vocabulary given as answer -> class label."""
        as_given: dict[str, list[int]] = {}
        normalized: dict[str, list[int]] = {}
        for answer, label in vocab.items():
            as_given.setdefault(clean_whitespace(answer), []).append(label)
            normalized.setdefault(normalize_answer(answer), []).append(label)
        return cls(
            {form: tuple(labels) for form, labels in as_given.items()},
            {form: tuple(labels) for form, labels in normalized.items()},
        )


def soft_targets(answers: Sequence[str], vocab: Mapping[str, int] | VocabIndex) -> tuple[list[int], list[float]]:
    """Class labels and soft targets of one question: every vocabulary class the official evaluation credits.

    Args:
        answers: the human answers, raw (one string per annotator).
        vocab: answer -> class label, or its :class:`VocabIndex`.

    Returns:
        The labels with a nonzero target, sorted, and their targets: for class ``c``,
        ``mmoe.metrics.vqa.vqa_accuracy(c, answers)`` (see the module docstring). Both empty when no class is credited.
    """
    if not answers:
        return [], []
    index = vocab if isinstance(vocab, VocabIndex) else VocabIndex.of(vocab)
    labels_of = index.normalized if answers_differ(answers) else index.as_given
    targets = {
        label: score for form, score in answer_scores(answers).items() if score for label in labels_of.get(form, ())
    }
    labels = sorted(targets)
    return labels, [targets[label] for label in labels]


def build_answer_vocab(multiple_choice_answers: Iterable[str], min_count: int = 9) -> list[str]:
    """The answer vocabulary: :func:`normalize_answer` forms of the ``multiple_choice_answer`` strings seen at least
    ``min_count`` times (9 in ViLT and BEiT-3), most frequent first, ties alphabetical; no empty answer. The list index
    is the class label."""
    counts = Counter(normalize_answer(answer) for answer in multiple_choice_answers)
    kept = [(answer, count) for answer, count in counts.items() if count >= min_count and answer]
    return [answer for answer, _ in sorted(kept, key=lambda item: (-item[1], item[0]))]


def read_answer_vocab(
    path: str | os.PathLike, error: type[Exception] = ValueError, allow_empty: bool = False
) -> list[str]:
    """The answer vocabulary of an :data:`ANSWERS_FILE`: the answers in class-label order.

    Args:
        path: the file; a JSON list of answers (index = class label) or an object answer -> label whose labels are
            the integers 0..n-1, each once. Either way the answers are distinct non-empty strings.
        error: the exception raised for a file that breaks these rules or cannot be read (a command's own input
            error); a missing file is a ``FileNotFoundError`` unless ``error`` is given.
        allow_empty: accept a vocabulary with no answer. A classifier needs at least one, but the converter writes
            an empty one (with a warning) when no answer is frequent enough, and reads it back for the other splits.

    Raises:
        error: one line naming the file and what is wrong with it.
    """
    value = read_json(path, "answer vocabulary", error, written_by=f"mmoe data convert vqav2 writes {ANSWERS_FILE}")
    named = f"answer vocabulary {path}"
    if isinstance(value, dict):
        labels = list(value.values())
        if sorted(label for label in labels if type(label) is int) != list(range(len(value))):
            raise error(f"{named}: labels must be 0..{len(value) - 1}, each once")
        value = sorted(value, key=value.__getitem__)
    if not isinstance(value, list):
        raise error(f"{named}: expected a JSON list of answers (index = class label) or an object answer -> label")
    if not value and not allow_empty:
        raise error(f"{named}: holds no answer")
    for label, answer in enumerate(value):
        if not isinstance(answer, str) or not answer:
            raise error(f"{named}: answer {label} must be a non-empty string, got {answer!r}")
    repeated = sorted(answer for answer, count in Counter(value).items() if count > 1)
    if repeated:
        raise error(f"{named}: repeats answers {', '.join(map(repr, repeated[:5]))}")
    return value
