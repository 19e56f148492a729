"""Pre-trained against random init in ``mmoe demo --random-init``: a paired cluster bootstrap over the evaluation
images and statement sets, conditional on one pre-training and one random init.

One value per start decides nothing: a few evaluation images more or fewer could swap them. Each compared metric is
written as a function of per-item counts summed over the items (:class:`~mmoe.pipeline.items.ItemCounts`): a VQA
question's official accuracy, an NLVR2 pair right or not, a test image's colour words right and written, a test
image's image->text rank and its captions' text->image ranks as hits at R@1/5/10 (ranks against the full gallery).
Over the full sample the function gives the official scorer's value.

Items are not independent: the ~5 questions of one VQA image share the image, the pairs of one NLVR2 statement set
share the statement (the official consistency group). The bootstrap therefore resamples clusters, not items
(Davison & Hinkley, Bootstrap Methods and their Application, 1997, section 3.8, resampling clusters): a VQA
question's cluster is its image, an NLVR2 pair's its statement set, a captioning or retrieval test image its own.
Every metric is a function of the column sums, so the items' rows are summed per cluster first and the cluster rows
resampled: the same sums as picking the clusters and scoring the union of their items.

The interval is Efron & Tibshirani's percentile bootstrap (An Introduction to the Bootstrap, 1993, ch. 13, the
percentile interval; :func:`mmoe.stats.bootstrap`, :func:`mmoe.stats.percentile_interval`): :data:`RESAMPLES`
resamples of the clusters with replacement drawn by a numpy Generator seeded :data:`SEED`, the difference of the metric
(pre-trained - random init) on each, and the 2.5% and 97.5% percentiles of those differences. It is paired because
both fine-tunings are scored on the same items: each resample picks the same clusters for both starts, so what a
cluster does to both (an easy image, a hard statement) cancels in the difference.
Verdict (:func:`mmoe.stats.side_of_zero`): "pre-trained ahead" when the interval's lower end is above 0, "random init
ahead" when its upper end is below 0, else "not separated".

The interval is conditional on one pre-training and one random init, each fine-tuned once: it covers which
evaluation images and statement sets the split happens to hold, not the training seed's noise (fine-tuning again
with another seed may move either value by more than the interval's width). Whether pre-training helps over training
seeds is claim 7 of ``docs/claims.md`` (pre-trained backbones against random inits over several backbones per arm).

:func:`rows_from_items` computes the rows from a per-item document alone
(:mod:`mmoe.pipeline.comparison_items`); :func:`comparison` is that function over the document of a run's files.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from pathlib import Path
from typing import Any

import numpy as np

from mmoe.pipeline.comparison_items import ComparedItems, checked_document, comparison_items, document, files_entry
from mmoe.pipeline.items import ItemMetric
from mmoe.pipeline.layout import PipelineRun
from mmoe.pipeline.stages import PipelineError
from mmoe.pipeline.tables import aligned, number
from mmoe.stats import LEVEL, NOT_SEPARATED, RESAMPLES, bootstrap, percentile_interval, side_of_zero

#: The Generator's seed of the bootstrap's draws.
SEED = 0

PRETRAINED_AHEAD = "pre-trained ahead"
RANDOM_INIT_AHEAD = "random init ahead"

TITLE = (
    f"pre-trained - random init, {LEVEL:.0%} paired cluster bootstrap interval over the evaluation images or "
    f"statement sets ({RESAMPLES:,} resamples); conditional on one pre-training and one random init, not on the "
    "training seed"
)


def cluster_sums(counts: np.ndarray, clusters: list[Hashable]) -> np.ndarray:
    """(clusters, columns) the rows of ``counts`` summed per cluster, the clusters in order of first appearance."""
    index: dict[Hashable, int] = {}
    rows = np.array([index.setdefault(cluster, len(index)) for cluster in clusters], dtype=np.int64)
    sums = np.zeros((len(index), counts.shape[1]))
    np.add.at(sums, rows, counts)
    return sums


def paired_bootstrap(
    first: np.ndarray, second: np.ndarray, of_sums: Callable[[np.ndarray], float], seed: int = SEED
) -> np.ndarray:
    """The replicates of ``of_sums(first's sums) - of_sums(second's sums)``, each over the same draw of rows with
    replacement (``first``, ``second``: (clusters, columns) counts summed per cluster, row i the same cluster in both);
    an undefined replicate is left out (:func:`mmoe.stats.bootstrap`)."""

    def difference(picked: np.ndarray) -> float:
        return of_sums(first[picked].sum(0)) - of_sums(second[picked].sum(0))

    return bootstrap(difference, len(first), seed=seed)


def verdict(interval: list[float]) -> str:
    return {1: PRETRAINED_AHEAD, -1: RANDOM_INIT_AHEAD, 0: NOT_SEPARATED}[side_of_zero(interval)]


def metric_value(metric: ItemMetric, sums: np.ndarray, where: str) -> float:
    """``metric`` of the column sums; PipelineError naming ``where`` when the sums cannot give it."""
    try:
        with np.errstate(divide="ignore", invalid="ignore"):
            value = float(metric.of_sums(sums))
    except (IndexError, ZeroDivisionError) as error:
        raise PipelineError(f"{where}: {metric.metric} cannot be computed from {len(sums)} columns ({error})") from None
    if not np.isfinite(value):
        raise PipelineError(f"{where}: {metric.metric} is undefined on these counts (a column it divides by sums to 0)")
    return value


def compared(items: ComparedItems, metric: ItemMetric, where: str) -> dict:
    """One row of the comparison: both values, their difference, its interval and verdict, the numbers of items
    and clusters, and what a cluster is."""
    where = f"{where}, {items.benchmark}"
    value, baseline = (metric_value(metric, counts.sum(0), where) for counts in (items.pretrained, items.random_init))
    first, second = (cluster_sums(counts, items.clusters) for counts in (items.pretrained, items.random_init))
    replicates = paired_bootstrap(first, second, metric.of_sums)
    if len(replicates) < RESAMPLES:
        raise PipelineError(
            f"{where}: {metric.metric} is undefined on a resample of the clusters (a column it "
            "divides by sums to 0 over some clusters); expected a positive count in every cluster"
        )
    interval = percentile_interval(replicates)
    return {
        "task": metric.task,
        "metric": metric.metric,
        "pretrained": value,
        "random_init": baseline,
        "difference": value - baseline,
        "interval": interval,
        "verdict": verdict(interval),
        "items": len(items.ids),
        "clusters": len(first),
        "cluster": items.cluster_kind,
    }


def rows_from_items(items_document: Any, where: str = "comparison items") -> list[dict]:
    """The comparison rows of a per-item document (:mod:`mmoe.pipeline.comparison_items`), from it alone;
    PipelineError naming ``where``, the benchmark and the field when the document is malformed."""
    return [
        compared(items, metric, where) for items in checked_document(items_document, where) for metric in items.metrics
    ]


def comparison(run: PipelineRun, variant: str) -> list[dict]:
    """The comparison rows of ``variant``: each trained benchmark's prediction files from both starts, compared."""
    return rows_from_items(comparison_items(run, variant), f"{variant}'s comparison")


def compared_files(run: PipelineRun, benchmark: str, pretrained: Path, random_init: Path) -> list[dict]:
    """The comparison rows of one benchmark (its name) from the two starts' prediction files, scored on ``run``'s
    corpus; PipelineError naming both files when one cannot be read."""
    return rows_from_items(
        document([files_entry(run, benchmark, pretrained, random_init)]), f"{pretrained} and {random_init}"
    )


def format_comparison(rows_by_variant: dict[str, list[dict]]) -> str:
    """:data:`TITLE`, then per variant a table of its comparison rows."""
    header = ["task", "metric", "pre-trained", "random init", "difference", "interval", "verdict", "items", "clusters"]
    blocks = [TITLE]
    for variant, rows in rows_by_variant.items():
        lines = [header] + [
            [
                row["task"],
                row["metric"],
                number(row["pretrained"]),
                number(row["random_init"]),
                number(row["difference"]),
                "[{}, {}]".format(*map(number, row["interval"])),
                row["verdict"],
                str(row["items"]),
                f"{row['clusters']} {row['cluster']}",
            ]
            for row in rows
        ]
        blocks.append(f"{variant}\n{aligned(lines)}")
    return "\n\n".join(blocks)
