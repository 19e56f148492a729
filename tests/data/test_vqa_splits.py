"""VQAv2 on several splits, as BEiT-3 trains it: one answer vocabulary over train + val (``mmoe data answers``), a
seeded image hold-out of val (``--holdout-images``), and a DataModule training on the list of splits."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mmoe.cli import main
from mmoe.data.answers import build_answer_vocab
from mmoe.data.datamodules import VQADataModule
from mmoe.data.synth.corpus import SynthSizes, build_corpus
from tests.cli_fixtures import SMALL_CORPUS, run_mmoe
from tests.data.test_converters import read_all


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("vqa_splits")
    build_corpus(root, seed=0, sizes=SynthSizes(**(SMALL_CORPUS | {"val_images": 8, "questions_per_image": 4})))
    return root


def files(corpus: Path, subtype: str) -> tuple[str, str]:
    return (str(corpus / "vqav2" / f"v2_OpenEnded_mscoco_{subtype}_questions.json"),
            str(corpus / "vqav2" / f"v2_mscoco_{subtype}_annotations.json"))  # fmt: skip


def convert(corpus: Path, subtype: str, out: Path, *extra: str) -> dict:
    questions, annotations = files(corpus, subtype)
    argv = ["data", "convert", "vqav2", "--questions", questions, "--annotations", annotations,
            "--images", str(corpus / "coco"), "--out", str(out), *extra]  # fmt: skip
    assert main(argv) == 0
    return json.loads((out / "manifest.json").read_text())


def test_one_vocabulary_over_train_and_val(corpus, tmp_path, capsys):
    out = tmp_path / "answers.json"
    argv = ["data", "answers", "--annotations", files(corpus, "train2014")[1], files(corpus, "val2014")[1],
            "--out", str(out), "--min-answer-count", "2"]  # fmt: skip
    code, printed, err = run_mmoe(argv, capsys)
    assert code == 0, err
    multiple_choice = [
        annotation["multiple_choice_answer"]
        for subtype in ("train2014", "val2014")
        for annotation in json.loads(Path(files(corpus, subtype)[1]).read_text())["annotations"]
    ]
    vocab = json.loads(out.read_text())
    assert vocab == build_answer_vocab(multiple_choice, 2) and json.loads(printed)["answers"] == len(vocab)
    code, _, err = run_mmoe([*argv[:-2], "--min-answer-count", "100000"], capsys)
    assert code == 2 and "100000 or more" in err


def test_holdout_splits_val_by_image_repeatably_and_training_reads_every_split(corpus, tmp_path, capsys):
    vocab = tmp_path / "answers.json"
    annotations = [files(corpus, "train2014")[1], files(corpus, "val2014")[1]]
    argv = ["data", "answers", "--annotations", *annotations, "--out", str(vocab), "--min-answer-count", "1"]
    code, _, err = run_mmoe(argv, capsys)
    assert code == 0, err
    shards = tmp_path / "shards"
    convert(corpus, "train2014", shards / "train", "--answer-vocab", str(vocab))
    holdout = ["--answer-vocab", str(vocab), "--holdout-images", "2", "--holdout-out", str(shards / "rest")]
    trainable = convert(corpus, "val2014", shards / "trainable", *holdout)
    rest = json.loads((shards / "rest" / "manifest.json").read_text())
    assert (trainable["name"], rest["name"]) == ("vqav2-val2014-trainable", "vqav2-val2014-rest")
    kept, held = read_all(shards / "trainable"), read_all(shards / "rest")
    kept_images = {s["meta"]["image_id"] for s in kept}
    held_images = {s["meta"]["image_id"] for s in held}
    assert len(held_images) == 2 and not kept_images & held_images
    all_questions = json.loads(Path(files(corpus, "val2014")[0]).read_text())["questions"]
    assert sorted(s["meta"]["question_id"] for s in kept + held) == sorted(q["question_id"] for q in all_questions)
    facts = {"images": 2, "seed": 0, "questions": len(held), "trainable_questions": len(kept)}
    assert trainable["holdout"] == {**facts, "part": "trainable", "other_split": str(shards / "rest")}
    assert rest["holdout"] == {**facts, "part": "held out", "other_split": str(shards / "trainable")}
    again = convert(corpus, "val2014", tmp_path / "again" / "trainable", "--answer-vocab", str(vocab),
                    "--holdout-images", "2", "--holdout-out", str(tmp_path / "again" / "rest"))  # fmt: skip
    assert again["samples"] == trainable["samples"]
    assert {s["meta"]["image_id"] for s in read_all(tmp_path / "again" / "rest")} == held_images  # same seed

    module = VQADataModule(answer_vocab=str(vocab), train_shards=[str(shards / "train"), str(shards / "trainable")],
                           val_shards=str(shards / "rest"), image_size=32, batch_size=4, num_workers=0,
                           crop_scale=None)  # fmt: skip
    seen = set()
    for batch in module.train_dataloader():
        seen |= {int(i) for i in batch["question_id"]}
    train_ids = {s["meta"]["question_id"] for s in read_all(shards / "train")}
    assert seen & train_ids and seen & {s["meta"]["question_id"] for s in kept}
    assert not seen & {s["meta"]["question_id"] for s in held}


def test_holdout_options_are_checked(corpus, tmp_path, capsys):
    questions, annotations = files(corpus, "val2014")
    vocab = tmp_path / "answers.json"
    vocab.write_text(json.dumps(["yes", "no"]))
    base = ["data", "convert", "vqav2", "--questions", questions, "--annotations", annotations, "--images",
            str(corpus / "coco"), "--answer-vocab", str(vocab), "--out", str(tmp_path / "o")]  # fmt: skip
    cases = [
        (["--holdout-images", "2"], "--holdout-images needs --holdout-out"),
        (["--holdout-out", str(tmp_path / "r")], "--holdout-out needs --holdout-images"),
        (["--holdout-images", "8", "--holdout-out", str(tmp_path / "r")], "must lie between 1 and 7"),
    ]
    for extra, message in cases:
        code, _, err = run_mmoe([*base, *extra], capsys)
        assert code == 2 and message in err, err
    assert not (tmp_path / "o").exists() and not (tmp_path / "r").exists()
