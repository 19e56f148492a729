"""VQA accuracy against hand-worked cases of the official algorithm (GT-Vision-Lab/VQA vqaEval.py, latest commit).

Every expected accuracy below is written as the official arithmetic: the mean, over the left-out annotators in answer
order, of min(1, matches among the others / 3). The sums are written in that order so the floats compare exactly.
"""

from __future__ import annotations

import json

import pytest

from mmoe.metrics.files import EvalInputError
from mmoe.metrics.vqa import answer_scores, evaluate_vqa, evaluate_vqa_files, vqa_accuracy
from mmoe.metrics.vqa_normalize import normalize_answer, process_digit_article, process_punctuation

THIRD, TWO_THIRDS = 1 / 3, 2 / 3


# ---------------------------------------------------------------- normalisation rules


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("t-shirt", "t shirt"),  # a mark glued to words becomes a space
        ("yes!", "yes "),  # ... also at the end
        ("yes !", "yes "),  # a mark next to a space is deleted
        ("red, white", "red white"),  # ", " touches a space: every comma goes
        ("red,white", "red white"),
        ("1,000", "1000"),  # digit-comma-digit: every mark is deleted
        ("1,000 (approx)", "1000 approx"),  # ... including marks far from the digits
        ("3.5", "3.5"),  # a period before a digit stays
        ("1.", "1"),  # the mistyped lookbehind: a period after a digit goes too
        ("e.g.", "eg"),
        ("don't", "don't"),  # the apostrophe is not a punctuation mark here
        ("10:30", "10:30"),  # nor is the colon
        ("a/b", "a b"),
    ],
)
def test_process_punctuation(text, expected):
    assert process_punctuation(text) == expected


def test_process_punctuation_removes_at_most_32_periods():
    # re.UNICODE (= 32) is passed as sub()'s count: of 40 periods, 8 survive.
    assert process_punctuation("x." * 40) == "x" * 32 + "x." * 8


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("two dogs", "2 dogs"),  # number words become digits
        ("Ten", "10"),  # after lower-casing
        ("none", "0"),  # "none" is a number word (GT-Vision-Lab/VQA issue #7)
        ("twenty", "twenty"),  # only zero..ten
        ("a dog", "dog"),  # articles go
        ("the one", "1"),
        ("an apple", "apple"),
        ("a", ""),  # an article alone leaves nothing
        ("dont", "don't"),  # contractions written without apostrophe are restored
        ("whats up", "what's up"),
        ("Im", "im"),  # table keys with capitals never match after lower-casing
        ("somebody'd", "somebodyd"),  # the official table maps this way round
        ("  Red   Car ", "red car"),  # split on whitespace, joined with single spaces
    ],
)
def test_process_digit_article(text, expected):
    assert process_digit_article(text) == expected


def test_normalize_answer_chains_whitespace_punctuation_digits():
    assert normalize_answer("\tThe Two-Dogs!\n") == "2 dogs"
    # punctuation first: "two." loses its period, then "two" becomes "2"
    assert normalize_answer("two.") == "2"


# ---------------------------------------------------------------- accuracy: split ground truth (processing on)


def test_split_ground_truth_normalises_both_sides_number_words():
    answers = ["two", "2"] + ["three"] * 8  # normalised: "2", "2", then eight "3"
    # prediction "Two" -> "2". Leave out a "2": one "2" left -> 1/3 (twice); leave out a "3": two "2" -> 2/3 (8 times)
    expected = sum([THIRD, THIRD] + [TWO_THIRDS] * 8) / 10  # = 0.6
    assert vqa_accuracy("Two", answers) == expected
    assert expected == pytest.approx(0.6)


def test_split_ground_truth_articles():
    answers = ["the dog", "a dog"] + ["cat"] * 8  # normalised: "dog", "dog", eight "cat"
    assert vqa_accuracy("dog", answers) == sum([THIRD, THIRD] + [TWO_THIRDS] * 8) / 10  # 0.6
    assert vqa_accuracy("An dog", answers) == sum([THIRD, THIRD] + [TWO_THIRDS] * 8) / 10


