"""ImageNet-1K classification data: the train synset folders, the flat val folder with the devkit's ground truth or
Kaggle's LOC_val_solution.csv, any ImageFolder tree, converted with every image counted and labels in one class
index; bad folders refused with one line through the real command."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from PIL import Image

from mmoe.cli import main
from mmoe.data.converters.class_index import CLASSES_FILE
from mmoe.data.shards import MANIFEST
from tests.data.test_converters import read_all

#: Three synsets in their standard (sorted) order, with names as Kaggle's LOC_synset_mapping.txt gives them.
SYNSETS = {
    "n01440764": "tench, Tinca tinca",
    "n01443537": "goldfish, Carassius auratus",
    "n01484850": "great white shark",
}
TRAIN = {"n01440764": 3, "n01443537": 2, "n01484850": 4}
#: The devkit numbers classes in its own order (meta.mat's ILSVRC2012_ID), not the sorted one.
DEVKIT_ORDER = ["n01484850", "n01440764", "n01443537"]
#: Each val image's class, image 1 first.
VAL = ["n01443537", "n01484850", "n01484850", "n01440764", "n01443537"]


def picture(path: Path, shade: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", (8, 6), (shade, 255 - shade, 40)).save(path, format="JPEG")


def val_name(number: int) -> str:
    return f"ILSVRC2012_val_{number:08d}.JPEG"


def write_layout(root: Path) -> Path:
    """ImageNet's train and val folders, the devkit's ground truth, a WNID-by-ILSVRC2012_ID file and Kaggle's files."""
    for wnid, count in TRAIN.items():
        for number in range(count):
            picture(root / "train" / wnid / f"{wnid}_{1000 + number}.JPEG", 20 * number + len(wnid))
    (root / "train" / "n01440764" / "notes.txt").write_text("not an image")
    for number in range(1, len(VAL) + 1):
        picture(root / "val" / val_name(number), 30 * number)
    truth = root / "ILSVRC2012_devkit_t12" / "data" / "ILSVRC2012_validation_ground_truth.txt"
    truth.parent.mkdir(parents=True)
    truth.write_text("".join(f"{DEVKIT_ORDER.index(wnid) + 1}\n" for wnid in VAL))
    (root / "devkit_synsets.txt").write_text("".join(f"{wnid}\n" for wnid in DEVKIT_ORDER))
    rows = [f"{val_name(n)[:-5]},{wnid} 1 2 5 6 {wnid} 0 0 3 3 " for n, wnid in enumerate(VAL, start=1)]
    (root / "LOC_val_solution.csv").write_text("ImageId,PredictionString\n" + "\n".join(reversed(rows)) + "\n")
    (root / "LOC_synset_mapping.txt").write_text("".join(f"{w} {name}\n" for w, name in SYNSETS.items()))
    return root


@pytest.fixture(scope="module")
def imagenet(tmp_path_factory) -> Path:
    root = write_layout(tmp_path_factory.mktemp("imagenet"))
    assert main(["data", "convert", "imagenet", "--images", str(root / "train"), "--out", str(root / "out-train")]) == 0
    return root


def convert(*options: str) -> int:
    return main(["data", "convert", "imagenet", *options])


def labels_by_path(split: Path) -> dict[str, int]:
    samples = read_all(split)
    assert all(any(key in sample for key in ("jpg", "png")) for sample in samples)
    return {sample["meta"]["path"]: int(sample["cls"]) for sample in samples}


def test_train_synset_folders_convert_every_image_with_sorted_wnid_labels(imagenet):
    split = imagenet / "out-train"
    sorted_wnids = sorted(TRAIN)
    expected = {
        f"{wnid}/{wnid}_{1000 + n}.JPEG": sorted_wnids.index(wnid)
        for wnid, count in TRAIN.items()
        for n in range(count)
    }
    assert labels_by_path(split) == expected
    manifest = json.loads((split / MANIFEST).read_text())
    assert manifest["samples"] == sum(TRAIN.values()) and manifest["skipped"] == 0
    assert manifest["images_per_class"] == [TRAIN[wnid] for wnid in sorted_wnids] and manifest["other_files"] == 1
    classes = json.loads((split / CLASSES_FILE).read_text())
    assert classes == {"classes": [{"index": i, "wnid": w, "name": w} for i, w in enumerate(sorted_wnids)]}
    assert CLASSES_FILE in manifest["files"] and "image_digests.json" in manifest["files"]


