"""What every converter shares: clear input errors, image checks, and writing shards plus a manifest.

A converter validates its input files completely before writing anything; a bad record stops it with a
:class:`ConversionError` naming the file, the line or record, the field and the value. A missing or unreadable image
only skips its sample: it is counted in the manifest and the first few paths are printed.
"""

from __future__ import annotations

import functools
import io
import json
import os
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from PIL import Image

from mmoe.atomic import write_json_atomic
from mmoe.data.shards import MANIFEST, Manifest, ShardWriter

#: How many skipped image paths a converter prints (all are counted).
SHOWN_SKIPS = 5
IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".webp")
_EXTENSION_OF_FORMAT = {"JPEG": "jpg", "PNG": "png", "WEBP": "webp"}


class ConversionError(ValueError):
    """Bad converter input: the message names the file, the line or record, the field and the value."""


@dataclass
class Skip:
    """A sample left out because of its image."""

    path: str
    reason: str


def load_json(path: str | os.PathLike) -> Any:
    """Parses a JSON file; a missing file or bad JSON is a :class:`ConversionError` with the position."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as error:
        raise ConversionError(f"{path}: cannot read ({error.strerror or error})") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as error:
        position = f"line {error.lineno} column {error.colno}"
        raise ConversionError(f"{path}: not valid JSON at {position}: {error.msg}") from None


def field(record: Any, name: str, kind: type | tuple[type, ...], where: str) -> Any:
    """``record[name]``, checked to be of ``kind``; otherwise a ConversionError naming ``where``, field and value."""
    if not isinstance(record, dict):
        raise ConversionError(f"{where}: expected a JSON object, got {_short(record)}")
    if name not in record:
        raise ConversionError(f"{where}: missing field {name!r}")
    value = record[name]
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
        expected = " or ".join(k.__name__ for k in kinds)
        raise ConversionError(f"{where}: field {name!r} must be {expected}, got {_short(value)}")
    return value


def list_field(record: Any, name: str, where: str) -> list:
    return field(record, name, list, where)


def _short(value: Any) -> str:
    text = json.dumps(value, ensure_ascii=False) if not isinstance(value, bytes) else repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


@functools.lru_cache(maxsize=256)
def read_image(path: str) -> tuple[bytes, str]:
    """The file's bytes and the extension of its actual format (jpg / png / webp), after a full decode.

    Other formats (GIF, BMP, ...) are re-encoded as PNG. Raises OSError / ValueError for a missing or unreadable
    file. Cached, since one COCO image serves several VQA questions.
    """
    data = Path(path).read_bytes()
    with Image.open(io.BytesIO(data)) as image:
        image_format = image.format
        if image_format == "JPEG":
            image.draft("RGB", (64, 64))  # decoding at 1/8 scale still reads (and checks) the whole stream
        image.load()
        if image_format not in _EXTENSION_OF_FORMAT:
            buffer = io.BytesIO()
            image.convert("RGB").save(buffer, format="PNG")
            return buffer.getvalue(), "png"
    return data, _EXTENSION_OF_FORMAT[image_format]


def image_or_skip(path: str | os.PathLike) -> tuple[bytes, str] | Skip:
    """:func:`read_image`, or a :class:`Skip` saying why the image cannot be used."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        return Skip(path, "missing")
    try:
        return read_image(path)
    except Exception as error:  # any decoder failure makes the image unusable
        return Skip(path, f"unreadable ({type(error).__name__}: {error})")


def first_existing(candidates: Iterable[Path]) -> Path:
    """The first existing path among ``candidates`` (else the first candidate, which then reads as missing)."""
    candidates = list(candidates)
    return next((path for path in candidates if path.is_file()), candidates[0])


def write_split(
    out: str | os.PathLike,
    name: str,
    samples: Iterable[dict[str, Any] | Skip],
    shard_size: int = 1000,
    extra: dict[str, Any] | None = None,
) -> Manifest:
    """Writes ``samples`` (sample dicts, or :class:`Skip` for left-out ones) as ``OUT/<name>-%06d.tar`` shards and
    ``OUT/manifest.json``.

    ``OUT`` holds one split: if it already holds a different split's manifest, this stops before writing. Shards of
    an earlier run of the same split that the new run does not overwrite are removed after success.
    """
    out = Path(out)
    previous = out / MANIFEST
    if previous.exists():
        try:
            previous_name = json.loads(previous.read_text()).get("name")
        except (json.JSONDecodeError, AttributeError):
            previous_name = None
        if previous_name != name:
            raise ConversionError(
                f"{out} already holds shards of {previous_name!r}; write {name!r} to its own --out folder"
            )
    skips: list[Skip] = []
    with ShardWriter(out, name, max_count=shard_size) as writer:
        for sample in samples:
            if isinstance(sample, Skip):
                if len(skips) < SHOWN_SKIPS:
                    print(f"skipped {sample.path}: {sample.reason}", file=sys.stderr)
                skips.append(sample)
                continue
            writer.write(sample)
    if len(skips) > SHOWN_SKIPS:
        print(f"skipped {len(skips) - SHOWN_SKIPS} more samples (see {out / MANIFEST})", file=sys.stderr)
    for stale in sorted(out.glob(f"{name}-*.tar")):
        if stale.name not in writer.shards:
            stale.unlink()
    manifest = Manifest(
        name=name,
        samples=writer.samples,
        skipped=len(skips),
        shards=len(writer.shards),
        shard_files=writer.shards,
        skipped_examples=[f"{skip.path}: {skip.reason}" for skip in skips[:20]],
        extra=extra or {},
    )
    write_json_atomic(out / MANIFEST, manifest.to_json())
    return manifest


def with_image(sample: dict[str, Any], path: Path, entry: str | None = None) -> dict[str, Any] | Skip:
    """Adds the image at ``path`` to ``sample`` (under its format's extension, or under ``entry``), or a Skip."""
    image = image_or_skip(path)
    if isinstance(image, Skip):
        return image
    data, extension = image
    sample[entry or extension] = data
    return sample


def iter_json_lines(path: str | os.PathLike) -> Iterator[tuple[int, dict[str, Any]]]:
    """(line number, object) for each non-empty line of a JSON lines file; bad lines are ConversionErrors."""
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as error:
        raise ConversionError(f"{path}: cannot read ({error.strerror or error})") from None
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            raise ConversionError(f"{path}:{number}: not valid JSON at column {error.colno}: {error.msg}") from None
        if not isinstance(record, dict):
            raise ConversionError(f"{path}:{number}: expected a JSON object, got {_short(record)}")
        yield number, record
