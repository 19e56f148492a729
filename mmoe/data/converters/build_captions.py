"""The caption sample builder: :class:`~mmoe.data.converters.records.CaptionedImage` records -> one sample per image
with all its captions (the captioning and the retrieval tasks' shards), whichever reader gave them (COCO's captions
files, Karpathy's split files, HF parquet rows, a user's own table).

Each sample: the image, ``txt`` = the first caption, ``json`` = ``image_id``, ``captions``, ``file_name`` and, from a
Karpathy split, ``split``, from NoCaps, ``domain``. Each image's captions are its distinct captions
(:class:`CaptionSet`: the same caption twice is kept once, counted as ``duplicate_captions`` in the manifest). Next to
the shards, ``caption_tokens.json`` lists the tokenizer ids the split's captions use
(:func:`mmoe.data.tokenizer.token_ids_of`): the output vocabulary a captioning head can be restricted to
(``CaptioningFineTuning(output_vocab=...)``).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from mmoe.atomic import write_text_atomic
from mmoe.data.converters.common import Skip, bounded_text, json_text, write_split
from mmoe.data.converters.records import CaptionedImage, ImageSource, with_image
from mmoe.data.shards import Manifest
from mmoe.data.tokenizer import TextTokenizer, token_ids_of

#: Written next to a caption split's shards: the sorted tokenizer ids of its captions, end-of-text included.
CAPTION_TOKENS_FILE = "caption_tokens.json"


def caption_tokens_text(captions: Iterable[str], tokenizer: TextTokenizer | None = None) -> str:
    """The text of ``caption_tokens.json``: the ids :func:`mmoe.data.tokenizer.token_ids_of` finds in ``captions``
    with ``tokenizer`` (open_clip's BPE by default)."""
    return json_text(token_ids_of(captions, tokenizer), indent=None)


def write_caption_tokens(
    out: str | os.PathLike, captions: Iterable[str], tokenizer: TextTokenizer | None = None
) -> None:
    """Writes ``out/caption_tokens.json`` for ``captions`` (a converted split gets it from :func:`write_split`)."""
    write_text_atomic(Path(out) / CAPTION_TOKENS_FILE, caption_tokens_text(captions, tokenizer))


class CaptionSet:
    """The captions of each image, each distinct caption once; repeats are counted and the first one remembered."""

    def __init__(self) -> None:
        self.by_image: dict[int, list[str]] = {}
        self.duplicates = 0
        self.first_duplicate = ""
        self._seen: set[tuple[int, str]] = set()

    def add(self, image_id: int, caption: str, where: str) -> None:
        """Adds ``caption``, read at ``where`` (one longer than
        :data:`~mmoe.data.converters.common.MAX_TEXT_CHARS` is a ConversionError)."""
        caption = bounded_text(caption, where, "the caption").strip()
        if (image_id, caption) in self._seen:
            self.duplicates += 1
            self.first_duplicate = self.first_duplicate or where
            return
        self._seen.add((image_id, caption))
        self.by_image.setdefault(image_id, []).append(caption)

    def report(self, source: str | os.PathLike) -> dict[str, int]:
        """Prints how many repeated captions were dropped; returns the manifest entry."""
        if self.duplicates:
            print(
                f"{source}: dropped {self.duplicates} repeated captions (the same caption twice for one image; "
                f"first: {self.first_duplicate})",
                file=sys.stderr,
            )
        return {"duplicate_captions": self.duplicates}

    def all_captions(self) -> Iterator[str]:
        return (caption for captions in self.by_image.values() for caption in captions)


def caption_sample(image: CaptionedImage) -> dict[str, Any]:
    """The sample of one image without its pixels."""
    meta: dict[str, Any] = {"image_id": image.image_id, "captions": image.captions, "file_name": image.file_name}
    if image.split is not None:
        meta["split"] = image.split
    if image.domain is not None:
        meta["domain"] = image.domain
    return {"__key__": str(image.image_id), "txt": image.captions[0] if image.captions else "", "json": meta}


def write_caption_split(
    out: str | os.PathLike,
    name: str,
    images: Iterable[tuple[CaptionedImage, ImageSource] | Skip],
    captions: CaptionSet,
    source: str | os.PathLike,
    shard_size: int,
    extra: dict[str, Any],
    tokenizer: TextTokenizer | None = None,
) -> Manifest:
    """Writes one sample per image (a :class:`Skip` the reader decided is counted) as the split ``name`` in ``out``,
    with ``caption_tokens.json`` of ``captions`` (read from ``source``)."""

    def samples() -> Iterator[dict[str, Any] | Skip]:
        for item in images:
            yield item if isinstance(item, Skip) else with_image(caption_sample(item[0]), item[1])

    files = {CAPTION_TOKENS_FILE: caption_tokens_text(captions.all_captions(), tokenizer)}
    return write_split(out, name, samples(), shard_size, {**extra, **captions.report(source)}, files)