def test_the_written_order_is_seeded_and_mixes_classes(imagenet, tmp_path):
    assert convert("--images", str(imagenet / "train"), "--out", str(tmp_path / "again")) == 0
    paths = lambda split: [s["meta"]["path"] for s in read_all(split)]  # noqa: E731
    assert paths(tmp_path / "again") == paths(imagenet / "out-train")
    assert convert("--images", str(imagenet / "train"), "--out", str(tmp_path / "other"), "--seed", "3") == 0
    assert paths(tmp_path / "other") != paths(imagenet / "out-train")
    assert paths(imagenet / "out-train") != sorted(paths(imagenet / "out-train"))


@pytest.mark.parametrize("labels", ["devkit", "solution"])
def test_val_labels_from_the_devkit_or_kaggle_agree_with_the_train_index(imagenet, tmp_path, labels):
    if labels == "devkit":
        source = ["--devkit", str(imagenet / "ILSVRC2012_devkit_t12"), "--devkit-synsets"]
        source.append(str(imagenet / "devkit_synsets.txt"))
    else:
        source = ["--val-solution", str(imagenet / "LOC_val_solution.csv")]
    train = imagenet / "out-train"
    assert convert("--images", str(imagenet / "val"), *source, "--classes", str(train), "--out", str(tmp_path)) == 0
    train_index = {entry["wnid"]: entry["index"] for entry in json.loads((train / CLASSES_FILE).read_text())["classes"]}
    assert labels_by_path(tmp_path) == {val_name(n): train_index[w] for n, w in enumerate(VAL, start=1)}
    assert (tmp_path / CLASSES_FILE).read_text() == (train / CLASSES_FILE).read_text()
    assert json.loads((tmp_path / MANIFEST).read_text())["samples"] == len(VAL)


def test_synset_mapping_gives_names_and_an_imagefolder_tree_numbers_as_torchvision(imagenet, tmp_path):
    from torchvision.datasets import ImageFolder

    mapping = str(imagenet / "LOC_synset_mapping.txt")
    assert convert("--images", str(imagenet / "train"), "--synsets", mapping, "--out", str(tmp_path / "named")) == 0
    classes = json.loads((tmp_path / "named" / CLASSES_FILE).read_text())["classes"]
    assert [(c["wnid"], c["name"]) for c in classes] == list(SYNSETS.items())
    folder = ImageFolder(str(imagenet / "train"))
    reference = {Path(path).relative_to(imagenet / "train").as_posix(): label for path, label in folder.samples}
    assert labels_by_path(tmp_path / "named") == reference


def run(*options: str, capsys=None) -> subprocess.CompletedProcess:
    """The real command in a subprocess; with ``capsys``, the same command line in this process (the cases beside
    the ones each refusal is shown in a subprocess by, to keep the test fast)."""
    argv = ["data", "convert", "imagenet", *options]
    if capsys is not None:
        capsys.readouterr()
        status = main(argv)
        out, err = capsys.readouterr()
        return subprocess.CompletedProcess(argv, status, out, err)
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    command = [sys.executable, "-m", "mmoe.cli", *argv]
    return subprocess.run(command, capture_output=True, text=True, env=environment, timeout=120)


def one_line(done: subprocess.CompletedProcess, *parts: str) -> str:
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1, done.stderr
    assert lines[0].startswith("mmoe data convert: error: ") and "Traceback" not in done.stderr
    assert all(part in lines[0] for part in parts), lines[0]
    return lines[0]


def test_bad_val_labels_are_one_line_each_and_exit_2(imagenet, tmp_path, capsys):
    devkit = tmp_path / "ILSVRC2012_devkit_t12" / "data" / "ILSVRC2012_validation_ground_truth.txt"
    devkit.parent.mkdir(parents=True)
    devkit.write_text("1\n7\n1\n1\n1\n")
    synsets = tmp_path / "ids.txt"
    synsets.write_text("".join(f"{wnid}\n" for wnid in [*DEVKIT_ORDER, "n09999999"]))
    train, val = str(imagenet / "out-train"), str(imagenet / "val")
    common = ["--images", val, "--classes", train, "--devkit", str(devkit), "--devkit-synsets", str(synsets)]
    one_line(run(*common, "--out", str(tmp_path / "a")), f"{devkit}:2", "label 7 is out of range", "1 to 4")
    devkit.write_text("1\n4\n1\n1\n1\n")
    one_line(run(*common, "--out", str(tmp_path / "b")), f"{devkit}:2", "'n09999999' is not in the class index")
    solution = tmp_path / "LOC_val_solution.csv"
    text = (imagenet / "LOC_val_solution.csv").read_text()
    solution.write_text(text.replace("n01440764", "n07777777"))
    options = ["--images", val, "--classes", train, "--val-solution", str(solution), "--out", str(tmp_path / "c")]
    done = run(*options, capsys=capsys)
    one_line(done, str(solution), "'n07777777' is not in the class index", "3 classes")
    assert not any((tmp_path / name).exists() for name in "abc")


