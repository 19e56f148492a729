"""The per-item file of a pre-trained against random-init comparison: everything :mod:`mmoe.pipeline.compare`
resamples, so that anyone can recompute the comparison without the run folder or its corpus.

A document (:func:`comparison_items` builds one per variant; ``mmoe demo --random-init`` writes them as
:data:`ITEMS_FILE`, a mapping variant -> document) is a JSON object::

    {"format": "mmoe-comparison-items", "version": 1, "benchmarks": [
        {"benchmark": "vqav2", "metrics": [{"task": "VQAv2 val", "metric": "accuracy (%)"}], "cluster": "images",
         "items": [question ids], "clusters": [image id of each item],
         "pretrained": [[count, ...] per item], "random_init": [[count, ...] per item]}, ...]}

Row i of both starts' counts is item i (:class:`~mmoe.pipeline.items.ItemCounts` gives what the columns are per
benchmark). A document may come from someone else: :func:`checked_document` refuses one whose shapes, types or sizes
are off with a one-line :class:`~mmoe.pipeline.stages.PipelineError` naming the benchmark, the field and what was
expected, before any number is computed.
"""

from __future__ import annotations

import math
from collections.abc import Hashable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from mmoe.io import json_excerpt, read_json, require_field
from mmoe.pipeline.benchmarks import BENCHMARKS, Benchmark, benchmark_named, trained_benchmarks
from mmoe.pipeline.items import CLUSTER_KINDS, ItemCounts, ItemMetric
from mmoe.pipeline.layout import PipelineRun, random_init_name
from mmoe.pipeline.stages import PipelineError

#: The file ``mmoe demo --random-init`` writes beside ``results.json``: variant -> document.
ITEMS_FILE = "comparison_items.json"
FORMAT = "mmoe-comparison-items"
VERSION = 1

#: Bounds on a document: items per benchmark (VQAv2 test-dev holds about 450,000 questions), count columns, the
#: characters of an item or cluster id, and the bytes of a file read.
MAX_ITEMS = 1_000_000
MAX_COLUMNS = 64
MAX_ID_CHARS = 200
MAX_FILE_BYTES = 256 * 2**20


@dataclass(frozen=True)
class ComparedItems:
    """One benchmark of a checked document: both starts' counts, row i item i of ``ids``.

    Attributes:
        benchmark: the catalog task's name.
        metrics: the compared metrics, in the document's order.
        cluster_kind: what a cluster is (:data:`~mmoe.pipeline.items.CLUSTER_KINDS`).
        ids: the items.
        clusters: the cluster of each item.
        pretrained: (items, columns) the counts of the fine-tuning from the pre-trained backbone.
        random_init: (items, columns) the counts of the fine-tuning from the random backbone.
    """

    benchmark: str
    metrics: tuple[ItemMetric, ...]
    cluster_kind: str
    ids: list[Hashable]
    clusters: list[Hashable]
    pretrained: np.ndarray
    random_init: np.ndarray


def json_numbers(counts: np.ndarray) -> list[list[int | float]]:
    """The rows of ``counts`` as JSON numbers, whole values as integers (the same floats when read back)."""
    return [[int(value) if value.is_integer() else value for value in row] for row in counts.tolist()]


def json_id(value: Hashable) -> Hashable:
    """An item or cluster id as JSON holds it (numpy integers as Python ones)."""
    return value.item() if isinstance(value, np.generic) else value


def benchmark_entry(benchmark: Benchmark, pretrained: ItemCounts, random_init: ItemCounts, where: str) -> dict:
    """A document's entry of one benchmark from both starts' items (PipelineError, naming ``where``, unless both
    hold the same items in the same clusters), in ``pretrained``'s item order."""
    aligned = random_init.rows_in_order_of(pretrained, where)
    return {
        "benchmark": benchmark.name,
        "metrics": [{"task": metric.task, "metric": metric.metric} for metric in benchmark.compared],
        "cluster": pretrained.cluster_kind,
        "items": [json_id(item) for item in pretrained.ids],
        "clusters": [json_id(cluster) for cluster in pretrained.clusters],
        "pretrained": json_numbers(pretrained.counts),
        "random_init": json_numbers(aligned),
    }


