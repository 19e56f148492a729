"""Converters on small hand-written files in each official format, malformed inputs, and the CLI."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
from PIL import Image

from mmoe.cli import main
from mmoe.data.converters import (
    ConversionError,
    convert_coco_captions,
    convert_images,
    convert_karpathy,
    convert_nlvr2,
    convert_text,
    convert_tsv,
    convert_vqav2,
    image_names,
)
from mmoe.data.converters.build_captions import CAPTION_TOKENS_FILE
from mmoe.data.shards import resolve_shards
from mmoe.data.streams import ShardStream
from mmoe.data.tokenizer import SOT_ID, TextTokenizer


def image_file(path: Path, color=(200, 10, 10), image_format: str = "JPEG") -> bytes:
    path.parent.mkdir(parents=True, exist_ok=True)
    buffer = io.BytesIO()
    Image.new("RGB", (16, 12), color).save(buffer, format=image_format)
    path.write_bytes(buffer.getvalue())
    return buffer.getvalue()


def read_all(folder: Path) -> list[dict]:
    samples = list(ShardStream(resolve_shards(folder), decode=lambda s: s))
    for sample in samples:
        sample["meta"] = json.loads(sample["json"])
    return samples


def write_json(path: Path, value) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(value))
    return path


def vqa_files(root: Path, subtype: str = "train2014", answers=None):
    questions = {
        "info": {},
        "task_type": "Open-Ended",
        "data_type": "mscoco",
        "data_subtype": subtype,
        "license": {},
        "questions": [
            {"image_id": 9, "question": "What color is the bus?", "question_id": 9000},
            {"image_id": 9, "question": "Is it raining?", "question_id": 9001},
            {"image_id": 42, "question": "How many dogs?", "question_id": 42000},
        ],
    }
    answers = answers or {
        9000: ["red"] * 8 + ["Red.", "orange"],
        9001: ["no"] * 9 + ["yes"],
        42000: ["2"] * 3 + ["3"] * 7,
    }
    types = {9000: ("what color is the", "other"), 9001: ("is it", "yes/no"), 42000: ("how many", "number")}
    annotations = {
        "annotations": [
            {
                "question_id": qid,
                "image_id": qid // 1000,
                "question_type": types[qid][0],
                "answer_type": types[qid][1],
                "multiple_choice_answer": max(set(given), key=given.count),
                "answers": [{"answer": a, "answer_confidence": "yes", "answer_id": i + 1} for i, a in enumerate(given)],
            }
            for qid, given in answers.items()
        ]
    }
    q = write_json(root / f"v2_OpenEnded_mscoco_{subtype}_questions.json", questions)
    a = write_json(root / f"v2_mscoco_{subtype}_annotations.json", annotations)
    return q, a


def test_vqav2_training_split_builds_vocab_and_soft_targets(tmp_path):
    q, a = vqa_files(tmp_path)
    image_file(tmp_path / "coco/train2014/COCO_train2014_000000000009.jpg")
    bytes42 = image_file(tmp_path / "coco/COCO_train2014_000000000042.jpg", (0, 0, 255))  # directly in DIR
    manifest = convert_vqav2(q, tmp_path / "coco", tmp_path / "out", annotations=a, min_answer_count=1)
    assert (manifest.name, manifest.samples, manifest.skipped, manifest.shards) == ("vqav2-train2014", 3, 0, 1)
    on_disk = json.loads((tmp_path / "out/manifest.json").read_text())
    assert on_disk["samples"] == 3 and on_disk["shards"] == 1 and on_disk["skipped"] == 0
    assert (tmp_path / "out/vqav2-train2014-000000.tar").exists()
    vocab = json.loads((tmp_path / "out/answers.json").read_text())
    assert sorted(vocab) == ["3", "no", "red"]
    samples = {s["meta"]["question_id"]: s for s in read_all(tmp_path / "out")}
    bus = samples[9000]["meta"]
    assert bus["image_id"] == 9 and bus["question"] == "What color is the bus?" and len(bus["answers"]) == 10
    # "Red." -> "red" (9 of 10), "orange" is not in the vocabulary
    assert [vocab[i] for i in bus["labels"]] == ["red"] and bus["scores"] == [1.0]
    dogs = samples[42000]["meta"]
    assert dict(zip([vocab[i] for i in dogs["labels"]], dogs["scores"], strict=True)) == {"3": 1.0}
    assert samples[42000]["jpg"] == bytes42 and samples[9000]["txt"].decode() == "What color is the bus?"


def test_vqav2_val_needs_the_training_vocabulary(tmp_path):
    q, a = vqa_files(tmp_path, "val2014")
    image_file(tmp_path / "coco/val2014/COCO_val2014_000000000009.jpg")
    image_file(tmp_path / "coco/val2014/COCO_val2014_000000000042.jpg")
    with pytest.raises(ConversionError, match="--answer-vocab"):
        convert_vqav2(q, tmp_path / "coco", tmp_path / "out", annotations=a)
    vocab = write_json(tmp_path / "answers.json", ["yes", "no", "2", "3", "red"])
    manifest = convert_vqav2(q, tmp_path / "coco", tmp_path / "out", annotations=a, answer_vocab=vocab)
    assert manifest.name == "vqav2-val2014" and not (tmp_path / "out/answers.json").exists()
    dogs = next(s["meta"] for s in read_all(tmp_path / "out") if s["meta"]["question_id"] == 42000)
    assert dogs["labels"] == [2, 3] and dogs["scores"] == pytest.approx([0.9, 1.0])  # 3 x "2", 7 x "3"


def test_vqav2_test_dev_uses_test2015_images_and_missing_images_are_skipped(tmp_path, capsys):
    q, _ = vqa_files(tmp_path, "test-dev2015")
    image_file(tmp_path / "coco/test2015/COCO_test2015_000000000009.jpg")
    manifest = convert_vqav2(q, tmp_path / "coco", tmp_path / "out")
    assert (manifest.name, manifest.samples, manifest.skipped) == ("vqav2-test-dev2015", 2, 1)
    assert "COCO_test2015_000000000042.jpg: missing" in capsys.readouterr().err
    assert "COCO_test2015_000000000042.jpg" in manifest.skipped_examples[0]
    assert all("answers" not in s["meta"] for s in read_all(tmp_path / "out"))


def test_unreadable_image_is_skipped_and_the_rest_converts(tmp_path, capsys):
    q, a = vqa_files(tmp_path)
    image_file(tmp_path / "coco/COCO_train2014_000000000009.jpg")
    (tmp_path / "coco/COCO_train2014_000000000042.jpg").write_bytes(b"\xff\xd8\xff\xe0 truncated")
    manifest = convert_vqav2(q, tmp_path / "coco", tmp_path / "out", annotations=a, min_answer_count=1)
    assert manifest.samples == 2 and manifest.skipped == 1
    assert "unreadable" in capsys.readouterr().err


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda q, a: q["questions"][1].update(image_id="nine"), r"questions\[1\]: field 'image_id' must be int"),
        (lambda q, a: q["questions"][0].pop("question"), r"questions\[0\]: missing field 'question'"),
        (lambda q, a: q.pop("questions"), "missing field 'questions'"),
        (
            lambda q, a: a["annotations"][2].update(answers="2"),
            r"annotations\[2\] \(question_id 42000\): field 'answers'",
        ),
        (lambda q, a: a["annotations"].pop(0), "no annotation for question_id 9000"),
        (lambda q, a: a["annotations"][1].update(image_id=10), "question_id 9001 has image_id 10"),
        (lambda q, a: a["annotations"][0]["answers"][3].update(answer=None), r"answers\[3\]: field 'answer'"),
    ],
)
def test_vqav2_bad_files_name_file_record_field_and_value(tmp_path, mutate, message):
    q, a = vqa_files(tmp_path)
    questions, annotations = json.loads(q.read_text()), json.loads(a.read_text())
    mutate(questions, annotations)
    write_json(q, questions), write_json(a, annotations)
    with pytest.raises(ConversionError, match=message) as error:
        convert_vqav2(q, tmp_path, tmp_path / "out", annotations=a)
    assert str(q.name) in str(error.value) or str(a.name) in str(error.value)
    assert not (tmp_path / "out").exists()  # nothing written


def test_invalid_json_reports_the_position(tmp_path):
    bad = tmp_path / "v2_OpenEnded_mscoco_val2014_questions.json"
    bad.write_text('{"questions": [\n  {"image_id": 1,,}\n]}')
    with pytest.raises(ConversionError, match=r"questions.json: malformed JSON at line 2, column"):
        convert_vqav2(bad, tmp_path, tmp_path / "out")


def coco_captions_file(root: Path) -> Path:
    return write_json(
        root / "annotations/captions_val2014.json",
        {
            "images": [
                {"id": 391895, "file_name": "COCO_val2014_000000391895.jpg", "width": 16, "height": 12},
                {"id": 7, "file_name": "COCO_val2014_000000000007.jpg", "width": 16, "height": 12},
            ],
            "annotations": [
                {"id": 1, "image_id": 391895, "caption": "A man riding a bike. "},
                {"id": 2, "image_id": 7, "caption": "A cat."},
                {"id": 3, "image_id": 391895, "caption": "Someone on a bicycle."},
            ],
        },
    )


def test_coco_captions_one_sample_per_image_with_all_captions(tmp_path):
    path = coco_captions_file(tmp_path)
    image_file(tmp_path / "coco/val2014/COCO_val2014_000000391895.jpg")
    png = image_file(tmp_path / "coco/COCO_val2014_000000000007.jpg", image_format="PNG")  # a PNG named .jpg
    manifest = convert_coco_captions(path, tmp_path / "coco", tmp_path / "out")
    assert (manifest.name, manifest.samples) == ("coco-captions-val2014", 2)
    samples = {s["meta"]["image_id"]: s for s in read_all(tmp_path / "out")}
    assert samples[391895]["meta"]["captions"] == ["A man riding a bike.", "Someone on a bicycle."]
    assert samples[7]["png"] == png and samples[7]["meta"]["captions"] == ["A cat."]
    tokens = json.loads((tmp_path / "out" / CAPTION_TOKENS_FILE).read_text())
    assert TextTokenizer().encode("someone on a bicycle. a cat.")[1] in tokens  # BPE lower-cases


def test_coco_captions_unknown_image_id_is_an_error(tmp_path):
    path = coco_captions_file(tmp_path)
    data = json.loads(path.read_text())
    data["annotations"][1]["image_id"] = 8
    write_json(path, data)
    with pytest.raises(ConversionError, match=r"annotations\[1\]: field 'image_id' = 8 is not in 'images'"):
        convert_coco_captions(path, tmp_path, tmp_path / "out")


def karpathy_file(root: Path) -> Path:
    def image(cocoid, split, filepath, captions):
        return {
            "filepath": filepath,
            "filename": f"COCO_{filepath}_{cocoid:012d}.jpg",
            "imgid": cocoid,
            "split": split,
            "cocoid": cocoid,
            "sentences": [
                {"raw": c, "tokens": c.split(), "imgid": cocoid, "sentid": i} for i, c in enumerate(captions)
            ],
            "sentids": list(range(len(captions))),
        }

    return write_json(
        root / "dataset_coco.json",
        {
            "dataset": "coco",
            "images": [
                image(1, "train", "train2014", ["a dog", "a puppy"]),
                image(2, "restval", "val2014", ["a bus"]),
                image(3, "test", "val2014", ["a red car", "a car on a road"]),
            ],
        },
    )


def test_karpathy_splits(tmp_path):
    path = karpathy_file(tmp_path)
    for cocoid, folder in ((1, "train2014"), (2, "val2014"), (3, "val2014")):
        image_file(tmp_path / f"coco/{folder}/COCO_{folder}_{cocoid:012d}.jpg")
    test = convert_karpathy(path, "test", tmp_path / "coco", tmp_path / "test")
    assert (test.name, test.samples) == ("coco-karpathy-test", 1)
    assert read_all(tmp_path / "test")[0]["meta"]["captions"] == ["a red car", "a car on a road"]
    tokenizer = TextTokenizer()
    expected = {token for caption in ("a red car", "a car on a road") for token in tokenizer.encode(caption)} - {SOT_ID}
    assert json.loads((tmp_path / "test" / CAPTION_TOKENS_FILE).read_text()) == sorted(expected)
    train = convert_karpathy(path, "train,restval", tmp_path / "coco", tmp_path / "train")
    assert train.name == "coco-karpathy-train-restval"
    assert sorted(s["meta"]["image_id"] for s in read_all(tmp_path / "train")) == [1, 2]
    with pytest.raises(ConversionError, match="--split 'dev'"):
        convert_karpathy(path, "dev", tmp_path / "coco", tmp_path / "x")


def test_one_image_file_under_two_ids_is_refused(tmp_path):
    path = karpathy_file(tmp_path)
    (tmp_path / "coco").mkdir()
    data = json.loads(path.read_text())
    data["images"][1]["filename"] = data["images"][2]["filename"]  # restval's cocoid 2 names the test image's file
    write_json(path, data)
    file_name = "val2014/COCO_val2014_000000000003.jpg"
    message = rf"images\[2\] \(cocoid 3\): file '{file_name}' is also images\[1\] \(cocoid 2\)"
    with pytest.raises(ConversionError, match=message):
        convert_karpathy(path, "test,restval", tmp_path / "coco", tmp_path / "out")
    path = coco_captions_file(tmp_path)
    data = json.loads(path.read_text())
    data["images"][1]["file_name"] = data["images"][0]["file_name"]
    write_json(path, data)
    message = r"images\[1\] \(id 7\): file 'COCO_val2014_000000391895.jpg' is also images\[0\] \(id 391895\)"
    with pytest.raises(ConversionError, match=message):
        convert_coco_captions(path, tmp_path / "coco", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_coco_image_without_captions_is_skipped_unless_the_file_has_none(tmp_path, capsys):
    path = coco_captions_file(tmp_path)
    image_file(tmp_path / "coco/COCO_val2014_000000391895.jpg")
    image_file(tmp_path / "coco/COCO_val2014_000000000007.jpg")
    data = json.loads(path.read_text())
    data["annotations"].pop(1)  # image 7's only caption
    write_json(path, data)
    manifest = convert_coco_captions(path, tmp_path / "coco", tmp_path / "out")
    assert (manifest.samples, manifest.skipped) == (1, 1)
    assert "COCO_val2014_000000000007.jpg: no caption" in capsys.readouterr().err
    data.pop("annotations")  # test image info: every sample without captions, for predictions only
    write_json(path, data)
    manifest = convert_coco_captions(path, tmp_path / "coco", tmp_path / "test")
    assert (manifest.samples, manifest.skipped) == (2, 0)
    assert [s["meta"]["captions"] for s in read_all(tmp_path / "test")] == [[], []]


def test_nlvr2_naming_rule():
    assert image_names("dev-850-0-0") == ("dev-850-0-img0.png", "dev-850-0-img1.png")
    assert image_names("train-10171-0-1") == ("train-10171-0-img0.png", "train-10171-0-img1.png")


def nlvr2_file(path: Path, lines: list) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(line if isinstance(line, str) else json.dumps(line) for line in lines) + "\n")
    return path


def test_nlvr2_finds_images_anywhere_and_keeps_labels(tmp_path, capsys):
    left = image_file(tmp_path / "images/train/17/train-3-1-img0.png", image_format="PNG")
    right = image_file(tmp_path / "images/elsewhere/deep/train-3-1-img1.png", (0, 255, 0), "PNG")
    image_file(tmp_path / "images/train/2/train-4-0-img0.png", image_format="PNG")  # its right image is missing
    data = nlvr2_file(
        tmp_path / "train.json",
        [
            {"identifier": "train-3-1-0", "sentence": "One dog.", "label": "True", "directory": "17"},
            {"identifier": "train-3-1-1", "sentence": "Two dogs.", "label": "false"},
            {"identifier": "train-4-0-0", "sentence": "A cat.", "label": "False"},
        ],
    )
    manifest = convert_nlvr2(data, tmp_path / "images", tmp_path / "out")
    assert (manifest.name, manifest.samples, manifest.skipped) == ("nlvr2-train", 2, 1)
    assert "train-4-0-img1.png: missing" in capsys.readouterr().err
    samples = {s["meta"]["identifier"]: s for s in read_all(tmp_path / "out")}
    assert samples["train-3-1-0"]["left.png"] == left and samples["train-3-1-0"]["right.png"] == right
    assert samples["train-3-1-0"]["meta"]["label"] is True and samples["train-3-1-1"]["meta"]["label"] is False
    assert samples["train-3-1-1"]["meta"]["sentence"] == "Two dogs."


@pytest.mark.parametrize(
    "line, message",
    [
        ('{"identifier": "dev-1-0-0", "sentence": "x", "label": "maybe"}', r"dev.json:2: field 'label'.*'maybe'"),
        ('{"identifier": "dev-1-0-0"}', r"dev.json:2: missing field 'sentence'"),
        ('{"identifier": "dev-1", "sentence": "x"}', r"dev.json:2: field 'identifier' must read"),
        ('{"identifier": "dev-1-0-0", "sentence": "x",', r"dev.json:2: not valid JSON"),
        ('{"identifier": "dev-0-0-0", "sentence": "x"}', r"dev.json:2: field 'identifier' = 'dev-0-0-0' appears twice"),
    ],
)
def test_nlvr2_bad_lines(tmp_path, line, message):
    data = nlvr2_file(tmp_path / "dev.json", [{"identifier": "dev-0-0-0", "sentence": "ok", "label": "True"}, line])
    with pytest.raises(ConversionError, match=message):
        convert_nlvr2(data, tmp_path, tmp_path / "out")


def test_pretraining_corpora(tmp_path):
    image_file(tmp_path / "imgs/a/one.jpg")
    image_file(tmp_path / "imgs/two.png", image_format="PNG")
    (tmp_path / "imgs/notes.txt").write_text("not an image")
    manifest = convert_images(tmp_path / "imgs", tmp_path / "images")
    assert manifest.samples == 2 and sorted(s["meta"]["path"] for s in read_all(tmp_path / "images")) == [
        "a/one.jpg",
        "two.png",
    ]
    (tmp_path / "pairs.tsv").write_text("a/one.jpg\ta red square\n\nmissing.jpg\tnothing\ntwo.png\tred again\n")
    manifest = convert_tsv(tmp_path / "pairs.tsv", tmp_path / "imgs", tmp_path / "pairs")
    assert (manifest.samples, manifest.skipped) == (2, 1)
    assert [s["txt"].decode() for s in read_all(tmp_path / "pairs")] == ["a red square", "red again"]
    (tmp_path / "bad.tsv").write_text("a/one.jpg\ta caption\nno tab here\n")
    with pytest.raises(ConversionError, match=r"bad.tsv:2: expected 'image_path<TAB>caption'"):
        convert_tsv(tmp_path / "bad.tsv", tmp_path / "imgs", tmp_path / "bad")
    (tmp_path / "a.txt").write_text("first text\n\nsecond text\n")
    (tmp_path / "b.txt").write_text("third\n")
    manifest = convert_text([tmp_path / "a.txt", tmp_path / "b.txt"], tmp_path / "text", shard_size=2)
    assert (manifest.samples, manifest.shards) == (3, 2)
    assert [s["txt"].decode() for s in read_all(tmp_path / "text")] == ["first text", "second text", "third"]


def test_output_folder_holds_one_split(tmp_path):
    (tmp_path / "a.txt").write_text("x\n")
    convert_text([tmp_path / "a.txt"], tmp_path / "out", name="one")
    with pytest.raises(ConversionError, match="already holds shards of 'one'"):
        convert_text([tmp_path / "a.txt"], tmp_path / "out", name="two")
    (tmp_path / "a.txt").write_text("x\n" * 5)
    convert_text([tmp_path / "a.txt"], tmp_path / "out", name="one", shard_size=1)
    (tmp_path / "a.txt").write_text("x\n")
    convert_text([tmp_path / "a.txt"], tmp_path / "out", name="one", shard_size=1)  # stale shards go away
    assert sorted(p.name for p in (tmp_path / "out").glob("*.tar")) == ["one-000000.tar"]


def test_cli_converts_and_reports_errors(tmp_path, capsys):
    q, a = vqa_files(tmp_path)
    image_file(tmp_path / "coco/train2014/COCO_train2014_000000000009.jpg")
    image_file(tmp_path / "coco/train2014/COCO_train2014_000000000042.jpg")
    argv = ["data", "convert", "vqav2", "--questions", str(q), "--annotations", str(a), "--images",
            str(tmp_path / "coco"), "--out", str(tmp_path / "out"), "--min-answer-count", "1"]  # fmt: skip
    assert main(argv) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["name"] == "vqav2-train2014" and printed["samples"] == 3
    caption_argv = ["data", "convert", "coco-captions", "--karpathy", str(q), "--images", str(tmp_path), "--out", "x"]
    assert main(caption_argv) == 2
    assert "--karpathy needs --split" in capsys.readouterr().err
    bad = ["data", "convert", "nlvr2", "--data", str(tmp_path / "absent.json"), "--images", ".", "--out", "x"]
    assert main(bad) == 2
    assert "absent.json: cannot read" in capsys.readouterr().err