def test_unreadable_images_are_skipped_and_counted_and_a_folder_of_them_refused(tmp_path, capsys):
    picture(tmp_path / "train" / "n01440764" / "a.JPEG", 10)
    (tmp_path / "train" / "n01443537").mkdir()
    (tmp_path / "train" / "n01443537" / "b.JPEG").write_bytes(b"not a jpeg")
    done = run("--images", str(tmp_path / "train"), "--out", str(tmp_path / "out"))
    assert done.returncode == 0 and done.stderr.strip().splitlines() == [
        f"skipped {tmp_path / 'train' / 'n01443537' / 'b.JPEG'}: unreadable (not an image: Pillow cannot identify it)"
    ]
    manifest = json.loads(done.stdout)
    assert (manifest["samples"], manifest["skipped"], manifest["classes"]) == (1, 1, 2)
    (tmp_path / "train" / "n01440764" / "a.JPEG").write_bytes(b"\xff\xd8 cut")
    done = run("--images", str(tmp_path / "train"), "--out", str(tmp_path / "none"), capsys=capsys)
    assert done.returncode == 2 and "all 2 samples were skipped" in done.stderr.strip().splitlines()[-1]
    assert not (tmp_path / "none").exists()


def test_a_train_class_missing_from_the_given_index_and_an_unlabelled_val_image_are_refused(imagenet, tmp_path, capsys):
    mapping = tmp_path / "LOC_synset_mapping.txt"
    mapping.write_text("n01440764 tench\nn01443537 goldfish\n")
    done = run(
        "--images", str(imagenet / "train"), "--synsets", str(mapping), "--out", str(tmp_path / "a"), capsys=capsys
    )
    one_line(done, "n01484850", "is not in the class index", str(mapping))
    solution = tmp_path / "LOC_val_solution.csv"
    solution.write_text("\n".join((imagenet / "LOC_val_solution.csv").read_text().splitlines()[:-1]) + "\n")
    train = str(imagenet / "out-train")
    options = ["--images", str(imagenet / "val"), "--classes", train, "--val-solution", str(solution)]
    done = run(*options, "--out", str(tmp_path / "b"), capsys=capsys)
    one_line(done, val_name(1), "has no label in", "1 of the folder's images")


def test_shards_carrying_cls_are_indexed_in_place_and_read_with_the_same_labels(imagenet, tmp_path):
    import shutil

    converted = imagenet / "out-train"
    for tar in converted.glob("*.tar"):
        shutil.copy(tar, tmp_path / tar.name)
    before = {tar.name: tar.read_bytes() for tar in tmp_path.glob("*.tar")}
    assert convert("--shards", str(tmp_path), "--classes", str(converted / CLASSES_FILE)) == 0
    assert {tar.name: tar.read_bytes() for tar in tmp_path.glob("*.tar")} == before
    manifest = json.loads((tmp_path / MANIFEST).read_text())
    assert manifest["samples"] == sum(TRAIN.values()) and manifest["images_per_class"] == [3, 2, 4]
    assert labels_by_path(tmp_path) == labels_by_path(converted)
    assert (tmp_path / CLASSES_FILE).read_text() == (converted / CLASSES_FILE).read_text()


def test_shards_with_a_cls_out_of_range_or_without_cls_are_refused_with_one_line(imagenet, tmp_path, capsys):
    from mmoe.data.shards import ShardWriter

    jpeg = next((imagenet / "train" / "n01440764").glob("*.JPEG")).read_bytes()
    with ShardWriter(tmp_path / "range", "mine") as writer:
        writer.write({"__key__": "a", "jpg": jpeg, "cls": "2"})
        writer.write({"__key__": "b", "jpg": jpeg, "cls": "3"})
    done = run("--shards", str(tmp_path / "range"), "--classes", str(imagenet / "out-train"))
    one_line(done, "mine-000000.tar: sample 'b'", "cls 3 is out of range", "3 classes (0 to 2)")
    assert sorted(path.name for path in (tmp_path / "range").iterdir()) == ["mine-000000.tar"]
    with ShardWriter(tmp_path / "none", "mine") as writer:
        writer.write({"__key__": "a", "jpg": jpeg, "txt": "no class"})
    assert convert("--shards", str(tmp_path / "none"), "--synsets", str(imagenet / "LOC_synset_mapping.txt")) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "sample 'a': no .cls member" in err[0]
    converted = str(imagenet / "out-train")
    assert convert("--shards", converted, "--classes", converted) == 2  # a converted split is not indexed again
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "manifest.json: exists and is not an index of shards with cls" in err[0]