def files_entry(run: PipelineRun, benchmark: str, pretrained: Path, random_init: Path) -> dict:
    """The entry of one benchmark (its name) from the two starts' prediction files, scored on ``run``'s corpus;
    PipelineError naming both files when one cannot be read."""
    from mmoe.metrics.files import EvalInputError

    record = benchmark_named(benchmark)
    try:
        first, second = record.items(run, pretrained), record.items(run, random_init)
    except (EvalInputError, ValueError, KeyError) as error:
        raise PipelineError(f"comparing {pretrained} with {random_init}: {error}") from None
    return benchmark_entry(record, first, second, f"{pretrained} and {random_init}")


def document(entries: list[dict]) -> dict:
    """A document holding ``entries`` (one per benchmark)."""
    return {"format": FORMAT, "version": VERSION, "benchmarks": entries}


def comparison_items(run: PipelineRun, variant: str) -> dict:
    """The document of ``variant``: each trained benchmark's items from both starts' prediction files."""
    entries = []
    for benchmark in trained_benchmarks(run.settings):
        starts = (run.finetuning(variant, benchmark.name), run.finetuning(random_init_name(variant), benchmark.name))
        pretrained, random_init = (layout.predictions(benchmark.predictions) for layout in starts)
        entries.append(files_entry(run, benchmark.name, pretrained, random_init))
    return document(entries)


def read_comparison_items(path: Path, what: str = "comparison items") -> Any:
    """The JSON value of a per-item file, or of its rows (not checked beyond its size and syntax:
    :func:`checked_document`); PipelineError naming ``what`` and ``path`` otherwise."""
    try:
        size = path.stat().st_size
    except OSError:
        size = 0  # read_json names what is wrong with it
    if size > MAX_FILE_BYTES:
        raise PipelineError(f"{what} {path}: {size:,} bytes; expected at most {MAX_FILE_BYTES:,}")
    return read_json(path, what, PipelineError)  # nesting bounded (mmoe.io.parse_json)


def checked_document(value: Any, where: str = "comparison items") -> list[ComparedItems]:
    """The benchmarks of a document, each checked (:func:`checked_entry`); PipelineError naming ``where``, the
    benchmark and the field otherwise."""
    if require_field(value, "format", str, where, PipelineError) != FORMAT:
        raise PipelineError(f"{where}: format {json_excerpt(value['format'])}; expected {FORMAT!r}")
    version = require_field(value, "version", int, where, PipelineError)
    if version != VERSION:
        raise PipelineError(f"{where}: version {version}; expected {VERSION} (written by another mmoe version)")
    entries = require_field(value, "benchmarks", list, where, PipelineError)
    if not 1 <= len(entries) <= len(BENCHMARKS):
        raise PipelineError(f"{where}: {len(entries)} benchmarks; expected 1 to {len(BENCHMARKS)}")
    checked = [checked_entry(entry, f"{where}, benchmark {index}") for index, entry in enumerate(entries)]
    names = [entry.benchmark for entry in checked]
    if len(set(names)) != len(names):
        raise PipelineError(f"{where}: a benchmark appears twice ({', '.join(names)}); expected each once")
    return checked


def checked_entry(entry: Any, where: str) -> ComparedItems:
    """One benchmark's entry of a document, checked: a known benchmark and its compared metrics, a known cluster
    kind, unique ids, one cluster and one row of counts per item, rows of one width of finite non-negative numbers."""
    name = require_field(entry, "benchmark", str, where, PipelineError)
    try:
        benchmark = benchmark_named(name)
    except KeyError:
        known = ", ".join(b.name for b in BENCHMARKS)
        raise PipelineError(f"{where}: benchmark {json_excerpt(name)} is unknown; expected one of {known}") from None
    where = f"{where} ({name})"
    cluster_kind = require_field(entry, "cluster", str, where, PipelineError)
    if cluster_kind not in CLUSTER_KINDS:
        raise PipelineError(f"{where}: cluster {json_excerpt(cluster_kind)}; expected one of {CLUSTER_KINDS}")
    ids = checked_ids(entry, "items", where)
    if len(set(ids)) != len(ids):
        raise PipelineError(f"{where}: field 'items' names an item twice; expected each item once")
    clusters = checked_ids(entry, "clusters", where, len(ids))
    pretrained = checked_counts(entry, "pretrained", where, len(ids))
    random_init = checked_counts(entry, "random_init", where, len(ids), pretrained.shape[1])
    metrics = checked_metrics(entry, benchmark, where)
    return ComparedItems(name, metrics, cluster_kind, ids, clusters, pretrained, random_init)


