"""The benchmarks a pipeline fine-tunes, predicts and scores: for each fine-tuning task of the catalog, one
:class:`Benchmark` record that owns everything known of it beyond the task class: the corpus files it reads, its
evaluation split and predictions file, its official scorer, its table rows and their chance levels, its per-item
reader and the metrics a paired comparison resamples."""

from __future__ import annotations

import contextlib
import io
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mmoe.data.converters.class_index import CLASSES_FILE
from mmoe.data.synth.chance import ChanceLevels
from mmoe.data.synth.layout import (
    CAPTION_TEST_SPLIT,
    CLASSIFICATION_TRAIN_SPLIT,
    CLASSIFICATION_VAL_SPLIT,
    NLVR2_DEV_SPLIT,
    RETRIEVAL_TEST_SPLIT,
    VQA_VAL_SPLIT,
    CorpusLayout,
)
from mmoe.data.synth.scenes import COLORS
from mmoe.io import read_json
from mmoe.pipeline.items import (
    NLVR2_EVAL_SPLIT,
    VQA_EVAL_SUBTYPE,
    ItemCounts,
    ItemMetric,
    caption_items,
    caption_test_files,
    classification_items,
    mean_recall,
    nlvr2_items,
    percent_of_items,
    percent_share,
    retrieval_items,
    share,
    text_to_image_r1,
    vqa_items,
)
from mmoe.pipeline.layout import PipelineRun
from mmoe.pipeline.settings import TrainingSettings
from mmoe.pipeline.tables import row
from mmoe.tasks.captioning import CaptioningFineTuning
from mmoe.tasks.classification import ImageClassificationFineTuning
from mmoe.tasks.finetuning import FineTuningTask
from mmoe.tasks.nlvr2 import NLVR2FineTuning
from mmoe.tasks.retrieval import RetrievalFineTuning
from mmoe.tasks.vqa import VQAFineTuning


def score_vqa(run: PipelineRun, predictions: Path) -> dict:
    from mmoe.metrics.vqa import evaluate_vqa_files

    report = evaluate_vqa_files(
        run.corpus.vqa_questions(VQA_EVAL_SUBTYPE), run.corpus.vqa_annotations(VQA_EVAL_SUBTYPE), predictions
    )
    return {"overall": report["overall"], "perAnswerType": report["perAnswerType"]}


def score_nlvr2(run: PipelineRun, predictions: Path) -> dict:
    from mmoe.metrics.nlvr2 import evaluate_nlvr2_files

    return evaluate_nlvr2_files(run.corpus.nlvr2_records(NLVR2_EVAL_SPLIT), predictions)


def score_captions(run: PipelineRun, predictions: Path) -> dict:
    from mmoe.metrics.caption_words import word_precision
    from mmoe.metrics.captions import score_captions as coco_scores

    # What `mmoe eval caption --karpathy ... --split test` computes, with the references and captions read once for
    # both the COCO metrics and the colour-word check.
    references, captions = caption_test_files(run, predictions)
    with contextlib.redirect_stdout(io.StringIO()):  # pycocoevalcap prints its progress
        report = coco_scores(references, captions, meteor=False, spice=False)  # the table shows neither
    scores = {name: value for name, value in report.items() if isinstance(value, float)}
    colours = word_precision(captions, references, COLORS)
    return scores | {"colour_word_precision": colours["precision"], "colour_word_chance": colours["chance"]}


def score_retrieval(run: PipelineRun, predictions: Path) -> dict:
    """What ``mmoe eval retrieval`` computes from the test split's embeddings, and under ``random_ranking`` the same
    recalls of a random ranking of that split (its images and their captions in ``dataset_flickr30k.json``)."""
    from mmoe.metrics.retrieval import evaluate_retrieval_file, random_recall

    split = read_json(run.corpus.karpathy_flickr, "Karpathy split file")
    captions_per_image = [len(image["sentences"]) for image in split["images"] if image["split"] == "test"]
    return evaluate_retrieval_file(predictions) | {"random_ranking": random_recall(captions_per_image)}


def score_classification(run: PipelineRun, predictions: Path) -> dict:
    """What ``mmoe eval classification`` computes against the corpus's ``LOC_val_solution.csv``: top-1 and top-5."""
    from mmoe.metrics.classification import evaluate_classification_files

    return evaluate_classification_files(predictions, run.corpus.imagenet_val_solution)


