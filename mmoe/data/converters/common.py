"""What every converter shares: clear input errors, image checks, and writing shards plus a manifest.

A converter validates its input files completely before writing anything; a bad record stops it with a
:class:`ConversionError` naming the file, the line or record, the field and the value (an image path taken from an
input file that points outside ``--images`` is such a bad record). A missing or unreadable image only skips its
sample: it is counted in the manifest and the first few paths are printed. A conversion without any sample is an
error. :func:`write_split` writes a whole split beside ``OUT`` and swaps it in at the end, so ``OUT`` always holds
one whole conversion.
"""

from __future__ import annotations

import functools
import io
import json
import os
import re
import shutil
import sys
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from PIL import Image, UnidentifiedImageError

from mmoe.atomic import write_json_atomic, write_text_atomic
from mmoe.data.converters.image_digests import IMAGE_DIGESTS_FILE, ImageDigests
from mmoe.data.converters.staging import (
    OutputFolderError,
    check_replaceable,
    clean_leftovers,
    output_folder,
    staging_folder,
    swap_in,
)
from mmoe.data.shards import MANIFEST, Manifest, ShardWriter, check_shard_name
from mmoe.data.transforms import to_rgb
from mmoe.io import json_excerpt, one_line, parse_json, read_json, require_field

#: How many skipped image paths a converter prints (all are counted).
SHOWN_SKIPS = 5
IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".webp")
_EXTENSION_OF_FORMAT = {"JPEG": "jpg", "PNG": "png", "WEBP": "webp"}
#: Longest caption, question or sentence a converter takes, in characters. The models read 32 to 64 tokens of a text
#: (:data:`mmoe.data.tokenizer.DEFAULT_MAX_TEXT_LENGTH`), but tokenising a text costs time and about 30 bytes of memory
#: per character, at conversion (``caption_tokens.json``) and at every read: a 100 MB caption took 106 s and 2.9 GB.
MAX_TEXT_CHARS = 1 << 16


class ConversionError(ValueError):
    """Bad converter input: the message names the file, the line or record, the field and the value."""


@dataclass
class Skip:
    """A sample left out because of its image."""

    path: str
    reason: str


def load_json(path: str | os.PathLike) -> Any:
    """Parses a JSON file; a missing file or bad JSON is a :class:`ConversionError` naming the file (and the line and
    column of bad JSON)."""
    return read_json(path, error=ConversionError)


def field(record: Any, name: str, kind: type | tuple[type, ...], where: str) -> Any:
    """``record[name]``, checked to be of ``kind``; otherwise a ConversionError naming ``where``, field and value
    (:func:`mmoe.io.require_field`)."""
    return require_field(record, name, kind, where, error=ConversionError)


def bounded_text(text: str, where: str, what: str) -> str:
    """``text`` when it is at most :data:`MAX_TEXT_CHARS` long; else a ConversionError naming ``where`` (file and row),
    ``what`` (the field) and the length."""
    if len(text) > MAX_TEXT_CHARS:
        raise ConversionError(
            f"{where}: {what} is {len(text):,} characters long, more than the {MAX_TEXT_CHARS:,} a caption, question "
            "or sentence may have (the models read at most 64 tokens of it)"
        )
    return text


def list_field(record: Any, name: str, where: str) -> list:
    return field(record, name, list, where)


@functools.lru_cache(maxsize=256)
def read_image(path: str) -> tuple[bytes, str]:
    """:func:`image_of_bytes` of the file at ``path``. Raises OSError / ValueError for a missing or unreadable file.
    Cached, since one COCO image serves several VQA questions."""
    return image_of_bytes(Path(path).read_bytes())


def image_of_bytes(data: bytes) -> tuple[bytes, str]:
    """Encoded image bytes as a sample stores them, with the extension of their actual format (jpg / png / webp), after
    a full decode. Other formats (GIF, BMP, TIFF, ...) are re-encoded as 8-bit RGB PNG (16-bit greyscale scaled, not
    clipped: :func:`mmoe.data.transforms.to_rgb`). Raises what the decoder raises for bytes it cannot read."""
    with Image.open(io.BytesIO(data)) as image:
        image_format = image.format
        if image_format == "JPEG":
            image.draft("RGB", (64, 64))  # decoding at 1/8 scale still reads (and checks) the whole stream
        image.load()
        if image_format not in _EXTENSION_OF_FORMAT:
            buffer = io.BytesIO()
            to_rgb(image).save(buffer, format="PNG")
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
        return Skip(path, unreadable(error))