def test_split_ground_truth_punctuation():
    answers = ["t-shirt", "t shirt"] + ["shirt"] * 8  # both become "t shirt"
    assert vqa_accuracy("T-Shirt!", answers) == sum([THIRD, THIRD] + [TWO_THIRDS] * 8) / 10  # 0.6
    assert vqa_accuracy("tshirt", answers) == 0.0
    answers = ["1,000", "1000"] + ["many"] * 8  # digit-comma-digit: "1000" twice
    assert vqa_accuracy("1,000", answers) == sum([THIRD, THIRD] + [TWO_THIRDS] * 8) / 10


def test_split_ground_truth_contractions():
    answers = ["dont"] * 3 + ["no"] * 7  # "don't" three times
    # leave out a "don't": 2 left -> 2/3 (3 times); leave out a "no": 3 left -> 1 (7 times)
    assert vqa_accuracy("don't", answers) == sum([TWO_THIRDS] * 3 + [1.0] * 7) / 10  # 0.9
    assert vqa_accuracy("dont", answers) == sum([TWO_THIRDS] * 3 + [1.0] * 7) / 10


def test_split_ground_truth_none_becomes_zero():
    answers = ["none"] + ["nothing"] * 9  # "0" once
    # leave out the "0": nothing left -> 0; leave out a "nothing": one "0" -> 1/3 (9 times)
    assert vqa_accuracy("none", answers) == sum([0.0] + [THIRD] * 9) / 10  # 0.3
    assert vqa_accuracy("0", answers) == sum([0.0] + [THIRD] * 9) / 10


def test_split_ground_truth_four_or_more_matches_score_one():
    answers = ["yes"] * 9 + ["no"]
    # "Yes." -> "yes". Leave out a "yes": 8 left -> 1; leave out the "no": 9 -> 1
    assert vqa_accuracy("Yes.", answers) == 1.0
    # "no": leave out a "yes" (9 times): the one "no" is left -> 1/3; leave out the "no": none left -> 0
    assert vqa_accuracy("no", answers) == sum([THIRD] * 9 + [0.0]) / 10  # 0.3


# ---------------------------------------------------------------- accuracy: unanimous ground truth (processing off)


def test_unanimous_ground_truth_compares_raw_strings():
    answers = ["yes"] * 10
    assert vqa_accuracy("yes", answers) == 1.0  # 9 matches whoever is left out
    assert vqa_accuracy(" yes\n", answers) == 1.0  # whitespace cleanup still happens
    assert vqa_accuracy("Yes", answers) == 0.0  # no lower-casing
    assert vqa_accuracy("yes!", answers) == 0.0  # no punctuation processing
    assert vqa_accuracy("the yes", answers) == 0.0  # no article removal


def test_unanimous_number_word_is_not_mapped():
    assert vqa_accuracy("0", ["none"] * 10) == 0.0
    assert vqa_accuracy("none", ["none"] * 10) == 1.0
    assert vqa_accuracy("2", ["two"] * 10) == 0.0


def test_unanimity_is_decided_after_whitespace_cleanup():
    # "yes\n" and "yes" are the same answer once cleaned, so the ground truth is unanimous and "Yes" scores 0
    assert vqa_accuracy("Yes", ["yes\n"] * 5 + ["yes"] * 5) == 0.0
    # with one differing answer, processing is on and "Yes" matches the nine "yes"
    assert vqa_accuracy("Yes", ["yes\n"] * 5 + ["yes"] * 4 + ["no"]) == 1.0


# ---------------------------------------------------------------- accuracy: answer records, soft scores


def test_records_with_distinct_answer_ids_leave_one_at_a_time():
    records = [{"answer": "yes", "answer_id": i} for i in (1, 2, 3)]
    records += [{"answer": "no", "answer_id": i} for i in range(4, 11)]
    # leave out a "yes": 2 left -> 2/3 (3 times); leave out a "no": 3 -> 1 (7 times)
    assert vqa_accuracy("yes", records) == sum([TWO_THIRDS] * 3 + [1.0] * 7) / 10  # 0.9