def vqa_rows(scores: dict, chance: ChanceLevels) -> list[dict]:
    blind = chance.vqa_question_prior
    baseline = f"top training answer per question type (VQA paper's prior); image-blind per question: {blind:.2f}"
    return [row("VQAv2 val", "accuracy (%)", scores["overall"], chance.vqa_prior, baseline)]


def nlvr2_rows(scores: dict, chance: ChanceLevels) -> list[dict]:
    return [
        row("NLVR2 dev", "accuracy", scores["accuracy"], chance.nlvr2_constant, "constant answer"),
        row("NLVR2 dev", "consistency", scores["consistency"], chance.nlvr2_random_consistency, "random answers"),
    ]


def caption_rows(scores: dict, chance: ChanceLevels) -> list[dict]:
    rows = [
        row(
            "COCO captions Karpathy test",
            name,
            scores[name],
            chance.caption_constant[name],
            "most common training caption",
        )
        for name in ("Bleu_4", "CIDEr")
    ]
    if "colour_word_precision" not in scores:  # scored by an older mmoe demo: no colour check in its marker
        return rows
    colours = row(
        "COCO captions Karpathy test",
        "colour words right (%)",
        round(100 * scores["colour_word_precision"], 2),
        round(100 * scores["colour_word_chance"], 2),
        "the same colour words on a random image",
    )
    return [*rows, colours]


def retrieval_rows(scores: dict, chance: ChanceLevels) -> list[dict]:
    """Image -> text and text -> image R@1 and the mean of the six recalls, beside a random ranking's (the scores'
    ``random_ranking``: 1 / images for text -> image, captions per image / captions for image -> text)."""
    baseline = "random ranking of the test split"
    return [
        row("Flickr30K Karpathy test", label, scores[name], scores["random_ranking"][name], baseline)
        for name, label in (
            ("i2t_r1", "image->text R@1"),
            ("t2i_r1", "text->image R@1"),
            ("mean_recall", "mean recall (R@1/5/10)"),
        )
    ]


def classification_rows(scores: dict, chance: ChanceLevels) -> list[dict]:
    """Top-1 and top-5 accuracy (%) beside the most common training class's top-1 and five random classes' top-5."""
    task = "Classification val"
    return [
        row(
            task, "top-1 accuracy (%)", 100 * scores["top1"], 100 * chance.classification_majority, "most common class"
        ),
        row(
            task, "top-5 accuracy (%)", 100 * scores["top5"], 500 * chance.classification_uniform, "five random classes"
        ),
    ]


def vqa_chance(chance: ChanceLevels) -> float:
    """The VQA paper's prior (top training answer per question type)."""
    return chance.vqa_prior


def nlvr2_chance(chance: ChanceLevels) -> float:
    """A constant answer's accuracy."""
    return chance.nlvr2_constant


def caption_chance(chance: ChanceLevels) -> float:
    """The most common training caption's CIDEr."""
    return chance.caption_constant["CIDEr"]


def classification_chance(chance: ChanceLevels) -> float:
    """The most common training class's top-1 accuracy (a fraction, as the headline score)."""
    return chance.classification_majority


def no_files(corpus: CorpusLayout) -> dict[str, Path]:
    return {}


def vqa_files(corpus: CorpusLayout) -> dict[str, Path]:
    """The training split's answer vocabulary, the classifier's outputs."""
    return {"answer_vocab": corpus.vqa_answer_vocab}


def classification_files(corpus: CorpusLayout) -> dict[str, Path]:
    """The training split's class index, the head's classes."""
    return {"classes": corpus.shard(CLASSIFICATION_TRAIN_SPLIT) / CLASSES_FILE}


def caption_files(corpus: CorpusLayout) -> dict[str, Path]:
    """The training captions' token ids, the head's output vocabulary."""
    return {"output_vocab": corpus.caption_tokens}


def no_options(settings: TrainingSettings) -> dict[str, Any]:
    return {}


def caption_options(settings: TrainingSettings) -> dict[str, Any]:
    """Beam search of the run's width; no caption files at validation (the pipelines do not validate)."""
    return {"num_beams": settings.num_beams, "results_dir": None}


