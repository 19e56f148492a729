"""VQA answer normalisation and soft scores against hand-computed cases of the official evaluation."""

from __future__ import annotations

import pytest

from mmoe.data.answers import (
    answer_accuracy,
    answer_scores,
    build_answer_vocab,
    normalize_answer,
    process_punctuation,
    soft_targets,
)


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


def test_answer_scores_apply_punctuation_only_when_answers_differ():
    scores = answer_scores(["red"] * 6 + ["red."] + ["blue"] * 2 + ["Red"])
    # "red." -> "red" (7 matches), "Red" keeps its capital (human answers are not lower-cased): 1 match
    assert scores == pytest.approx({"red": 1.0, "blue": 0.6, "Red": 0.3})
    assert answer_scores(["two"] * 10) == {"two": 1.0}  # identical answers are not processed at all


def test_soft_targets_against_a_vocabulary():
    vocab = {"yes": 0, "no": 1, "2": 2}
    labels, scores = soft_targets(["yes"] * 3 + ["no"] * 6 + ["maybe"], vocab)
    assert labels == [0, 1] and scores == pytest.approx([0.9, 1.0])
    assert soft_targets(["maybe"] * 10, vocab) == ([], [])


def test_answer_vocabulary_is_normalised_counted_and_ordered():
    answers = ["Yes"] * 12 + ["no"] * 10 + ["two"] * 9 + ["2"] + ["rare"] * 3
    assert build_answer_vocab(answers, min_count=9) == ["yes", "2", "no"]
    assert build_answer_vocab(answers, min_count=1) == ["yes", "2", "no", "rare"]
