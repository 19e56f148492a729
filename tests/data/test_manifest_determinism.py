"""Two identical conversions write byte-identical manifests, skipped samples included: a stored reason holds no
memory address (Pillow names the buffer it could not identify by its ``repr``, ``<_io.BytesIO object at 0x...>``).
Each conversion runs as ``mmoe data convert`` in a process of its own, as a user runs it twice."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from mmoe.data.shards import MANIFEST
from tests.data.test_converters import image_file, nlvr2_file
from tests.data.test_own_data import write_csv
from tests.data.test_parquet_converters import NLVR2_SCHEMA, cell, nlvr2_rows_without_images, write_parquet


def convert(argv: list[str], out: Path) -> bytes:
    """``mmoe data convert ARGV --out OUT`` in a new process; the manifest's bytes."""
    done = subprocess.run(
        [sys.executable, "-m", "mmoe.cli", "data", "convert", *argv, "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONHASHSEED": "random"},
    )
    assert done.returncode == 0, done.stderr
    return (out / MANIFEST).read_bytes()


def assert_twice_alike(argv: list[str], tmp_path: Path, skipped: int) -> list[str]:
    """Converts twice into two folders; the manifests are equal bytes and their stored reasons have no address."""
    first, second = convert(argv, tmp_path / "first"), convert(argv, tmp_path / "second")
    manifest = json.loads(first)
    assert manifest["skipped"] == skipped and len(manifest["skipped_examples"]) == skipped
    assert not any(" at 0x" in reason for reason in manifest["skipped_examples"]), manifest["skipped_examples"]
    assert first == second
    return manifest["skipped_examples"]


def test_own_pairs_with_unusable_images_write_the_same_manifest_twice(tmp_path):
    images = tmp_path / "images"
    image_file(images / "good.jpg")
    (images / "text.jpg").write_bytes(b"these are words, not a photograph\n")  # Pillow cannot identify it
    (images / "empty.png").write_bytes(b"")
    whole = image_file(tmp_path / "whole.png", image_format="PNG")
    (images / "cut.png").write_bytes(whole[: len(whole) // 2])  # a PNG cut short
    names = ["good.jpg", "text.jpg", "empty.png", "cut.png", "absent.jpg"]
    table = write_csv(tmp_path / "pairs.csv", [{"image": name, "caption": f"picture {name}"} for name in names])
    reasons = assert_twice_alike(["pairs", "--table", str(table), "--images", str(images)], tmp_path, skipped=4)
    assert f"{images / 'text.jpg'}: unreadable (not an image: Pillow cannot identify it)" in reasons
    assert f"{images / 'absent.jpg'}: missing" in reasons


def test_a_parquet_copy_with_undecodable_bytes_writes_the_same_manifest_twice(tmp_path):
    lines = [{"identifier": f"dev-{i}-0-0", "sentence": "s", "label": "True"} for i in range(3)]
    data = nlvr2_file(tmp_path / "dev.json", lines)
    real = tmp_path / "real.png"
    image_file(real, image_format="PNG")
    rows = [{**row, "left_image": cell(real), "right_image": cell(real)} for row in nlvr2_rows_without_images(data)]
    rows[1]["right_image"] = {"bytes": b"GIF89a but nothing after", "path": str(real)}
    rows[2]["left_image"] = {"bytes": b"plain text", "path": str(real)}
    copy = write_parquet(tmp_path / "dev.parquet", rows, NLVR2_SCHEMA)
    reasons = assert_twice_alike(["nlvr2", "--parquet", str(copy)], tmp_path, skipped=2)
    assert f"{copy}: row 2 (dev-2-0-0): field 'left_image': unreadable (not an image: Pillow cannot identify it)" in (
        reasons
    )
