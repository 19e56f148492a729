"""The NoCaps converter on files in NoCaps' own layout (``nocaps_val_4500_captions.json`` with its images in ``val/``,
``nocaps_test_image_info.json`` with its images in ``test/``), and its refusals through the real command."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
from PIL import Image

from mmoe.data.converters.common import ConversionError
from mmoe.data.converters.nocaps import convert_nocaps
from mmoe.data.shards import resolve_shards
from mmoe.data.streams import ShardStream

#: A few images per domain, as the real file mixes them.
DOMAINS = ["near-domain", "in-domain", "out-domain", "near-domain", "in-domain", "out-domain", "near-domain"]


def nocaps_file(root: Path, split: str, domains: list[str], captions: bool) -> Path:
    """NoCaps' file for ``split`` (its fields as nocaps.org documents them, ``domain`` on each image) and its images,
    PIL-written into ``root/images/<split>/``; the val file has 10 captions per image."""
    images, annotations = [], []
    for index, domain in enumerate(domains):
        image_id = 100 + index
        open_images_id = f"{0x13EA2087020901 + index:016x}"
        path = root / "images" / split / f"{open_images_id}.jpg"
        path.parent.mkdir(parents=True, exist_ok=True)
        Image.new("RGB", (24, 18), (20 * index, 200 - 20 * index, 90)).save(path, format="JPEG")
        images.append(
            {
                "id": image_id,
                "open_images_id": open_images_id,
                "height": 18,
                "width": 24,
                "coco_url": f"https://s3.amazonaws.com/nocaps/{split}/{open_images_id}.jpg",
                "file_name": f"{open_images_id}.jpg",
                "license": 0,
                "date_captured": "2018-11-06 11:04:33",
                "domain": domain,
            }
        )
        annotations += [
            {"image_id": image_id, "id": 10 * image_id + k, "caption": f"Picture {index} seen by annotator {k}."}
            for k in range(10)
        ]
    data = {"licenses": [], "info": {"url": "http://nocaps.org", "version": "0.1"}, "images": images}
    if captions:
        data["annotations"] = annotations
    path = root / ("nocaps_val_4500_captions.json" if split == "val" else "nocaps_test_image_info.json")
    path.write_text(json.dumps(data))
    return path


def samples(folder: Path) -> list[dict]:
    return [json.loads(s["json"]) for s in ShardStream(resolve_shards(folder), decode=lambda s: s)]


def test_val_and_test_files_convert_every_image_with_its_domain(tmp_path):
    val = nocaps_file(tmp_path, "val", DOMAINS, captions=True)
    manifest = convert_nocaps(val, tmp_path / "images", tmp_path / "nocaps-val", shard_size=3)
    written = samples(tmp_path / "nocaps-val")
    assert (manifest.name, manifest.samples, manifest.skipped, manifest.shards) == ("nocaps-val", 7, 0, 3)
    assert sorted(s["image_id"] for s in written) == list(range(100, 107))
    assert {s["image_id"]: s["domain"] for s in written} == {100 + i: d for i, d in enumerate(DOMAINS)}
    assert all(len(s["captions"]) == 10 for s in written)
    assert manifest.extra["domains"] == dict(Counter(DOMAINS)) == {"in-domain": 2, "near-domain": 3, "out-domain": 2}
    assert manifest.extra["split"] == "val" and "sha256" in manifest.extra

    test = nocaps_file(tmp_path, "test", DOMAINS[:4], captions=False)
    manifest = convert_nocaps(test, tmp_path / "images", tmp_path / "nocaps-test")
    written = samples(tmp_path / "nocaps-test")
    assert (manifest.name, manifest.samples, manifest.skipped) == ("nocaps-test", 4, 0)
    assert [s["captions"] for s in written] == [[]] * 4
    assert [s["domain"] for s in written] == DOMAINS[:4]


def test_image_info_without_domains_converts_and_a_partial_one_is_refused(tmp_path):
    test = nocaps_file(tmp_path, "test", DOMAINS[:3], captions=False)
    data = json.loads(test.read_text())
    for image in data["images"]:
        del image["domain"]
    test.write_text(json.dumps(data))
    manifest = convert_nocaps(test, tmp_path / "images", tmp_path / "out")
    assert manifest.samples == 3 and manifest.extra["domains"] is None
    assert all("domain" not in s for s in samples(tmp_path / "out"))
    data["images"][2]["domain"] = "in-domain"
    test.write_text(json.dumps(data))
    with pytest.raises(ConversionError, match=r"images\[0\] has no 'domain' while other images have one"):
        convert_nocaps(test, tmp_path / "images", tmp_path / "out2")


def test_unreadable_image_stops_the_conversion_and_writes_nothing(tmp_path):
    val = nocaps_file(tmp_path, "val", DOMAINS[:3], captions=True)
    broken = tmp_path / "images/val" / json.loads(val.read_text())["images"][1]["file_name"]
    broken.write_bytes(b"not a jpeg")
    message = r"images\[1\] \(id 101\): image .*: unreadable \(not an image: Pillow cannot identify it\)"
    with pytest.raises(ConversionError, match=message):
        convert_nocaps(val, tmp_path / "images", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def _missing_domain(data: dict, root: Path) -> str:
    del data["images"][2]["domain"]
    return r"images\[2\] \(id 102\): missing field 'domain'; expected one of in-domain, near-domain, out-domain"


def _unknown_domain(data: dict, root: Path) -> str:
    data["images"][1]["domain"] = "far-domain"
    return r"images\[1\] \(id 101\): field 'domain' = \"far-domain\": expected one of in-domain, near-domain"


def _image_not_in_folder(data: dict, root: Path) -> str:
    (root / "images/val" / data["images"][3]["file_name"]).unlink()
    return rf"images\[3\] \(id 103\): image file '{data['images'][3]['file_name']}' is in neither --images"


def _uncaptioned_image(data: dict, root: Path) -> str:
    data["annotations"] = [a for a in data["annotations"] if a["image_id"] != 104]
    return r"images\[4\] \(id 104\): no caption in 'annotations'; expected its reference captions"


def test_an_image_without_captions_in_the_val_file_is_refused(tmp_path):
    val = nocaps_file(tmp_path, "val", DOMAINS, captions=True)
    data = json.loads(val.read_text())
    expected = _uncaptioned_image(data, tmp_path)
    val.write_text(json.dumps(data))
    with pytest.raises(ConversionError, match=expected):
        convert_nocaps(val, tmp_path / "images", tmp_path / "out")


@pytest.mark.parametrize("spoil", [_missing_domain, _unknown_domain, _image_not_in_folder, "unreadable JSON"])
def test_bad_files_give_one_line_and_exit_2_through_the_command(tmp_path, spoil):
    val = nocaps_file(tmp_path, "val", DOMAINS, captions=True)
    if spoil == "unreadable JSON":
        val.write_text(val.read_text()[:-20])
        expected = r"malformed JSON at line 1, column \d+"
    else:
        data = json.loads(val.read_text())
        expected = spoil(data, tmp_path)
        val.write_text(json.dumps(data))
    out = tmp_path / "out"
    options = ["--annotations", str(val), "--images", str(tmp_path / "images"), "--out", str(out)]
    command = [sys.executable, "-m", "mmoe.cli", "data", "convert", "nocaps", *options]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert done.stdout == "" and len(done.stderr.splitlines()) == 1, done.stderr
    assert done.stderr.startswith(f"mmoe data convert: error: {val}")
    assert re.search(expected, done.stderr), done.stderr
    assert not out.exists()
