"""Conversions as a user meets their faults: a conversion killed midway leaves the old split whole, readers refuse a
folder whose shards and manifest disagree, bad options and empty inputs get one line and exit status 2, and bad
records (duplicates, labels, paths outside --images, 16-bit images) are caught or converted correctly."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from mmoe.cli import main
from mmoe.data.converters import (
    ConversionError,
    common,
    convert_coco_captions,
    convert_images,
    convert_karpathy,
    convert_nlvr2,
    convert_text,
    convert_tsv,
    convert_vqav2,
    staging,
)
from mmoe.data.converters.build_captions import CAPTION_TOKENS_FILE
from mmoe.data.converters.common import read_image
from mmoe.data.shards import ShardWriter, expected_samples, resolve_shards
from mmoe.data.transforms import decode_image
from tests.data.http_server import Plan, PlannedHandler, serve, text_shard
from tests.data.test_converters import (
    coco_captions_file,
    image_file,
    karpathy_file,
    nlvr2_file,
    read_all,
    vqa_files,
    write_json,
)

REPO = Path(__file__).resolve().parents[2]
NO_SUCH_PID = 2**31 - 1


def folder_bytes(folder: Path) -> dict[str, bytes]:
    """Every file in ``folder`` (hidden ones included) with its bytes."""
    return {path.name: path.read_bytes() for path in sorted(folder.iterdir())}


def text_file(path: Path, lines: int, prefix: str = "line") -> Path:
    path.write_text("".join(f"{prefix} {i} of the corpus\n" for i in range(lines)))
    return path


def siblings(out: Path) -> list[str]:
    """Hidden staging / replaced folders beside ``out``."""
    return sorted(path.name for path in out.parent.iterdir() if path.name.startswith(f".{out.name}."))


# 1. A split on disk is always one whole conversion.


def test_a_conversion_killed_midway_leaves_the_old_split_whole(tmp_path):
    out = tmp_path / "text"
    convert_text([text_file(tmp_path / "old.txt", 25, "old")], out, shard_size=10, name="corpus")
    before = folder_bytes(out)
    assert sorted(before) == ["corpus-000000.tar", "corpus-000001.tar", "corpus-000002.tar", "manifest.json"]
    big = text_file(tmp_path / "new.txt", 100_000, "new")
    command = [sys.executable, "-m", "mmoe.cli", "data", "convert", "text", "--text", str(big), "--out", str(out),
               "--shard-size", "100", "--name", "corpus"]  # fmt: skip
    process = subprocess.Popen(command, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    staged = tmp_path / f".text.staging-{process.pid}"
    deadline = time.monotonic() + 120
    while not list(staged.glob("corpus-*.tar")):
        assert process.poll() is None, f"the conversion ended before it was killed: {process.stderr.read()}"
        assert time.monotonic() < deadline, "no staged shard after 120 s"
        time.sleep(0.01)
    process.send_signal(signal.SIGKILL)
    process.wait()
    process.stderr.close()

    assert folder_bytes(out) == before  # same manifest, same shards, nothing added
    assert siblings(out) == [staged.name]
    assert [s["txt"].decode() for s in read_all(out)] == [f"old {i} of the corpus" for i in range(25)]

    manifest = convert_text([text_file(tmp_path / "next.txt", 12, "next")], out, shard_size=10, name="corpus")
    assert (manifest.samples, manifest.shard_files) == (12, ["corpus-000000.tar", "corpus-000001.tar"])
    assert siblings(out) == []  # the killed run's staging folder is gone
    assert sorted(os.listdir(out)) == ["corpus-000000.tar", "corpus-000001.tar", "manifest.json"]
    assert [s["txt"].decode() for s in read_all(out)][-1] == "next 11 of the corpus"


def interrupt_on_call(monkeypatch, module, function_name: str, call: int) -> None:
    """Makes ``module.function_name`` raise KeyboardInterrupt (a Ctrl-C) on its ``call``-th call."""
    original, calls = getattr(module, function_name), []

    def interrupted(*args, **kwargs):
        calls.append(1)
        if len(calls) == call:
            raise KeyboardInterrupt
        return original(*args, **kwargs)

    monkeypatch.setattr(module, function_name, interrupted)


def test_vqa_answers_json_is_swapped_with_its_shards(tmp_path, monkeypatch):
    from mmoe.data.converters import build_vqa

    q, a = vqa_files(tmp_path)
    image_file(tmp_path / "coco/COCO_train2014_000000000009.jpg")
    image_file(tmp_path / "coco/COCO_train2014_000000000042.jpg")
    out = tmp_path / "out"
    manifest = convert_vqav2(q, tmp_path / "coco", out, annotations=a, min_answer_count=1, shard_size=1)
    files = ["answers.json", "image_digests.json"]
    assert manifest.files == files and manifest.to_json()["files"] == files
    before = folder_bytes(out)
    q, a = vqa_files(tmp_path, answers={9000: ["blue"] * 10, 9001: ["yes"] * 10, 42000: ["4"] * 10})
    interrupt_on_call(monkeypatch, build_vqa, "with_image", 3)
    with pytest.raises(KeyboardInterrupt):
        convert_vqav2(q, tmp_path / "coco", out, annotations=a, min_answer_count=1, shard_size=1)
    assert folder_bytes(out) == before and siblings(out) == []
    monkeypatch.undo()
    convert_vqav2(q, tmp_path / "coco", out, annotations=a, min_answer_count=1, shard_size=1)
    assert sorted(json.loads((out / "answers.json").read_text())) == ["4", "blue", "yes"]
    convert_vqav2(q, tmp_path / "coco", out, shard_size=1)  # the same split without annotations: no vocabulary
    manifest = json.loads((out / "manifest.json").read_text())
    assert not (out / "answers.json").exists() and manifest["files"] == ["image_digests.json"]


def test_caption_tokens_are_swapped_with_their_shards(tmp_path, monkeypatch):
    from mmoe.data.converters import build_captions

    path = karpathy_file(tmp_path)
    for cocoid, folder in ((1, "train2014"), (2, "val2014"), (3, "val2014")):
        image_file(tmp_path / f"coco/{folder}/COCO_{folder}_{cocoid:012d}.jpg")
    out = tmp_path / "out"
    convert_karpathy(path, "test", tmp_path / "coco", out, name="captions")
    before = folder_bytes(out)
    interrupt_on_call(monkeypatch, build_captions, "with_image", 2)
    with pytest.raises(KeyboardInterrupt):
        convert_karpathy(path, "train,restval", tmp_path / "coco", out, name="captions")
    assert folder_bytes(out) == before
    monkeypatch.undo()
    convert_karpathy(path, "train,restval", tmp_path / "coco", out, name="captions")
    assert folder_bytes(out)[CAPTION_TOKENS_FILE] != before[CAPTION_TOKENS_FILE]


def test_a_two_rename_swap_killed_between_its_renames_is_put_back(tmp_path, monkeypatch):
    """Where the filesystem cannot exchange two folders, the old split waits aside until the next conversion."""
    source = text_file(tmp_path / "a.txt", 3)
    out = tmp_path / "out"
    convert_text([source], out, name="one")
    before = folder_bytes(out)
    monkeypatch.setattr(staging, "_exchange", lambda first, second: False)
    renames = []

    def rename_then_die(source_path, target):
        renames.append(target)
        if len(renames) == 2:
            raise KeyboardInterrupt  # killed after OUT -> .out.replaced-<pid>, before staging -> OUT
        os.replace(source_path, target)

    monkeypatch.setattr(staging.os, "rename", rename_then_die)
    with pytest.raises(KeyboardInterrupt):
        convert_text([text_file(source, 7)], out, name="one")
    monkeypatch.undo()
    assert not out.exists() and siblings(out) == [f".out.replaced-{os.getpid()}"]
    with pytest.raises(ConversionError, match="already holds shards of 'one'"):
        convert_text([source], out, name="two")  # the old split is back before anything is checked
    assert folder_bytes(out) == before and siblings(out) == []
    monkeypatch.setattr(staging, "_exchange", lambda first, second: False)
    assert convert_text([source], out, name="one").samples == 7
    assert siblings(out) == []


def test_leftovers_of_dead_runs_are_removed_and_live_ones_kept(tmp_path):
    out = tmp_path / "out"
    dead = tmp_path / f".out.staging-{NO_SUCH_PID}"
    live = tmp_path / f".out.staging-{os.getppid()}"
    for folder in (dead, live):
        folder.mkdir()
        (folder / "x-000000.tar").write_bytes(b"partial")
    convert_text([text_file(tmp_path / "a.txt", 2)], out, name="x")
    assert not dead.exists() and live.exists()
    assert resolve_shards(out) == [str(out / "x-000000.tar")]


def test_out_holding_other_data_is_refused_and_left_alone(tmp_path):
    source = text_file(tmp_path / "a.txt", 2)
    questions = tmp_path / "vqav2"
    write_json(questions / "v2_OpenEnded_mscoco_val2014_questions.json", {"questions": []})
    with pytest.raises(ConversionError, match=r"holds v2_OpenEnded_mscoco_val2014_questions.json \(a file\)"):
        convert_text([source], questions, name="text")
    (tmp_path / "with-folder" / "images").mkdir(parents=True)
    with pytest.raises(ConversionError, match=r"holds images \(a folder or link\)"):
        convert_text([source], tmp_path / "with-folder", name="text")
    assert os.listdir(questions) == ["v2_OpenEnded_mscoco_val2014_questions.json"]
    empty = tmp_path / "empty"
    empty.mkdir()
    empty.chmod(0o750)
    convert_text([source], empty, name="text")
    assert (empty.stat().st_mode & 0o777) == 0o750  # the folder keeps its permissions


def test_a_linked_out_folder_is_written_where_it_points(tmp_path):
    target = tmp_path / "disk" / "text"
    convert_text([text_file(tmp_path / "a.txt", 2)], target, name="text")
    link = tmp_path / "text"
    link.symlink_to(target)
    convert_text([text_file(tmp_path / "a.txt", 4)], link, name="text")
    assert link.is_symlink() and json.loads((target / "manifest.json").read_text())["samples"] == 4


# 2. A reader refuses a folder whose shards and manifest disagree.


def converted(tmp_path: Path, lines: int = 25, shard_size: int = 10) -> Path:
    out = tmp_path / "split"
    convert_text([text_file(tmp_path / "a.txt", lines)], out, shard_size=shard_size, name="split")
    return out


def test_manifest_lists_samples_per_shard_and_expected_samples_reads_them(tmp_path):
    out = converted(tmp_path)
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["shard_samples"] == [10, 10, 5] and manifest["shards"] == 3
    shards = resolve_shards(out)
    assert expected_samples(shards) == dict(zip(shards, [10, 10, 5], strict=True))
    assert expected_samples(resolve_shards(str(out / "split-*.tar"))) == expected_samples(shards)
    loose = tmp_path / "loose"
    with ShardWriter(loose, "loose", max_count=2) as writer:
        for i in range(3):
            writer.write({"__key__": f"k{i}", "txt": "x"})
    assert writer.shard_samples == [2, 1]
    assert expected_samples(resolve_shards(loose) + shards[:1]) == {shards[0]: 10}  # no manifest: absent
    del manifest["shard_samples"]
    (out / "manifest.json").write_text(json.dumps(manifest))  # a manifest written before the field
    assert expected_samples(shards) == {} and resolve_shards(out) == shards
    server, url = serve(type("Handler", (PlannedHandler,), {"plan": Plan([text_shard("A")])}))
    try:  # a remote folder without a manifest (the loopback server has none): no expected counts
        assert expected_samples(["pipe:cat x.tar", f"{url}/s/t.tar"]) == {}
    finally:
        server.shutdown()


def test_a_missing_listed_shard_is_refused(tmp_path):
    out = converted(tmp_path)
    (out / "split-000001.tar").unlink()
    with pytest.raises(ValueError, match=r"split: shard split-000001.tar is missing; manifest.json lists 3 shards"):
        resolve_shards(out)


def test_a_shard_the_manifest_does_not_list_is_refused(tmp_path):
    out = converted(tmp_path)
    (out / "split-000007.tar").write_bytes((out / "split-000000.tar").read_bytes())
    with pytest.raises(ValueError, match=r"split-000007.tar is not in manifest.json, which lists 3 shards") as error:
        resolve_shards(out)
    assert str(out) in str(error.value)
    (out / "split-000007.tar").unlink()
    (out / "other-000000.tar").write_bytes(b"")  # another name is not this split's
    assert len(resolve_shards(out)) == 3


def test_a_truncated_shard_is_not_refused(tmp_path):
    out = converted(tmp_path)
    shard = out / "split-000000.tar"
    shard.write_bytes(shard.read_bytes()[:700])
    assert resolve_shards(out)[0] == str(shard)


def test_inconsistent_manifests_are_refused(tmp_path):
    out = converted(tmp_path)
    manifest = json.loads((out / "manifest.json").read_text())
    for change, message in (
        ({"shard_samples": [10, 10]}, "one sample count per entry"),
        ({"shards": 2}, "'shards' = 2 but 'shard_files' lists 3"),
        ({"shard_files": ["../x.tar", "a.tar", "b.tar"]}, "file names in"),
    ):
        (out / "manifest.json").write_text(json.dumps({**manifest, **change}))
        with pytest.raises(ValueError, match=message):
            resolve_shards(out)


# 3. Converter argument errors and empty conversions: one line, exit status 2, nothing written.


def run_cli(capsys, argv: list[str]) -> tuple[int, str]:
    status = main(["data", "convert", *argv])
    err = capsys.readouterr().err
    return status, err


def assert_one_error_line(err: str, *parts: str) -> None:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("mmoe data convert: error: "), err
    assert "Traceback" not in err
    for part in parts:
        assert part in lines[0], (part, lines[0])


@pytest.mark.parametrize(
    "options, parts",
    [
        (["--shard-size", "0"], ["--shard-size must be a whole number >= 1", "got 0"]),
        (["--shard-size", "-5"], ["--shard-size", "got -5"]),
        (["--name", "a/b"], ["--name: shard name 'a/b' must start with a letter or digit"]),
        (["--name", "*"], ["shard name '*'"]),
        (["--name", ".hidden"], ["shard name '.hidden'"]),
    ],
)
def test_bad_common_options(tmp_path, capsys, options, parts):
    argv = ["text", "--text", str(text_file(tmp_path / "a.txt", 2)), "--out", str(tmp_path / "out"), *options]
    status, err = run_cli(capsys, argv)
    assert status == 2
    assert_one_error_line(err, *parts)
    assert not (tmp_path / "out").exists()


def test_out_naming_a_file_or_below_a_file(tmp_path, capsys):
    source = str(text_file(tmp_path / "a.txt", 2))
    for out, part in ((source, f"--out {source}: is a file, not a folder"), (f"{source}/x", f"{source} is a file")):
        status, err = run_cli(capsys, ["text", "--text", source, "--out", out])
        assert status == 2
        assert_one_error_line(err, part)
    assert (tmp_path / "a.txt").read_text().count("\n") == 2


def test_other_converter_options(tmp_path, capsys):
    q, a = vqa_files(tmp_path)
    status, err = run_cli(capsys, ["vqav2", "--questions", str(q), "--annotations", str(a), "--images",
                                   str(tmp_path / "nowhere"), "--out", str(tmp_path / "out")])  # fmt: skip
    assert status == 2
    assert_one_error_line(err, f"--images {tmp_path / 'nowhere'}: not a folder")
    argv = ["vqav2", "--questions", str(q), "--annotations", str(a), "--images", str(tmp_path), "--out",
            str(tmp_path / "out"), "--min-answer-count", "0"]  # fmt: skip
    status, err = run_cli(capsys, argv)
    assert status == 2
    assert_one_error_line(err, "--min-answer-count must be >= 1, got 0")
    assert not (tmp_path / "out").exists()


def old_split(tmp_path: Path, name: str) -> tuple[Path, dict[str, bytes]]:
    """``OUT`` holding an earlier conversion of ``name`` (the empty conversions below must leave it)."""
    out = tmp_path / "out"
    (tmp_path / "old").mkdir(exist_ok=True)
    image_file(tmp_path / "old/one.jpg")
    convert_images(tmp_path / "old", out, name=name)
    return out, folder_bytes(out)


def test_every_sample_skipped_is_an_error_and_keeps_the_old_split(tmp_path, capsys):
    q, a = vqa_files(tmp_path)
    (tmp_path / "coco").mkdir()
    out, before = old_split(tmp_path, "vqav2-train2014")
    status, err = run_cli(capsys, ["vqav2", "--questions", str(q), "--annotations", str(a), "--images",
                                   str(tmp_path / "coco"), "--out", str(out), "--min-answer-count", "1"])  # fmt: skip
    assert status == 2
    error = err.strip().splitlines()[-1]  # after the first skipped paths
    assert error.startswith("mmoe data convert: error: ") and str(q) in error
    assert "all 3 samples were skipped (first: " in error and "COCO_train2014_000000000009.jpg: missing" in error
    assert folder_bytes(out) == before and siblings(out) == []


@pytest.mark.parametrize(
    "source, make, part",
    [
        (
            "vqav2",
            lambda d: [
                "--questions",
                str(write_json(d / "q.json", {"data_subtype": "val2014", "questions": []})),
                "--images",
                str(d),
            ],
            "q.json: field 'questions' is empty",
        ),
        (
            "nlvr2",
            lambda d: ["--data", str(nlvr2_file(d / "dev.json", ["", " "])), "--images", str(d)],
            "dev.json: no records to convert",
        ),
        (
            "tsv",
            lambda d: ["--tsv", str(nlvr2_file(d / "p.tsv", ["", ""])), "--images", str(d)],
            "p.tsv: no 'image_path<TAB>caption' lines",
        ),
        ("text", lambda d: ["--text", str(nlvr2_file(d / "t.txt", ["", "  "]))], "t.txt: no non-empty lines"),
        ("images", lambda d: ["--images", str(d / "none")], "no .jpg/.jpeg/.png/.webp files under it"),
        (
            "coco-captions",
            lambda d: ["--annotations", str(write_json(d / "c.json", {"images": []})), "--images", str(d)],
            "c.json: field 'images' is empty",
        ),
        (
            "coco-captions",
            lambda d: ["--karpathy", str(karpathy_file(d)), "--split", "val", "--images", str(d)],
            "dataset_coco.json: no images in split val",
        ),
    ],
)
def test_an_empty_conversion_is_an_error_and_keeps_the_old_split(tmp_path, capsys, source, make, part):
    out, before = old_split(tmp_path, "kept")
    (tmp_path / "none").mkdir()
    status, err = run_cli(capsys, [source, *make(tmp_path), "--out", str(out), "--name", "kept"])
    assert status == 2
    assert_one_error_line(err, part)
    assert folder_bytes(out) == before and siblings(out) == []


# 4. Converter gaps.


@pytest.mark.parametrize(
    "mutate, message",
    [
        (
            lambda q, a: q["questions"][2].update(question_id=9000),
            r"questions.json: questions\[2\]: question_id 9000 appears twice \(first at questions\[0\]\)",
        ),
        (
            lambda q, a: a["annotations"].append(dict(a["annotations"][1])),
            r"annotations.json: annotations\[3\] \(question_id 9001\): a second annotation for question_id 9001 "
            r"\(first at annotations\[1\]\)",
        ),
    ],
)
def test_vqa_duplicates_are_errors(tmp_path, mutate, message):
    q, a = vqa_files(tmp_path)
    questions, annotations = json.loads(q.read_text()), json.loads(a.read_text())
    mutate(questions, annotations)
    write_json(q, questions), write_json(a, annotations)
    with pytest.raises(ConversionError, match=message):
        convert_vqav2(q, tmp_path, tmp_path / "out", annotations=a)
    assert not (tmp_path / "out").exists()


def nlvr2_images(root: Path, *stems: str) -> None:
    for stem in stems:
        for side in (0, 1):
            image_file(root / f"{stem}-img{side}.png", image_format="PNG")


@pytest.mark.parametrize(
    "label, message",
    [
        (None, r"dev.json:2: record 'dev-0-0-1' has no field 'label', but line 1 \('dev-0-0-0'\) has one"),
        ("yes", r"dev.json:2: field 'label' of 'dev-0-0-1' must be \"True\" or \"False\", got 'yes'"),
        (1, r"dev.json:2: field 'label' of 'dev-0-0-1' must be \"True\" or \"False\", got 1"),
        ("", r"got ''"),
    ],
)
def test_nlvr2_labels_must_be_true_or_false_throughout(tmp_path, label, message):
    second = {"identifier": "dev-0-0-1", "sentence": "y"} | ({} if label is None else {"label": label})
    data = nlvr2_file(tmp_path / "dev.json", [{"identifier": "dev-0-0-0", "sentence": "x", "label": "True"}, second])
    with pytest.raises(ConversionError, match=message):
        convert_nlvr2(data, tmp_path, tmp_path / "out")


def test_nlvr2_label_spellings_and_an_unlabelled_split(tmp_path, capsys):
    nlvr2_images(tmp_path / "images", "dev-0-0", "test2-0-0")
    data = nlvr2_file(tmp_path / "dev.json", [
        {"identifier": "dev-0-0-0", "sentence": "a", "label": "TRUE"},
        {"identifier": "dev-0-0-1", "sentence": "b", "label": False},
        {"identifier": "dev-0-0-2", "sentence": "c", "label": "false"},
    ])  # fmt: skip
    manifest = convert_nlvr2(data, tmp_path / "images", tmp_path / "dev")
    assert manifest.extra["labelled"] is True
    assert [s["meta"]["label"] for s in read_all(tmp_path / "dev")] == [True, False, False]
    hidden = nlvr2_file(tmp_path / "test2.json", [
        {"identifier": "test2-0-0-0", "sentence": "a"},
        {"identifier": "test2-0-0-1", "sentence": "b", "label": None},
    ])  # fmt: skip
    convert_nlvr2(hidden, tmp_path / "images", tmp_path / "test2")
    assert "no record has a 'label': converted as an unlabelled split" in capsys.readouterr().err
    assert json.loads((tmp_path / "test2/manifest.json").read_text())["labelled"] is False
    assert [s["meta"]["label"] for s in read_all(tmp_path / "test2")] == [None, None]


def test_repeated_captions_are_dropped_and_counted_repeated_ids_refused(tmp_path, capsys):
    path = coco_captions_file(tmp_path)
    image_file(tmp_path / "coco/COCO_val2014_000000391895.jpg")
    image_file(tmp_path / "coco/COCO_val2014_000000000007.jpg")
    data = json.loads(path.read_text())
    data["annotations"] += [
        {"id": 4, "image_id": 7, "caption": "A cat. "},  # the same caption as id 2 once stripped
        {"id": 5, "image_id": 391895, "caption": "A cat."},  # the same words for another image: kept
    ]
    write_json(path, data)
    manifest = convert_coco_captions(path, tmp_path / "coco", tmp_path / "out")
    assert manifest.extra["duplicate_captions"] == 1
    assert "dropped 1 repeated captions (the same caption twice for one image; first: " in capsys.readouterr().err
    samples = {s["meta"]["image_id"]: s["meta"]["captions"] for s in read_all(tmp_path / "out")}
    assert samples == {391895: ["A man riding a bike.", "Someone on a bicycle.", "A cat."], 7: ["A cat."]}
    data["annotations"][4]["id"] = 2
    write_json(path, data)
    with pytest.raises(ConversionError, match=r"annotations\[4\]: annotation id 2 appears twice \(first at \[1\]\)"):
        convert_coco_captions(path, tmp_path / "coco", tmp_path / "out")


def test_karpathy_repeats(tmp_path, capsys):
    path = karpathy_file(tmp_path)
    data = json.loads(path.read_text())
    data["images"][2]["sentences"].append({"raw": " a red car", "tokens": [], "imgid": 3, "sentid": 9})
    write_json(path, data)
    image_file(tmp_path / "coco/val2014/COCO_val2014_000000000003.jpg")
    manifest = convert_karpathy(path, "test", tmp_path / "coco", tmp_path / "out")
    assert manifest.extra["duplicate_captions"] == 1 and "dropped 1 repeated captions" in capsys.readouterr().err
    assert read_all(tmp_path / "out")[0]["meta"]["captions"] == ["a red car", "a car on a road"]
    data["images"][1].update(cocoid=3, split="test")
    write_json(path, data)
    with pytest.raises(ConversionError, match=r"images\[2\] \(cocoid 3\): cocoid 3 appears twice"):
        convert_karpathy(path, "test,restval", tmp_path / "coco", tmp_path / "out")


def gradient_png16() -> tuple[bytes, np.ndarray]:
    """A 16-bit grey PNG whose columns run from 0 to 65535, and the 8-bit values it stands for."""
    values = np.tile(np.linspace(0, 65535, 64).round().astype(np.uint16), (4, 1))
    buffer = io.BytesIO()
    Image.fromarray(values).save(buffer, format="PNG")
    return buffer.getvalue(), np.round(values / 257).astype(np.uint8)


def test_16_bit_png_decodes_to_the_scaled_8_bit_values():
    data, expected = gradient_png16()
    assert Image.open(io.BytesIO(data)).mode.startswith("I")  # the file really is 16-bit
    rgb = np.asarray(decode_image(data))
    assert rgb.shape == (4, 64, 3) and rgb.dtype == np.uint8
    for channel in range(3):
        np.testing.assert_array_equal(rgb[..., channel], expected)
    assert (rgb == 255).mean() < 0.05


def test_16_bit_images_re_encoded_by_the_converters_keep_their_values(tmp_path):
    data, expected = gradient_png16()
    values = np.asarray(Image.open(io.BytesIO(data)))
    tiff = tmp_path / "imgs" / "grey16.tif"  # not jpg / png / webp: re-encoded as PNG by read_image
    tiff.parent.mkdir()
    Image.fromarray(values).save(tiff, format="TIFF")
    encoded, extension = read_image(str(tiff))
    assert extension == "png"
    np.testing.assert_array_equal(np.asarray(Image.open(io.BytesIO(encoded)))[..., 1], expected)
    (tmp_path / "imgs" / "grey16.png").write_bytes(data)  # a 16-bit PNG is stored as it is, then decoded right
    convert_images(tmp_path / "imgs", tmp_path / "out")
    (sample,) = read_all(tmp_path / "out")
    np.testing.assert_array_equal(np.asarray(decode_image(sample["png"]))[..., 0], expected)


@pytest.mark.parametrize("path", ["../secret.jpg", "/etc/passwd", "a/../../secret.jpg", "a/../../../etc/passwd"])
def test_tsv_paths_outside_images_are_refused(tmp_path, path):
    image_file(tmp_path / "imgs/a/one.jpg")
    tsv = tmp_path / "pairs.tsv"
    tsv.write_text(f"a/one.jpg\tfine\n{path}\tnot fine\n")
    message = f"pairs.tsv:2: image path '{path}' is outside --images {tmp_path / 'imgs'}"
    with pytest.raises(ConversionError, match=message.replace(".", r"\.")):
        convert_tsv(tsv, tmp_path / "imgs", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_paths_inside_images_may_use_dots_and_links(tmp_path):
    image_file(tmp_path / "elsewhere/one.jpg")
    (tmp_path / "imgs").mkdir()
    (tmp_path / "imgs/linked").symlink_to(tmp_path / "elsewhere")
    (tmp_path / "pairs.tsv").write_text("linked/one.jpg\tvia a link\nlinked/../linked/./one.jpg\tdots inside\n")
    assert convert_tsv(tmp_path / "pairs.tsv", tmp_path / "imgs", tmp_path / "out").samples == 2


def test_caption_file_paths_outside_images_are_refused(tmp_path):
    path = coco_captions_file(tmp_path)
    data = json.loads(path.read_text())
    data["images"][1]["file_name"] = "../../etc/passwd"
    write_json(path, data)
    with pytest.raises(ConversionError, match=r"images\[1\] \(id 7\): image path '\.\./\.\./etc/passwd' is outside"):
        convert_coco_captions(path, tmp_path, tmp_path / "out")
    path = karpathy_file(tmp_path)
    data = json.loads(path.read_text())
    data["images"][0]["filepath"] = "/etc"
    write_json(path, data)
    with pytest.raises(ConversionError, match=r"dataset_coco.json: images\[0\] \(cocoid 1\): image path '/etc/"):
        convert_karpathy(path, "train", tmp_path, tmp_path / "out")


def test_written_shards_hold_what_the_manifest_says(tmp_path):
    """The per-shard counts are the tar contents (two members per text sample)."""
    out = converted(tmp_path, lines=7, shard_size=3)
    counts = json.loads((out / "manifest.json").read_text())["shard_samples"]
    members = [len(tarfile.open(path).getnames()) // 2 for path in resolve_shards(out)]
    assert counts == members == [3, 3, 1]


def test_empty_write_split_leaves_nothing(tmp_path):
    with pytest.raises(ConversionError, match="no samples to convert"):
        common.write_split(tmp_path / "out", "x", iter([]), extra={"source": {"text": "t.txt"}})
    assert os.listdir(tmp_path) == []
