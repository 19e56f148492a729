"""The classification benchmark of the pipeline kit: its scores are ``mmoe eval classification``'s on the corpus's
``LOC_val_solution.csv``, its item counts give the same top-1, and two runs compare image by image as the demo's
``--random-init`` compares the other benchmarks."""

from __future__ import annotations

import importlib.util
import json
import random
from pathlib import Path
from types import SimpleNamespace

import pytest

from mmoe.metrics.classification import evaluate_classification_files
from mmoe.pipeline.benchmarks import benchmark_named
from mmoe.pipeline.compare import compared_files
from mmoe.pipeline.layout import PipelineRun
from mmoe.pipeline.settings import DEMO_FAST

CLASSES = ["blue-circle", "green-square", "red-star", "white-triangle", "yellow-circle", "red-square"]


def write_solution(run: PipelineRun, labels: dict[str, str]) -> None:
    folder = run.corpus.imagenet_val_solution.parent
    folder.mkdir(parents=True, exist_ok=True)
    rows = [f"{image},{wnid} 1 2 30 40" for image, wnid in labels.items()]
    run.corpus.imagenet_val_solution.write_text("\n".join(["ImageId,PredictionString", *rows]) + "\n")


def write_predictions(path, labels: dict[str, str], right: float, seed: int) -> None:
    """Predictions with the label first for a share ``right`` of the images, second for the others."""
    generator = random.Random(seed)
    entries = []
    for image, wnid in labels.items():
        others = [name for name in CLASSES if name != wnid]
        generator.shuffle(others)
        ranked = [wnid, *others] if generator.random() < right else [others[0], wnid, *others[1:]]
        entries.append({"key": image, "image": image, "wnids": ranked[:5]})
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(entries))


@pytest.fixture
def scored_run(tmp_path):
    run = PipelineRun(tmp_path, DEMO_FAST)
    generator = random.Random(0)
    labels = {f"ILSVRC2012_val_{index:08d}": generator.choice(CLASSES) for index in range(1, 201)}
    write_solution(run, labels)
    return run, labels


def test_classification_scores_are_the_official_scorer_s_and_items_give_the_same_top1(scored_run, tmp_path):
    run, labels = scored_run
    benchmark = benchmark_named("imagenet")
    predictions = tmp_path / "val_predictions.json"
    write_predictions(predictions, labels, right=0.7, seed=1)
    scores = benchmark.score(run, predictions)
    official = evaluate_classification_files(predictions, run.corpus.imagenet_val_solution)
    assert scores == official and scores["top5"] == 1.0
    items = benchmark.items(run, predictions)
    assert items.ids == list(labels) and items.clusters == items.ids  # each image its own cluster
    (metric,) = benchmark.compared
    assert metric.of_sums(items.counts.sum(0)) == pytest.approx(100 * scores["top1"])
    chance = SimpleNamespace(classification_majority=0.25, classification_uniform=0.125)  # ChanceLevels' two fields
    rows = {row["metric"]: row for row in benchmark.rows(scores, chance)}
    assert rows["top-1 accuracy (%)"]["value"] == 100 * scores["top1"] and rows["top-1 accuracy (%)"]["chance"] == 25
    assert rows["top-5 accuracy (%)"]["chance"] == pytest.approx(62.5)
    assert benchmark.model_options(run) == {"classes": str(run.shards / "classification-train" / "classes.json")}


def test_two_runs_compare_image_by_image(scored_run, tmp_path):
    run, labels = scored_run
    better, worse = tmp_path / "a" / "val_predictions.json", tmp_path / "b" / "val_predictions.json"
    write_predictions(better, labels, right=0.9, seed=2)
    write_predictions(worse, labels, right=0.3, seed=3)
    (row,) = compared_files(run, "imagenet", better, worse)
    assert row["metric"] == "top-1 accuracy (%)" and row["clusters"] == row["items"] == len(labels)
    expected = 100 * (
        evaluate_classification_files(better, run.corpus.imagenet_val_solution)["top1"]
        - evaluate_classification_files(worse, run.corpus.imagenet_val_solution)["top1"]
    )
    assert row["difference"] == pytest.approx(expected) and row["verdict"] == "pre-trained ahead"
    assert row["interval"][0] > 0


SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "classification_seeds.py"
SHIPPED = Path(__file__).resolve().parents[2] / "docs" / "classification_seeds"
PAGE = Path(__file__).resolve().parents[2] / "tasks" / "imagenet" / "README.md"


def seeds_script():
    spec = importlib.util.spec_from_file_location("classification_seeds", SCRIPT)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    return script


def test_the_rule_over_seeds_is_the_paired_t_interval_of_the_differences():
    script = seeds_script()
    summary = script.over_seeds([4.0, 6.0, 8.0])  # mean 6, sd 2: 6 ± 4.303 · 2 / sqrt(3)
    half = 4.303 * 2 / 3**0.5  # t_975 with 2 degrees of freedom, as mmoe.stats tabulates it
    assert summary["interval"] == pytest.approx([6 - half, 6 + half]) and summary["verdict"] == "pre-trained ahead"
    assert script.over_seeds([4.0, -6.0, 8.0])["verdict"] == "not separated"
    assert script.over_seeds([-4.0, -6.0, -5.0])["verdict"] == "random init ahead"


def test_the_shipped_table_is_the_shipped_results_under_the_plan():
    script = seeds_script()
    results = json.loads((SHIPPED / "results.json").read_text())
    plan = json.loads((SHIPPED / "plan.json").read_text())
    assert [run["seed"] for run in results["runs"]] == plan["seeds"] and results["steps"] == script.STEPS
    assert results["over_seeds"] == script.over_seeds([run["paired"]["difference"] for run in results["runs"]])
    for run in results["runs"]:
        paired = run["paired"]
        assert paired["difference"] == pytest.approx(run["top1"]["pretrained"] - run["top1"]["random_init"])
    assert script.page_block(PAGE, script.BEGIN, script.END) == script.markdown(results).rstrip("\n")
