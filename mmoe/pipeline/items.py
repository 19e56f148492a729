"""Each benchmark's evaluation item by item (:class:`ItemCounts`), and its compared metrics as functions of the
items' summed counts (:class:`ItemMetric`): what a paired comparison of two runs resamples
(:mod:`mmoe.pipeline.compare`). Over all items each function gives the official scorer's value.

Each item belongs to a cluster, the unit the comparison resamples: the items of one cluster share what makes them
alike (a VQA question shares its image with the image's other questions; an NLVR2 pair shares its statement with the
other pairs of its set, the official consistency group). Captioning and retrieval items are test images, each its own
cluster.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from mmoe.io import json_excerpt, require_field
from mmoe.pipeline.layout import PipelineRun
from mmoe.pipeline.stages import PipelineError

#: The evaluation splits of the synthetic corpus the benchmarks score (VQAv2 val, NLVR2 dev, the Karpathy tests).
VQA_EVAL_SUBTYPE = "val2014"
NLVR2_EVAL_SPLIT = "dev"
KARPATHY_EVAL_SPLIT = "test"


def caption_test_files(run: PipelineRun, predictions: Path) -> tuple[dict, dict]:
    """``(references, captions)`` of the Karpathy test split, as ``mmoe eval caption --karpathy ... --split test``
    reads them."""
    from mmoe.metrics.captions import read_caption_files

    return read_caption_files(predictions, karpathy=run.corpus.karpathy_coco, split=KARPATHY_EVAL_SPLIT)


#: What a cluster of items is, as a comparison row names it.
IMAGES = "images"
STATEMENT_SETS = "statement sets"
CLUSTER_KINDS = (IMAGES, STATEMENT_SETS)


@dataclass(frozen=True)
class ItemCounts:
    """One fine-tuning's evaluation, item by item.

    Attributes:
        ids: the items (question ids, pair identifiers, image ids), one per row of ``counts``.
        counts: (items, columns) what each item adds to the sums a metric is computed from.
        clusters: the cluster of each item, one per row (a VQA question's image id, an NLVR2 pair's consistency
            group, a test image's own id).
        cluster_kind: what a cluster is (:data:`CLUSTER_KINDS`).
    """

    ids: list[Hashable]
    counts: np.ndarray
    clusters: list[Hashable]
    cluster_kind: str

    def rows_in_order_of(self, other: ItemCounts, where: str) -> np.ndarray:
        """``counts`` with the rows in ``other``'s item order; PipelineError unless both hold the same items, each
        in the same cluster."""
        row = {item: index for index, item in enumerate(self.ids)}
        if len(row) != len(self.ids) or len(other.ids) != len(self.ids) or row.keys() != set(other.ids):
            raise PipelineError(f"{where}: the two starts were scored on different items; expected the same split")
        order = [row[item] for item in other.ids]
        for item, index, cluster in zip(other.ids, order, other.clusters, strict=True):
            if self.clusters[index] != cluster:
                raise PipelineError(
                    f"{where}: the two starts put item {json_excerpt(item)} in different clusters "
                    f"({json_excerpt(self.clusters[index])} and {json_excerpt(cluster)}); expected the same split"
                )
        return self.counts[order]


@dataclass(frozen=True)
class ItemMetric:
    """A metric of the demo's table as a function of the column sums of :class:`ItemCounts`."""

    task: str
    metric: str
    of_sums: Callable[[np.ndarray], float]


def vqa_items(run: PipelineRun, predictions: Path) -> ItemCounts:
    """Per question of the annotations: its official accuracy (the scorer's :func:`~mmoe.metrics.vqa.vqa_accuracy`,
    a fraction) and 1; its cluster is its image (the annotation's ``image_id``)."""
    from mmoe.metrics.files import EvalInputError
    from mmoe.metrics.vqa import load_vqa, vqa_accuracy

    annotations = run.corpus.vqa_annotations(VQA_EVAL_SUBTYPE)
    entries, answers = load_vqa(run.corpus.vqa_questions(VQA_EVAL_SUBTYPE), annotations, predictions)
    accuracies = [vqa_accuracy(answers[entry["question_id"]], entry["answers"]) for entry in entries]
    images = [
        require_field(
            entry, "image_id", (int, str), f"{annotations}, question id {entry['question_id']!r}", EvalInputError
        )
        for entry in entries
    ]
    counts = np.column_stack([accuracies, np.ones(len(entries))])
    return ItemCounts([entry["question_id"] for entry in entries], counts, images, IMAGES)


def nlvr2_items(run: PipelineRun, predictions: Path) -> ItemCounts:
    """Per dev pair: 1 if its prediction is its label, else 0, and 1; its cluster is its statement's set (the
    official consistency group, :func:`~mmoe.metrics.nlvr2.consistency_group`)."""
    from mmoe.metrics.nlvr2 import consistency_group, correct_pairs, read_nlvr2_files

    correct = correct_pairs(*read_nlvr2_files(run.corpus.nlvr2_records(NLVR2_EVAL_SPLIT), predictions))
    counts = np.column_stack([list(correct.values()), np.ones(len(correct))]).astype(float)
    return ItemCounts(list(correct), counts, [consistency_group(pair) for pair in correct], STATEMENT_SETS)


def classification_items(run: PipelineRun, predictions: Path) -> ItemCounts:
    """Per val image of the classification split: 1 if its first-ranked class is its label, else 0, and 1; each image
    is its own cluster (the labels of the corpus's ``LOC_val_solution.csv``)."""
    from mmoe.metrics.classification import read_predictions, read_solution, score_predictions

    ranked, labels = read_predictions(predictions), read_solution(run.corpus.imagenet_val_solution)
    score_predictions(ranked, labels, str(predictions))  # every labelled image predicted, or a named error
    images = list(labels)
    correct = [float(ranked[image][:1] == [labels[image]]) for image in images]
    return ItemCounts(images, np.column_stack([correct, np.ones(len(images))]), images, IMAGES)


def caption_items(run: PipelineRun, predictions: Path) -> ItemCounts:
    """Per test image: its caption's colour words right and written
    (:func:`~mmoe.metrics.caption_words.word_counts`); each image is its own cluster."""
    from mmoe.data.synth.scenes import COLORS
    from mmoe.metrics.caption_words import word_counts

    references, captions = caption_test_files(run, predictions)
    counts = word_counts(captions, references, COLORS)
    images = list(counts)
    return ItemCounts(images, np.array(list(counts.values()), dtype=float).reshape(len(counts), 2), images, IMAGES)


def retrieval_items(run: PipelineRun, predictions: Path) -> ItemCounts:
    """Per test image, eight columns: whether its image->text rank is at most 1, 5, 10; 1; how many of its captions
    rank it at most 1, 5, 10 (text->image); its number of captions. The ranks are those against the full gallery
    (:func:`~mmoe.metrics.retrieval.score_embeddings`). Each image is its own cluster."""
    from mmoe.metrics.retrieval import DEFAULT_CHUNK, RECALL_AT, read_embeddings_file, score_embeddings

    _, ranks = score_embeddings(read_embeddings_file(predictions), DEFAULT_CHUNK)
    row = {entry["image_id"]: index for index, entry in enumerate(ranks["images"])}
    counts = np.zeros((len(row), 8))
    for entry in ranks["images"]:
        counts[row[entry["image_id"]], :4] = [*(entry["rank"] <= k for k in RECALL_AT), 1]
    for entry in ranks["captions"]:
        counts[row[entry["image_id"]], 4:] += [*(entry["rank"] <= k for k in RECALL_AT), 1]
    return ItemCounts(list(row), counts, list(row), IMAGES)


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