def test_identical_records_leave_together():
    # Without answer_id the three "yes" records are equal dicts: leaving one out removes all three (item != gtAnsDatum).
    records = [{"answer": "yes"}] * 3 + [{"answer": "no"}] * 7
    # leave out a "yes": no "yes" left -> 0 (3 times); leave out a "no": all 3 "yes" -> 1 (7 times)
    assert vqa_accuracy("yes", records) == sum([0.0] * 3 + [1.0] * 7) / 10  # 0.7
    # records become equal after processing too: "Two" and "2" both read "2"
    records = [{"answer": "Two"}, {"answer": "2"}] + [{"answer": "three", "answer_id": i} for i in range(8)]
    assert vqa_accuracy("2", records) == sum([0.0, 0.0] + [TWO_THIRDS] * 8) / 10


def test_answer_scores_are_the_soft_targets():
    answers = ["red"] * 4 + ["blue"] * 3 + ["green"] * 2 + ["pink"]
    # left out in answer order: the four "red", the three "blue", the two "green", the "pink"
    assert answer_scores(answers) == {
        "red": 1.0,  # 3 or 4 "red" among the others
        "blue": sum([1.0] * 4 + [TWO_THIRDS] * 3 + [1.0] * 3) / 10,  # 0.9
        "green": sum([TWO_THIRDS] * 7 + [THIRD] * 2 + [TWO_THIRDS]) / 10,  # 0.6 (0.5999999999999999 in this order)
        "pink": sum([THIRD] * 9 + [0.0]) / 10,  # 0.3
    }
    # keys in compared form: "Two", "2" and "two" are three votes for "2"
    assert answer_scores(["Two", "2", "two"] + ["3"] * 7) == {"2": sum([TWO_THIRDS] * 3 + [1.0] * 7) / 10, "3": 1.0}


def test_no_ground_truth_is_an_error():
    with pytest.raises(ValueError, match="no ground-truth answers"):
        vqa_accuracy("yes", [])


# ---------------------------------------------------------------- whole evaluation


def _annotation(qid, answers, question_type="what is", answer_type="other"):
    return {
        "question_id": qid,
        "image_id": qid // 10,
        "question_type": question_type,
        "answer_type": answer_type,
        "answers": [{"answer": a, "answer_confidence": "yes", "answer_id": i + 1} for i, a in enumerate(answers)],
    }


ANNOTATIONS = [
    _annotation(10, ["yes"] * 10, "is the", "yes/no"),  # "yes" -> 1.0
    _annotation(11, ["two"] * 2 + ["three"] * 8, "how many", "number"),  # "2" -> 0.6
    _annotation(20, ["dont"] * 3 + ["no"] * 7, "is the", "yes/no"),  # "no" -> 1.0 (7 "no")
    _annotation(21, ["red"] * 10, "what color", "other"),  # "Red" -> 0 (unanimous, case-sensitive)
]
PREDICTIONS = {10: "yes", 11: "2", 20: "no", 21: "Red"}
SIX_TENTHS = sum([THIRD, THIRD] + [TWO_THIRDS] * 8) / 10


def test_evaluate_vqa_report():
    report = evaluate_vqa(ANNOTATIONS, PREDICTIONS)
    assert list(report) == ["overall", "perAnswerType", "perQuestionType", "perQuestion"]
    assert report["perQuestion"] == {"10": 100.0, "11": 100 * SIX_TENTHS, "20": 100.0, "21": 0.0}
    assert report["overall"] == 100 * (1.0 + SIX_TENTHS + 1.0 + 0.0) / 4
    assert report["perAnswerType"] == {"yes/no": 100.0, "number": 100 * SIX_TENTHS, "other": 0.0}
    assert report["perQuestionType"] == {"is the": 100.0, "how many": 100 * SIX_TENTHS, "what color": 0.0}


