"""One image is one image: the same file under several path spellings is one sample, one image id never names two
different images, and the overlap check refuses a digests file that lists fewer images than its split holds."""

from __future__ import annotations

import io
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from mmoe.cli import main
from tests.data.test_conversion_faults import assert_one_error_line, run_cli
from tests.data.test_converters import read_all
from tests.data.test_own_data import picture, write_csv, write_jsonl


def png(color) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (48, 40), color).save(buffer, format="PNG")
    return buffer.getvalue()


@pytest.mark.parametrize("source", ["captions", "vqa", "pairs"])
def test_one_file_under_several_path_spellings_is_one_image(tmp_path, capsys, source):
    images = tmp_path / "images"
    picture(images / "0.jpg", (200, 10, 10))
    picture(images / "sub" / "1.jpg", (10, 10, 200))
    spellings = ["0.jpg", "./0.jpg", "sub/../0.jpg", "sub//../0.jpg", "sub/1.jpg", "./sub/./1.jpg"]
    rows = [{"image": path, "caption": f"c{n}", "question": f"q{n}?"} for n, path in enumerate(spellings)]
    table = write_jsonl(tmp_path / "t.jsonl", rows)
    out = tmp_path / "out"
    status, err = run_cli(capsys, [source, "--table", str(table), "--images", str(images), "--out", str(out)])
    assert status == 0, err
    metas = [sample["meta"] for sample in read_all(out)]
    digests = json.loads((out / "image_digests.json").read_text())["images"]
    assert len(digests) == 2
    if source == "pairs":  # the TSV converter writes the same pairs
        tsv = tmp_path / "t.tsv"
        tsv.write_text("".join(f"{row['image']}\t{row['caption']}\n" for row in rows))
        assert (
            run_cli(capsys, ["tsv", "--tsv", str(tsv), "--images", str(images), "--out", str(tmp_path / "tsv")])[0] == 0
        )
        assert [sample["meta"]["path"] for sample in read_all(tmp_path / "tsv")] == [meta["path"] for meta in metas]
    if source == "captions":
        assert sorted((meta["file_name"], len(meta["captions"])) for meta in metas) == [("0.jpg", 4), ("sub/1.jpg", 2)]
    elif source == "vqa":
        assert len({meta["image_id"] for meta in metas}) == 2 and len(metas) == 6
    else:
        assert sorted({meta["path"] for meta in metas}) == ["0.jpg", "sub/1.jpg"]


@pytest.mark.parametrize("path", ["../0.jpg", "sub/../../0.jpg", "/etc/passwd", "./.."])
def test_a_path_escaping_the_image_folder_is_refused(tmp_path, capsys, path):
    images = tmp_path / "images"
    picture(images / "0.jpg", (200, 10, 10))
    table = write_csv(tmp_path / "t.csv", [{"image": "0.jpg", "caption": "a"}, {"image": path, "caption": "b"}])
    status, err = run_cli(
        capsys, ["captions", "--table", str(table), "--images", str(images), "--out", str(tmp_path / "o")]
    )
    assert status == 2
    assert_one_error_line(err, "t.csv:3", repr(path), "outside --images")


def _vqa_parquet(path, images) -> str:
    rows = [
        {
            "question_id": 100 + n,
            "image_id": image_id,
            "question": f"what colour {n}?",
            "image": {"bytes": data, "path": None},
        }
        for n, (image_id, data) in enumerate(images)
    ]
    pq.write_table(pa.Table.from_pylist(rows), path)
    return str(path)


def test_a_vqav2_parquet_giving_one_image_id_two_images_is_refused_naming_both_rows(tmp_path, capsys):
    red, green = png((200, 10, 10)), png((10, 200, 10))
    parquet = _vqa_parquet(tmp_path / "test.parquet", [(7, green), (8, green), (7, red)])
    status, err = run_cli(capsys, ["vqav2", "--parquet", parquet, "--split", "test", "--out", str(tmp_path / "o")])
    assert status == 2
    errors = [line for line in err.splitlines() if ": note: " not in line]  # the evaluation-split note
    assert_one_error_line("\n".join(errors), "test.parquet: row 2", "test.parquet: row 0", "COCO_test2015_000000000007")
    assert not (tmp_path / "o").exists()


def test_a_vqav2_parquet_repeating_one_image_for_its_id_converts(tmp_path, capsys):
    green = png((10, 200, 10))
    parquet = _vqa_parquet(tmp_path / "test.parquet", [(7, green), (8, png((1, 2, 3))), (7, green)])
    status, err = run_cli(capsys, ["vqav2", "--parquet", parquet, "--split", "test", "--out", str(tmp_path / "o")])
    assert status == 0, err
    assert len(json.loads((tmp_path / "o" / "image_digests.json").read_text())["images"]) == 2


@pytest.mark.parametrize("emptied", ["eval", "train"])
@pytest.mark.parametrize("strict", [True, False])
def test_check_overlap_refuses_a_digests_file_listing_no_images_of_a_split_with_samples(
    tmp_path, capsys, emptied, strict
):
    images = tmp_path / "images"
    for n in range(3):
        picture(images / f"{n}.jpg", (80 * n, 0, 0))
    folders = {}
    for split, names in {"train": ["0.jpg", "1.jpg"], "eval": ["1.jpg", "2.jpg"]}.items():
        table = write_csv(tmp_path / f"{split}.csv", [{"image": name, "caption": name} for name in names])
        folders[split] = tmp_path / split
        assert (
            run_cli(capsys, ["pairs", "--table", str(table), "--images", str(images), "--out", str(folders[split])])[0]
            == 0
        )
    digests = folders[emptied] / "image_digests.json"
    digests.write_text(json.dumps({**json.loads(digests.read_text()), "images": []}))
    argv = ["data", "check-overlap", str(folders["train"]), str(folders["eval"])] + (["--strict"] if strict else [])
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("mmoe data check-overlap: error: ")
    assert str(digests) in err[0] and "lists no images" in err[0] and "2 samples" in err[0]
