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

Punctuation processing (``processPunctuation``): each of 21 marks (no apostrophe, colon or period) is deleted when the
*original* text has it next to a space or the text contains a digit-comma-digit anywhere, and is replaced by a space
otherwise. Then periods not followed by a digit are deleted: the pattern ``(?!<=\\d)(\\.)(?!\\d)`` has a mistyped
lookbehind that never applies, so "1." loses its period too, and ``re.UNICODE`` is passed as the ``count`` argument of
``sub``, so at most 32 periods go. Digit/article processing (``processDigitArticle``): lower-case, split on
whitespace, map the words zero..ten and "none" to digits ("none" becomes "0", GT-Vision-Lab/VQA issue #7), drop
"a", "an", "the", expand contractions written without apostrophe ("dont" -> "don't"), join with single spaces.

Accuracies are reported in percent and never rounded (the official script rounds to ``n = 2`` decimals); sums run in
the official order so the floats are bit-identical to the official script run with a large ``n``.
"""

from __future__ import annotations

import functools
import re
from collections import Counter
from collections.abc import Hashable, Mapping, Sequence
from pathlib import Path
from typing import Any

from mmoe.metrics.files import EvalInputError, read_json, require_field, require_list

#: ``processPunctuation``'s marks, in the official order. The apostrophe, colon and period are not among them.
PUNCTUATION = (";", "/", "[", "]", '"', "{", "}", "(", ")", "=", "+", "\\", "_", "-", ">", "<", "@", "`", ",", "?", "!")

#: ``manualMap``: number words (and "none") become digits.
NUMBER_WORDS = {
    "none": "0",
    "zero": "0",
    "one": "1",
    "two": "2",
    "three": "3",
    "four": "4",
    "five": "5",
    "six": "6",
    "seven": "7",
    "eight": "8",
    "nine": "9",
    "ten": "10",
}

ARTICLES = frozenset({"a", "an", "the"})

#: The official contraction table. Lookups happen after lower-casing, so the keys with capitals ("Im", "Ive",
#: "Id've", "I'dve") never apply; "somebody'd" maps to "somebodyd" (sic). Both kept as in the official table.
CONTRACTIONS = {
    "aint": "ain't", "arent": "aren't", "cant": "can't", "couldve": "could've", "couldnt": "couldn't",
    "couldn'tve": "couldn't've", "couldnt've": "couldn't've", "didnt": "didn't", "doesnt": "doesn't", "dont": "don't",
    "hadnt": "hadn't", "hadnt've": "hadn't've", "hadn'tve": "hadn't've", "hasnt": "hasn't", "havent": "haven't",
    "hed": "he'd", "hed've": "he'd've", "he'dve": "he'd've", "hes": "he's", "howd": "how'd", "howll": "how'll",
    "hows": "how's", "Id've": "I'd've", "I'dve": "I'd've", "Im": "I'm", "Ive": "I've", "isnt": "isn't", "itd": "it'd",
    "itd've": "it'd've", "it'dve": "it'd've", "itll": "it'll", "let's": "let's", "maam": "ma'am", "mightnt": "mightn't",
    "mightnt've": "mightn't've", "mightn'tve": "mightn't've", "mightve": "might've", "mustnt": "mustn't",
    "mustve": "must've", "neednt": "needn't", "notve": "not've", "oclock": "o'clock", "oughtnt": "oughtn't",
    "ow's'at": "'ow's'at", "'ows'at": "'ow's'at", "'ow'sat": "'ow's'at", "shant": "shan't", "shed've": "she'd've",
    "she'dve": "she'd've", "she's": "she's", "shouldve": "should've", "shouldnt": "shouldn't",
    "shouldnt've": "shouldn't've", "shouldn'tve": "shouldn't've", "somebody'd": "somebodyd",
    "somebodyd've": "somebody'd've", "somebody'dve": "somebody'd've", "somebodyll": "somebody'll",
    "somebodys": "somebody's", "someoned": "someone'd", "someoned've": "someone'd've", "someone'dve": "someone'd've",
    "someonell": "someone'll", "someones": "someone's", "somethingd": "something'd", "somethingd've": "something'd've",
    "something'dve": "something'd've", "somethingll": "something'll", "thats": "that's", "thered": "there'd",
    "thered've": "there'd've", "there'dve": "there'd've", "therere": "there're", "theres": "there's", "theyd": "they'd",
    "theyd've": "they'd've", "they'dve": "they'd've", "theyll": "they'll", "theyre": "they're", "theyve": "they've",
    "twas": "'twas", "wasnt": "wasn't", "wed've": "we'd've", "we'dve": "we'd've", "weve": "we've", "werent": "weren't",
    "whatll": "what'll", "whatre": "what're", "whats": "what's", "whatve": "what've", "whens": "when's",
    "whered": "where'd", "wheres": "where's", "whereve": "where've", "whod": "who'd", "whod've": "who'd've",
    "who'dve": "who'd've", "wholl": "who'll", "whos": "who's", "whove": "who've", "whyll": "why'll", "whyre": "why're",
    "whys": "why's", "wont": "won't", "wouldve": "would've", "wouldnt": "wouldn't", "wouldnt've": "wouldn't've",
    "wouldn'tve": "wouldn't've", "yall": "y'all", "yall'll": "y'all'll", "y'allll": "y'all'll",
    "yall'd've": "y'all'd've", "y'alld've": "y'all'd've", "y'all'dve": "y'all'd've", "youd": "you'd",
    "youd've": "you'd've", "you'dve": "you'd've", "youll": "you'll", "youre": "you're", "youve": "you've",
}  # fmt: skip

_DIGIT_COMMA_DIGIT = re.compile(r"\d,\d")
#: Equivalent to the official ``(?!<=\d)(\.)(?!\d)``: its "lookbehind" is a lookahead for the text "<=" and a digit,
#: which never matches at a period, so only "not followed by a digit" remains.
_PERIOD_NOT_BEFORE_DIGIT = re.compile(r"\.(?!\d)")
#: The official call is ``periodStrip.sub("", text, re.UNICODE)``: re.UNICODE (32) lands in ``count``.
_MAX_PERIODS_REMOVED = int(re.UNICODE)


def clean_whitespace(text: str) -> str:
    """Newlines and tabs become spaces, then leading and trailing whitespace goes (the official first step)."""
    return text.replace("\n", " ").replace("\t", " ").strip()


def process_punctuation(text: str) -> str:
    """The official ``processPunctuation``: delete or space out 21 marks, then delete periods not before a digit.

    A mark is deleted when the *original* text has it next to a space ("yes !" -> "yes ") or contains a
    digit-comma-digit anywhere ("1,000" -> "1000"); otherwise it becomes a space ("t-shirt" -> "t shirt"). At most
    32 periods are deleted.
    """
    glue_everything = _DIGIT_COMMA_DIGIT.search(text) is not None
    out = text
    for mark in PUNCTUATION:
        delete = glue_everything or f"{mark} " in text or f" {mark}" in text
        out = out.replace(mark, "" if delete else " ")
    return _PERIOD_NOT_BEFORE_DIGIT.sub("", out, count=_MAX_PERIODS_REMOVED)


def process_digit_article(text: str) -> str:
    """The official ``processDigitArticle``: lower-case, number words to digits, no articles, contractions expanded."""
    words = [NUMBER_WORDS.get(word, word) for word in text.lower().split()]
    return " ".join(CONTRACTIONS.get(word, word) for word in words if word not in ARTICLES)


def normalize_answer(text: str) -> str:
    """Whitespace cleanup, punctuation, then digit/article processing: the full official answer normalisation.

    This is what the official script applies to both sides when the annotators disagree; use it to build answer
    vocabularies and to normalise model outputs.
    """
    return _processed(clean_whitespace(text))


def comparison_forms(prediction: str, answers: Sequence[str]) -> tuple[str, list[str]]:
    """The prediction and ground-truth answers exactly as the official script compares them.

    Whitespace is cleaned on both sides; when the cleaned answers are not all identical both sides are also normalised
    (:func:`normalize_answer`), when they are identical nothing else is done.
    """
    truths = [clean_whitespace(answer) for answer in answers]
    guess = clean_whitespace(prediction)
    if _differ(truths):
        truths = [_processed(answer) for answer in truths]
        guess = _processed(guess)
    return guess, truths


def answers_differ(answers: Sequence[str]) -> bool:
    """Whether the official script normalises this question: its whitespace-cleaned answers are not all identical.

    When they differ, answers and prediction are compared in :func:`normalize_answer` form; otherwise as given (after
    :func:`clean_whitespace`).
    """
    return _differ([clean_whitespace(answer) for answer in answers])


def _differ(cleaned: Sequence[str]) -> bool:
    return len(set(cleaned)) > 1


@functools.lru_cache(maxsize=1 << 16)
def _processed(text: str) -> str:
    """Punctuation then digit/article processing, memoised: VQA answers repeat across questions."""
    return process_digit_article(process_punctuation(text))


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