def test_evaluate_vqa_needs_exact_coverage():
    with pytest.raises(EvalInputError, match="no answer for question id 21"):
        evaluate_vqa(ANNOTATIONS, {k: v for k, v in PREDICTIONS.items() if k != 21})
    with pytest.raises(EvalInputError, match="question id 99 is not in"):
        evaluate_vqa(ANNOTATIONS, {**PREDICTIONS, 99: "yes"})


# ---------------------------------------------------------------- files and their errors


@pytest.fixture
def vqa_files(tmp_path):
    questions = {
        "task_type": "Open-Ended",
        "questions": [
            {"question_id": a["question_id"], "image_id": a["image_id"], "question": "?"} for a in ANNOTATIONS
        ],
    }
    paths = {name: tmp_path / f"{name}.json" for name in ("questions", "annotations", "results")}
    paths["questions"].write_text(json.dumps(questions))
    paths["annotations"].write_text(json.dumps({"annotations": ANNOTATIONS}))
    paths["results"].write_text(json.dumps([{"question_id": q, "answer": a} for q, a in PREDICTIONS.items()]))
    return paths


def _score(paths):
    return evaluate_vqa_files(paths["questions"], paths["annotations"], paths["results"])


def test_files_give_the_in_memory_report(vqa_files):
    assert _score(vqa_files) == evaluate_vqa(ANNOTATIONS, PREDICTIONS)


@pytest.mark.parametrize(
    ("results", "message"),
    [
        (
            [{"question_id": 10, "answer": "yes"}],
            r"results.json: no answer for question id 11, 20, 21 of .*annotations",
        ),
        (
            [{"question_id": q, "answer": "x"} for q in (10, 11, 20, 21, 77)],
            r"results.json: question id 77 is not in .*annotations.json",
        ),
        (
            [{"question_id": q, "answer": "x"} for q in ("10", 11, 20, 21)],
            r"no answer for question id 10 of .*JSON type",
        ),
        (
            [{"question_id": q, "answer": "x"} for q in (10, 11, 20, 21, 10)],
            r"results.json, entry 4: question id 10 answered twice",
        ),
        ([{"question_id": 10}], r"results.json, entry 0 \(question id 10\): missing field 'answer'"),
        ([{"question_id": 10, "answer": 3}], r"field 'answer' must be a string, got 3"),
        ({"question_id": 10, "answer": "yes"}, r"results.json: expected a JSON array"),
    ],
)
def test_bad_results(vqa_files, results, message):
    vqa_files["results"].write_text(json.dumps(results))
    with pytest.raises(EvalInputError, match=message):
        _score(vqa_files)


def test_malformed_json_names_file_line_and_column(vqa_files):
    vqa_files["results"].write_text('[{"question_id": 10,\n "answer": yes}]')
    with pytest.raises(EvalInputError, match=r"results.json: malformed JSON at line 2, column 12"):
        _score(vqa_files)


def test_bad_annotations_and_questions(vqa_files):
    broken = [dict(ANNOTATIONS[0], answers=[])] + ANNOTATIONS[1:]
    vqa_files["annotations"].write_text(json.dumps({"annotations": broken}))
    with pytest.raises(EvalInputError, match=r"annotations.json, question id 10: empty 'answers'"):
        _score(vqa_files)
    missing_type = [{k: v for k, v in ANNOTATIONS[0].items() if k != "answer_type"}] + ANNOTATIONS[1:]
    vqa_files["annotations"].write_text(json.dumps({"annotations": missing_type}))
    with pytest.raises(EvalInputError, match=r"question id 10: missing field 'answer_type'"):
        _score(vqa_files)
    vqa_files["annotations"].write_text(json.dumps({"annotations": ANNOTATIONS}))
    vqa_files["questions"].write_text(json.dumps({"questions": [{"question_id": 10}]}))
    with pytest.raises(EvalInputError, match=r"question id 11 is not in .*questions.json"):
        _score(vqa_files)


def test_missing_file(vqa_files, tmp_path):
    vqa_files["results"] = tmp_path / "nowhere.json"
    with pytest.raises(EvalInputError, match=r"nowhere.json: no such file"):
        _score(vqa_files)
