"""Benchmarks from HF ``datasets`` parquet (``mmoe data convert ... --parquet``): tiny parquet files written with the
public schemas convert to the same shards as the equivalent official files, byte for byte (same tar files, same
``answers.json`` / ``caption_tokens.json``, manifests equal but for their provenance); the split guards (Karpathy's
5,000 test images, Flickr30K's split file, the note on splits without training rows); and bad parquet files as one
line naming the file, the row and the field, exit 2, nothing written."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from mmoe.data.converters import convert_karpathy, convert_nlvr2, convert_vqav2
from mmoe.data.converters.parquet_captions import convert_flickr30k_parquet, convert_karpathy_parquet
from mmoe.data.converters.parquet_nlvr2 import convert_nlvr2_parquet
from mmoe.data.converters.parquet_vqav2 import convert_vqav2_parquet
from mmoe.data.shards import MANIFEST
from tests.data.test_conversion_faults import assert_one_error_line, run_cli
from tests.data.test_converters import image_file, karpathy_file, nlvr2_file, read_all, vqa_files, write_json
from tests.data.test_flickr30k import flickr_file

#: ``datasets``' Image feature as stored in parquet.
IMAGE = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
ANSWER = pa.struct([("answer", pa.string()), ("answer_confidence", pa.string()), ("answer_id", pa.int64())])
VQA_SCHEMA = pa.schema(
    [("question_type", pa.string()), ("multiple_choice_answer", pa.string()), ("answers", pa.list_(ANSWER)),
     ("image_id", pa.int64()), ("answer_type", pa.string()), ("question_id", pa.int64()), ("question", pa.string()),
     ("image", IMAGE)]
)  # fmt: skip
SENTENCE = pa.struct(
    [("tokens", pa.list_(pa.string())), ("raw", pa.string()), ("imgid", pa.int64()), ("sentid", pa.int64())]
)
FLICKR30K_SCHEMA = pa.schema(
    [("image", IMAGE), ("caption", pa.list_(pa.string())), ("sentids", pa.list_(pa.string())),
     ("img_id", pa.string()), ("filename", pa.string())]
)  # fmt: skip
NLVR2_SCHEMA = pa.schema(
    [("identifier", pa.string()), ("sentence", pa.string()), ("label", pa.string()), ("left_image", IMAGE),
     ("right_image", IMAGE)]
)  # fmt: skip
PROVENANCE = ("source", "sha256", "split_rule")


def karpathy_schema(per_sentence: bool) -> pa.Schema:
    return pa.schema(
        [("filepath", pa.string()), ("sentids", pa.list_(pa.int64())), ("filename", pa.string()),
         ("imgid", pa.int64()), ("split", pa.string()), ("sentences", SENTENCE if per_sentence else pa.list_(SENTENCE)),
         ("cocoid", pa.int64()), ("image", IMAGE)]
    )  # fmt: skip


def write_parquet(path: Path, rows: list[dict], schema: pa.Schema) -> Path:
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), path)
    return path


def cell(image: Path) -> dict:
    """An Image feature cell holding ``image``'s bytes; its ``path`` names a file that must never be read."""
    return {"bytes": image.read_bytes(), "path": "/etc/shadow"}


def assert_same_split(official: Path, parquet: Path, files: list[Path], other_inputs: tuple[Path, ...] = ()) -> dict:
    """Both folders hold the same files byte for byte and manifests that differ only in provenance, which names the
    parquet ``files`` and the digests of every input; returns the parquet split's manifest."""

    def contents(folder: Path) -> dict[str, bytes]:
        return {path.name: path.read_bytes() for path in sorted(folder.iterdir()) if path.name != MANIFEST}

    assert contents(official) == contents(parquet) and any(name.endswith(".tar") for name in contents(parquet))
    manifests = [json.loads((folder / MANIFEST).read_text()) for folder in (official, parquet)]
    theirs, ours = ({k: v for k, v in m.items() if k not in PROVENANCE} for m in manifests)
    assert theirs == ours and ours["skipped"] == 0
    manifest = manifests[1]
    assert manifest["source"]["parquet"] == [str(path) for path in files]
    digests = {str(path): hashlib.sha256(path.read_bytes()).hexdigest() for path in [*files, *other_inputs]}
    assert manifest["sha256"] == digests
    return manifest


