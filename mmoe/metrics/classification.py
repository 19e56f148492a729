"""Image classification accuracy: top-k accuracy, the share of images whose label is among the k best-scored classes
(ImageNet's top-1 / top-5; BEiT-3 reports them as ``Acc@1`` / ``Acc@5`` through timm's ``accuracy``), and the
predictions file of ``mmoe predict`` scored against ImageNet's validation solution file (``mmoe eval
classification``)."""

from __future__ import annotations

import csv
import io
from collections.abc import Hashable, Mapping, Sequence
from pathlib import Path
from typing import Any

from mmoe.metrics.files import EvalInputError, read_json, read_text, require_field, require_list

#: The k of the accuracies reported (ImageNet's top-1 and top-5).
TOP_K = (1, 5)


def top_k_accuracy(
    ranked: Sequence[Sequence[Hashable]], labels: Sequence[Hashable], ks: Sequence[int] = TOP_K
) -> dict[str, float]:
    """``{"top<k>": share}`` for each k of ``ks``: the share (0..1) of images whose label is among the first k of its
    ranked classes (``ranked[i]``: image i's classes, best first, at least max(ks) of them unless the classes are
    fewer). An empty list scores 0."""
    if len(ranked) != len(labels):
        raise ValueError(f"{len(ranked)} rankings for {len(labels)} labels")
    total = max(len(labels), 1)
    return {f"top{k}": sum(label in row[:k] for row, label in zip(ranked, labels, strict=True)) / total for k in ks}


def read_predictions(path: str | Path) -> dict[str, list[str]]:
    """Image id -> ranked class ids (WordNet ids, best first) of a predictions file of ``mmoe predict`` (a JSON list
    of ``{"key", "image", "labels", "wnids", "names", "probabilities"}``, the image id its ``image``); the first entry
    of an image is kept."""
    entries = require_list(read_json(path), str(path), "predictions")
    ranked: dict[str, list[str]] = {}
    for index, entry in enumerate(entries):
        where = f"{path}, entry {index}"
        key = require_field(entry, "image", str, where)
        wnids = require_field(entry, "wnids", list, where)
        if not all(isinstance(wnid, str) for wnid in wnids):
            raise EvalInputError(f"{where}: wnids must be an array of strings")
        ranked.setdefault(key, wnids)
    return ranked


def read_solution(path: str | Path) -> dict[str, str]:
    """Image id -> WordNet id of ImageNet's ``LOC_val_solution.csv`` (header ``ImageId,PredictionString``; each
    prediction string is boxes ``wnid x0 y0 x1 y1 ...``, all of the image's class, whose first word is taken)."""
    rows = csv.reader(io.StringIO(read_text(path)))
    header = next(rows, None)
    if header is None or [name.strip() for name in header[:2]] != ["ImageId", "PredictionString"]:
        raise EvalInputError(f"{path}: expected the header ImageId,PredictionString, got {header!r}")
    labels: dict[str, str] = {}
    for number, row in enumerate(rows, start=2):
        if not row:
            continue
        words = row[1].split() if len(row) > 1 else []
        if not words:
            raise EvalInputError(f"{path}, line {number}: no class for image {row[0]!r}")
        labels[row[0]] = words[0]
    return labels


def score_predictions(ranked: Mapping[str, Sequence[str]], labels: Mapping[str, str], source: str) -> dict[str, Any]:
    """Top-1 / top-5 of ``ranked`` (key -> class ids) against ``labels`` (key -> class id), over every labelled image,
    and the number of images; a labelled key without a prediction is an EvalInputError naming ``source`` and the
    key."""
    missing = [key for key in labels if key not in ranked]
    if missing:
        raise EvalInputError(f"{source}: no prediction for {len(missing)} labelled images, e.g. {missing[0]!r}")
    keys = list(labels)
    return top_k_accuracy([ranked[key] for key in keys], [labels[key] for key in keys]) | {"images": len(keys)}


def evaluate_classification_files(predictions: str | Path, solution: str | Path) -> dict[str, Any]:
    """``mmoe eval classification``: top-1 / top-5 (fractions) of a predictions file against a solution file."""
    return score_predictions(read_predictions(predictions), read_solution(solution), str(predictions))
