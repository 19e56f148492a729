"""Pre-trained against random init in ``mmoe demo --random-init``: a paired bootstrap over the evaluation items.

One value per start decides nothing: a few evaluation items more or fewer could swap them. Each compared metric is
written as a function of per-item counts summed over the items (:class:`ItemCounts`): a VQA question's official
accuracy, an NLVR2 pair right or not, a test image's colour words right and written, a test image's image->text
rank and its captions' text->image ranks as hits at R@1/5/10 (ranks against the full gallery; resampling picks query
units). Over the full sample the function gives the official scorer's value.

The interval is Efron & Tibshirani's percentile bootstrap (An Introduction to the Bootstrap, 1993, ch. 13, the
percentile interval): :data:`RESAMPLES` resamples of the items with replacement drawn by a numpy Generator seeded
:data:`SEED`, the difference of the metric (pre-trained - random init) on each, and the 2.5% and 97.5% percentiles of
those differences. It is paired because both fine-tunings are scored on the same items: each resample picks the same
items for both starts, so what an item does to both (an easy question, a hard image) cancels in the difference.
Verdict: "pre-trained ahead" when the interval's lower end is above 0, "random init ahead" when its upper end is
below 0, else "not separated".

The interval covers the evaluation sample's noise (which items the split happens to hold), not the training seed's:
fine-tuning again with another seed may move either value by more than the interval's width.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np

from mmoe.pipeline.benchmarks import benchmark_named, trained_benchmarks
from mmoe.pipeline.items import ItemCounts, ItemMetric
from mmoe.pipeline.layout import PipelineRun
from mmoe.pipeline.stages import PipelineError
from mmoe.pipeline.tables import aligned, number

#: Bootstrap resamples, the interval's coverage and the Generator's seed.
RESAMPLES = 1000
LEVEL = 0.95
SEED = 0

PRETRAINED_AHEAD = "pre-trained ahead"
RANDOM_INIT_AHEAD = "random init ahead"
NOT_SEPARATED = "not separated"

TITLE = (
    f"pre-trained - random init, {LEVEL:.0%} paired bootstrap interval over the evaluation items "
    f"({RESAMPLES:,} resamples)"
)


def paired_bootstrap(
    first: np.ndarray, second: np.ndarray, of_sums: Callable[[np.ndarray], float], resamples: int = RESAMPLES,
    seed: int = SEED,
) -> np.ndarray:  # fmt: skip
    """(resamples,) replicates of ``of_sums(first's sums) - of_sums(second's sums)``, each over the same draw of
    item rows with replacement (``first``, ``second``: (items, columns) counts, row i the same item in both)."""
    generator = np.random.default_rng(seed)
    items = len(first)
    replicates = np.empty(resamples)
    for index in range(resamples):
        picked = generator.integers(0, items, items)
        replicates[index] = of_sums(first[picked].sum(0)) - of_sums(second[picked].sum(0))
    return replicates


def percentile_interval(replicates: np.ndarray, level: float = LEVEL) -> list[float]:
    """The central ``level`` percentile interval of the replicates."""
    tail = 100 * (1 - level) / 2
    return [float(bound) for bound in np.percentile(replicates, [tail, 100 - tail])]


def verdict(interval: list[float]) -> str:
    low, high = interval
    return PRETRAINED_AHEAD if low > 0 else RANDOM_INIT_AHEAD if high < 0 else NOT_SEPARATED


def compared(pretrained: ItemCounts, random_init: ItemCounts, metric: ItemMetric, where: str) -> dict:
    """One row of the comparison: both values, their difference, its interval and verdict, the number of items."""
    first, second = pretrained.counts, random_init.rows_in_order_of(pretrained, where)
    value, baseline = float(metric.of_sums(first.sum(0))), float(metric.of_sums(second.sum(0)))
    interval = percentile_interval(paired_bootstrap(first, second, metric.of_sums))
    return {
        "task": metric.task, "metric": metric.metric, "pretrained": value, "random_init": baseline,
        "difference": value - baseline, "interval": interval, "verdict": verdict(interval), "items": len(first),
    }  # fmt: skip


def comparison(run: PipelineRun, variant: str) -> list[dict]:
    """The comparison rows of ``variant``: each trained benchmark's prediction files from both starts, compared."""
    rows = []
    for benchmark in trained_benchmarks(run.settings):
        starts = (run.finetuning(variant, benchmark.name), run.finetuning_from_random(variant, benchmark.name))
        pretrained, random_init = (layout.predictions(benchmark.predictions) for layout in starts)
        rows += compared_files(run, benchmark.name, pretrained, random_init)
    return rows


def compared_files(run: PipelineRun, benchmark: str, pretrained: Path, random_init: Path) -> list[dict]:
    """The comparison rows of one benchmark (its name) from the two starts' prediction files, scored on ``run``'s
    corpus; PipelineError naming both files when one cannot be read."""
    from mmoe.metrics.files import EvalInputError

    record = benchmark_named(benchmark)
    try:
        first, second = record.items(run, pretrained), record.items(run, random_init)
    except (EvalInputError, ValueError, KeyError) as error:
        raise PipelineError(f"comparing {pretrained} with {random_init}: {error}") from None
    return [compared(first, second, metric, f"{pretrained} and {random_init}") for metric in record.compared]


def format_comparison(rows_by_variant: dict[str, list[dict]]) -> str:
    """:data:`TITLE`, then per variant a table of its comparison rows."""
    header = ["task", "metric", "pre-trained", "random init", "difference", "interval", "verdict", "items"]
    blocks = [TITLE]
    for variant, rows in rows_by_variant.items():
        lines = [header] + [
            [row["task"], row["metric"], number(row["pretrained"]), number(row["random_init"]),
             number(row["difference"]), "[{}, {}]".format(*map(number, row["interval"])), row["verdict"],
             str(row["items"])]
            for row in rows
        ]  # fmt: skip
        blocks.append(f"{variant}\n{aligned(lines)}")
    return "\n\n".join(blocks)