def vqa_rows(root: Path, subtype: str, images: Path) -> list[dict]:
    """The parquet rows (``lmms-lab/VQAv2``'s columns) of :func:`vqa_files`' questions, answers and images; a test
    split's rows carry null answers, as the Hub's do."""
    questions = json.loads((root / f"v2_OpenEnded_mscoco_{subtype}_questions.json").read_text())["questions"]
    annotations = json.loads((root / f"v2_mscoco_{subtype}_annotations.json").read_text())["annotations"]
    by_question = {a["question_id"]: a for a in annotations}
    folder = "test2015" if subtype == "test-dev2015" else subtype
    rows = []
    for question in questions:
        annotation = {} if subtype.startswith("test") else by_question[question["question_id"]]
        image = images / folder / f"COCO_{folder}_{question['image_id']:012d}.jpg"
        rows.append({**question, **{key: annotation.get(key) for key in VQA_SCHEMA.names[:5]}, "image": cell(image)})
        rows[-1]["image_id"] = question["image_id"]
    return rows


@pytest.mark.parametrize(
    ("subtype", "hub_split", "evaluation"),
    [("val2014", "validation", True), ("train2014", "train", False), ("test-dev2015", "testdev", True)],
)
def test_vqav2_parquet_gives_the_official_files_shards(tmp_path, capsys, subtype, hub_split, evaluation):
    questions, annotations = vqa_files(tmp_path, subtype)
    folder = "test2015" if subtype == "test-dev2015" else subtype
    image_file(tmp_path / f"coco/{folder}/COCO_{folder}_000000000009.jpg")
    image_file(tmp_path / f"coco/{folder}/COCO_{folder}_000000000042.jpg", (0, 0, 255), "BMP")  # re-encoded as PNG
    vocab = write_json(tmp_path / "answers.json", ["yes", "no", "2", "3", "red"])
    options = {"answer_vocab": vocab} if subtype == "val2014" else {}
    test_split = subtype.startswith("test")
    official = {"min_answer_count": 1, "annotations": None if test_split else annotations, **options}
    convert_vqav2(questions, tmp_path / "coco", tmp_path / "official", **official)
    rows = vqa_rows(tmp_path, subtype, tmp_path / "coco")
    files = [write_parquet(tmp_path / f"{hub_split}-0000{i}.parquet", part, VQA_SCHEMA) for i, part in
             enumerate((rows[:2], rows[2:]))]  # fmt: skip
    capsys.readouterr()
    convert_vqav2_parquet(files, hub_split, tmp_path / "parquet", min_answer_count=1, **options)
    notes = [line for line in capsys.readouterr().err.splitlines() if "note:" in line]
    assert len(notes) == evaluation and all("for evaluation" in note and "no training split" in note for note in notes)
    manifest = assert_same_split(tmp_path / "official", tmp_path / "parquet", files)
    assert manifest["name"] == f"vqav2-{subtype}" and subtype in manifest["split_rule"]
    samples = {s["meta"]["question_id"]: s for s in read_all(tmp_path / "parquet")}
    assert samples[42000]["png"][:4] == b"\x89PNG" and samples[9000]["meta"]["data_subtype"] == subtype
    assert ("answers" in samples[9000]["meta"]) is not test_split


def karpathy_rows(path: Path, images: Path, per_sentence: bool) -> list[dict]:
    """The parquet rows of a Karpathy split file's records with their images: one per image, or one per sentence."""
    rows = []
    for record in json.loads(path.read_text())["images"]:
        row = {**record, "image": cell(images / record["filepath"] / record["filename"])}
        if not per_sentence:
            rows.append(row)
        rows.extend({**row, "sentences": sentence} for sentence in record["sentences"] if per_sentence)
    return rows