def checked_metrics(entry: dict, benchmark: Benchmark, where: str) -> tuple[ItemMetric, ...]:
    """The entry's ``metrics``: each a distinct (task, metric) of ``benchmark.compared``."""
    listed = require_field(entry, "metrics", list, where, PipelineError)
    known = {(metric.task, metric.metric): metric for metric in benchmark.compared}
    if not 1 <= len(listed) <= len(known):
        raise PipelineError(f"{where}: field 'metrics' lists {len(listed)}; expected 1 to {len(known)}")
    metrics = []
    for index, named in enumerate(listed):
        place = f"{where}, metric {index}"
        key = (
            require_field(named, "task", str, place, PipelineError),
            require_field(named, "metric", str, place, PipelineError),
        )
        if key not in known:
            expected = "; ".join(f"{task}: {metric}" for task, metric in known)
            raise PipelineError(f"{place}: {json_excerpt(list(key))} is not compared; expected one of {expected}")
        metrics.append(known[key])
    if len(set(metrics)) != len(metrics):
        raise PipelineError(f"{where}: field 'metrics' lists a metric twice; expected each once")
    return tuple(metrics)


def checked_ids(entry: dict, field: str, where: str, length: int | None = None) -> list[Hashable]:
    """The entry's list ``field`` of ids (integers or strings of at most :data:`MAX_ID_CHARS`), ``length`` of
    them (1 to :data:`MAX_ITEMS` when None)."""
    ids = require_field(entry, field, list, where, PipelineError)
    if length is None and not 1 <= len(ids) <= MAX_ITEMS:
        raise PipelineError(f"{where}: field {field!r} holds {len(ids):,} ids; expected 1 to {MAX_ITEMS:,}")
    if length is not None and len(ids) != length:
        raise PipelineError(f"{where}: field {field!r} holds {len(ids):,} ids; expected one per item ({length:,})")
    for index, value in enumerate(ids):
        if type(value) is not int and (type(value) is not str or len(value) > MAX_ID_CHARS):
            raise PipelineError(
                f"{where}: field {field!r}, entry {index}: {json_excerpt(value)}; expected an integer or a string "
                f"of at most {MAX_ID_CHARS} characters"
            )
    return ids


def checked_counts(entry: dict, field: str, where: str, items: int, width: int | None = None) -> np.ndarray:
    """The entry's ``field``: (items, width) counts, a list per item of finite non-negative numbers, every row as
    wide as the first (1 to :data:`MAX_COLUMNS`) or ``width``."""
    rows = require_field(entry, field, list, where, PipelineError)
    if len(rows) != items:
        raise PipelineError(f"{where}: field {field!r} holds {len(rows):,} rows; expected one per item ({items:,})")
    width = width if width is not None else len(rows[0]) if isinstance(rows[0], list) else 0
    if not 1 <= width <= MAX_COLUMNS:
        raise PipelineError(
            f"{where}: field {field!r}, row 0: {json_excerpt(rows[0])}; expected a list of 1 to {MAX_COLUMNS} numbers"
        )
    for index, row in enumerate(rows):
        if not isinstance(row, list) or len(row) != width or not all(type(v) in (int, float) for v in row):
            raise PipelineError(
                f"{where}: field {field!r}, row {index}: {json_excerpt(row)}; expected a list of {width} numbers"
            )
        if not all(0 <= value < math.inf for value in row):  # NaN fails both comparisons
            raise PipelineError(
                f"{where}: field {field!r}, row {index}: {json_excerpt(row)}; expected finite counts of at least 0"
            )
    try:
        return np.array(rows, dtype=float)
    except OverflowError:
        raise PipelineError(f"{where}: field {field!r}: a count is too large for a float") from None
