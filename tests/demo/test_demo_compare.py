"""The demo's pre-trained against random-init comparison: per-item scores equal the official scorers over the full
sample, the paired cluster bootstrap equals a per-cluster loop with the same Generator draws, and the verdicts."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from mmoe.data.synth.chance import ChanceLevels
from mmoe.data.synth.scenes import COLORS
from mmoe.metrics.caption_words import word_precision
from mmoe.metrics.nlvr2 import consistency_group
from mmoe.metrics.retrieval import evaluate_retrieval_file
from mmoe.metrics.vqa import evaluate_vqa_files
from mmoe.pipeline import PipelineError, PipelineRun, benchmark_named
from mmoe.pipeline.benchmarks import score_nlvr2, score_retrieval, score_vqa, trained_benchmarks
from mmoe.pipeline.compare import (
    NOT_SEPARATED,
    PRETRAINED_AHEAD,
    RANDOM_INIT_AHEAD,
    TITLE,
    comparison,
    format_comparison,
    rows_from_items,
)
from mmoe.pipeline.comparison_items import ITEMS_FILE, comparison_items
from mmoe.pipeline.items import ItemCounts, caption_test_files
from mmoe.pipeline.layout import random_init_name
from mmoe.pipeline.settings import DEMO_FAST as FAST

#: The benchmarks the demo fine-tunes, and so compares.
DEMO_BENCHMARKS = trained_benchmarks(FAST)
#: Their names.
BENCHMARK_NAMES = [benchmark.name for benchmark in DEMO_BENCHMARKS]
SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"
VARIANT = "mhmoe"
PRETRAINED, RANDOM_INIT = "pre-trained", "random init"
ANSWERS = ["yes", "no", "two", "three", "red", "blue"]
NEVER_ANSWERED = "seven"
#: Colours the references use; captions that get a colour wrong write the one left out.
USED_COLOURS, UNUSED_COLOUR = list(COLORS)[:-1], list(COLORS)[-1]
QUESTIONS, PAIRS, CAPTIONED, RETRIEVED = 40, 48, 30, 24
#: Questions per VQA image and pairs per NLVR2 statement set (the clusters resampled).
QUESTIONS_PER_IMAGE, PAIRS_PER_SET = 5, 4


def write_json(path, content):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(content))


def write_corpus(run: PipelineRun, rng: np.random.Generator) -> dict:
    """The evaluation files the demo's scorers read, with skewed VQA answers, mixed NLVR2 labels and two-colour
    references; returns what the prediction writers need."""
    annotations = []
    for question in range(QUESTIONS):
        answers = rng.choice(ANSWERS, 10, p=[0.4, 0.2, 0.15, 0.1, 0.1, 0.05]).tolist()
        records = [{"answer": a, "answer_confidence": "yes", "answer_id": j + 1} for j, a in enumerate(answers)]
        annotations.append({"question_id": 100 + question, "image_id": question // QUESTIONS_PER_IMAGE,
                            "question_type": "what is",
                            "answer_type": "other", "answers": records})  # fmt: skip
    questions = [{"question_id": a["question_id"], "image_id": a["image_id"], "question": "?"} for a in annotations]
    questions_file = run.data / "vqav2" / "v2_OpenEnded_mscoco_val2014_questions.json"
    write_json(questions_file, {"task_type": "Open-Ended", "questions": questions})
    write_json(questions_file.with_name("v2_mscoco_val2014_annotations.json"), {"annotations": annotations})

    labels = {
        f"dev-{pair // PAIRS_PER_SET}-{pair % PAIRS_PER_SET}-0": bool(rng.random() < 0.5) for pair in range(PAIRS)
    }
    lines = [json.dumps({"identifier": name, "label": str(label)}) for name, label in labels.items()]
    (run.data / "nlvr2").mkdir(parents=True)
    (run.data / "nlvr2" / "dev.json").write_text("\n".join(lines) + "\n")

    colours = {500 + image: rng.choice(USED_COLOURS, 2).tolist() for image in range(CAPTIONED)}
    images = [{"cocoid": image, "split": "test", "sentences": [{"raw": f"A {a} circle and a {b} square."},
                                                               {"raw": f"a {b} square, a {a} circle"}]}
              for image, (a, b) in colours.items()]  # fmt: skip
    images.append({"cocoid": 1, "split": "train", "sentences": [{"raw": "a red circle"}]})
    write_json(run.data / "coco" / "karpathy" / "dataset_coco.json", {"images": images})
    captions_per_image = rng.integers(1, 4, RETRIEVED)
    write_json(run.data / "flickr30k" / "dataset_flickr30k.json", {"images": [
        {"split": "test", "sentences": [{"raw": "x"}] * int(count)} for count in captions_per_image]})  # fmt: skip
    return {"annotations": annotations, "labels": labels, "colours": colours, "captions_per_image": captions_per_image,
            "image_embeddings": torch.from_numpy(rng.normal(size=(RETRIEVED, 16)))}  # fmt: skip


def prediction_file(run: PipelineRun, name: str, start: str):
    """The prediction file of benchmark ``name`` fine-tuned from ``start`` (pre-trained or random init)."""
    benchmark = benchmark_named(name)
    start_name = VARIANT if start == PRETRAINED else random_init_name(VARIANT)
    return run.finetuning(start_name, name).predictions(benchmark.predictions)


def write_predictions(run: PipelineRun, corpus: dict, start: str, skill: float, rng: np.random.Generator) -> None:
    """One start's four prediction files: each item right with probability ``skill`` (0: wrong on every item; 1:
    right on every item)."""
    files = {name: prediction_file(run, name, start) for name in BENCHMARK_NAMES}

    def right() -> bool:
        return bool(rng.random() < skill)

    common = [max(ANSWERS, key=[a["answer"] for a in entry["answers"]].count) for entry in corpus["annotations"]]
    write_json(files["vqav2"], [{"question_id": entry["question_id"], "answer": answer if right() else NEVER_ANSWERED}
                                for entry, answer in zip(corpus["annotations"], common, strict=True)])  # fmt: skip

    files["nlvr2"].parent.mkdir(parents=True, exist_ok=True)
    files["nlvr2"].write_text("".join(f"{name},{label == right()}\n" for name, label in corpus["labels"].items()))

    def colour(used):
        return used if right() else UNUSED_COLOUR

    write_json(files["captioning"], [{"image_id": image, "caption": f"a {colour(a)} circle and a {colour(b)} square"}
                                     for image, (a, b) in corpus["colours"].items()])  # fmt: skip

    images = corpus["image_embeddings"]
    owners = torch.arange(RETRIEVED).repeat_interleave(torch.from_numpy(corpus["captions_per_image"]))
    signs = torch.tensor([1.0 if right() else -1.0 for _ in owners])[:, None]
    captions = signs * images[owners] + 0.8 * torch.from_numpy(rng.normal(size=(len(owners), images.shape[1])))
    files["retrieval"].parent.mkdir(parents=True, exist_ok=True)
    torch.save({"image_ids": torch.arange(RETRIEVED) + 900, "image_embeddings": images.float(),
                "caption_image_ids": owners + 900, "caption_embeddings": captions.float(),
                "captions": [f"caption {i}" for i in range(len(owners))]}, files["retrieval"])  # fmt: skip


@pytest.fixture
def demo_run(tmp_path):
    rng = np.random.default_rng(7)
    run = PipelineRun(tmp_path / "demo", FAST)
    corpus = write_corpus(run, rng)
    return run, corpus, rng


def official_values(run: PipelineRun, start: str) -> dict[tuple[str, str], float]:
    """(task, metric) -> the official scorer's value on ``start``'s files."""
    files = {name: prediction_file(run, name, start) for name in BENCHMARK_NAMES}
    references, captions = caption_test_files(run, files["captioning"])
    retrieval = score_retrieval(run, files["retrieval"])
    return {
        ("VQAv2 val", "accuracy (%)"): score_vqa(run, files["vqav2"])["overall"],
        ("NLVR2 dev", "accuracy"): score_nlvr2(run, files["nlvr2"])["accuracy"],
        ("COCO captions Karpathy test", "colour words right (%)"):
            100 * word_precision(captions, references, COLORS)["precision"],
        ("Flickr30K Karpathy test", "mean recall (R@1/5/10)"): retrieval["mean_recall"],
        ("Flickr30K Karpathy test", "text->image R@1"): retrieval["t2i_r1"],
    }  # fmt: skip


def per_item_reference(run: PipelineRun, start: str, tmp_path) -> dict[tuple[str, str], tuple[list, object]]:
    """(task, metric) -> (item ids, statistic of a list of picked item ids), straight from the official scorers'
    per-item outputs: VQA's perQuestion, NLVR2 labels against predictions, the colour check of one image at a time,
    each query's rank from ``mmoe eval retrieval --results``."""
    files = {name: prediction_file(run, name, start) for name in BENCHMARK_NAMES}
    per_question = evaluate_vqa_files(
        run.corpus.vqa_questions("val2014"), run.corpus.vqa_annotations("val2014"), files["vqav2"]
    )["perQuestion"]
    labels = {json.loads(line)["identifier"]: json.loads(line)["label"] == "True"
              for line in (run.data / "nlvr2" / "dev.json").read_text().splitlines()}  # fmt: skip
    predicted = dict(line.split(",") for line in files["nlvr2"].read_text().splitlines())
    references, captions = caption_test_files(run, files["captioning"])
    colour_checks = {image: word_precision({image: caption}, references, COLORS) for image, caption in captions.items()}
    ranks_file = tmp_path / f"ranks_{start}.json"
    evaluate_retrieval_file(files["retrieval"], ranks_file)
    ranks = json.loads(ranks_file.read_text())
    image_rank = {entry["image_id"]: entry["rank"] for entry in ranks["images"]}
    caption_ranks = {image: [c["rank"] for c in ranks["captions"] if c["image_id"] == image] for image in image_rank}

    def recalls(picked):
        i2t = [sum(image_rank[image] <= k for image in picked) / len(picked) for k in (1, 5, 10)]
        texts = [rank for image in picked for rank in caption_ranks[image]]
        return i2t + [sum(rank <= k for rank in texts) / len(texts) for k in (1, 5, 10)]

    def colour_share(picked):
        written = sum(colour_checks[image]["words"] for image in picked)
        right = sum(colour_checks[image]["words"] * colour_checks[image]["precision"] for image in picked)
        return 100 * right / written if written else 0.0

    return {
        ("VQAv2 val", "accuracy (%)"): (
            [int(q) for q in per_question], lambda picked: sum(per_question[str(q)] for q in picked) / len(picked)),
        ("NLVR2 dev", "accuracy"): (
            list(labels), lambda picked: sum((predicted[p] == "True") == labels[p] for p in picked) / len(picked)),
        ("COCO captions Karpathy test", "colour words right (%)"): (list(captions), colour_share),
        ("Flickr30K Karpathy test", "mean recall (R@1/5/10)"): (list(image_rank), lambda p: sum(recalls(p)) / 6),
        ("Flickr30K Karpathy test", "text->image R@1"): (list(image_rank), lambda p: recalls(p)[3]),
    }  # fmt: skip