@pytest.mark.parametrize("per_sentence", [False, True], ids=["row-per-image", "row-per-sentence"])
@pytest.mark.parametrize("split", ["train,restval", "test"])
def test_a_karpathy_parquet_copy_gives_the_split_files_shards(tmp_path, per_sentence, split):
    path = karpathy_file(tmp_path)
    for cocoid, folder in ((1, "train2014"), (2, "val2014"), (3, "val2014")):
        image_file(tmp_path / f"coco/{folder}/COCO_{folder}_{cocoid:012d}.jpg", (40 * cocoid, 90, 10))
    convert_karpathy(path, split, tmp_path / "coco", tmp_path / "official")
    rows = karpathy_rows(path, tmp_path / "coco", per_sentence)
    files = [write_parquet(tmp_path / "karpathy.parquet", rows, karpathy_schema(per_sentence))]
    convert_karpathy_parquet(files, split, tmp_path / "parquet", test_images=1)
    manifest = assert_same_split(tmp_path / "official", tmp_path / "parquet", files)
    assert manifest["source"]["split"] == split.split(",")
    assert [len(s["meta"]["captions"]) for s in read_all(tmp_path / "parquet")] == ([2, 1] if "train" in split else [2])


def test_a_karpathy_test_split_of_another_size_is_refused_naming_its_count(tmp_path, capsys):
    path = karpathy_file(tmp_path)
    for cocoid, folder in ((1, "train2014"), (2, "val2014"), (3, "val2014")):
        image_file(tmp_path / f"coco/{folder}/COCO_{folder}_{cocoid:012d}.jpg")
    rows = [{**row, "split": "test"} for row in karpathy_rows(path, tmp_path / "coco", per_sentence=True)]
    copy = write_parquet(tmp_path / "test.parquet", rows, karpathy_schema(per_sentence=True))
    argv = ["coco-captions", "--parquet", str(copy), "--split", "test", "--out", str(tmp_path / "out")]
    status, err = run_cli(capsys, argv)
    assert status == 2 and not (tmp_path / "out").exists()
    assert_one_error_line(err, "test.parquet", "hold 3 images", "Karpathy's COCO test split has 5,000")
    status, err = run_cli(capsys, [*argv, "--test-images", "3"])
    assert status == 0, err
    assert json.loads((tmp_path / "out" / MANIFEST).read_text())["samples"] == 3


def flickr30k_rows(root: Path) -> list[dict]:
    """``lmms-lab/flickr30k``'s rows for :func:`flickr_file`'s images: every image, one split, ids as strings."""
    records = json.loads((root / "dataset_flickr30k.json").read_text())["images"]
    return [
        {"image": cell(root / "flickr30k-images" / r["filename"]), "caption": [s["raw"] for s in r["sentences"]],
         "sentids": [str(i) for i in r["sentids"]], "img_id": str(r["imgid"]), "filename": r["filename"]}
        for r in records
    ]  # fmt: skip


def test_flickr30k_parquet_takes_karpathys_test_split_from_the_split_file(tmp_path, capsys):
    karpathy = flickr_file(tmp_path)
    convert_karpathy(karpathy, "test", tmp_path / "flickr30k-images", tmp_path / "official")
    files = [write_parquet(tmp_path / "test-00000.parquet", flickr30k_rows(tmp_path), FLICKR30K_SCHEMA)]
    convert_flickr30k_parquet(files, karpathy, "test", tmp_path / "parquet")
    manifest = assert_same_split(tmp_path / "official", tmp_path / "parquet", files, (karpathy,))
    assert manifest["source"]["karpathy"] == str(karpathy) and "dataset_flickr30k.json" in manifest["split_rule"]
    assert [s["meta"]["image_id"] for s in read_all(tmp_path / "parquet")] == [1, 2]  # 2 of the parquet's 4 images
    argv = ["flickr30k", "--parquet", str(files[0]), "--split", "test", "--out", str(tmp_path / "out")]
    capsys.readouterr()
    status, err = run_cli(capsys, argv)
    assert status == 2 and not (tmp_path / "out").exists()
    assert_one_error_line(err, "--karpathy dataset_flickr30k.json", "31,783 images", "1,000-image test set")


