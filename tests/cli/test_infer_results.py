"""``mmoe infer``'s results format themselves: the printed lines show what the ``--json`` record holds, and a task's
spec says which checkpoint arguments its options replace."""

from __future__ import annotations

import json

import pytest

from mmoe.infer.results import FolderResults, ImageMatches, Routed, ShardResults, TextMatches
from mmoe.tasks.catalog import INFER_SPECS
from mmoe.tasks.inference import Answer, Answers, Caption, Similarity, Verdict

TASK_RESULTS = [
    Answers([Answer("two", 0.912345), Answer("red", 0.04)]),
    Verdict(False, 0.312345),
    Caption("a red square on a blue field"),
    Similarity(-0.25),
]
COMMAND_RESULTS = [
    FolderResults("answers.json", 3, 1),
    ShardResults("predictions.json", 7, 2, "results were written for 7 of the 9 samples"),
    ImageMatches("a red square", [{"file": "b.png", "score": 0.5}, {"file": "a/c.png", "score": 0.125}], 4, 1, 2, 1),
    TextMatches("photo.jpg", [{"text": "a blue circle", "score": 0.75}], 3),
]


def shown(value) -> list[str]:
    """How a value of a record appears in the printed lines: a float to 4 places, a list through its elements."""
    if isinstance(value, float):
        return [f"{value:.4f}"]
    if isinstance(value, list):
        return [text for element in value for field in element.values() for text in shown(field)]
    return [str(value)]


@pytest.mark.parametrize("result", TASK_RESULTS + COMMAND_RESULTS, ids=lambda result: type(result).__name__)
def test_the_printed_lines_show_every_value_of_the_json_record(result):
    record = json.loads(json.dumps(result.record()))  # JSON-serialisable as it is
    text = result.formatted()
    for key, value in record.items():
        # The query is the user's own, the shortfall goes to stderr, a text file's line count is not printed.
        if key not in ("query", "shortfall", "texts"):
            assert all(part in text for part in shown(value)), (key, value, text)


@pytest.mark.parametrize("result", TASK_RESULTS, ids=lambda result: type(result).__name__)
def test_a_routed_result_adds_a_line_per_text_token_and_the_map_to_the_result(result):
    tokens = [{"token": "a", "experts": {"layer1": [[0, 2]], "layer3": [[1, 3]]}}, {"token": "red", "experts": {}}]
    routed = Routed(result, tokens, "map.png")
    assert routed.record() == {**result.record(), "text_tokens": tokens, "routing_map": "map.png"}
    lines = routed.formatted().splitlines()
    own = result.formatted().splitlines()
    assert lines[: len(own)] == own and lines[-1] == "routing map: map.png"
    assert [line.split("\t")[0] for line in lines[len(own) : -1]] == ["'a'", "'red'"]
    assert "layer1: [[0, 2]]  layer3: [[1, 3]]" in lines[len(own)]


def test_a_spec_replaces_the_file_arguments_given_and_its_own():
    options = {"answer_vocab": "moved/answers.json", "text_tokenizer": None, "top_k": 3}
    assert INFER_SPECS["vqav2"].task_arguments(options) == {"answer_vocab": "moved/answers.json"}
    captioning = INFER_SPECS["captioning"]
    assert captioning.task_arguments({"beam": 1, "output_vocab": None}) == {"num_beams": 1}
    assert captioning.task_arguments({"beam": None, "output_vocab": "v.json"}) == {"output_vocab": "v.json"}
    assert INFER_SPECS["nlvr2"].task_arguments({"text_tokenizer": "beit3.spm"}) == {"text_tokenizer": "beit3.spm"}
