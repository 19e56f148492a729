"""The synthetic default corpus: deterministic, in the official formats, and readable by the converters."""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from mmoe.cli import main
from mmoe.data.answers import normalize_answer
from mmoe.data.converters import image_names
from mmoe.data.synth.chance import ChanceLevels, vqa_prior_accuracy
from mmoe.data.synth.corpus import SIZES, build_corpus
from mmoe.data.synth.language import (
    COMPARISON_SHARE,
    captions,
    human_answers,
    majority_answer,
    questions,
    statement,
)
from mmoe.data.synth.layout import SUMMARY_FILE, CorpusLayout
from mmoe.data.synth.scenes import COLORS, SHAPES, render, sample_scene
from tests.data.test_converters import read_all

TINY = SIZES["tiny"]


def digest(root: Path) -> dict[str, str]:
    return {
        str(path.relative_to(root)): hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(root.rglob("*"))
        if path.is_file()
    }


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("synth")
    build_corpus(root, seed=0, sizes=TINY)
    return root


def test_same_seed_same_files_other_seed_other_files(corpus, tmp_path):
    build_corpus(tmp_path / "again", seed=0, sizes=TINY)
    assert digest(tmp_path / "again") == digest(corpus)
    build_corpus(tmp_path / "other", seed=1, sizes=TINY)
    other, first = digest(tmp_path / "other"), digest(corpus)
    # ImageNet's train layout names each image's class folder, which the scene decides.
    named_by_class = lambda files: {p for p in files if p.startswith("imagenet/train/")}  # noqa: E731
    assert other.keys() - named_by_class(other) == first.keys() - named_by_class(first) and other != first
    assert len(named_by_class(other)) == len(named_by_class(first)) == TINY.train_images


def test_worker_processes_write_the_same_files(corpus, tmp_path):
    import shutil

    from mmoe.data.synth.convert import convert_layout

    build_corpus(tmp_path, seed=0, sizes=TINY, workers=2)
    assert digest(tmp_path) == digest(corpus)
    manifests = convert_layout(tmp_path, tmp_path / "shards", shard_size=8)
    shards = digest(tmp_path / "shards")
    shutil.rmtree(tmp_path / "shards")
    assert convert_layout(tmp_path, tmp_path / "shards", shard_size=8, workers=3) == manifests
    assert digest(tmp_path / "shards") == shards and any(name.endswith(".tar") for name in shards)
    layout = CorpusLayout(tmp_path)
    assert sorted(manifests) == sorted(folder.name for folder in layout.shards.iterdir())
    assert all((layout.shard(name) / "manifest.json").is_file() for name in manifests)
    assert layout.caption_tokens.is_file() and layout.vqa_answer_vocab.is_file()


def test_the_layout_names_every_file_the_writer_writes(corpus):
    layout = CorpusLayout(corpus)
    files = [layout.summary, layout.karpathy_coco, layout.karpathy_flickr, layout.pretrain_text, layout.pretrain_pairs]
    files += [layout.coco_captions(subtype) for subtype in ("train2014", "val2014")]
    files += [layout.vqa_questions(subtype) for subtype in ("train2014", "val2014", "test2015", "test-dev2015")]
    files += [layout.vqa_annotations(subtype) for subtype in ("train2014", "val2014")]
    files += [layout.nlvr2_records(split) for split in ("train", "dev", "test1")]
    files += [layout.imagenet_val_solution, layout.imagenet_synsets]
    image_folders = [layout.coco_split_images(subtype) for subtype in ("train2014", "val2014", "test2015")]
    image_folders += [layout.flickr_images, layout.nlvr2_images]
    image_folders += [layout.imagenet_images(split) for split in ("train", "val")]
    written = {path for path in corpus.rglob("*") if path.is_file()}
    images = {path for path in written if any(folder in path.parents for folder in image_folders)}
    assert set(files) <= written and images and written == set(files) | images
    assert len(list(layout.nlvr2_image_folder("dev", "0").glob("dev-*-img0.png"))) == 4 * TINY.nlvr2_eval_sets
    assert layout.nlvr2_image_folder("train", "3") == corpus / "nlvr2/images/train/3"
    assert layout.vqa_images == layout.coco_images == corpus / "coco"
    relative = CorpusLayout(Path())
    assert relative.caption_tokens == Path("shards/coco-karpathy-train-restval/caption_tokens.json")
    assert relative.vqa_answer_vocab == Path("shards/vqav2-train2014/answers.json")
    assert relative.shard("nlvr2-dev") == Path("shards/nlvr2-dev")


