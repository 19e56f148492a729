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

from collections.abc import Callable, Hashable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from mmoe.demo.benchmarks import caption_test_files, nlvr2_dev_file, trained_benchmarks, vqa_val_files
from mmoe.demo.report import aligned, number
from mmoe.demo.settings import DemoError, DemoRun

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


@dataclass(frozen=True)
class ItemCounts:
    """One fine-tuning's evaluation, item by item.

    Attributes:
        ids: the items (question ids, pair identifiers, image ids), one per row of ``counts``.
        counts: (items, columns) what each item adds to the sums a metric is computed from.
    """

    ids: list[Hashable]
    counts: np.ndarray

    def rows_in_order_of(self, other: ItemCounts, where: str) -> np.ndarray:
        """``counts`` with the rows in ``other``'s item order; DemoError unless both hold the same items."""
        row = {item: index for index, item in enumerate(self.ids)}
        if len(row) != len(self.ids) or len(other.ids) != len(self.ids) or row.keys() != set(other.ids):
            raise DemoError(f"{where}: the two starts were scored on different items; expected the same split")
        return self.counts[[row[item] for item in other.ids]]


@dataclass(frozen=True)
class ItemMetric:
    """A metric of the demo's table as a function of the column sums of :class:`ItemCounts`."""

    task: str
    metric: str
    of_sums: Callable[[np.ndarray], float]


def vqa_items(run: DemoRun, predictions: Path) -> ItemCounts:
    """Per question of the annotations: its official accuracy (the scorer's :func:`~mmoe.metrics.vqa.vqa_accuracy`,
    a fraction) and 1."""
    from mmoe.metrics.vqa import load_vqa, vqa_accuracy

    entries, answers = load_vqa(*vqa_val_files(run), predictions)
    accuracies = [vqa_accuracy(answers[entry["question_id"]], entry["answers"]) for entry in entries]
    return ItemCounts([entry["question_id"] for entry in entries], np.column_stack([accuracies, np.ones(len(entries))]))


def nlvr2_items(run: DemoRun, predictions: Path) -> ItemCounts:
    """Per dev pair: 1 if its prediction is its label, else 0, and 1."""
    from mmoe.metrics.nlvr2 import correct_pairs, read_nlvr2_files

    correct = correct_pairs(*read_nlvr2_files(nlvr2_dev_file(run), predictions))
    return ItemCounts(list(correct), np.column_stack([list(correct.values()), np.ones(len(correct))]).astype(float))


def caption_items(run: DemoRun, predictions: Path) -> ItemCounts:
    """Per test image: its caption's colour words right and written
    (:func:`~mmoe.metrics.caption_words.word_counts`)."""
    from mmoe.data.synth.scenes import COLORS
    from mmoe.metrics.caption_words import word_counts

    references, captions = caption_test_files(run, predictions)
    counts = word_counts(captions, references, COLORS)
    return ItemCounts(list(counts), np.array(list(counts.values()), dtype=float).reshape(len(counts), 2))


def retrieval_items(run: DemoRun, predictions: Path) -> ItemCounts:
    """Per test image, eight columns: whether its image->text rank is at most 1, 5, 10; 1; how many of its captions
    rank it at most 1, 5, 10 (text->image); its number of captions. The ranks are those against the full gallery
    (:func:`~mmoe.metrics.retrieval.score_embeddings`)."""
    from mmoe.metrics.retrieval import DEFAULT_CHUNK, RECALL_AT, read_embeddings_file, score_embeddings

    _, ranks = score_embeddings(read_embeddings_file(predictions), DEFAULT_CHUNK)
    row = {entry["image_id"]: index for index, entry in enumerate(ranks["images"])}
    counts = np.zeros((len(row), 8))
    for entry in ranks["images"]:
        counts[row[entry["image_id"]], :4] = [*(entry["rank"] <= k for k in RECALL_AT), 1]
    for entry in ranks["captions"]:
        counts[row[entry["image_id"]], 4:] += [*(entry["rank"] <= k for k in RECALL_AT), 1]
    return ItemCounts(list(row), counts)


def percent_of_items(sums: np.ndarray) -> float:
    """``100 * sum / items``, in the VQA scorer's association."""
    return 100 * sums[0] / sums[1]


def share(sums: np.ndarray) -> float:
    """``right / counted`` (0.0 when nothing is counted, as :func:`~mmoe.metrics.caption_words.word_precision`)."""
    return sums[0] / sums[1] if sums[1] else 0.0


def percent_share(sums: np.ndarray) -> float:
    return 100 * share(sums)


def mean_recall(sums: np.ndarray) -> float:
    """The mean of image->text and text->image R@1/5/10, in :func:`~mmoe.metrics.retrieval.retrieval_scores`'s order."""
    recalls = [sums[column] / sums[3] for column in range(3)] + [sums[column] / sums[7] for column in range(4, 7)]
    return sum(recalls) / len(recalls)


def text_to_image_r1(sums: np.ndarray) -> float:
    return sums[4] / sums[7]


#: Per benchmark name: how its prediction file is read item by item, and the compared metrics of the demo's table.
ITEM_METRICS: dict[str, tuple[Callable[[DemoRun, Path], ItemCounts], tuple[ItemMetric, ...]]] = {
    "vqav2": (vqa_items, (ItemMetric("VQAv2 val", "accuracy (%)", percent_of_items),)),
    "nlvr2": (nlvr2_items, (ItemMetric("NLVR2 dev", "accuracy", share),)),
    "captioning": (
        caption_items,
        (ItemMetric("COCO captions Karpathy test", "colour words right (%)", percent_share),),
    ),
    "retrieval": (
        retrieval_items,
        (
            ItemMetric("Flickr30K Karpathy test", "mean recall (R@1/5/10)", mean_recall),
            ItemMetric("Flickr30K Karpathy test", "text->image R@1", text_to_image_r1),
        ),
    ),
}


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


def comparison(run: DemoRun, variant: str) -> list[dict]:
    """The comparison rows of ``variant``: each trained benchmark's prediction files from both starts, compared."""
    rows = []
    for benchmark in trained_benchmarks(run.settings):
        starts = (run.finetuning(variant, benchmark.name), run.finetuning_from_random(variant, benchmark.name))
        pretrained, random_init = (layout.predictions(benchmark.predictions) for layout in starts)
        rows += compared_files(run, benchmark.name, pretrained, random_init)
    return rows


def compared_files(run: DemoRun, benchmark: str, pretrained: Path, random_init: Path) -> list[dict]:
    """The comparison rows of one benchmark (its name) from the two starts' prediction files, scored on ``run``'s
    corpus; DemoError naming both files when one cannot be read."""
    from mmoe.metrics.files import EvalInputError

    read, metrics = ITEM_METRICS[benchmark]
    try:
        first, second = read(run, pretrained), read(run, random_init)
    except (EvalInputError, ValueError, KeyError) as error:
        raise DemoError(f"comparing {pretrained} with {random_init}: {error}") from None
    return [compared(first, second, metric, f"{pretrained} and {random_init}") for metric in metrics]


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
