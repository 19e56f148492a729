"""Pre-training corpora -> shards: image folders (image-only), image-caption TSV files (pairs), text files
(text-only, one text per line). A TSV image path must lie inside the image folder; an input without any sample is an
error."""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from mmoe.data.converters.common import (
    IMAGE_SUFFIXES,
    ConversionError,
    Skip,
    bounded_text,
    images_folder,
    path_under,
    read_lines,
    write_split,
)
from mmoe.data.converters.provenance import provenance
from mmoe.data.converters.records import ImageFile, with_image
from mmoe.data.shards import Manifest


def convert_images(
    images: str | os.PathLike, out: str | os.PathLike, shard_size: int = 1000, name: str = "images"
) -> Manifest:
    """Every image under ``images`` (recursive, sorted; .jpg .jpeg .png .webp) as an image-only sample with
    ``json`` = ``path`` (relative to ``images``)."""
    root = images_folder(images)
    paths = sorted(p for p in root.rglob("*") if p.suffix.lower() in IMAGE_SUFFIXES and p.is_file())
    if not paths:
        raise ConversionError(f"--images {root}: no {'/'.join(IMAGE_SUFFIXES)} files under it")

    def samples() -> Iterator[dict[str, Any] | Skip]:
        for index, path in enumerate(paths):
            relative = path.relative_to(root).as_posix()
            sample = {"__key__": f"{index:09d}", "json": {"path": relative}}
            yield with_image(sample, ImageFile(path, root, relative))

    rule = f"every {'/'.join(IMAGE_SUFFIXES)} file under --images, sorted by path"
    return write_split(out, name, samples(), shard_size, {"source": {"images": str(root)}, **provenance([], rule)})


def convert_tsv(
    tsv: str | os.PathLike,
    images: str | os.PathLike,
    out: str | os.PathLike,
    shard_size: int = 1000,
    name: str = "pairs",
) -> Manifest:
    """Image-text pairs from a TSV file of ``image_path<TAB>caption`` lines (paths relative to ``images``); each
    sample holds the image, ``txt`` and ``json`` = ``path``, ``line``."""
    tsv, root = Path(tsv), images_folder(images)
    rows = []
    for number, line in enumerate(read_lines(tsv), start=1):
        if not line.strip():
            continue
        parts = line.split("\t")
        if len(parts) != 2 or not parts[0].strip() or not parts[1].strip():
            raise ConversionError(f"{tsv}:{number}: expected 'image_path<TAB>caption', got {line[:80]!r}")
        file = path_under(root, parts[0].strip(), f"{tsv}:{number}")
        caption = bounded_text(parts[1], f"{tsv}:{number}", "the caption").strip()
        rows.append((number, file.relative_to(root).as_posix(), file, caption))  # ./0.jpg is 0.jpg
    if not rows:
        raise ConversionError(f"{tsv}: no 'image_path<TAB>caption' lines to convert")

    def samples() -> Iterator[dict[str, Any] | Skip]:
        for index, (number, path, file, caption) in enumerate(rows):
            sample = {"__key__": f"{index:09d}", "txt": caption, "json": {"path": path, "line": number}}
            yield with_image(sample, ImageFile(file, root, path))

    extra = {"source": {"tsv": str(tsv), "images": str(root)}, **provenance([tsv], "every line of the file")}
    return write_split(out, name, samples(), shard_size, extra)


def convert_text(
    texts: Sequence[str | os.PathLike], out: str | os.PathLike, shard_size: int = 1000, name: str = "text"
) -> Manifest:
    """Text-only samples, one per non-empty line of each file; ``json`` = ``file``, ``line``."""
    if not texts:
        raise ConversionError("--text: give at least one file")
    files = [(Path(path), read_lines(Path(path))) for path in texts]
    if not any(line.strip() for _, lines in files for line in lines):
        raise ConversionError(f"--text {' '.join(str(path) for path, _ in files)}: no non-empty lines to convert")

    def samples() -> Iterator[dict[str, Any]]:
        index = 0
        for path, lines in files:
            for number, line in enumerate(lines, start=1):
                if line.strip():
                    yield {"__key__": f"{index:09d}", "txt": line.strip(), "json": {"file": path.name, "line": number}}
                    index += 1

    extra = {"source": {"text": [str(path) for path, _ in files]}}
    extra.update(provenance([path for path, _ in files], "every non-empty line of each file, in order"))
    return write_split(out, name, samples(), shard_size, extra)
