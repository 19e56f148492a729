"""A shard folder in img2dataset's exact webdataset layout, with planted failures, small images and repeats.

Per shard ``NNNNN.tar`` holds ``<key>.jpg``, ``<key>.txt`` and ``<key>.json`` for each successful download (json keys
as img2dataset writes them, plus DataComp's ``uid``); ``NNNNN.parquet`` beside it holds one row per attempted sample,
failed downloads included (only there), and ``NNNNN_stats.json`` the counts.
"""

from __future__ import annotations

import hashlib
import io
import json
import tarfile
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from PIL import Image

#: The json keys of an img2dataset sample (and its parquet columns), DataComp's uid last.
JSON_KEYS = ("url", "caption", "key", "status", "error_message", "width", "height", "original_width",
             "original_height", "exif", "md5", "uid")  # fmt: skip


@dataclass(frozen=True)
class Attempt:
    """One attempted download: ``side`` px square image on success, ``status`` otherwise; ``uid`` and ``key`` given
    to plant repeats (default: a fresh uid and the shard's next key); ``original``: the downloaded image's side
    before img2dataset resized it to ``side`` (default: ``side``, not resized)."""

    side: int = 40
    status: str = "success"
    uid: str | None = None
    key: str | None = None
    original: int | None = None


def image_bytes(side: int, shade: int) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (side, side), (shade % 256, (3 * shade) % 256, 90)).save(buffer, format="JPEG")
    return buffer.getvalue()


def _add(archive: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    archive.addfile(info, io.BytesIO(data))


def write_shard(folder: Path, shard: int, attempts: list[Attempt]) -> list[dict]:
    """Writes one shard's tar, parquet and stats; returns the parquet rows."""
    rows = []
    with tarfile.open(folder / f"{shard:05d}.tar", "w") as archive:
        for index, attempt in enumerate(attempts):
            key = attempt.key or f"{shard:05d}{index:04d}"
            ok = attempt.status == "success"
            data = image_bytes(attempt.side, shard * 100 + index) if ok else b""
            row = {
                "url": f"http://127.0.0.1/{key}.jpg", "caption": f"a picture number {shard * 100 + index}",
                "key": key, "status": attempt.status, "error_message": None if ok else "404 Client Error",
                "width": attempt.side if ok else None, "height": attempt.side if ok else None,
                "original_width": (attempt.original or attempt.side) if ok else None,
                "original_height": (attempt.original or attempt.side) if ok else None,
                "exif": None, "md5": hashlib.md5(data).hexdigest() if ok else None,
                "uid": attempt.uid or hashlib.md5(key.encode()).hexdigest(),
            }  # fmt: skip
            rows.append(row)
            if ok:
                _add(archive, f"{key}.jpg", data)
                _add(archive, f"{key}.txt", row["caption"].encode())
                _add(archive, f"{key}.json", json.dumps(row).encode())
    sizes = ("width", "height", "original_width", "original_height")
    schema = pa.schema([(name, pa.int64() if name in sizes else pa.string()) for name in JSON_KEYS])
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), folder / f"{shard:05d}.parquet")
    successes = sum(row["status"] == "success" for row in rows)
    stats = {"count": len(rows), "successes": successes, "failed_to_download": len(rows) - successes}
    (folder / f"{shard:05d}_stats.json").write_text(json.dumps(stats))
    return rows


#: Two shards of 7 attempts: 2 failed downloads, 1 image below 32 px, 1 repeated key, 1 repeated DataComp uid;
#: 9 samples to train on. The last sample of the last shard is a kept one (a run that reads one pass meets every
#: planted sample before its last batch).
PLANTED = [
    [Attempt(), Attempt(status="failed_to_download"), Attempt(side=16), Attempt(), Attempt(uid="u-dup"), Attempt(),
     Attempt()],
    [Attempt(), Attempt(uid="u-dup"), Attempt(key="000000000"), Attempt(status="failed_to_download"), Attempt(),
     Attempt(), Attempt()],
]  # fmt: skip
PLANTED_CAUSES = {"status": 2, "too_small": 1, "duplicate_key": 1, "duplicate_uid": 1}
PLANTED_KEPT = 9


def write_planted(folder: Path) -> Path:
    """The :data:`PLANTED` shards in ``folder`` (created); returns it."""
    folder.mkdir(parents=True, exist_ok=True)
    for shard, attempts in enumerate(PLANTED):
        write_shard(folder, shard, attempts)
    return folder
