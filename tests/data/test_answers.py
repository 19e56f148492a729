"""VQA answer vocabulary and soft targets against hand-computed cases of the official evaluation, and against
``mmoe.metrics.vqa.vqa_accuracy`` itself (what ``mmoe eval vqa`` credits)."""

from __future__ import annotations

import json

import pytest

from mmoe.data.answers import (
    ANSWERS_FILE,
    VocabIndex,
    answer_accuracy,
    answer_scores,
    build_answer_vocab,
    normalize_answer,
    process_punctuation,
    read_answer_vocab,
    soft_targets,
)
from mmoe.data.converters import ConversionError
from mmoe.metrics import vqa as metrics
from mmoe.metrics import vqa_normalize

THIRD, TWO_THIRDS = 1 / 3, 2 / 3


def test_normalisation_is_the_metrics_one():
    assert normalize_answer is vqa_normalize.normalize_answer
    assert process_punctuation is vqa_normalize.process_punctuation
    assert answer_scores is metrics.answer_scores


@pytest.mark.parametrize(
    "raw, normalised",
    [
        ("Two", "2"),
        ("two dogs.", "2 dogs"),
        ("The cat", "cat"),
        ("an apple", "apple"),
        ("none", "0"),
        ("dont know", "don't know"),
        ("isnt it", "isn't it"),
        ("yes!", "yes"),  # "!" becomes a space, then split/join drops it
        ("1,000", "1000"),  # digit-comma-digit: every mark is deleted
        ("3.5", "3.5"),  # a period before a digit stays
        ("red-white", "red white"),
        ("red - white", "red white"),  # a mark next to a space is deleted
        ("  Hello\tWorld \n", "hello world"),
        ("fire hydrant", "fire hydrant"),
    ],
)
def test_normalize_answer(raw, normalised):
    assert normalize_answer(raw) == normalised


def test_period_rule_stops_after_32_periods():
    assert process_punctuation("." * 40) == "." * 8


def test_official_accuracy_by_number_of_matching_annotators():
    assert [round(answer_accuracy(m), 10) for m in range(6)] == [0.0, 0.3, 0.6, 0.9, 1.0, 1.0]
    # 3 of 4 annotators: leave-one-out subsets of 3 -> (3 * 2/3 + 1 * 1) / 4
    assert answer_accuracy(3, 4) == pytest.approx(0.75)
    # the same float as the evaluation when the matching annotators come first
    assert answer_accuracy(2) == metrics.vqa_accuracy("a", ["a"] * 2 + ["b"] * 8)
    with pytest.raises(ValueError, match="0 <= matches <= annotators"):
        answer_accuracy(11)


def test_answer_scores_normalise_both_sides_only_when_answers_differ():
    scores = answer_scores(["red"] * 6 + ["red."] + ["blue"] * 2 + ["Red"])
    # answers differ: "red." and "Red" both become "red" (8 matches); left out in order: 7 "red", 2 "blue", "Red"
    assert scores == {"red": 1.0, "blue": sum([TWO_THIRDS] * 7 + [THIRD] * 2 + [TWO_THIRDS]) / 10}
    assert scores["blue"] == pytest.approx(0.6)
    assert answer_scores(["two"] * 10) == {"two": 1.0}  # identical answers are not processed at all


def test_soft_targets_against_a_vocabulary():
    vocab = {"yes": 0, "no": 1, "2": 2}
    labels, scores = soft_targets(["yes"] * 3 + ["no"] * 6 + ["maybe"], vocab)
    # "yes": leave out a "yes" -> 2 left (3 times), a "no" or "maybe" -> 3 left (7 times); "no": 5 or 6 left -> 1
    assert labels == [0, 1] and scores == [sum([TWO_THIRDS] * 3 + [1.0] * 7) / 10, 1.0]
    assert scores == pytest.approx([0.9, 1.0])
    assert soft_targets(["maybe"] * 10, vocab) == ([], [])
    assert soft_targets([], vocab) == ([], [])


def test_number_words_and_digits_give_the_class_and_score_eval_credits():
    # "two", "2", "Two" are three votes for "2" once normalised; "three" seven votes for "3"
    answers = ["two", "2", "Two"] + ["three"] * 7
    vocab = build_answer_vocab(["two", "2", "three", "3"], min_count=1)
    assert vocab == ["2", "3"]
    labels, scores = soft_targets(answers, {answer: label for label, answer in enumerate(vocab)})
    assert labels == [0, 1]
    # class "2": leave out one of the three -> 2 left (3 times), leave out a "three" -> 3 left (7 times)
    assert scores[0] == sum([TWO_THIRDS] * 3 + [1.0] * 7) / 10 == pytest.approx(0.9)
    assert scores[1] == 1.0
    # exactly what mmoe eval vqa gives the class's answer, and the unnormalised prediction "two" as well
    assert scores == [metrics.vqa_accuracy("2", answers), metrics.vqa_accuracy("3", answers)]
    assert metrics.vqa_accuracy("two", answers) == scores[0]