def test_a_flickr30k_image_missing_from_the_parquet_is_skipped_and_counted(tmp_path, capsys):
    karpathy = flickr_file(tmp_path)
    rows = [row for row in flickr30k_rows(tmp_path) if row["filename"] != "1002.jpg"]
    copy = write_parquet(tmp_path / "test.parquet", rows, FLICKR30K_SCHEMA)
    argv = ["--karpathy", str(karpathy), "--split", "test", "--out", str(tmp_path / "out")]
    status, err = run_cli(capsys, ["flickr30k", "--parquet", str(copy), *argv])
    assert status == 0, err
    assert "1002.jpg: missing (no parquet row has this filename)" in err
    manifest = json.loads((tmp_path / "out" / MANIFEST).read_text())
    assert (manifest["samples"], manifest["skipped"]) == (1, 1)


def nlvr2_rows(data: Path, images: Path) -> list[dict]:
    """The parquet rows of an NLVR2 file's records with the images its identifiers name."""
    rows = nlvr2_rows_without_images(data)
    for row in rows:
        stem = "-".join(row["identifier"].split("-")[:3])
        row.update({f"{side}_image": cell(images / f"{stem}-img{i}.png") for i, side in enumerate(("left", "right"))})
    return rows


def test_nlvr2_parquet_gives_the_official_files_shards_and_says_it_is_for_evaluation(tmp_path, capsys):
    for stem, color in (("dev-3-1", (10, 200, 10)), ("dev-4-0", (10, 10, 200))):
        image_file(tmp_path / f"images/{stem}-img0.png", color, "PNG")
        image_file(tmp_path / f"images/{stem}-img1.png", color[::-1], "JPEG")  # a JPEG named .png, kept as it is
    records = [
        {"identifier": "dev-3-1-0", "sentence": "One dog.", "label": "True"},
        {"identifier": "dev-3-1-1", "sentence": "Two dogs.", "label": "False"},
        {"identifier": "dev-4-0-0", "sentence": "A cat.", "label": "false"},
    ]
    data = nlvr2_file(tmp_path / "dev.json", records)
    convert_nlvr2(data, tmp_path / "images", tmp_path / "official")
    files = [write_parquet(tmp_path / "balanced_dev.parquet", nlvr2_rows(data, tmp_path / "images"), NLVR2_SCHEMA)]
    capsys.readouterr()
    convert_nlvr2_parquet(files, tmp_path / "parquet")
    err = capsys.readouterr().err
    assert "note: NLVR2 split 'dev' from parquet is for evaluation" in err and len(err.splitlines()) == 1
    manifest = assert_same_split(tmp_path / "official", tmp_path / "parquet", files)
    assert (manifest["name"], manifest["labelled"]) == ("nlvr2-dev", True)


def test_image_bytes_are_decoded_and_the_path_never_read(tmp_path, capsys):
    """A row without image bytes is skipped even where its ``path`` names a real image; undecodable bytes too."""
    data = nlvr2_file(tmp_path / "dev.json", [{"identifier": f"dev-{i}-0-0", "sentence": "s", "label": "True"}
                                              for i in range(3)])  # fmt: skip
    real = tmp_path / "real.png"
    image_file(real, image_format="PNG")
    rows = [{**row, "left_image": cell(real), "right_image": cell(real)} for row in nlvr2_rows_without_images(data)]
    rows[1]["right_image"] = {"bytes": None, "path": str(real)}
    rows[2]["left_image"] = {"bytes": b"\x89PNG\r\n\x1a\n not really", "path": str(real)}
    copy = write_parquet(tmp_path / "dev.parquet", rows, NLVR2_SCHEMA)
    status, err = run_cli(capsys, ["nlvr2", "--parquet", str(copy), "--out", str(tmp_path / "out")])
    assert status == 0, err
    assert f"skipped {copy}: row 1 (dev-1-0-0): field 'right_image': missing (no image bytes)" in err
    assert f"skipped {copy}: row 2 (dev-2-0-0): field 'left_image': unreadable" in err
    assert [s["meta"]["identifier"] for s in read_all(tmp_path / "out")] == ["dev-0-0-0"]
    assert json.loads((tmp_path / "out" / MANIFEST).read_text())["skipped"] == 2


def nlvr2_rows_without_images(data: Path) -> list[dict]:
    return [{key: json.loads(line)[key] for key in ("identifier", "sentence", "label")} for line in
            data.read_text().splitlines()]  # fmt: skip


