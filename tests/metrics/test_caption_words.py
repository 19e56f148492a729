"""Colour-word precision of captions against their references, and its random-image chance level, by hand."""

from __future__ import annotations

import pytest

from mmoe.data.synth.scenes import COLORS
from mmoe.metrics.caption_words import word_counts, word_precision

REFERENCES = {
    1: ["A red circle at the top.", "a red circle and a blue square"],
    2: ["a green triangle"],
    3: ["a blue cross in the middle", "a White square"],
    4: ["a yellow circle"],
}


def test_precision_counts_each_listed_word_against_the_same_images_references():
    predictions = {1: "a red circle and a green square", 2: "a green triangle, a green cross", 3: "a white, blue shape"}
    # Listed words: red (1: yes), green (1: no), green, green (2: yes, yes), white (3: yes, case and comma ignored),
    # blue (3: yes): 5 of 6.
    # Share of the 4 images whose references hold the word: red 1/4, green 1/4, white 1/4, blue 2/4.
    result = word_precision(predictions, REFERENCES, COLORS)
    assert result["words"] == 6
    assert result["precision"] == pytest.approx(5 / 6)
    assert result["chance"] == pytest.approx((0.25 + 0.25 + 0.25 + 0.25 + 0.25 + 0.5) / 6)


def test_fixed_words_score_their_chance_level():
    # One caption for every image: its precision is the share of images holding its words, i.e. the chance level.
    predictions = {image_id: "a blue square" for image_id in REFERENCES}
    result = word_precision(predictions, REFERENCES, COLORS)
    assert result["precision"] == pytest.approx(result["chance"]) == pytest.approx(0.5)


def test_other_word_lists_no_listed_word_and_unknown_ids():
    assert word_precision({4: "a yellow circle"}, REFERENCES, words=["circle", "square"]) == {
        "words": 1, "precision": 1.0, "chance": 0.5,
    }  # fmt: skip
    assert word_precision({4: "a shape"}, REFERENCES, COLORS) == {"words": 0, "precision": 0.0, "chance": 0.0}
    with pytest.raises(KeyError, match=r"predicted image ids \[9\] have no references"):
        word_precision({9: "a red circle"}, REFERENCES, COLORS)


def test_per_image_counts_sum_to_the_precision():
    predictions = {1: "a red circle and a green square", 2: "green triangle, green cross", 3: "a shape", 4: "Yellow"}
    counts = word_counts(predictions, REFERENCES, COLORS)
    assert counts == {1: (1, 2), 2: (2, 2), 3: (0, 0), 4: (1, 1)}
    result = word_precision(predictions, REFERENCES, COLORS)
    assert result["words"] == sum(written for _, written in counts.values())
    assert result["precision"] == sum(right for right, _ in counts.values()) / result["words"]
    with pytest.raises(KeyError, match=r"predicted image ids \[9\] have no references"):
        word_counts({9: "a red circle"}, REFERENCES, COLORS)