def test_unanimous_answers_credit_only_the_identical_string_as_eval_does():
    answers = ["two"] * 10  # the official script compares these as given
    assert metrics.vqa_accuracy("2", answers) == 0.0 and metrics.vqa_accuracy("two", answers) == 1.0
    assert soft_targets(answers, {"2": 0, "3": 1}) == ([], [])  # the vocabulary form "2" earns nothing
    assert soft_targets(answers, {"2": 0, "two": 1}) == ([1], [1.0])  # a vocabulary holding "two" as typed


ANSWER_SETS = [
    ["two", "2", "Two"] + ["three"] * 7,
    ["two"] * 10,
    ["yes"] * 9 + ["Yes"],
    ["Yes"] * 10,
    ["t-shirt", "t shirt", "T-Shirt!"] + ["shirt"] * 7,
    ["the dog", "a dog", "dog."] + ["cat"] * 4 + ["none", "0", "zero"],
    ["dont know"] * 2 + ["don't know"] * 2 + ["no"] * 6,
    ["red\n"] * 5 + ["red"] * 5,
    ["1,000", "1000", "many"],
]
VOCAB = ["2", "two", "Two", "3", "yes", "Yes", "t shirt", "T-Shirt", "shirt", "dog", "the dog", "cat", "0", "none"]
VOCAB += ["don't know", "dont know", "no", "red", " red ", "1000", "many"]


@pytest.mark.parametrize("answers", ANSWER_SETS)
def test_every_soft_target_is_the_official_accuracy_of_its_class(answers):
    vocab = {answer: label for label, answer in enumerate(VOCAB)}
    labels, scores = soft_targets(answers, VocabIndex.of(vocab))
    target = dict(zip(labels, scores, strict=True))
    for answer, label in vocab.items():
        assert target.get(label, 0.0) == metrics.vqa_accuracy(answer, answers), answer
    assert soft_targets(answers, vocab) == (labels, scores)  # a plain mapping gives the same


def test_answer_vocabulary_is_normalised_counted_and_ordered():
    answers = ["Yes"] * 12 + ["no"] * 10 + ["two"] * 9 + ["2"] + ["rare"] * 3
    assert build_answer_vocab(answers, min_count=9) == ["yes", "2", "no"]
    assert build_answer_vocab(answers, min_count=1) == ["yes", "2", "no", "rare"]
    assert build_answer_vocab(["a", "the"], min_count=1) == []  # nothing left after dropping articles


def test_answers_file_as_a_list_or_an_object_in_label_order(tmp_path):
    listed, mapped = tmp_path / "list.json", tmp_path / "map.json"
    listed.write_text(json.dumps(["yes", "no", "2"]))
    mapped.write_text(json.dumps({"no": 1, "2": 2, "yes": 0}))  # keys out of label order
    assert read_answer_vocab(listed) == read_answer_vocab(mapped) == ["yes", "no", "2"]


@pytest.mark.parametrize(
    "content, why",
    [
        (["yes", "no", "yes"], "repeats answers 'yes'"),
        ({"yes": 0, "no": 2}, "labels must be 0..1, each once"),
        ({"yes": 0, "no": 0}, "labels must be 0..1, each once"),
        ({"yes": 0, "no": True}, "labels must be 0..1, each once"),
        ("yes", "expected a JSON list of answers (index = class label) or an object answer -> label"),
        (42, "expected a JSON list of answers (index = class label) or an object answer -> label"),
        ([], "holds no answer"),
        (["yes", ""], "answer 1 must be a non-empty string, got ''"),
        (["yes", 2], "answer 1 must be a non-empty string, got 2"),
    ],
)
def test_a_bad_answers_file_is_one_line_naming_it(tmp_path, content, why):
    path = tmp_path / ANSWERS_FILE
    path.write_text(json.dumps(content))
    with pytest.raises(ValueError) as error:
        read_answer_vocab(path)
    assert str(error.value) == f"answer vocabulary {path}: {why}"
    with pytest.raises(ConversionError, match="answer vocabulary .*answers.json"):  # the converters' error type
        read_answer_vocab(path, ConversionError)


def test_only_the_converter_reads_an_empty_answers_file(tmp_path):
    path = tmp_path / ANSWERS_FILE
    path.write_text("[]")
    assert read_answer_vocab(path, allow_empty=True) == []
    with pytest.raises(ValueError, match="holds no answer"):
        read_answer_vocab(path)


def test_a_missing_or_malformed_answers_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="answers.json does not exist .mmoe data convert vqav2"):
        read_answer_vocab(tmp_path / ANSWERS_FILE)
    (tmp_path / ANSWERS_FILE).write_text('["yes",')
    with pytest.raises(ValueError, match=r"answers.json: malformed JSON at line 1"):
        read_answer_vocab(tmp_path / ANSWERS_FILE)