def test_layout_and_official_formats(corpus):
    coco = json.loads((corpus / "coco/annotations/captions_train2014.json").read_text())
    assert len(coco["images"]) == TINY.train_images and len(coco["annotations"]) == 5 * TINY.train_images
    for image in coco["images"]:
        assert (corpus / "coco/train2014" / image["file_name"]).is_file()
        assert image["file_name"] == f"COCO_train2014_{image['id']:012d}.jpg"
    karpathy = json.loads((corpus / "coco/karpathy/dataset_coco.json").read_text())
    assert {image["split"] for image in karpathy["images"]} == {"train", "val", "test", "restval"}
    questions_file = json.loads((corpus / "vqav2/v2_OpenEnded_mscoco_val2014_questions.json").read_text())
    annotations = json.loads((corpus / "vqav2/v2_mscoco_val2014_annotations.json").read_text())["annotations"]
    assert questions_file["data_subtype"] == "val2014"
    assert len(annotations) == len(questions_file["questions"]) > 0
    for annotation in annotations:
        assert len(annotation["answers"]) == 10
        assert annotation["answer_type"] in ("yes/no", "number", "other")
        given = [normalize_answer(a["answer"]) for a in annotation["answers"]]
        assert given.count(annotation["multiple_choice_answer"]) == max(Counter(given).values())
    test = json.loads((corpus / "vqav2/v2_OpenEnded_mscoco_test2015_questions.json").read_text())["questions"]
    dev = json.loads((corpus / "vqav2/v2_OpenEnded_mscoco_test-dev2015_questions.json").read_text())["questions"]
    assert dev and all(q in test for q in dev)
    assert not (corpus / "vqav2/v2_mscoco_test2015_annotations.json").exists()


def test_the_summary_reads_back_as_chance_levels(corpus):
    chance = ChanceLevels.from_summary(json.loads((corpus / SUMMARY_FILE).read_text())["chance"])
    assert 0 < chance.vqa_prior < 100 and 0 < chance.vqa_question_prior < 100
    assert chance.nlvr2_constant == 0.5 and chance.nlvr2_random_consistency == 1 / 16
    assert {"Bleu_4", "CIDEr"} <= set(chance.caption_constant)
    assert chance.classification_uniform == round(1 / 24, 4) and 0 < chance.classification_majority <= 1


def test_nlvr2_sets_are_balanced_and_named_officially(corpus):
    lines = [json.loads(line) for line in (corpus / "nlvr2/dev.json").read_text().splitlines()]
    assert len(lines) == 4 * TINY.nlvr2_eval_sets
    by_set: dict[str, list] = {}
    for line in lines:
        split, set_id, pair, sentence = line["identifier"].split("-")
        by_set.setdefault(set_id, []).append(line)
        for name in image_names(line["identifier"]):
            assert (corpus / "nlvr2/images/dev" / name).is_file()
    for group in by_set.values():
        assert sorted(line["label"] for line in group) == ["False", "False", "True", "True"]
        assert len({line["sentence"] for line in group}) == 1
    train = [json.loads(line) for line in (corpus / "nlvr2/train.json").read_text().splitlines()]
    for line in train:
        left, _ = image_names(line["identifier"])
        assert (corpus / "nlvr2/images/train" / line["directory"] / left).is_file()


def test_texts_describe_the_scene():
    rng = np.random.default_rng(0)
    for _ in range(200):
        scene = sample_scene(rng)
        for caption in captions(scene, rng):
            assert all(obj.color in caption and obj.shape in caption for obj in scene.shapes)
        for question in questions(scene, rng, 5):
            if question.text == "how many shapes are there?":
                assert question.answer == str(len(scene.shapes))
            if question.text.startswith("is there a "):
                color, shape = question.text[len("is there a ") : -1].split()
                assert (question.answer == "yes") == (scene.count(color=color, shape=shape) > 0)
        answers = human_answers(questions(scene, rng, 1)[0], rng)
        assert len(answers) == 10 and majority_answer(answers)


def test_statements_hold_or_not_as_labelled():
    rng = np.random.default_rng(1)
    truths = Counter()
    for _ in range(300):
        chosen = statement(rng)
        truths[chosen.holds(sample_scene(rng), sample_scene(rng))] += 1
    assert truths[True] > 30 and truths[False] > 30  # every template can go both ways


def test_half_the_statements_are_the_image_comparison():
    rng = np.random.default_rng(3)
    texts = [statement(rng).text for _ in range(2000)]
    share = texts.count("there are more shapes in the left image than in the right image") / len(texts)
    assert abs(share - COMPARISON_SHARE) < 0.05
    assert len(set(texts)) > 50  # the slotted templates vary their words


def test_rendered_objects_show_their_colour():
    rng = np.random.default_rng(2)
    for _ in range(50):
        scene = sample_scene(rng)
        pixels = np.asarray(render(scene, 64)).reshape(-1, 3).astype(int)
        for obj in scene.shapes:
            distance = np.abs(pixels - np.array(COLORS[obj.color])).sum(1)
            assert (distance < 10).sum() >= 10, obj


