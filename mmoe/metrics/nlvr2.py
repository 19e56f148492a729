"""NLVR2 accuracy and consistency as lil-lab/nlvr ``nlvr2/eval/metrics.py`` computes them.

The official script reads ``identifier,prediction`` lines and the JSON-lines data file, compares each example's
prediction with its label case-insensitively (accuracy = correct / examples) and calls a sentence *consistent* when
every example sharing its identifier with the third dash-separated field blanked out is right
("dev-850-0-1" and "dev-850-3-1" form the group "dev-850--1"; the field is the image-pair id, so a group is one
sentence of one set). Consistency = consistent groups / groups. Groups never come from the sentence text: two
sets can share a sentence and still be two groups.

Where the official script prints "Some predictions are missing!" and exits, or crashes on a malformed line, mmoe raises
:class:`~mmoe.metrics.files.EvalInputError` naming the identifier or line; predictions for identifiers absent from the
data are ignored, as there, with a warning.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from pathlib import Path

from mmoe.metrics.files import EvalInputError, read_json_lines, read_text, require_field

LABELS = {"true": True, "false": False}


def consistency_group(identifier: str) -> str:
    """The official grouping key: the identifier with its third dash-separated field (the pair id) emptied.

    Raises:
        EvalInputError: fewer than three dash-separated fields (the official script fails with an IndexError).
    """
    fields = identifier.split("-")
    if len(fields) < 3:
        raise EvalInputError(f"identifier {identifier!r} is not of the form split-set_id-pair_id-sentence_id")
    fields[2] = ""
    return "-".join(fields)


def parse_label(value: str | bool, where: str) -> bool:
    """``True``/``False`` from a bool or a case-insensitive "true"/"false" string."""
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in LABELS:
        return LABELS[value.strip().lower()]
    raise EvalInputError(f"{where}: label {value!r} is neither true nor false (case-insensitive)")


def nlvr2_scores(labels: Mapping[str, str | bool], predictions: Mapping[str, str | bool]) -> dict[str, float]:
    """Accuracy and consistency of true/false predictions, as fractions.

    Args:
        labels: identifier -> gold label (bool, or "True"/"False" in any case), in data order.
        predictions: identifier -> predicted label, same forms.

    Returns:
        ``{"accuracy": correct / examples, "consistency": consistent groups / groups}``.

    Raises:
        EvalInputError: no example, an example without prediction, a label that is not true/false, or an identifier
            with fewer than three dash-separated fields.
    """
    correct = correct_pairs(labels, predictions)
    group_consistent: dict[str, bool] = {}
    for identifier, right in correct.items():
        group = consistency_group(identifier)
        group_consistent[group] = group_consistent.get(group, True) and right
    return {
        "accuracy": sum(correct.values()) / len(correct),
        "consistency": sum(group_consistent.values()) / len(group_consistent),
    }


def correct_pairs(labels: Mapping[str, str | bool], predictions: Mapping[str, str | bool]) -> dict[str, bool]:
    """Identifier -> whether its prediction is its label, in ``labels``' order (the items of :func:`nlvr2_scores`'
    accuracy; same arguments and errors)."""
    if not labels:
        raise EvalInputError("no labelled example to score")
    missing = [identifier for identifier in labels if identifier not in predictions]
    if missing:
        raise EvalInputError(f"no prediction for {_some(missing)}; expected one for each of the {len(labels)} examples")
    extra = [identifier for identifier in predictions if identifier not in labels]
    if extra:
        warnings.warn(
            f"{len(extra)} predictions have identifiers absent from the data and are ignored (e.g. {extra[0]!r})",
            stacklevel=3,
        )
    return {
        identifier: parse_label(predictions[identifier], f"prediction for {identifier!r}")
        == parse_label(label, f"label of {identifier!r}")
        for identifier, label in labels.items()
    }


def load_nlvr2_labels(path: str | Path) -> dict[str, str]:
    """Reads an NLVR2 JSON-lines file (``train.json``, ``dev.json``, ``test1.json``): identifier -> label."""
    labels: dict[str, str] = {}
    for number, example in read_json_lines(path):
        where = f"{path}, line {number}"
        identifier = require_field(example, "identifier", str, where)
        label = require_field(example, "label", str, f"{where} ({identifier})")
        parse_label(label, f"{where} ({identifier})")
        try:
            consistency_group(identifier)
        except EvalInputError as error:
            raise EvalInputError(f"{where}: {error}") from None
        if identifier in labels:
            raise EvalInputError(f"{where}: identifier {identifier!r} appears twice; expected one line per example")
        labels[identifier] = label
    if not labels:
        raise EvalInputError(f"{path}: no example; expected one JSON object per line")
    return labels


def load_nlvr2_predictions(path: str | Path) -> dict[str, bool]:
    """Reads ``identifier,prediction`` lines (no header; true/false in any case; blank lines skipped)."""
    predictions: dict[str, bool] = {}
    for number, line in enumerate(read_text(path).splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{path}, line {number}"
        fields = [field.strip() for field in line.split(",")]
        if len(fields) != 2 or not fields[0]:
            raise EvalInputError(f"{where}: {line.strip()[:80]!r} is not 'identifier,prediction' (true or false)")
        identifier, value = fields
        if identifier in predictions:
            raise EvalInputError(f"{where}: second prediction for {identifier!r}; expected one line per example")
        predictions[identifier] = parse_label(value, f"{where} ({identifier})")
    return predictions


def evaluate_nlvr2_files(data: str | Path, predictions: str | Path) -> dict[str, float]:
    """What ``mmoe eval nlvr2`` prints: :func:`nlvr2_scores` of the two files, errors naming them."""
    return nlvr2_scores(*read_nlvr2_files(data, predictions))


def read_nlvr2_files(data: str | Path, predictions: str | Path) -> tuple[dict[str, str], dict[str, bool]]:
    """The labels of the data file and the predictions file, a prediction for every labelled example, errors naming
    the files."""
    labels = load_nlvr2_labels(data)
    predicted = load_nlvr2_predictions(predictions)
    missing = [identifier for identifier in labels if identifier not in predicted]
    if missing:
        raise EvalInputError(
            f"{predictions}: no prediction for {_some(missing)}; expected one line for each of the {len(labels)} "
            f"examples of {data}"
        )
    return labels, predicted


def _some(identifiers: list[str], shown: int = 5) -> str:
    text = ", ".join(repr(i) for i in identifiers[:shown])
    return text if len(identifiers) <= shown else f"{text} and {len(identifiers) - shown} more"