@dataclass(frozen=True)
class Benchmark:
    """A fine-tuning task as a pipeline runs, scores and shows it.

    Attributes:
        task: the task class (its ``name`` names the config, ``configs/finetune/<name>_tiny.yaml``).
        eval_split: the shard folder (under the corpus's ``shards``) predicted on and scored.
        predictions: file name of the predictions.
        score: (run, predictions file) -> the official scores.
        rows: (scores, chance levels of the corpus summary) -> table rows.
        headline: the benchmark's main score, (its name in the scores, its label in a table of runs).
        chance: (chance levels) -> the chance level of the headline score (None: none from the corpus).
        items: (run, predictions file) -> the evaluation item by item.
        compared: the metrics of ``rows`` a paired comparison of two runs resamples from ``items``.
        corpus_files: (the corpus's layout) -> task arguments naming files of the corpus.
        options: (settings) -> the task's other arguments.
    """

    task: type[FineTuningTask]
    eval_split: str
    predictions: str
    score: Callable[[PipelineRun, Path], dict]
    rows: Callable[[dict, ChanceLevels], list[dict]]
    headline: tuple[str, str]
    chance: Callable[[ChanceLevels], float] | None
    items: Callable[[PipelineRun, Path], ItemCounts]
    compared: tuple[ItemMetric, ...]
    corpus_files: Callable[[CorpusLayout], dict[str, Path]] = no_files
    options: Callable[[TrainingSettings], dict[str, Any]] = no_options

    @property
    def name(self) -> str:
        return self.task.name

    def model_options(self, run: PipelineRun) -> dict[str, Any]:
        """The task's arguments in a run: its files in ``run``'s corpus and its options."""
        files = {argument: str(path) for argument, path in self.corpus_files(run.corpus).items()}
        return files | self.options(run.settings)


#: The benchmarks in the order the pipelines run them.
BENCHMARKS = (
    Benchmark(
        VQAFineTuning,
        VQA_VAL_SPLIT,
        "val_results.json",
        score_vqa,
        vqa_rows,
        ("overall", "VQAv2 accuracy (%)"),
        vqa_chance,
        vqa_items,
        (ItemMetric("VQAv2 val", "accuracy (%)", percent_of_items),),
        vqa_files,
    ),
    Benchmark(
        NLVR2FineTuning,
        NLVR2_DEV_SPLIT,
        "dev_predictions.csv",
        score_nlvr2,
        nlvr2_rows,
        ("accuracy", "NLVR2 accuracy"),
        nlvr2_chance,
        nlvr2_items,
        (ItemMetric("NLVR2 dev", "accuracy", share),),
    ),
    Benchmark(
        CaptioningFineTuning,
        CAPTION_TEST_SPLIT,
        "test_captions.json",
        score_captions,
        caption_rows,
        ("CIDEr", "COCO CIDEr"),
        caption_chance,
        caption_items,
        (ItemMetric("COCO captions Karpathy test", "colour words right (%)", percent_share),),
        caption_files,
        caption_options,
    ),
    Benchmark(
        RetrievalFineTuning,
        RETRIEVAL_TEST_SPLIT,
        "test_embeddings.pt",
        score_retrieval,
        retrieval_rows,
        ("mean_recall", "Flickr30K mean recall"),
        None,
        retrieval_items,
        (
            ItemMetric("Flickr30K Karpathy test", "mean recall (R@1/5/10)", mean_recall),
            ItemMetric("Flickr30K Karpathy test", "text->image R@1", text_to_image_r1),
        ),
    ),
    Benchmark(
        ImageClassificationFineTuning,
        CLASSIFICATION_VAL_SPLIT,
        "val_predictions.json",
        score_classification,
        classification_rows,
        ("top1", "classification top-1"),
        classification_chance,
        classification_items,
        (ItemMetric("Classification val", "top-1 accuracy (%)", percent_share),),
        classification_files,
    ),
)


def benchmark_named(name: str) -> Benchmark:
    """The benchmark of the catalog task ``name``; KeyError naming the known ones otherwise."""
    for benchmark in BENCHMARKS:
        if benchmark.name == name:
            return benchmark
    raise KeyError(f"no benchmark named {name!r}; known: {', '.join(b.name for b in BENCHMARKS)}")


def trained_benchmarks(settings: TrainingSettings) -> tuple[Benchmark, ...]:
    """The benchmarks ``settings`` give fine-tuning steps, in :data:`BENCHMARKS` order."""
    return tuple(benchmark for benchmark in BENCHMARKS if benchmark.name in settings.finetune_steps)
