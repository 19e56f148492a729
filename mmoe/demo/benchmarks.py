"""The benchmarks the demo fine-tunes, predicts and scores: for each fine-tuning task of the catalog, the files of the
demo's corpus it reads, its evaluation split, and how its predictions are scored and shown."""

from __future__ import annotations

import contextlib
import io
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mmoe.data.answers import ANSWERS_FILE
from mmoe.data.synth.convert import (
    CAPTION_TEST_SPLIT,
    NLVR2_DEV_SPLIT,
    RETRIEVAL_TEST_SPLIT,
    VQA_TRAIN_SPLIT,
    VQA_VAL_SPLIT,
)
from mmoe.data.synth.scenes import COLORS
from mmoe.demo.report import caption_rows, nlvr2_rows, retrieval_rows, vqa_rows
from mmoe.demo.settings import CAPTION_TOKENS, DemoRun, DemoSettings
from mmoe.io import read_json
from mmoe.tasks.catalog import FINETUNING_TASKS
from mmoe.tasks.finetuning import FineTuningTask


def vqa_val_files(run: DemoRun) -> tuple[Path, Path]:
    """The VQAv2 validation questions and annotations of the demo's corpus."""
    vqa = run.data / "vqav2"
    return vqa / "v2_OpenEnded_mscoco_val2014_questions.json", vqa / "v2_mscoco_val2014_annotations.json"


def nlvr2_dev_file(run: DemoRun) -> Path:
    return run.data / "nlvr2" / "dev.json"


def caption_test_files(run: DemoRun, predictions: Path) -> tuple[dict, dict]:
    """``(references, captions)`` of the Karpathy test split, as ``mmoe eval caption --karpathy ... --split test``
    reads them."""
    from mmoe.metrics.captions import read_caption_files

    return read_caption_files(predictions, karpathy=run.data / "coco" / "karpathy" / "dataset_coco.json", split="test")


def score_vqa(run: DemoRun, predictions: Path) -> dict:
    from mmoe.metrics.vqa import evaluate_vqa_files

    report = evaluate_vqa_files(*vqa_val_files(run), predictions)
    return {"overall": report["overall"], "perAnswerType": report["perAnswerType"]}


def score_nlvr2(run: DemoRun, predictions: Path) -> dict:
    from mmoe.metrics.nlvr2 import evaluate_nlvr2_files

    return evaluate_nlvr2_files(nlvr2_dev_file(run), predictions)


def score_captions(run: DemoRun, predictions: Path) -> dict:
    from mmoe.metrics.caption_words import word_precision
    from mmoe.metrics.captions import score_captions as coco_scores

    # What `mmoe eval caption --karpathy ... --split test` computes, with the references and captions read once for
    # both the COCO metrics and the colour-word check.
    references, captions = caption_test_files(run, predictions)
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):  # pycocoevalcap prints its progress
        warnings.simplefilter("ignore", ResourceWarning)
        report = coco_scores(references, captions, meteor=False, spice=False)  # the table shows neither
    scores = {name: value for name, value in report.items() if isinstance(value, float)}
    colours = word_precision(captions, references, COLORS)
    return scores | {"colour_word_precision": colours["precision"], "colour_word_chance": colours["chance"]}


def score_retrieval(run: DemoRun, predictions: Path) -> dict:
    """What ``mmoe eval retrieval`` computes from the test split's embeddings, and under ``random_ranking`` the same
    recalls of a random ranking of that split (its images and their captions in ``dataset_flickr30k.json``)."""
    from mmoe.metrics.retrieval import evaluate_retrieval_file, random_recall

    split = read_json(run.data / "flickr30k" / "dataset_flickr30k.json", "Karpathy split file")
    captions_per_image = [len(image["sentences"]) for image in split["images"] if image["split"] == "test"]
    return evaluate_retrieval_file(predictions) | {"random_ranking": random_recall(captions_per_image)}


def no_options(settings: DemoSettings) -> dict[str, Any]:
    return {}


def caption_options(settings: DemoSettings) -> dict[str, Any]:
    """Beam search of the demo's width; no caption files at validation (the demo does not validate)."""
    return {"num_beams": settings.num_beams, "results_dir": None}


@dataclass(frozen=True)
class Benchmark:
    """A fine-tuning task as the demo runs it.

    Attributes:
        task: the task class (its ``name`` names the config, ``configs/finetune/<name>_tiny.yaml``).
        eval_split: the shard folder (under the corpus's ``shards``) predicted on and scored.
        predictions: file name of the predictions.
        score: (run, predictions file) -> the official scores.
        rows: (scores, chance levels of the corpus summary) -> table rows.
        corpus_files: task arguments naming files of the demo's corpus -> their path under the corpus root.
        options: (settings) -> the task's other arguments.
    """

    task: type[FineTuningTask]
    eval_split: str
    predictions: str
    score: Callable[[DemoRun, Path], dict]
    rows: Callable[[dict, dict], list[dict]]
    corpus_files: dict[str, str] = field(default_factory=dict)
    options: Callable[[DemoSettings], dict[str, Any]] = no_options

    @property
    def name(self) -> str:
        return self.task.name

    def model_options(self, run: DemoRun) -> dict[str, Any]:
        """The task's arguments in the demo: its corpus files in ``run``'s corpus and its options."""
        files = {argument: str(run.data / path) for argument, path in self.corpus_files.items()}
        return files | self.options(run.settings)


#: The benchmarks in the order the demo runs them.
BENCHMARKS = (
    Benchmark(FINETUNING_TASKS["vqav2"], VQA_VAL_SPLIT, "val_results.json", score_vqa, vqa_rows,
              {"answer_vocab": f"shards/{VQA_TRAIN_SPLIT}/{ANSWERS_FILE}"}),
    Benchmark(FINETUNING_TASKS["nlvr2"], NLVR2_DEV_SPLIT, "dev_predictions.csv", score_nlvr2, nlvr2_rows),
    Benchmark(FINETUNING_TASKS["captioning"], CAPTION_TEST_SPLIT, "test_captions.json", score_captions, caption_rows,
              {"output_vocab": CAPTION_TOKENS}, caption_options),
    Benchmark(FINETUNING_TASKS["retrieval"], RETRIEVAL_TEST_SPLIT, "test_embeddings.pt", score_retrieval,
              retrieval_rows),
)  # fmt: skip


def trained_benchmarks(settings: DemoSettings) -> tuple[Benchmark, ...]:
    """The benchmarks ``settings`` give fine-tuning steps, in :data:`BENCHMARKS` order."""
    return tuple(benchmark for benchmark in BENCHMARKS if benchmark.name in settings.finetune_steps)
