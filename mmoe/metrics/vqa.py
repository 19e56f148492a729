"""VQA accuracy as the official VQA evaluation computes it, quirks included.

Reference: GT-Vision-Lab/VQA, ``PythonEvaluationTools/vqaEvaluation/vqaEval.py`` (latest commit) and
``PythonHelperTools/vqaTools/vqa.py`` (``loadRes``). For every question the official script

1. replaces newlines and tabs by spaces and strips the predicted answer and each ground-truth answer;
2. **only when the ground-truth answers are not all identical** (after step 1), runs the punctuation and then the
   digit/article/contraction processing on the ground-truth answers *and on the prediction*. When all annotators gave
   the same string nothing else is done to either side, so the comparison is exact and case-sensitive ("Yes." does
   not match ten "yes"); the authors' reason is OCR-style questions (GT-Vision-Lab/VQA issue #14);
3. averages, over the ten leave-one-annotator-out subsets ("10 choose 9"), ``min(1, #matching answers / 3)``.
   The left-out annotator is removed by comparing whole answer records (``item != gtAnsDatum``), so records that are
   equal in every field (answer text after processing, ``answer_confidence``, ``answer_id``) leave together. In the
   released annotations every record has its own ``answer_id`` and exactly one leaves.

The punctuation and digit/article/contraction processing of step 2 is :mod:`mmoe.metrics.vqa_normalize`.

Accuracies are reported in percent and never rounded (the official script rounds to ``n = 2`` decimals); sums run in
the official order so the floats are bit-identical to the official script run with a large ``n``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable, Mapping, Sequence
from pathlib import Path
from typing import Any

from mmoe.metrics.files import EvalInputError, read_json, require_field, require_list
from mmoe.metrics.vqa_normalize import comparison_forms


def vqa_accuracy(prediction: str, answers: Sequence[str] | Sequence[Mapping[str, Any]]) -> float:
    """Official VQA accuracy of one predicted answer, as a fraction in [0, 1].

    Args:
        prediction: the model's answer, raw.
        answers: the ground-truth answers, raw: strings (one per annotator), or the annotation's answer records
            (``{"answer": ..., "answer_confidence": ..., "answer_id": ...}``), in which case records equal in every
            field leave the leave-one-out subsets together, as in the official script.

    Returns:
        The mean over left-out annotators of ``min(1, matches / 3)``: 0.3 / 0.6 / 0.9 / 1.0 for 1 / 2 / 3 / >= 4
        matching annotators out of ten.

    Raises:
        ValueError: no ground-truth answer.
    """
    texts, identities = _texts_and_identities(answers)
    guess, truths = comparison_forms(prediction, texts)
    return _leave_one_out_accuracy(guess, truths, _processed_identities(identities, truths))


def answer_scores(answers: Sequence[str] | Sequence[Mapping[str, Any]]) -> dict[str, float]:
    """The official accuracy that each distinct ground-truth answer would get as the prediction.

    Keys are the answers in the form the official script compares (normalised when the annotators disagree, as given
    otherwise); values are fractions (0.3 / 0.6 / 0.9 / 1.0 for 1 / 2 / 3 / >= 4 of ten annotators). These are the
    soft targets of VQA fine-tuning.
    """
    texts, identities = _texts_and_identities(answers)
    _, truths = comparison_forms("", texts)
    identities = _processed_identities(identities, truths)
    return {form: _leave_one_out_accuracy(form, truths, identities) for form in dict.fromkeys(truths)}


def answer_accuracy(matches: int, annotators: int = 10) -> float:
    """Official accuracy of an answer given by ``matches`` of ``annotators`` distinct annotators, as a fraction.

    The mean over the leave-one-out subsets of ``min(1, matches in the subset / 3)``: 0.3 / 0.6 / 0.9 / 1.0 for
    1 / 2 / 3 / >= 4 of ten. Computed by the same code as :func:`vqa_accuracy`, with the matching annotators listed
    first (the last bit of the float depends on the order of the answers).

    Raises:
        ValueError: unless ``annotators > 0`` and ``0 <= matches <= annotators``.
    """
    if annotators <= 0 or not 0 <= matches <= annotators:
        raise ValueError(f"need 0 <= matches <= annotators, annotators > 0; got {matches} of {annotators}")
    truths = ["match"] * matches + ["other"] * (annotators - matches)
    return _leave_one_out_accuracy("match", truths, list(range(annotators)))


def _texts_and_identities(answers: Sequence[str] | Sequence[Mapping[str, Any]]) -> tuple[list[str], list[Any]]:
    if not answers:
        raise ValueError("no ground-truth answers: VQA accuracy needs at least one")
    if all(isinstance(answer, str) for answer in answers):
        return list(answers), list(range(len(answers)))  # one annotator per string
    return [record["answer"] for record in answers], [dict(record) for record in answers]


def _processed_identities(identities: list[Any], truths: list[str]) -> list[Hashable | dict]:
    """Answer records as the official script compares them: with their ``answer`` field processed in place."""
    return [
        {**identity, "answer": truth} if isinstance(identity, dict) else identity
        for identity, truth in zip(identities, truths, strict=True)
    ]


def _leave_one_out_accuracy(guess: str, truths: list[str], identities: list[Any]) -> float:
    """Mean over left-out records of ``min(1, matching others / 3)``, "others" being the records unequal to it.

    Equal records carry equal answers, so the others that match are all matches less those in the left-out record's
    group of equal records; counting per group keeps this linear. Records with unhashable fields are compared
    pairwise, as the official script does.
    """
    keys = [_record_key(identity) for identity in identities]
    if any(key is None for key in keys):
        counts = [
            sum(1 for t, other in zip(truths, identities, strict=True) if other != i and t == guess) for i in identities
        ]
    else:
        matches_per_key = Counter(key for key, truth in zip(keys, truths, strict=True) if truth == guess)
        total = sum(matches_per_key.values())
        counts = [total - matches_per_key[key] for key in keys]
    subset_accuracies = [min(1.0, count / 3) for count in counts]
    return sum(subset_accuracies) / len(subset_accuracies)


def _record_key(identity: Any) -> Hashable | None:
    """A hashable stand-in with the same equality as the record (``dict ==``), or ``None`` if there is none."""
    if not isinstance(identity, dict):
        return identity
    try:
        key = frozenset(identity.items())
        hash(key)
    except TypeError:
        return None
    return key


def evaluate_vqa(annotations: Sequence[Mapping[str, Any]], predictions: Mapping[Any, str]) -> dict[str, Any]:
    """Scores predictions against VQA annotations in the official format.

    Args:
        annotations: the ``annotations`` list of a ``v2_mscoco_*_annotations.json`` file; every entry needs
            ``question_id``, ``question_type``, ``answer_type`` and ``answers``.
        predictions: question id -> predicted answer, one per annotated question, none other (as ``loadRes``
            asserts).

    Returns:
        ``{"overall", "perAnswerType", "perQuestionType", "perQuestion"}`` in percent, unrounded; ``perQuestion`` is
        keyed by the question id as a string, all in annotation order.

    Raises:
        EvalInputError: a question without prediction, a prediction for an unknown question, or a malformed entry.
    """
    annotations = _checked_annotations(annotations, "annotations")
    check_coverage([a["question_id"] for a in annotations], predictions, "predictions", "annotations")
    per_question: dict[str, float] = {}
    accuracies: list[float] = []
    by_question_type: dict[str, list[float]] = {}
    by_answer_type: dict[str, list[float]] = {}
    for annotation in annotations:
        accuracy = vqa_accuracy(predictions[annotation["question_id"]], annotation["answers"])
        accuracies.append(accuracy)
        by_question_type.setdefault(annotation["question_type"], []).append(accuracy)
        by_answer_type.setdefault(annotation["answer_type"], []).append(accuracy)
        per_question[str(annotation["question_id"])] = 100 * accuracy
    return {
        "overall": _percent_mean(accuracies),
        "perAnswerType": {name: _percent_mean(values) for name, values in by_answer_type.items()},
        "perQuestionType": {name: _percent_mean(values) for name, values in by_question_type.items()},
        "perQuestion": per_question,
    }


def _percent_mean(values: list[float]) -> float:
    """``100 * sum / count`` in the official association (``round(100*float(sum(acc))/len(acc), n)`` without round)."""
    return 100 * sum(values) / len(values)


def check_coverage(expected_ids: Sequence[Any], predictions: Mapping[Any, Any], source: str, reference: str) -> None:
    """Raises unless ``predictions`` has exactly one entry for each of ``expected_ids`` and no other.

    Args:
        expected_ids: the annotated question ids.
        predictions: the predictions keyed by question id.
        source: how to name the predictions in the error (a file name).
        reference: how to name the annotations in the error (a file name).
    """
    expected = set(expected_ids)
    missing = [qid for qid in expected_ids if qid not in predictions]
    extra = [qid for qid in predictions if qid not in expected]
    as_text = {str(qid) for qid in missing}
    hint = ' (ids are compared with their JSON type: 1 and "1" differ)' if any(str(q) in as_text for q in extra) else ""
    if missing:
        raise EvalInputError(
            f"{source}: no answer for question id {_id_list(missing)} of {reference}{hint}; "
            "expected exactly one answer per annotated question (the official loadRes asserts the same)"
        )
    if extra:
        raise EvalInputError(
            f"{source}: question id {_id_list(extra)} is not in {reference}; "
            "expected answers only for annotated questions (the official loadRes asserts the same)"
        )


def _id_list(ids: list[Any], shown: int = 5) -> str:
    text = ", ".join(repr(i) for i in ids[:shown])
    return text if len(ids) <= shown else f"{text} and {len(ids) - shown} more ({len(ids)} in all)"


def _checked_annotations(annotations: Sequence[Any], source: str) -> list[Mapping[str, Any]]:
    seen: set[Any] = set()
    for index, annotation in enumerate(annotations):
        where = f"{source}, annotation {index}"
        qid = require_field(annotation, "question_id", (int, str), where)
        where = f"{source}, question id {qid!r}"
        if qid in seen:
            raise EvalInputError(f"{where}: annotated twice; expected one annotation per question")
        seen.add(qid)
        require_field(annotation, "question_type", str, where)
        require_field(annotation, "answer_type", str, where)
        answers = require_field(annotation, "answers", list, where)
        if not answers:
            raise EvalInputError(f"{where}: empty 'answers'; expected the annotators' answers (ten in VQAv2)")
        for number, record in enumerate(answers):
            require_field(record, "answer", str, f"{where}, answer {number}")
    return list(annotations)


def load_vqa(
    questions: str | Path, annotations: str | Path, results: str | Path
) -> tuple[list[Mapping[str, Any]], dict[Any, str]]:
    """Reads the three official files and checks them against each other.

    Args:
        questions: ``v2_OpenEnded_mscoco_*_questions.json`` (``{"questions": [{"question_id", ...}]}``).
        annotations: ``v2_mscoco_*_annotations.json`` (``{"annotations": [...]}``).
        results: ``[{"question_id": int, "answer": str}, ...]``, one entry per annotated question.

    Returns:
        The annotation entries and the predictions keyed by question id.

    Raises:
        EvalInputError: unreadable or malformed JSON, a missing field, an annotated question absent from the
            questions file, a duplicate, missing or extra question id in the results, or (multiple-choice task) an
            answer that is not one of the question's choices.
    """
    question_data = read_json(questions)
    annotation_data = read_json(annotations)
    result_data = require_list(read_json(results), str(results), "{question_id, answer} objects")
    question_list = require_field(question_data, "questions", list, str(questions))
    known = {
        require_field(q, "question_id", (int, str), f"{questions}, question {i}"): q
        for i, q in enumerate(question_list)
    }
    entries = require_field(annotation_data, "annotations", list, str(annotations))
    entries = _checked_annotations(entries, str(annotations))
    for entry in entries:
        if entry["question_id"] not in known:
            raise EvalInputError(
                f"{annotations}: question id {entry['question_id']!r} is not in {questions}; "
                "expected the questions and annotations files of the same split"
            )
    predictions: dict[Any, str] = {}
    for index, result in enumerate(result_data):
        qid = require_field(result, "question_id", (int, str), f"{results}, entry {index}")
        answer = require_field(result, "answer", str, f"{results}, entry {index} (question id {qid!r})")
        if qid in predictions:
            raise EvalInputError(f"{results}, entry {index}: question id {qid!r} answered twice; expected one answer")
        predictions[qid] = answer
    check_coverage([entry["question_id"] for entry in entries], predictions, str(results), str(annotations))
    if isinstance(question_data, dict) and question_data.get("task_type") == "Multiple Choice":
        for qid, answer in predictions.items():
            choices = known[qid].get("multiple_choices", [])
            if answer not in choices:
                raise EvalInputError(f"{results}: answer {answer!r} to question id {qid!r} is not one of its choices")
    return entries, predictions


def evaluate_vqa_files(questions: str | Path, annotations: str | Path, results: str | Path) -> dict[str, Any]:
    """:func:`load_vqa` then :func:`evaluate_vqa`: what ``mmoe eval vqa`` prints."""
    entries, predictions = load_vqa(questions, annotations, results)
    return evaluate_vqa(entries, predictions)