#: An object named by its ``repr`` in an error message (``<_io.BytesIO object at 0x7fca3a7feca0>``).
_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+>")


def unreadable(error: BaseException) -> str:
    """Why an image could not be decoded, as a :class:`Skip` stores it in the manifest: the same text for the same
    input in every run. Pillow's message for bytes it cannot identify names the buffer it read by its ``repr``, a
    memory address; that case is said in words, and any other address is dropped from the message."""
    if isinstance(error, UnidentifiedImageError):
        return "unreadable (not an image: Pillow cannot identify it)"
    return f"unreadable ({type(error).__name__}: {_ADDRESS.sub('>', one_line(error))})"


def images_folder(images: str | os.PathLike, option: str = "--images") -> Path:
    """The image folder, which must exist (a mistyped path would otherwise skip every sample)."""
    images = Path(images)
    if not images.is_dir():
        raise ConversionError(f"{option} {images}: not a folder")
    return images


def path_under(root: Path, relative: str, where: str) -> Path:
    """``root / relative`` for an image path taken from an input file; a path that is absolute or climbs out of
    ``root`` with ``..`` is a ConversionError naming ``where`` and the path. The test is on the text of the path:
    symbolic links inside ``root`` may point anywhere."""
    normal = os.path.normpath(relative) if relative else ""
    if not normal or "\0" in relative or os.path.isabs(relative) or normal == os.pardir or normal.startswith("../"):
        raise ConversionError(
            f"{where}: image path {relative!r} is outside --images {root}; image paths must be relative to it"
        )
    return root / normal