def test_synth_cli_builds_and_converts(tmp_path, capsys):
    assert main(["data", "synth", "--out", str(tmp_path), "--size", "tiny", "--train-images", "10", "--shards"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["sizes"]["train_images"] == 10
    chance = summary["chance"]
    assert 0 < chance["vqav2_val_prior_accuracy"]["overall"] <= chance["vqav2_val_question_prior_accuracy"]["overall"]
    assert chance["vqav2_val_question_prior_accuracy"]["overall"] < 100 and chance["nlvr2"]["accuracy_random"] == 0.5
    shards = summary["shards"]
    assert shards["vqav2-train2014"] > 0 and shards["nlvr2-dev"] == 4 * TINY.nlvr2_eval_sets
    assert shards["coco-karpathy-test"] > 0 and shards["pretrain-pairs"] == 20 and shards["pretrain-text"] == TINY.texts
    for name in shards:
        manifest = json.loads((tmp_path / "shards" / name / "manifest.json").read_text())
        assert manifest["skipped"] == 0 and manifest["name"] == name
    assert (tmp_path / "shards/vqav2-train2014/answers.json").exists()
    assert_classification_recounted(tmp_path, summary, train_images=10)
    with pytest.raises(SystemExit) as refused:
        main(["data", "synth", "--out", str(tmp_path / "other"), "--workers", "0"])
    assert refused.value.code == 2 and "--workers: 0 is below 1" in capsys.readouterr().err


def assert_classification_recounted(root: Path, summary: dict, train_images: int) -> None:
    """Each classification sample's class is its COCO image's top object's colour and shape, recounted from the scene
    the generator draws for that image (seeded by seed 0, the COCO split's code and the image's index); the sample's
    image is the COCO image's bytes; the chance levels are the val split's."""
    classes = sorted(f"{color}-{shape}" for color in COLORS for shape in SHAPES)

    def top_class(code: int, index: int) -> str:
        top = sample_scene(np.random.default_rng([0, code, index])).shapes[0]
        return f"{top.color}-{top.shape}"

    counted = {}
    for split, code, count in (("train", 1, train_images), ("val", 2, TINY.val_images)):
        folder = root / "shards" / f"classification-{split}"
        index = json.loads((folder / "classes.json").read_text())["classes"]
        assert index == [{"index": i, "wnid": c, "name": c.replace("-", " ")} for i, c in enumerate(classes)]
        samples = read_all(folder)
        assert len(samples) == count == summary["counts"]["classification_images"][split]
        for sample in samples:
            path = sample["meta"]["path"]
            number = int(path.rsplit("_", 1)[1].split(".")[0])  # the image id (train) or val image number
            image_id = number if split == "train" else 100_000 + number
            subtype = "train2014" if split == "train" else "val2014"
            assert sample["jpg"] == (root / "coco" / subtype / f"COCO_{subtype}_{image_id:012d}.jpg").read_bytes()
            assert classes[int(sample["cls"])] == top_class(code, image_id - 1 if split == "train" else number - 1)
        counted[split] = Counter(classes[int(sample["cls"])] for sample in samples)
    chance = summary["chance"]["classification_val"]
    most = max(counted["train"].values())
    majority = min(name for name, count in counted["train"].items() if count == most)
    assert chance["majority_class"] == majority and chance["accuracy_uniform"] == round(1 / 24, 4)
    assert chance["accuracy_majority_class"] == round(counted["val"][majority] / TINY.val_images, 4)


def annotation(question_id: int, question_type: str, answer_type: str, answers: list[str]) -> dict:
    return {
        "question_id": question_id,
        "question_type": question_type,
        "answer_type": answer_type,
        "multiple_choice_answer": majority_answer(answers),
        "answers": [{"answer": a, "answer_id": i + 1} for i, a in enumerate(answers)],
    }


def test_blind_priors_by_question_type_and_by_question_text():
    texts = {1: "what color is the shape at the top?", 2: "what color is the shape at the top?",
             3: "what shape is at the top?", 4: "what shape is at the top?", 5: "what shape is at the top?",
             11: "what color is the shape at the top?", 12: "what shape is at the top?",
             13: "what size is the red circle?"}  # fmt: skip
    train = [annotation(1, "what", "other", ["red"] * 10), annotation(2, "what", "other", ["red"] * 10)]
    train += [annotation(i, "what", "other", ["circle"] * 10) for i in (3, 4, 5)]
    val = [
        annotation(11, "what", "other", ["red"] * 10),
        annotation(12, "what", "other", ["circle"] * 2 + ["square"] * 8),
        annotation(13, "what", "other", ["large"] * 10),
    ]
    # per type: "circle" everywhere (3 of 5 training answers): 0, min(1, 2 / 3) averaged over the 10 leave-one-out
    # subsets = (2 * 1/3 + 8 * 2/3) / 10 = 0.6, and 0
    assert vqa_prior_accuracy(train, val) == {"overall": 20.0, "perAnswerType": {"other": 20.0}}
    # per text: "red", "circle", and the unseen size question falls back to the type's "circle"
    assert vqa_prior_accuracy(train, val, texts) == {"overall": 53.33, "perAnswerType": {"other": 53.33}}
