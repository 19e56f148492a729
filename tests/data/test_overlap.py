"""Provenance and contamination: every conversion's manifest names its inputs' SHA-256 digests and its split rule;
``mmoe data check-overlap`` finds images two splits share by id and by digest (from ``image_digests.json`` or from
the shards themselves), ``--strict`` exits 2 on any overlap; a fine-tuning DataModule warns at setup when its train
and eval splits share images."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest

from mmoe.cli import main
from mmoe.data.converters import (
    convert_images,
    convert_karpathy,
    convert_nlvr2,
    convert_text,
    convert_tsv,
    convert_vqav2,
)
from mmoe.data.converters.own_data import convert_own_captions
from mmoe.data.datamodules import CaptioningDataModule, RetrievalDataModule
from mmoe.data.overlap import overlap_report, split_images
from tests.data.test_converters import image_file, karpathy_file, nlvr2_file, vqa_files
from tests.data.test_own_data import picture, write_jsonl


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_every_conversion_records_its_inputs_digests_and_split_rule(tmp_path):
    q, a = vqa_files(tmp_path)
    for image_id in (9, 42):
        image_file(tmp_path / f"coco/train2014/COCO_train2014_{image_id:012d}.jpg")
    manifest = convert_vqav2(q, tmp_path / "coco", tmp_path / "vqa", annotations=a, min_answer_count=1)
    assert manifest.extra["sha256"] == {str(q): digest(q), str(a): digest(a)}
    assert manifest.extra["split_rule"] == "every question of the questions file"
    held = convert_vqav2(q, tmp_path / "coco", tmp_path / "kept", annotations=a, min_answer_count=1,
                         holdout_images=1, holdout_out=tmp_path / "rest", seed=3)  # fmt: skip
    rest = json.loads((tmp_path / "rest/manifest.json").read_text())
    assert "random.Random(3)" in rest["split_rule"] and held.extra["split_rule"].startswith("every question but")
    karpathy = karpathy_file(tmp_path)
    image_file(tmp_path / "coco/val2014/COCO_val2014_000000000003.jpg")
    manifest = convert_karpathy(karpathy, "test", tmp_path / "coco", tmp_path / "test")
    assert manifest.extra["sha256"] == {str(karpathy): digest(karpathy)}
    assert manifest.extra["split_rule"] == "images whose 'split' is test"
    data = nlvr2_file(tmp_path / "dev.json", [{"identifier": "dev-1-0-0", "sentence": "s", "label": "True"}])
    for side in (0, 1):
        image_file(tmp_path / f"nlvr2/dev-1-0-img{side}.png", image_format="PNG")
    assert convert_nlvr2(data, tmp_path / "nlvr2", tmp_path / "n").extra["sha256"] == {str(data): digest(data)}
    (tmp_path / "p.tsv").write_text("train2014/COCO_train2014_000000000009.jpg\ta caption\n")
    manifest = convert_tsv(tmp_path / "p.tsv", tmp_path / "coco", tmp_path / "pairs")
    assert manifest.extra["sha256"] == {str(tmp_path / "p.tsv"): digest(tmp_path / "p.tsv")}
    (tmp_path / "t.txt").write_text("one\n")
    manifest = convert_text([tmp_path / "t.txt"], tmp_path / "text")
    assert manifest.extra["sha256"] == {str(tmp_path / "t.txt"): digest(tmp_path / "t.txt")}
    assert not (tmp_path / "text/image_digests.json").exists()  # no images, no image digests


@pytest.fixture
def splits(tmp_path) -> dict[str, Path]:
    """Caption splits: ``train``; ``clean`` (other images); ``same_name`` (train's file name in another folder, other
    bytes); ``same_bytes`` (train's bytes under another name); ``same_folder`` (a file of train's folder)."""
    train_images, eval_images = tmp_path / "train-images", tmp_path / "eval-images"
    red = picture(train_images / "red.jpg", (200, 10, 10))
    picture(train_images / "green.jpg", (10, 200, 10))
    picture(eval_images / "blue.jpg", (10, 10, 200))
    picture(eval_images / "red.jpg", (250, 250, 10))  # the name of a training image, another picture
    shutil.copy(red, eval_images / "copy.jpg")  # a training image under another name
    tables = {
        "train": (train_images, ["red.jpg", "green.jpg"]),
        "clean": (eval_images, ["blue.jpg"]),
        "same_name": (eval_images, ["blue.jpg", "red.jpg"]),
        "same_bytes": (eval_images, ["blue.jpg", "copy.jpg"]),
        "same_folder": (train_images, ["green.jpg"]),
    }
    for name, (images, files) in tables.items():
        table = write_jsonl(tmp_path / f"{name}.jsonl", [{"image": f, "caption": f"a {f}"} for f in files])
        convert_own_captions(table, images, tmp_path / name)
    return {name: tmp_path / name for name in tables}


@pytest.mark.parametrize("from_shards", [False, True])
@pytest.mark.parametrize(
    ("split", "by_id", "by_digest"),
    [("clean", 0, 0), ("same_name", 0, 0), ("same_bytes", 0, 1), ("same_folder", 1, 1)],
)
def test_check_overlap_by_id_and_by_digest(splits, capsys, split, by_id, by_digest, from_shards):
    if from_shards:  # folders converted before image_digests.json existed: their shards are read
        for folder in (splits["train"], splits[split]):
            (folder / "image_digests.json").unlink()
        by_id += split == "same_name"  # shards name an own image by its file name alone, not by its folder too
    assert main(["data", "check-overlap", str(splits["train"]), str(splits[split])]) == 0
    captured = capsys.readouterr()
    report = json.loads(captured.out)
    shared = by_id or by_digest
    assert (report["by_id"]["count"], report["by_digest"]["count"]) == (by_id, by_digest)
    assert report["shared_images"] == shared and report["eval"]["images"] == 2 - (split in ("clean", "same_folder"))
    assert report["train"]["read_from"] == ("shards" if from_shards else "image_digests.json")
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("mmoe data check-overlap: ")
    assert ("shares none" in lines[0]) == (not shared)

    def image_id(folder: str, name: str) -> str:
        return name if from_shards else f"{(splits['train'].parent / folder).resolve().as_posix()}/{name}"

    if split == "same_folder":
        assert report["by_id"]["examples"] == [image_id("train-images", "green.jpg")]
    if split == "same_bytes":
        assert report["by_digest"]["examples"][0] == {
            "eval_id": image_id("eval-images", "copy.jpg"),
            "train_id": image_id("train-images", "red.jpg"),
            "sha256": digest(splits["train"].parent / "train-images/red.jpg"),
        }
    strict = main(["data", "check-overlap", "--strict", str(splits["train"]), str(splits[split])])
    assert strict == (2 if shared else 0)


def test_check_overlap_bad_folders_are_one_line(splits, tmp_path, capsys):
    assert main(["data", "check-overlap", str(splits["train"]), str(tmp_path / "absent")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"mmoe data check-overlap: error: {tmp_path / 'absent'}: not a folder"]
    (splits["clean"] / "image_digests.json").write_text('{"format": "something else"}')
    assert main(["data", "check-overlap", str(splits["train"]), str(splits["clean"])]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "image_digests.json: not an mmoe-image-digests file" in err[0]


@pytest.mark.parametrize("module_class", [CaptioningDataModule, RetrievalDataModule])
def test_finetuning_warns_when_train_and_eval_splits_share_images(splits, capsys, module_class):
    def setup(val: str, test: str | None = None) -> list[str]:
        module = module_class(train_shards=splits["train"], val_shards=[str(splits[val])],
                              test_shards=test and str(splits[test]), image_size=32, num_workers=0)  # fmt: skip
        capsys.readouterr()
        module.setup("fit")
        module.setup("validate")  # warned once
        return capsys.readouterr().err.strip().splitlines()

    assert setup("clean") == [] and setup("same_name") == []  # another folder's file of the same name
    lines = setup("same_bytes", test="same_folder")
    assert len(lines) == 2
    assert lines[0].startswith("mmoe: warning: data.val_shards shares 1 of its 2 images with data.train_shards")
    assert "(0 by id, 1 by digest; e.g. " in lines[0] and "eval-images/copy.jpg)" in lines[0]
    assert "mmoe data check-overlap" in lines[0]
    assert lines[1].startswith("mmoe: warning: data.test_shards shares 1 of its 1 images") and "1 by id" in lines[1]


def test_own_folders_with_the_same_file_names_share_no_images_by_that_name(tmp_path):
    """Own-data ids are qualified by their image folder: two folders that both number their files 000000.jpg, ...
    share nothing, while two tables over one folder share what they both name."""
    for folder, colors in (("a", [(250, 10, 10), (10, 250, 10)]), ("b", [(10, 10, 250), (250, 250, 10)])):
        for index, color in enumerate(colors):
            picture(tmp_path / folder / f"{index:06d}.jpg", color)
    tables = {"train": ("a", [0, 1]), "eval": ("b", [0, 1]), "eval_same_folder": ("a", [1])}
    for name, (folder, indices) in tables.items():
        rows = [{"image": f"{index:06d}.jpg", "caption": f"a picture {index}"} for index in indices]
        convert_own_captions(write_jsonl(tmp_path / f"{name}.jsonl", rows), tmp_path / folder, tmp_path / name)
    train = split_images(tmp_path / "train")
    assert overlap_report(train, split_images(tmp_path / "eval"))["shared_images"] == 0
    report = overlap_report(train, split_images(tmp_path / "eval_same_folder"))
    assert (report["shared_images"], report["by_id"]["count"], report["by_digest"]["count"]) == (1, 1, 1)
    assert report["by_id"]["examples"] == [f"{(tmp_path / 'a').resolve().as_posix()}/000001.jpg"]


def test_a_coco_image_stored_with_other_bytes_is_shared_by_its_file_name(tmp_path):
    """COCO file names name the image wherever it is stored: a re-encoded copy still shares it (by id)."""
    karpathy = karpathy_file(tmp_path)
    for folder, color in (("coco", (200, 10, 10)), ("recoded", (160, 30, 30))):
        image_file(tmp_path / folder / "val2014/COCO_val2014_000000000003.jpg", color)
        convert_karpathy(karpathy, "test", tmp_path / folder, tmp_path / f"{folder}-test")
    report = overlap_report(split_images(tmp_path / "coco-test"), split_images(tmp_path / "recoded-test"))
    assert (report["shared_images"], report["by_id"]["count"], report["by_digest"]["count"]) == (1, 1, 0)
    assert report["by_id"]["examples"] == ["COCO_val2014_000000000003.jpg"]


def test_pair_and_image_folders_with_the_same_file_names_share_no_images_by_that_name(tmp_path):
    """The pre-training converters' ids carry their image folder too (``convert tsv`` / ``convert images``)."""
    for folder, color in (("a", (250, 10, 10)), ("b", (10, 10, 250))):
        picture(tmp_path / folder / "000000.jpg", color)
        (tmp_path / f"{folder}.tsv").write_text("000000.jpg\ta picture\n")
        convert_tsv(tmp_path / f"{folder}.tsv", tmp_path / folder, tmp_path / f"pairs-{folder}")
        convert_images(tmp_path / folder, tmp_path / f"images-{folder}")
    for kind in ("pairs", "images"):
        report = overlap_report(split_images(tmp_path / f"{kind}-a"), split_images(tmp_path / f"{kind}-b"))
        assert report["shared_images"] == 0, kind
    same = overlap_report(split_images(tmp_path / "pairs-a"), split_images(tmp_path / "images-a"))
    assert (same["shared_images"], same["by_id"]["count"], same["by_digest"]["count"]) == (1, 1, 1)


def test_finetuning_refuses_an_eval_digests_file_listing_no_images_in_one_line(splits):
    digests = splits["same_folder"] / "image_digests.json"
    digests.write_text(json.dumps({**json.loads(digests.read_text()), "images": []}))
    module = CaptioningDataModule(train_shards=splits["train"], val_shards=[str(splits["same_folder"])], image_size=32)
    with pytest.raises(ValueError) as error:
        module.setup("fit")  # it shares an image with train: an emptied file would have hidden it
    assert (
        str(error.value) == f"{digests}: lists no images, but manifest.json counts 1 sample; convert the split "
        "again, or remove the file to have the shards read"
    )