def test_an_empty_class_folder_keeps_its_index_as_in_torchvision(tmp_path):
    from torchvision.datasets.folder import find_classes

    picture(tmp_path / "tree" / "cat" / "1.png", 5)
    picture(tmp_path / "tree" / "dog" / "deep" / "2.jpg", 9)
    (tmp_path / "tree" / "bird").mkdir()
    assert convert("--images", str(tmp_path / "tree"), "--out", str(tmp_path / "out"), "--name", "pets") == 0
    _, reference = find_classes(str(tmp_path / "tree"))
    assert labels_by_path(tmp_path / "out") == {"cat/1.png": reference["cat"], "dog/deep/2.jpg": reference["dog"]}
    classes = json.loads((tmp_path / "out" / CLASSES_FILE).read_text())["classes"]
    assert [entry["wnid"] for entry in classes] == sorted(reference, key=reference.get) == ["bird", "cat", "dog"]


def _solution(imagenet: Path, tmp_path: Path, text: str) -> list[str]:
    (tmp_path / "solution.csv").write_text(text)
    train = str(imagenet / "out-train")
    return ["--images", str(imagenet / "val"), "--classes", train, "--val-solution", str(tmp_path / "solution.csv")]


def _devkit(imagenet: Path, tmp_path: Path, text: str, synsets: bool = True) -> list[str]:
    (tmp_path / "truth.txt").write_text(text)
    options = ["--images", str(imagenet / "val"), "--classes", str(imagenet / "out-train"), "--devkit"]
    options.append(str(tmp_path / "truth.txt"))
    return options + (["--devkit-synsets", str(imagenet / "devkit_synsets.txt")] if synsets else [])


def _bad_classes(imagenet: Path, tmp_path: Path) -> list[str]:
    (tmp_path / "classes.json").write_text('{"classes": [{"index": 1, "wnid": "n01440764", "name": "tench"}]}')
    return ["--images", str(imagenet / "train"), "--classes", str(tmp_path / "classes.json")]


@pytest.mark.parametrize(
    "case, parts",
    [
        (lambda i, t: _solution(i, t, "ImageId,PredictionString\nILSVRC2012_val_00000001,\n"), [":2: expected"]),
        (lambda i, t: _solution(i, t, "Id,Labels\n"), [":1: expected the header ImageId,PredictionString"]),
        (
            lambda i, t: _solution(i, t, "ImageId,PredictionString\nA,n01440764 1 1 2 2 n01443537 1 1 2 2\n"),
            [":2: boxes of two classes (n01440764, n01443537)"],
        ),
        (
            lambda i, t: _solution(i, t, "ImageId,PredictionString\nA,n01440764 1 1 2 2\nA,n01440764 0 0 1 1\n"),
            [":3: image A is labelled twice", ":2)"],
        ),
        (lambda i, t: _devkit(i, t, "1\nx\n"), ["truth.txt:2: expected an ILSVRC2012_ID", "got 'x'"]),
        (lambda i, t: _devkit(i, t, "1\n", synsets=False), ["--devkit needs --devkit-synsets", "meta.mat"]),
        (lambda i, t: _solution(i, t, "")[:2] + _solution(i, t, "")[4:], ["need the training split's --classes"]),
        (_bad_classes, ["classes[0]: field 'index' = 1, expected 0"]),
        (lambda i, t: ["--shards", str(i / "out-train"), "--out", str(t)], ["--out does not apply to --shards"]),
    ],
)
def test_bad_options_and_label_files_are_one_line_naming_file_line_and_value(imagenet, tmp_path, capsys, case, parts):
    options = case(imagenet, tmp_path)
    done = run(*options, *([] if "--shards" in options else ["--out", str(tmp_path / "out")]), capsys=capsys)
    one_line(done, *parts)
    assert not (tmp_path / "out").exists()