def vqa_parquet(tmp_path: Path, schema: pa.Schema = VQA_SCHEMA, edit=None) -> Path:
    """A validation split's parquet file of :func:`vqa_files`, its rows changed by ``edit``."""
    vqa_files(tmp_path, "val2014")
    for image_id in (9, 42):
        image_file(tmp_path / f"coco/val2014/COCO_val2014_{image_id:012d}.jpg")
    rows = vqa_rows(tmp_path, "val2014", tmp_path / "coco")
    if edit is not None:
        edit(rows)
    return write_parquet(tmp_path / "validation.parquet", rows, schema)


def stringify_image_ids(rows: list[dict]) -> None:
    for row in rows:
        row["image_id"] = str(row["image_id"])


def retyped(name: str, kind: pa.DataType) -> pa.Schema:
    return VQA_SCHEMA.set(VQA_SCHEMA.get_field_index(name), pa.field(name, kind))


@pytest.mark.parametrize(
    ("make", "parts"),
    [
        (lambda d: (d / "validation.parquet").write_text("question_id,question\n1,hi\n") and d / "validation.parquet",
         ["validation.parquet: not a readable parquet file"]),
        (lambda d: d / "absent.parquet", ["absent.parquet: not a readable parquet file"]),
        (lambda d: vqa_parquet(d, VQA_SCHEMA.remove(VQA_SCHEMA.get_field_index("question"))),
         ["validation.parquet: missing column 'question' (a string)"]),
        (lambda d: vqa_parquet(d, retyped("image", pa.binary()), lambda rows: [r.update(image=b"x") for r in rows]),
         ["validation.parquet: every row: field 'image' is binary, expected an image struct"]),
        (lambda d: vqa_parquet(d, retyped("image_id", pa.string()), stringify_image_ids),
         ["validation.parquet: every row: field 'image_id' is string, expected an integer"]),
        (lambda d: vqa_parquet(d, edit=lambda rows: rows[1].update(question=None)),
         ["validation.parquet: row 1 (question_id 9001): field 'question' is null"]),
        (lambda d: vqa_parquet(d, edit=lambda rows: rows[2]["answers"][1].update(answer=None)),
         ["validation.parquet: row 2 (question_id 42000): field 'answers[1].answer' is null"]),
        (lambda d: vqa_parquet(d, edit=lambda rows: rows[2].update(question_id=9000)),
         ["validation.parquet: row 2: question_id 9000 appears twice (first at", "validation.parquet: row 0)"]),
    ],
    ids=["not-parquet", "absent", "missing-column", "image-not-a-struct", "wrong-type", "null", "null-answer", "twice"],
)  # fmt: skip
def test_bad_parquet_is_one_line_naming_file_row_and_field_and_writes_nothing(tmp_path, capsys, make, parts):
    copy = make(tmp_path)
    vocab = write_json(tmp_path / "answers.json", ["red"])
    argv = ["vqav2", "--parquet", str(copy), "--split", "validation", "--answer-vocab", str(vocab)]
    status, err = run_cli(capsys, [*argv, "--out", str(tmp_path / "out")])
    assert status == 2 and not (tmp_path / "out").exists()
    assert_one_error_line(err, *parts)


@pytest.mark.parametrize(
    ("argv", "part"),
    [
        (["vqav2", "--split", "validation", "--images", "coco"], "--images does not apply to --parquet"),
        (["vqav2", "--split", "val"], "--split 'val': expected the parquet files' VQAv2 split"),
        (["vqav2"], "vqav2 --parquet needs --split"),
    ],
)
def test_parquet_options_are_checked_in_one_line(tmp_path, capsys, argv, part):
    copy = vqa_parquet(tmp_path)
    status, err = run_cli(capsys, [argv[0], "--parquet", str(copy), *argv[1:], "--out", str(tmp_path / "out")])
    assert status == 2 and not (tmp_path / "out").exists()
    assert_one_error_line(err, part)