def path_inside(root: Path, relative: str, where: str) -> Path:
    """:func:`path_under`, and the file it names, links resolved, inside ``root`` too: a symbolic link out of
    ``root`` is a ConversionError naming ``where`` (a user's own table never reaches outside its image folder)."""
    path = path_under(root, relative, where)
    inside, real_root = os.path.realpath(path), os.path.realpath(root)
    if os.path.commonpath([inside, real_root]) != real_root:
        raise ConversionError(f"{where}: image path {relative!r} links out of --images {root}")
    return path


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
    files: Mapping[str, str] | None = None,
) -> Manifest:
    """Writes ``samples`` (sample dicts, or :class:`Skip` for left-out ones) as ``OUT/<name>-%06d.tar`` shards,
    ``files`` (file name -> text, e.g. ``answers.json``) and ``OUT/manifest.json``.

    The whole split is written into a staging folder beside ``OUT`` and swapped in at the end
    (:mod:`mmoe.data.converters.staging`): ``OUT`` holds the complete old split until the complete new one replaces
    it. ``OUT`` holds one split: if it holds a different split's manifest or other data, this stops before writing.
    A conversion that writes no sample (no records, or every image skipped) is a ConversionError; ``OUT`` stays as it
    was.
    """
    try:
        check_shard_name(name)
    except ValueError as error:
        raise ConversionError(f"{error}; pass a valid --name") from None
    check_shard_size(shard_size)
    try:
        out = output_folder(out)
        clean_leftovers(out)
        check_replaceable(out, name)
    except OutputFolderError as error:
        raise ConversionError(str(error)) from None
    staging = staging_folder(out)
    try:
        staging.mkdir(parents=True)
    except OSError as error:
        raise ConversionError(f"--out {out}: cannot create the staging folder {staging} ({error.strerror})") from None
    try:
        manifest = _write_staged(staging, out, name, samples, shard_size, extra or {}, files or {})
        swap_in(staging, out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return manifest


def check_shard_size(shard_size: Any) -> int:
    """``--shard-size`` is a whole number of samples, at least 1."""
    if not isinstance(shard_size, int) or isinstance(shard_size, bool) or shard_size < 1:
        raise ConversionError(f"--shard-size must be a whole number >= 1 (samples per shard), got {shard_size!r}")
    return shard_size


def _write_staged(
    staging: Path,
    out: Path,
    name: str,
    samples: Iterable[dict[str, Any] | Skip],
    shard_size: int,
    extra: dict[str, Any],
    files: Mapping[str, str],
) -> Manifest:
    """Writes the shards, ``files`` and the manifest into ``staging``; ``out`` is where they will be read."""
    skips: list[Skip] = []
    digests = ImageDigests()
    with ShardWriter(staging, name, max_count=shard_size) as writer:
        for sample in samples:
            if isinstance(sample, Skip):
                if len(skips) < SHOWN_SKIPS:
                    print(f"skipped {sample.path}: {sample.reason}", file=sys.stderr)
                skips.append(sample)
                continue
            try:
                digests.add(sample)
            except ValueError as error:  # one image id given to two different images
                raise ConversionError(str(error)) from None
            writer.write(sample)
    if writer.samples == 0:
        raise ConversionError(_nothing_to_write(extra, skips, out))
    if len(skips) > SHOWN_SKIPS:
        print(f"skipped {len(skips) - SHOWN_SKIPS} more samples (see {out / MANIFEST})", file=sys.stderr)
    if len(digests):
        files = {**files, IMAGE_DIGESTS_FILE: digests.text()}
    for file_name, text in files.items():
        if "/" in file_name or file_name == MANIFEST or file_name.startswith(f"{name}-"):
            raise ValueError(f"write_split: {file_name!r} cannot be a split's extra file")
        write_text_atomic(staging / file_name, text)
    manifest = Manifest(
        name=name,
        samples=writer.samples,
        skipped=len(skips),
        shards=len(writer.shards),
        shard_files=writer.shards,
        shard_samples=writer.shard_samples,
        skipped_examples=[f"{skip.path}: {skip.reason}" for skip in skips[:20]],
        files=sorted(files),
        extra=extra,
    )
    write_json_atomic(staging / MANIFEST, manifest.to_json())
    return manifest


def _nothing_to_write(extra: dict[str, Any], skips: list[Skip], out: Path) -> str:
    """The error of a conversion without samples, naming its input files."""
    source = extra.get("source") or {}
    inputs = ", ".join(str(value) for value in source.values() if value) if isinstance(source, dict) else str(source)
    if skips:
        first = skips[0]
        return (
            f"{inputs}: all {len(skips)} samples were skipped (first: {first.path}: {first.reason}); check --images. "
            f"Nothing was written to {out}"
        )
    return f"{inputs}: no samples to convert. Nothing was written to {out}"


def json_text(value: Any, indent: int | None = 2) -> str:
    """``value`` as the text :func:`mmoe.atomic.write_json_atomic` writes (non-ASCII kept, trailing newline)."""
    return json.dumps(value, indent=indent, ensure_ascii=False) + "\n"


def read_lines(path: Path) -> list[str]:
    """The lines of a UTF-8 text file, a leading byte order mark (which Excel and Notepad write) dropped. A line ends
    at ``\\n``, ``\\r\\n`` or ``\\r`` only: ``str.splitlines`` also ends one at U+2028, U+0085, ``\\x0b``,
    ``\\x0c`` and others, which a caption or a JSON string may hold as they are."""
    try:
        text = path.read_text(encoding="utf-8-sig")  # universal newlines: \r\n and \r are read as \n
    except OSError as error:
        raise ConversionError(f"{path}: cannot read ({error.strerror or error})") from None
    except UnicodeDecodeError as error:
        raise ConversionError(f"{path}: not UTF-8 text (byte {error.start})") from None
    return text.split("\n")


def iter_json_lines(path: str | os.PathLike) -> Iterator[tuple[int, dict[str, Any]]]:
    """(line number, object) for each non-empty line of a JSON lines file (:func:`read_lines`); bad lines are
    ConversionErrors."""
    path = Path(path)
    for number, line in enumerate(read_lines(path), start=1):
        if not line.strip():
            continue
        try:
            record = parse_json(line)
        except json.JSONDecodeError as error:
            raise ConversionError(f"{path}:{number}: not valid JSON at column {error.colno}: {error.msg}") from None
        if not isinstance(record, dict):
            raise ConversionError(f"{path}:{number}: expected a JSON object, got {json_excerpt(record)}")
        yield number, record
