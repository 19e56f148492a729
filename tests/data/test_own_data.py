"""A user's own image folder and table (CSV, JSON lines, LLaVA-style JSON) -> the shards of each task: the same
shards the official-format converters write for the same content, read back through the task DataModules; bad
tables as one line naming the file, the row and the field, exit 2, nothing written."""

from __future__ import annotations

import csv
import hashlib
import io
import json
import os
from pathlib import Path

import pytest
import torch
from PIL import Image

from mmoe.data.answers import soft_targets
from mmoe.data.converters import convert_coco_captions, convert_tsv, convert_vqav2
from mmoe.data.converters.common import MAX_TEXT_CHARS
from mmoe.data.converters.own_data import convert_own_captions, convert_own_pairs, convert_own_vqa
from mmoe.data.datamodules import CaptioningDataModule, PretrainDataModule, RetrievalDataModule, VQADataModule
from mmoe.data.shards import MANIFEST
from tests.data.test_conversion_faults import assert_one_error_line, run_cli
from tests.data.test_converters import read_all, vqa_files, write_json

COLORS = {"red.jpg": (200, 10, 10), "sub/blue.png": (10, 10, 200), "green.jpg": (10, 200, 10)}
ANSWER_FIELDS = ("multiple_choice_answer", "answer_type", "question_type")
PROVENANCE = ("source", "sha256", "split_rule", "skipped_rows")
#: Files an own-data split holds with other contents than the official conversion's: its manifest (provenance) and
#: its image ids (qualified by the image folder).
SET_APART = (MANIFEST, "image_digests.json")


def picture(path: Path, color, image_format: str | None = None) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    buffer = io.BytesIO()
    Image.new("RGB", (40, 36), color).save(buffer, format=image_format or ("PNG" if path.suffix == ".png" else "JPEG"))
    path.write_bytes(buffer.getvalue())
    return path


def image_folder(root: Path) -> Path:
    for name, color in COLORS.items():
        picture(root / name, color)
    return root


