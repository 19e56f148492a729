"""Gathered predictions (:mod:`mmoe.runtime.predictions`): one entry per sample, and a task's prediction file."""

from __future__ import annotations

from mmoe.runtime.predictions import unique_entries
from mmoe.tasks.nlvr2 import NLVR2FineTuning


def test_unique_entries_keeps_the_first_entry_of_each_sample_in_order():
    entries = [{"id": 2, "a": "x"}, {"id": 1, "a": "y"}, {"id": 2, "a": "z"}]
    assert unique_entries(entries, "id") == [{"id": 2, "a": "x"}, {"id": 1, "a": "y"}]
    assert unique_entries([("b", True), ("a", False), ("b", False)], 0) == [("b", True), ("a", False)]


def test_nlvr2_predictions_are_identifier_lines(tmp_path):
    task = NLVR2FineTuning.__new__(NLVR2FineTuning)  # the writer needs no backbone
    path = tmp_path / "predictions.csv"
    task.write_predictions([("dev-1-0-0", True), ("dev-1-0-1", False), ("dev-1-0-0", False)], path)
    assert path.read_text() == "dev-1-0-0,True\ndev-1-0-1,False\n"