def test_the_command_reads_parquet_in_a_process_of_its_own(tmp_path):
    """``mmoe data convert`` as a user runs it: a bad file is one line on stderr and exit status 2."""
    copy = vqa_parquet(tmp_path, edit=lambda rows: rows[1].update(question=None))
    argv = ["vqav2", "--parquet", str(copy), "--split", "testdev", "--out", str(tmp_path / "out")]
    result = subprocess.run(
        [sys.executable, "-m", "mmoe", "data", "convert", *argv], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 2 and not (tmp_path / "out").exists()
    assert result.stderr.strip().splitlines() == [
        f"mmoe data convert: error: {copy}: row 1 (question_id 9001): field 'question' is null"
    ]


def test_the_official_files_still_need_their_images_and_split_file(tmp_path, capsys):
    questions, _ = vqa_files(tmp_path, "val2014")
    status, err = run_cli(capsys, ["vqav2", "--questions", str(questions), "--out", str(tmp_path / "out")])
    assert status == 2
    assert_one_error_line(err, "vqav2 needs --images DIR (or --parquet files holding the images)")
    argv = ["flickr30k", "--split", "test", "--images", str(tmp_path), "--out", str(tmp_path / "out")]
    status, err = run_cli(capsys, argv)
    assert status == 2
    assert_one_error_line(err, "flickr30k needs --karpathy dataset_flickr30k.json")


def edited_karpathy_copy(root: Path, edit) -> Path:
    path = karpathy_file(root)
    for cocoid, folder in ((1, "train2014"), (2, "val2014"), (3, "val2014")):
        image_file(root / f"coco/{folder}/COCO_{folder}_{cocoid:012d}.jpg")
    rows = karpathy_rows(path, root / "coco", per_sentence=False)
    edit(rows)
    return write_parquet(root / "karpathy.parquet", rows, karpathy_schema(per_sentence=False))


def edited_nlvr2_copy(root: Path, edit) -> Path:
    data = nlvr2_file(root / "dev.json", [{"identifier": f"dev-{i}-0-0", "sentence": "s", "label": "True"}
                                          for i in range(2)])  # fmt: skip
    image = root / "pair.png"
    image_file(image, image_format="PNG")
    rows = [{**row, "left_image": cell(image), "right_image": cell(image)} for row in nlvr2_rows_without_images(data)]
    edit(rows)
    return write_parquet(root / "dev.parquet", rows, NLVR2_SCHEMA)


@pytest.mark.parametrize(
    ("source", "make", "parts"),
    [
        ("coco-captions", lambda d: edited_karpathy_copy(d, lambda rows: rows[1].update(cocoid=1, split="train")),
         ["karpathy.parquet: row 1: cocoid 1", "is also", "karpathy.parquet: row 0", "a row per image holds all"]),
        ("coco-captions", lambda d: edited_karpathy_copy(d, lambda rows: rows[2]["sentences"][1].update(raw=None)),
         ["karpathy.parquet: row 2 (cocoid 3): sentences[1]: field 'raw' is null"]),
        ("nlvr2", lambda d: edited_nlvr2_copy(d, lambda rows: rows[1].update(label=None)),
         ["dev.parquet: row 1: field 'label' of 'dev-1-0-0' is null, but", "dev.parquet: row 0 ('dev-0-0-0') has one"]),
        ("nlvr2", lambda d: edited_nlvr2_copy(d, lambda rows: rows[0].update(label="maybe")),
         ["dev.parquet: row 0: field 'label' of 'dev-0-0-0' must be \"True\" or \"False\", got 'maybe'"]),
        ("nlvr2", lambda d: edited_nlvr2_copy(d, lambda rows: rows[1].update(identifier="dev-0-0-0")),
         ["dev.parquet: row 1: field 'identifier' = 'dev-0-0-0' appears twice (first at", "row 0)"]),
    ],
    ids=["cocoid-twice", "null-caption", "label-missing", "label-bad", "identifier-twice"],
)  # fmt: skip
def test_bad_caption_and_pair_rows_are_one_line(tmp_path, capsys, source, make, parts):
    copy = make(tmp_path)
    split = ["--split", "train,restval,test", "--test-images", "1"] if source == "coco-captions" else []
    status, err = run_cli(capsys, [source, "--parquet", str(copy), *split, "--out", str(tmp_path / "out")])
    assert status == 2 and not (tmp_path / "out").exists()
    assert_one_error_line(err, *parts)