def write_csv(path: Path, rows: list[dict]) -> Path:
    with open(path, "w", newline="", encoding="utf-8") as file:
        writer = csv.DictWriter(file, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    return path


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def llava(image: str | None, *turns: str, hub: bool = False) -> dict:
    """An LLaVA row (``conversations`` of ``{from, value}``) or the Hub's (``conversation`` of ``{role, content}``)."""
    speakers = ["human", "gpt"] * len(turns)
    if hub:
        conversation = [{"role": "user" if s == "human" else "assistant", "content": [{"type": "text", "text": t}]}
                        for s, t in zip(speakers, turns, strict=False)]  # fmt: skip
        row = {"id": str(len(turns)), "conversation": conversation}
    else:
        row = {
            "id": str(len(turns)),
            "conversations": [{"from": s, "value": t} for s, t in zip(speakers, turns, strict=False)],
        }
    return row if image is None else {**row, "image": image}


PAIRS = [("red.jpg", "a red square"), ("sub/blue.png", "a blue square"), ("red.jpg", "red again")]


def pair_content(folder: Path) -> list[tuple]:
    return [(s["txt"], s["meta"]["path"], s.get("jpg", s.get("png"))) for s in read_all(folder)]


@pytest.mark.parametrize("table_format", ["csv", "jsonl", "llava", "hub"])
def test_pairs_from_every_table_format_equal_the_tsv_conversion(tmp_path, capsys, table_format):
    images = image_folder(tmp_path / "images")
    (tmp_path / "pairs.tsv").write_text("".join(f"{path}\t{caption}\n" for path, caption in PAIRS))
    convert_tsv(tmp_path / "pairs.tsv", images, tmp_path / "tsv")
    rows = [{"image": path, "caption": caption} for path, caption in PAIRS]
    if table_format == "csv":
        table = write_csv(tmp_path / "pairs.csv", rows)
    elif table_format == "jsonl":
        table = write_jsonl(tmp_path / "pairs.jsonl", rows)
    else:
        hub = table_format == "hub"
        records = [llava(path, "<image>\nDescribe the picture briefly.", caption, hub=hub) for path, caption in PAIRS]
        records.insert(1, llava("green.jpg", "<image>\nWhat is it?", "green", "And its shape?", "square", hub=hub))
        records.append(llava(None, "Tell me a joke.", "no", hub=hub))  # a text-only row
        table = write_json(tmp_path / "pairs.json", records)
    capsys.readouterr()
    manifest = convert_own_pairs(table, images, tmp_path / "own")
    assert pair_content(tmp_path / "own") == pair_content(tmp_path / "tsv") and manifest.samples == 3
    llava_rows = table_format in ("llava", "hub")
    assert manifest.extra["skipped_rows"] == ({"multi-turn": 1, "no image": 1} if llava_rows else {})
    assert ("skipped rows without a caption pair: 1 multi-turn" in capsys.readouterr().err) == llava_rows
    assert manifest.extra["sha256"] == {str(table): hashlib.sha256(table.read_bytes()).hexdigest()}
    module = PretrainDataModule(pair_shards=str(tmp_path / "own"), pair_weight=1.0, image_weight=0.0,
                                text_weight=0.0, batch_size=3, image_size=32, patch_size=16, batches_per_epoch=1,
                                num_workers=0, crop_scale=None, hflip=False)  # fmt: skip
    batch = next(iter(module.train_dataloader()))
    assert batch["kind"] == "pair" and batch["image"].shape == (3, 3, 32, 32)


def test_captions_equal_the_official_coco_conversion_and_read_as_captioning_and_retrieval(tmp_path):
    images = image_folder(tmp_path / "images")
    captions = {7: ["a red square", "a red box"], 3: ["a green square"]}
    files = {7: "red.jpg", 3: "green.jpg"}
    coco = {"images": [{"id": i, "file_name": files[i]} for i in captions],
            "annotations": [{"id": 10 * i + n, "image_id": i, "caption": c} for i in captions
                            for n, c in enumerate(captions[i])]}  # fmt: skip
    coco["annotations"].append({"id": 99, "image_id": 7, "caption": " a red box "})  # a repeated caption, dropped
    convert_coco_captions(write_json(tmp_path / "captions_own.json", coco), images, tmp_path / "official", name="c")
    rows = [{"image": files[i], "caption": c, "image_id": str(i)} for i in captions for c in captions[i]]
    rows.append({"image": "red.jpg", "caption": " a red box ", "image_id": "7"})  # a repeated caption, dropped
    manifest = convert_own_captions(write_csv(tmp_path / "own.csv", rows), images, tmp_path / "own", name="c")
    assert manifest.extra["duplicate_captions"] == 1
    assert_same_folders(tmp_path / "official", tmp_path / "own", images)
    for module_class in (CaptioningDataModule, RetrievalDataModule):
        module = module_class(train_shards=str(tmp_path / "own"), val_shards=str(tmp_path / "own"), image_size=32,
                              batch_size=2, num_workers=0, crop_scale=None)  # fmt: skip
        val = list(module.val_dataloader())
        assert [c for batch in val for c in batch["captions"]] == list(captions.values())
        assert torch.cat([batch["image_id"] for batch in val]).tolist() == [7, 3]
    # without image ids, images are numbered in the order of their first row
    plain = [{"image": "sub/blue.png", "caption": "blue"}, {"image": "red.jpg", "caption": "red"},
             {"image": "sub/blue.png", "caption": "a blue one"}]  # fmt: skip
    convert_own_captions(write_jsonl(tmp_path / "plain.jsonl", plain), images, tmp_path / "plain")
    assert [(s["meta"]["image_id"], s["meta"]["captions"]) for s in read_all(tmp_path / "plain")] == [
        (0, ["blue", "a blue one"]),
        (1, ["red"]),
    ]


def assert_same_folders(official: Path, own: Path, images: Path) -> None:
    """The same files byte for byte (shards, caption_tokens.json / answers.json) and manifests equal but for
    provenance; ``image_digests.json`` holds the same digests, the own images named by ``images`` and their path."""

    def contents(folder: Path) -> dict[str, bytes]:
        return {path.name: path.read_bytes() for path in sorted(folder.iterdir()) if path.name not in SET_APART}

    assert contents(official) == contents(own)
    theirs, ours = ({k: v for k, v in json.loads((f / MANIFEST).read_text()).items() if k not in PROVENANCE}
                    for f in (official, own))  # fmt: skip
    assert theirs == ours
    theirs, ours = (json.loads((f / "image_digests.json").read_text())["images"] for f in (official, own))
    assert ours == [[f"{images.resolve().as_posix()}/{name}", digest] for name, digest in theirs] and ours


def vqa_rows(root: Path, subtype: str) -> list[dict]:
    """The rows of :func:`vqa_files`' questions and annotations, images named by their path in the COCO folder."""
    questions = json.loads((root / f"v2_OpenEnded_mscoco_{subtype}_questions.json").read_text())["questions"]
    annotations = {
        a["question_id"]: a
        for a in json.loads((root / f"v2_mscoco_{subtype}_annotations.json").read_text())["annotations"]
    }  # noqa: E501
    rows = []
    for question in questions:
        annotation = annotations[question["question_id"]]
        rows.append({**question, "image": f"COCO_{subtype}_{question['image_id']:012d}.jpg",
                     "answers": [a["answer"] for a in annotation["answers"]],
                     **{k: annotation[k] for k in ANSWER_FIELDS}})  # fmt: skip
    return rows


def test_vqa_rows_equal_the_official_vqav2_conversion_and_train_with_soft_scores(tmp_path):
    coco = tmp_path / "coco"
    for subtype in ("train2014", "val2014"):
        for image_id, color in ((9, (200, 10, 10)), (42, (10, 10, 200))):
            picture(coco / f"COCO_{subtype}_{image_id:012d}.jpg", color)
    q, a = vqa_files(tmp_path, "train2014")
    convert_vqav2(q, coco, tmp_path / "official", annotations=a, min_answer_count=1, name="v")
    table = write_jsonl(tmp_path / "train.jsonl", vqa_rows(tmp_path, "train2014"))
    manifest = convert_own_vqa(table, coco, tmp_path / "own", min_answer_count=1, name="v", split="train2014")
    assert_same_folders(tmp_path / "official", tmp_path / "own", coco)
    assert manifest.files == ["answers.json", "image_digests.json"]
    vocab = tmp_path / "own/answers.json"
    q, a = vqa_files(tmp_path, "val2014")
    convert_vqav2(q, coco, tmp_path / "official-val", annotations=a, answer_vocab=vocab, name="w")
    val_rows = vqa_rows(tmp_path, "val2014")
    table = write_jsonl(tmp_path / "val.jsonl", val_rows)
    convert_own_vqa(table, coco, tmp_path / "own-val", answer_vocab=vocab, name="w", split="val2014")
    assert_same_folders(tmp_path / "official-val", tmp_path / "own-val", coco)
    # a CSV of any number of answers per question, '|'-separated, ids assigned by row and image
    csv_rows = [{"image": r["image"], "question": r["question"], "answers": "|".join(r["answers"][:n])}
                for r, n in zip(val_rows, (10, 3, 1), strict=True)]  # fmt: skip
    convert_own_vqa(write_csv(tmp_path / "val.csv", csv_rows), coco, tmp_path / "csv", answer_vocab=vocab)
    module = VQADataModule(answer_vocab=str(vocab), train_shards=str(tmp_path / "csv"),
                           val_shards=str(tmp_path / "csv"), image_size=32, batch_size=3, num_workers=0)  # fmt: skip
    batch = next(iter(module.val_dataloader()))
    answers = json.loads(vocab.read_text())
    assert batch["question_id"].tolist() == [0, 1, 2] and batch["image_id"].tolist() == [0, 0, 1]
    for row, (csv_row, humans) in enumerate(zip(csv_rows, batch["answers"], strict=True)):
        assert humans == csv_row["answers"].split("|")
        labels, scores = soft_targets(humans, {answer: label for label, answer in enumerate(answers)})
        expected = torch.zeros(len(answers))
        expected[labels] = torch.tensor(scores)
        assert torch.equal(batch["targets"][row], expected)


def bad_table(tmp_path: Path, name: str, rows) -> Path:
    path = tmp_path / name
    if name.endswith(".csv"):
        return write_csv(path, rows)
    return write_jsonl(path, rows) if name.endswith(".jsonl") else write_json(path, rows)


@pytest.mark.parametrize(
    ("source", "name", "rows", "parts"),
    [
        ("pairs", "t.csv", [{"image": "red.jpg", "caption": "x"}, {"image": "../out.jpg", "caption": "y"}],
         ["t.csv:3: field 'image'", "'../out.jpg' is outside --images"]),
        ("pairs", "t.jsonl", [{"image": "/etc/hosts", "caption": "y"}], ["t.jsonl:1: field 'image'", "'/etc/hosts'"]),
        ("pairs", "t.jsonl", [{"image": "link/red.jpg", "caption": "y"}],
         ["t.jsonl:1: field 'image'", "links out of --images"]),
        ("captions", "t.jsonl", [{"image": "red.jpg", "text": "y"}], ["t.jsonl:1", "missing field 'caption'"]),
        ("captions", "t.csv", [{"image": "red.jpg", "caption": "a", "image_id": "seven"}],
         ["t.csv:2", "field 'image_id' must be an integer"]),
        ("captions", "t.jsonl", [{"image": "red.jpg", "caption": "a", "image_id": 1},
                                 {"image": "green.jpg", "caption": "b", "image_id": 1}],
         ["t.jsonl:2", "field 'image_id' = 1 is also 'red.jpg'"]),
        ("pairs", "t.json", [llava("red.jpg", "a", "b") | {"conversations": [{"from": "gpt", "value": "x"},
                                                                              {"from": "human", "value": "y"}]}],
         ["t.json: record 0", "expected a human prompt then an answer"]),
        ("vqa", "t.jsonl", [{"image": "red.jpg", "question": "q?", "answers": ["a"], "question_id": 4},
                            {"image": "red.jpg", "question": "r?", "answers": ["b"], "question_id": 4}],
         ["t.jsonl:2", "field 'question_id' = 4 appears twice"]),
        ("vqa", "t.jsonl", [{"image": "red.jpg", "question": "q?", "answers": ["a"]},
                            {"image": "red.jpg", "question": "r?"}],
         ["t.jsonl:2", "field 'answers' is missing here", "in every row or in none"]),
        ("vqa", "t.jsonl", [{"image": "red.jpg", "question": "q?", "answers": "a||b"}],
         ["t.jsonl:1", "field 'answers' holds an empty answer"]),
        ("pairs", "t.txt", [], ["t.txt: unknown table format '.txt'"]),
    ],
)  # fmt: skip
def test_bad_tables_are_one_line_naming_file_row_and_field(tmp_path, capsys, source, name, rows, parts):
    images = image_folder(tmp_path / "images")
    (tmp_path / "elsewhere").mkdir()
    picture(tmp_path / "elsewhere/red.jpg", (1, 2, 3))
    os.symlink(tmp_path / "elsewhere", images / "link")
    table = bad_table(tmp_path, name, rows) if rows else tmp_path / name
    table.touch()
    argv = [source, "--table", str(table), "--images", str(images), "--out", str(tmp_path / "out")]
    status, err = run_cli(capsys, argv)
    assert status == 2 and not (tmp_path / "out").exists()
    assert_one_error_line(err, *parts)


#: Captions holding what str.splitlines() would end a line at, though a JSON string or a table cell holds it as it is.
UNICODE_BREAKS = [
    ("red.jpg", "a red\u2028square"),
    ("sub/blue.png", "a blue\u0085square"),
    ("green.jpg", "a\u2029green"),
]


def _windows_table(tmp_path: Path, table_format: str) -> tuple[str, Path]:
    """A table as Excel or Notepad writes it: a UTF-8 byte order mark and CRLF line ends."""
    rows = [{"image": path, "caption": caption} for path, caption in UNICODE_BREAKS]
    if table_format == "csv":
        lines = ["image,caption"] + [f"{row['image']},{row['caption']}" for row in rows]
    elif table_format == "jsonl":
        lines = [json.dumps(row, ensure_ascii=False) for row in rows]
    elif table_format == "json":
        lines = [json.dumps(rows, ensure_ascii=False, indent=1)]
    else:
        lines = [f"{row['image']}\t{row['caption']}" for row in rows]
    path = tmp_path / f"pairs.{table_format}"
    path.write_bytes(b"\xef\xbb\xbf" + "\r\n".join(lines + [""]).encode())
    return ("tsv" if table_format == "tsv" else "pairs"), path


@pytest.mark.parametrize("table_format", ["csv", "jsonl", "json", "tsv"])
def test_a_table_with_a_byte_order_mark_crlf_and_unicode_line_breaks_in_captions_converts_as_written(
    tmp_path, capsys, table_format
):
    images = image_folder(tmp_path / "images")
    source, table = _windows_table(tmp_path, table_format)
    option = "--tsv" if source == "tsv" else "--table"
    status, err = run_cli(capsys, [source, option, str(table), "--images", str(images), "--out", str(tmp_path / "o")])
    assert status == 0, err
    assert [(sample["txt"].decode(), sample["meta"]["path"]) for sample in read_all(tmp_path / "o")] == [
        (caption, path) for path, caption in UNICODE_BREAKS
    ]


def test_a_text_file_with_unicode_line_breaks_in_a_line_gives_one_sample_per_line(tmp_path, capsys):
    text = tmp_path / "texts.txt"
    text.write_bytes(b"\xef\xbb\xbf" + "one\u2028line\r\nsecond\x0cline\r\n".encode())
    status, err = run_cli(capsys, ["text", "--text", str(text), "--out", str(tmp_path / "o")])
    assert status == 0, err
    assert [sample["txt"].decode() for sample in read_all(tmp_path / "o")] == ["one\u2028line", "second\x0cline"]


def _long_text_table(tmp_path: Path, source: str, text: str) -> tuple[list[str], str]:
    """(the command's arguments after ``convert``, the field its error names) for a table holding ``text``."""
    if source == "tsv":
        (tmp_path / "t.tsv").write_text(f"red.jpg\ta\nsub/blue.png\t{text}\n")
        return ["tsv", "--tsv", str(tmp_path / "t.tsv")], "t.tsv:2: the caption is"
    if source == "pairs-llava":
        write_json(tmp_path / "t.json", [llava("red.jpg", "<image>\nDescribe it.", text)])
        return ["pairs", "--table", str(tmp_path / "t.json")], "t.json: record 0: conversations[1] is"
    field = "question" if source == "vqa" else "caption"
    row = {"image": "red.jpg", field: text, **({"answers": ["red"]} if source == "vqa" else {})}
    table = write_csv(tmp_path / "t.csv", [row]) if source == "pairs" else write_jsonl(tmp_path / "t.jsonl", [row])
    return [source, "--table", str(table)], f"{table.name}:{2 if source == 'pairs' else 1}: field '{field}' is"


@pytest.mark.parametrize("source", ["captions", "pairs", "pairs-llava", "vqa", "tsv"])
def test_a_caption_or_question_longer_than_the_cap_is_one_line_naming_row_length_and_limit(tmp_path, capsys, source):
    images = image_folder(tmp_path / "images")
    out = ["--images", str(images), "--out", str(tmp_path / "o")]
    arguments, named = _long_text_table(tmp_path, source, "a " * (MAX_TEXT_CHARS // 2) + "b")
    status, err = run_cli(capsys, [*arguments, *out])
    assert status == 2 and not (tmp_path / "o").exists()
    assert_one_error_line(err, named, f"{MAX_TEXT_CHARS + 1:,} characters long", f"more than the {MAX_TEXT_CHARS:,}")
    arguments, _ = _long_text_table(tmp_path, source, "a " * (MAX_TEXT_CHARS // 2 - 1) + "bc")  # at the cap: kept
    status, err = run_cli(capsys, [*arguments, *out])
    assert status == 0, err
