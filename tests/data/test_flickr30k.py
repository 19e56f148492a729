"""Flickr30K's Karpathy split file -> retrieval shards (one image with all its captions, image id ``imgid``), whole or
absent; bad records one line and exit 2; the synthetic corpus's Flickr30K layout converts to the same shards."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mmoe.cli import main
from mmoe.data.converters import ConversionError, convert_karpathy
from mmoe.data.datamodules import RetrievalDataModule
from mmoe.data.synth.corpus import SIZES
from tests.data.test_conversion_faults import assert_one_error_line, run_cli
from tests.data.test_converters import image_file, read_all, write_json


def flickr_file(root: Path) -> Path:
    def image(imgid: int, split: str, captions: list[str]) -> dict:
        return {
            "filename": f"{1000 + imgid}.jpg",
            "imgid": imgid,
            "split": split,
            "sentences": [
                {"raw": c, "tokens": c.split(), "imgid": imgid, "sentid": 10 * imgid + i}
                for i, c in enumerate(captions)
            ],
            "sentids": [10 * imgid + i for i in range(len(captions))],
        }

    for imgid in range(4):
        image_file(root / "flickr30k-images" / f"{1000 + imgid}.jpg", color=(60 * imgid, 10, 10))
    images = [
        image(0, "train", ["a dog runs", "a brown dog"]),
        image(1, "test", ["two men talk", "people on a street", "two men talk "]),
        image(2, "test", ["a red car"]),
        image(3, "val", ["a child"]),
    ]
    return write_json(root / "dataset_flickr30k.json", {"dataset": "flickr30k", "images": images})


def test_a_flickr30k_split_becomes_one_sample_per_image_with_all_its_captions(tmp_path, capsys):
    path = flickr_file(tmp_path)
    manifest = convert_karpathy(path, "test", tmp_path / "flickr30k-images", tmp_path / "test")
    assert (manifest.name, manifest.samples) == ("flickr30k-karpathy-test", 2)
    samples = read_all(tmp_path / "test")
    metas = sorted((s["meta"] for s in samples), key=lambda meta: meta["image_id"])
    assert [meta["image_id"] for meta in metas] == [1, 2]
    assert metas[0]["captions"] == ["two men talk", "people on a street"]  # the repeat is dropped and counted
    assert metas[0]["file_name"] == "1001.jpg" and metas[0]["split"] == "test"
    assert "repeated captions" in capsys.readouterr().err
    module = RetrievalDataModule(val_shards=str(tmp_path / "test"), image_size=32, batch_size=2, num_workers=0)
    batch = next(iter(module.val_dataloader()))
    assert batch["caption_image"].tolist() in ([0, 0, 1], [0, 1, 1])


def test_the_cli_converts_flickr30k_and_prints_the_manifest(tmp_path, capsys):
    path = flickr_file(tmp_path)
    argv = ["--karpathy", str(path), "--split", "train,val", "--images", str(tmp_path / "flickr30k-images")]
    assert main(["data", "convert", "flickr30k", *argv, "--out", str(tmp_path / "out")]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["name"] == "flickr30k-karpathy-train-val" and printed["samples"] == 2


@pytest.mark.parametrize(
    ("mutate", "part"),
    [
        (lambda data: data.update(dataset="flickr8"), "field 'dataset' = 'flickr8': expected one of coco, flickr30k"),
        (lambda data: data["images"][1].pop("imgid"), "images[1]: missing field 'imgid'"),
        (lambda data: data["images"][2].update(imgid=1), "images[2] (imgid 1): imgid 1 appears twice"),
        (lambda data: data["images"][1].update(filename="../x.jpg"), "images[1]"),
        (lambda data: data["images"][1]["sentences"][0].update(raw=3), "sentences[0]: field 'raw' must be str"),
    ],
)
def test_a_bad_record_is_one_line_exit_2_and_writes_nothing(tmp_path, capsys, mutate, part):
    path = flickr_file(tmp_path)
    data = json.loads(path.read_text())
    mutate(data)
    write_json(path, data)
    argv = ["flickr30k", "--karpathy", str(path), "--split", "test", "--images", str(tmp_path / "flickr30k-images")]
    status, err = run_cli(capsys, [*argv, "--out", str(tmp_path / "out")])
    assert status == 2
    assert_one_error_line(err, part)
    assert not (tmp_path / "out").exists()
    with pytest.raises(ConversionError):
        convert_karpathy(path, "test", tmp_path / "flickr30k-images", tmp_path / "out")


def test_the_synthetic_corpus_has_flickr30k_retrieval_splits(synthetic_corpus):
    shards = synthetic_corpus / "shards"
    counts = {split: len(read_all(shards / f"flickr30k-karpathy-{split}")) for split in ("train", "val", "test")}
    tiny = SIZES["tiny"]
    assert counts == {"train": tiny.train_images, "val": tiny.val_images // 2, "test": tiny.val_images // 2}
    sample = read_all(shards / "flickr30k-karpathy-test")[0]
    assert len(sample["meta"]["captions"]) == 5 and "jpg" in sample
    summary = json.loads((synthetic_corpus / "synth.json").read_text())
    chance = summary["chance"]["retrieval_flickr30k_test"]
    assert chance["text_to_image_r1_random"] == pytest.approx(1 / counts["test"])


def convert_edited(tmp_path, capsys, mutate) -> tuple[int, str]:
    """``mmoe data convert flickr30k`` of the test split of :func:`flickr_file` edited by ``mutate``."""
    path = flickr_file(tmp_path)
    data = json.loads(path.read_text())
    mutate(data)
    write_json(path, data)
    argv = ["flickr30k", "--karpathy", str(path), "--split", "test", "--images", str(tmp_path / "flickr30k-images")]
    return run_cli(capsys, [*argv, "--out", str(tmp_path / "out")])


def test_one_file_under_two_imgids_is_refused_naming_both_entries(tmp_path, capsys):
    status, err = convert_edited(tmp_path, capsys, lambda data: data["images"][2].update(filename="1001.jpg"))
    assert status == 2
    assert_one_error_line(err, "images[2] (imgid 2): file '1001.jpg' is also images[1] (imgid 1)")
    assert not (tmp_path / "out").exists()


def test_a_file_without_its_dataset_field_is_said_to_be_read_as_coco(tmp_path, capsys):
    status, err = convert_edited(tmp_path, capsys, lambda data: data.pop("dataset"))
    assert status == 2
    assert_one_error_line(
        err, "images[1]: missing field 'cocoid'", "no 'dataset' field", "read as COCO's", '"dataset": "flickr30k"'
    )


def test_an_image_without_captions_is_skipped_and_counted(tmp_path, capsys):
    status, err = convert_edited(tmp_path, capsys, lambda data: data["images"][2].update(sentences=[]))
    assert status == 0, err
    skipped = [line for line in err.splitlines() if line.startswith("skipped ")]
    assert len(skipped) == 1 and "1002.jpg: no caption" in skipped[0] and "images[2] (imgid 2)" in skipped[0], err
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert (manifest["samples"], manifest["skipped"]) == (1, 1)
    assert "no caption" in manifest["skipped_examples"][0]
    assert [s["meta"]["image_id"] for s in read_all(tmp_path / "out")] == [1]
    module = RetrievalDataModule(val_shards=str(tmp_path / "out"), image_size=32, batch_size=2, num_workers=0)
    batches = list(module.val_dataloader())  # no caption-less sample left for the reader to count as corrupt
    assert [batch["image_id"].tolist() for batch in batches] == [[1]] and not any(module.skipped_samples().values())