def test_per_item_counts_give_the_official_scores(demo_run):
    run, corpus, rng = demo_run
    write_predictions(run, corpus, PRETRAINED, 0.8, rng)
    write_predictions(run, corpus, RANDOM_INIT, 0.5, rng)
    rows = comparison(run, VARIANT)
    assert [(row["task"], row["metric"]) for row in rows] == list(official_values(run, PRETRAINED))
    for start, column in ((PRETRAINED, "pretrained"), (RANDOM_INIT, "random_init")):
        official = official_values(run, start)
        for row in rows:
            assert row[column] == pytest.approx(official[row["task"], row["metric"]], rel=1e-12, abs=1e-12)
    assert [row["items"] for row in rows] == [QUESTIONS, PAIRS, CAPTIONED, RETRIEVED, RETRIEVED]
    clusters = [QUESTIONS // QUESTIONS_PER_IMAGE, PAIRS // PAIRS_PER_SET, CAPTIONED, RETRIEVED, RETRIEVED]
    assert [(row["clusters"], row["cluster"]) for row in rows] == list(
        zip(clusters, ["images", "statement sets", "images", "images", "images"], strict=True)
    )


def cluster_members(corpus: dict, task: str, ids: list) -> dict:
    """Cluster -> its items in ``ids``' order, the clusters in order of first appearance: a VQA question's image
    (its annotation's ``image_id``), an NLVR2 pair's statement set (the identifier without its pair id), else the
    item itself."""
    image_of = {entry["question_id"]: entry["image_id"] for entry in corpus["annotations"]}
    cluster_of = {"VQAv2 val": image_of.__getitem__, "NLVR2 dev": consistency_group}.get(task, lambda item: item)
    members: dict = {}
    for item in ids:
        members.setdefault(cluster_of(item), []).append(item)
    return members


def test_paired_bootstrap_equals_a_per_cluster_loop_with_the_same_draws(demo_run, tmp_path):
    """Each resample picks clusters with replacement and scores the union of their items (an item twice when its
    cluster is picked twice) with the official per-item scores."""
    run, corpus, rng = demo_run
    write_predictions(run, corpus, PRETRAINED, 0.75, rng)
    write_predictions(run, corpus, RANDOM_INIT, 0.6, rng)
    rows = comparison(run, VARIANT)
    first, second = per_item_reference(run, PRETRAINED, tmp_path), per_item_reference(run, RANDOM_INIT, tmp_path)
    for row in rows:
        ids, pretrained = first[row["task"], row["metric"]]
        _, random_init = second[row["task"], row["metric"]]
        members = cluster_members(corpus, row["task"], ids)
        clusters = list(members)
        generator = np.random.default_rng(0)
        differences = []
        for _ in range(1000):
            picked = [item for index in generator.integers(0, len(clusters), len(clusters))
                      for item in members[clusters[index]]]  # fmt: skip
            differences.append(pretrained(picked) - random_init(picked))
        assert row["clusters"] == len(clusters) and row["items"] == len(ids)
        assert row["difference"] == pytest.approx(pretrained(ids) - random_init(ids), rel=1e-9, abs=1e-12)
        assert row["interval"] == pytest.approx(np.percentile(differences, [2.5, 97.5]), rel=1e-9, abs=1e-12)
        assert np.std(differences) > 0  # the skills differ cluster by cluster: the interval has a width
        low, high = row["interval"]
        assert row["verdict"] == (PRETRAINED_AHEAD if low > 0 else RANDOM_INIT_AHEAD if high < 0 else NOT_SEPARATED)


def test_identical_predictions_are_not_separated(demo_run):
    run, corpus, rng = demo_run
    write_predictions(run, corpus, PRETRAINED, 0.7, rng)
    for name in BENCHMARK_NAMES:
        target = prediction_file(run, name, RANDOM_INIT)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(prediction_file(run, name, PRETRAINED), target)
    for row in comparison(run, VARIANT):
        assert row["difference"] == 0 and row["interval"] == [0.0, 0.0] and row["verdict"] == NOT_SEPARATED


@pytest.mark.parametrize(("pretrained", "random_init", "verdict"), [(1.0, 0.0, PRETRAINED_AHEAD),
                                                                     (0.0, 1.0, RANDOM_INIT_AHEAD)])  # fmt: skip
def test_right_on_every_item_against_wrong_on_every_item_is_separated(demo_run, pretrained, random_init, verdict):
    run, corpus, rng = demo_run
    write_predictions(run, corpus, PRETRAINED, pretrained, rng)
    write_predictions(run, corpus, RANDOM_INIT, random_init, rng)
    rows = comparison(run, VARIANT)
    for row in rows:
        assert row["verdict"] == verdict
        assert (row["interval"][0] > 0) if verdict == PRETRAINED_AHEAD else (row["interval"][1] < 0)
    table = format_comparison({VARIANT: rows})
    assert table.splitlines()[0] == TITLE
    assert "1,000 resamples" in TITLE and "95%" in TITLE and "cluster bootstrap" in TITLE
    assert "conditional on one pre-training and one random init" in TITLE
    assert table.splitlines()[3].split()[-2:] == ["items", "clusters"]
    assert table.splitlines()[4].split()[-3:] == [str(QUESTIONS), str(QUESTIONS // QUESTIONS_PER_IMAGE), "images"]
    assert sum(verdict in line for line in table.splitlines()) == len(rows) == 5


def test_starts_scored_on_different_items_are_refused(demo_run):
    run, corpus, rng = demo_run
    write_predictions(run, corpus, PRETRAINED, 0.7, rng)
    write_predictions(run, corpus, RANDOM_INIT, 0.7, rng)
    embeddings = prediction_file(run, "retrieval", RANDOM_INIT)
    content = torch.load(embeddings, weights_only=True)
    torch.save(content | {"image_ids": content["image_ids"] + 1000, "caption_image_ids": content["caption_image_ids"]
                          + 1000}, embeddings)  # fmt: skip
    with pytest.raises(PipelineError, match="the two starts were scored on different items"):
        comparison(run, VARIANT)


def test_starts_that_put_an_item_in_different_clusters_are_refused():
    counts = np.ones((4, 2))
    pretrained = ItemCounts([1, 2, 3, 4], counts, ["a", "a", "b", "b"], "images")
    random_init = ItemCounts([4, 3, 2, 1], counts, ["b", "b", "a", "a"], "images")
    assert (random_init.rows_in_order_of(pretrained, "here") == counts).all()  # same clusters, another order
    moved = ItemCounts([4, 3, 2, 1], counts, ["b", "a", "a", "a"], "images")
    with pytest.raises(PipelineError, match="here: the two starts put item 3 in different clusters"):
        moved.rows_in_order_of(pretrained, "here")


def test_the_demo_command_saves_and_prints_the_comparison_after_the_table(demo_run, monkeypatch, capsys):
    from mmoe.demo import command

    run, corpus, rng = demo_run
    write_predictions(run, corpus, PRETRAINED, 0.8, rng)
    write_predictions(run, corpus, RANDOM_INIT, 0.5, rng)
    write_json(run.corpus.summary, {"chance": {}})
    monkeypatch.setattr(command, "run_demo", lambda *args: {})  # every stage done: only the report runs
    row = {"task": "NLVR2 dev", "metric": "accuracy", "value": 0.5, "chance": 0.5, "baseline": "constant answer"}
    monkeypatch.setattr(command, "variant_rows", lambda *args, **kwargs: [row])
    assert command.demo_command(["--out", str(run.out), "--fast", "--random-init"]) == 0
    saved = json.loads((run.out / "results.json").read_text())
    assert saved["comparison"] == {VARIANT: comparison(run, VARIANT)}
    items = json.loads((run.out / ITEMS_FILE).read_text())
    assert items == {VARIANT: comparison_items(run, VARIANT)}
    assert rows_from_items(items[VARIANT]) == saved["comparison"][VARIANT]  # from the file alone
    assert "\n" not in (run.out / ITEMS_FILE).read_text().strip()  # compact
    printed = capsys.readouterr().out
    assert printed.index("constant answer") < printed.index(TITLE) < printed.index("Files:")
    assert len([line for line in printed.splitlines() if line.startswith("Flickr30K Karpathy test")]) == 2
    assert f"  {run.out / ITEMS_FILE}" in printed.splitlines()

    assert command.demo_command(["--out", str(run.out), "--fast"]) == 0
    assert "comparison" not in json.loads((run.out / "results.json").read_text())
    assert not (run.out / ITEMS_FILE).exists()
    assert TITLE not in capsys.readouterr().out


def test_each_compared_metric_is_a_row_of_the_main_table_with_the_same_value(demo_run):
    run, corpus, rng = demo_run
    write_predictions(run, corpus, PRETRAINED, 0.8, rng)
    write_predictions(run, corpus, RANDOM_INIT, 0.5, rng)
    files = {name: prediction_file(run, name, PRETRAINED) for name in BENCHMARK_NAMES}
    colours = word_precision(*reversed(caption_test_files(run, files["captioning"])), COLORS)
    scores = {
        "vqav2": score_vqa(run, files["vqav2"]),
        "nlvr2": score_nlvr2(run, files["nlvr2"]),
        "captioning": {"Bleu_4": 0.0, "CIDEr": 0.0, "colour_word_precision": colours["precision"],
                       "colour_word_chance": colours["chance"]},
        "retrieval": score_retrieval(run, files["retrieval"]),
    }  # fmt: skip
    chance = ChanceLevels(0.0, 0.0, 0.5, 0.0, {"Bleu_4": 0.0, "CIDEr": 0.0})
    table = {
        (row["task"], row["metric"]): row["value"] for b in DEMO_BENCHMARKS for row in b.rows(scores[b.name], chance)
    }
    for row in comparison(run, VARIANT):
        assert row["pretrained"] == pytest.approx(table[row["task"], row["metric"]], abs=0.005)  # the table rounds %


def test_the_seed_script_compares_two_ablation_folders_as_the_demo_compares_its_starts(demo_run, tmp_path):
    """``scripts/demo_seed_compare.py`` over folders laid out as ``scripts/demo_ablation.py`` writes them (a corpus
    link and ``TASK/<predictions file>``) gives the demo's own comparison rows; a task only one folder holds is left
    out."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("demo_seed_compare", SCRIPTS / "demo_seed_compare.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    run, corpus, rng = demo_run
    write_predictions(run, corpus, PRETRAINED, 0.8, rng)
    write_predictions(run, corpus, RANDOM_INIT, 0.5, rng)
    folders = {start: tmp_path / start.replace(" ", "_") for start in (PRETRAINED, RANDOM_INIT)}
    for start, folder in folders.items():
        folder.mkdir()
        (folder / "data").symlink_to(run.data)
        for name in BENCHMARK_NAMES:
            source = prediction_file(run, name, start)
            (folder / name).mkdir()
            shutil.copy(source, folder / name / source.name)
    assert script.compare_folders(folders[PRETRAINED], folders[RANDOM_INIT]) == comparison(run, VARIANT)
    assert script.folder_items(folders[PRETRAINED], folders[RANDOM_INIT]) == comparison_items(run, VARIANT)
    (folders[RANDOM_INIT] / "nlvr2" / prediction_file(run, "nlvr2", RANDOM_INIT).name).unlink()
    rows = script.compare_folders(folders[PRETRAINED], folders[RANDOM_INIT])
    assert [row for row in comparison(run, VARIANT) if row["task"] != "NLVR2 dev"] == rows
    truncated = folders[RANDOM_INIT] / "vqav2" / prediction_file(run, "vqav2", RANDOM_INIT).name
    truncated.write_text(truncated.read_text()[:40])
    with pytest.raises(PipelineError, match=f"comparing .* with {truncated}"):
        script.compare_folders(folders[PRETRAINED], folders[RANDOM_INIT])
