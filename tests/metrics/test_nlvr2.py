"""NLVR2 accuracy and consistency against hand-worked cases of lil-lab/nlvr ``nlvr2/eval/metrics.py``."""

from __future__ import annotations

import json

import pytest

from mmoe.metrics.files import EvalInputError
from mmoe.metrics.nlvr2 import consistency_group, correct_pairs, evaluate_nlvr2_files, nlvr2_scores

SENTENCE = "There are two dogs in the left image."
# Two sets (850 and 851) that happen to use the same sentence text: two consistency groups, not one.
EXAMPLES = [
    {"identifier": "dev-850-0-1", "sentence": SENTENCE, "label": "True"},
    {"identifier": "dev-850-1-1", "sentence": SENTENCE, "label": "False"},
    {"identifier": "dev-851-0-1", "sentence": SENTENCE, "label": "True"},
    {"identifier": "dev-851-2-1", "sentence": SENTENCE, "label": "True"},
    {"identifier": "dev-850-0-2", "sentence": "Another sentence.", "label": "False"},
]
# Right, right, right, wrong, right.
PREDICTIONS = ["dev-850-0-1,true", "dev-850-1-1,FALSE", "dev-851-0-1,True", "dev-851-2-1,false", "dev-850-0-2,False"]


def test_group_blanks_the_pair_id():
    assert consistency_group("dev-850-3-1") == "dev-850--1"
    assert consistency_group("dev-850-0-1") == consistency_group("dev-850-3-1")
    assert consistency_group("dev-850-0-1") != consistency_group("dev-851-0-1")


def test_groups_come_from_identifiers_not_sentence_text():
    labels = {e["identifier"]: e["label"] for e in EXAMPLES}
    predictions = dict(line.split(",") for line in PREDICTIONS)
    scores = nlvr2_scores(labels, predictions)
    # accuracy: 4 of 5 right
    assert scores["accuracy"] == 4 / 5
    # groups: dev-850--1 (both right), dev-851--1 (one wrong), dev-850--2 (right) -> 2 of 3 consistent.
    # Grouping by sentence text would give 1 of 2.
    assert scores["consistency"] == 2 / 3


def test_labels_and_predictions_are_case_insensitive_and_may_be_bools():
    assert nlvr2_scores({"dev-1-0-0": "TRUE", "dev-1-1-0": "false"}, {"dev-1-0-0": True, "dev-1-1-0": "False"}) == {
        "accuracy": 1.0,
        "consistency": 1.0,
    }


def test_missing_prediction_is_an_error_extra_is_a_warning():
    with pytest.raises(EvalInputError, match=r"no prediction for 'dev-1-1-0'"):
        nlvr2_scores({"dev-1-0-0": "True", "dev-1-1-0": "True"}, {"dev-1-0-0": "true"})
    with pytest.warns(UserWarning, match=r"1 predictions have identifiers absent from the data.*dev-9-0-0"):
        scores = nlvr2_scores({"dev-1-0-0": "True"}, {"dev-1-0-0": "true", "dev-9-0-0": "false"})
    assert scores == {"accuracy": 1.0, "consistency": 1.0}


@pytest.fixture
def nlvr2_files(tmp_path):
    data, predictions = tmp_path / "dev.json", tmp_path / "predictions.csv"
    data.write_text("".join(json.dumps(e) + "\n" for e in EXAMPLES))
    predictions.write_text("\n".join(PREDICTIONS) + "\n")
    return data, predictions


def test_files(nlvr2_files):
    assert evaluate_nlvr2_files(*nlvr2_files) == {"accuracy": 4 / 5, "consistency": 2 / 3}


@pytest.mark.parametrize(
    ("lines", "message"),
    [
        (PREDICTIONS[:-1], r"predictions.csv: no prediction for 'dev-850-0-2'; expected one line for each of the 5"),
        (PREDICTIONS[:1] + ["dev-850-1-1"] + PREDICTIONS[2:], r"predictions.csv, line 2: 'dev-850-1-1' is not"),
        (PREDICTIONS[:1] + ["dev-850-1-1,false,x"] + PREDICTIONS[2:], r"predictions.csv, line 2: .* is not 'identif"),
        (
            PREDICTIONS[:2] + ["dev-851-0-1,maybe"] + PREDICTIONS[3:],
            r"line 3 \(dev-851-0-1\): label 'maybe' is neither",
        ),
        (PREDICTIONS + ["dev-850-0-1,true"], r"predictions.csv, line 6: second prediction for 'dev-850-0-1'"),
    ],
)
def test_bad_predictions(nlvr2_files, lines, message):
    data, predictions = nlvr2_files
    predictions.write_text("\n".join(lines) + "\n")
    with pytest.raises(EvalInputError, match=message):
        evaluate_nlvr2_files(data, predictions)


def test_blank_prediction_lines_are_skipped(nlvr2_files):
    data, predictions = nlvr2_files
    predictions.write_text("\n\n".join(PREDICTIONS) + "\n\n")
    assert evaluate_nlvr2_files(data, predictions)["accuracy"] == 4 / 5


@pytest.mark.parametrize(
    ("data_lines", "message"),
    [
        (['{"identifier": "dev-850-0-1", "label": "True"', "{}"], r"dev.json, line 1: malformed JSON"),
        (['{"identifier": "dev-850-0-1"}'], r"dev.json, line 1 \(dev-850-0-1\): missing field 'label'"),
        (['{"label": "True"}'], r"dev.json, line 1: missing field 'identifier'"),
        (['{"identifier": "dev-850", "label": "True"}'], r"line 1: identifier 'dev-850' is not of the form"),
        (['{"identifier": "dev-850-0-1", "label": "yes"}'], r"line 1 \(dev-850-0-1\): label 'yes' is neither"),
        (['{"identifier": "dev-850-0-1", "label": "True"}'] * 2, r"line 2: identifier 'dev-850-0-1' appears twice"),
        ([], r"dev.json: no example"),
    ],
)
def test_bad_data(nlvr2_files, data_lines, message):
    data, predictions = nlvr2_files
    data.write_text("\n".join(data_lines))
    with pytest.raises(EvalInputError, match=message):
        evaluate_nlvr2_files(data, predictions)


def test_correct_pairs_are_the_accuracy_items_in_data_order():
    labels = {"dev-1-0-0": "True", "dev-1-1-0": "false", "dev-2-0-1": "TRUE"}
    predictions = {"dev-2-0-1": False, "dev-1-1-0": "False", "dev-1-0-0": "true"}
    correct = correct_pairs(labels, predictions)
    assert list(correct.items()) == [("dev-1-0-0", True), ("dev-1-1-0", True), ("dev-2-0-1", False)]
    assert nlvr2_scores(labels, predictions)["accuracy"] == sum(correct.values()) / len(correct)


def test_files_with_a_byte_order_mark_and_unicode_line_breaks_in_a_sentence_are_read_as_written(nlvr2_files):
    data, predictions = nlvr2_files
    examples = [{**example, "sentence": f"{example['sentence']}\u2028and\u0085more"} for example in EXAMPLES]
    data.write_bytes(b"\xef\xbb\xbf" + "".join(json.dumps(e, ensure_ascii=False) + "\r\n" for e in examples).encode())
    predictions.write_bytes(b"\xef\xbb\xbf" + "\r\n".join(PREDICTIONS).encode())  # as Excel saves a CSV
    assert evaluate_nlvr2_files(data, predictions) == {"accuracy": 4 / 5, "consistency": 2 / 3}
