"""The NLVR2 sample builder: :class:`~mmoe.data.converters.records.NLVR2Pair` records -> one sample per statement,
whichever reader gave them (the official JSON lines and image files, HF parquet rows), and the checks every NLVR2
reader makes of its records.

Each sample holds ``left.png`` and ``right.png`` (the images' bytes), ``txt`` = the sentence and ``json`` =
``identifier``, ``sentence``, ``label`` (true / false / null), ``left``, ``right`` (the pair's official file names,
:func:`image_names`). Labels are the official ``"True"`` / ``"False"`` strings (any case) or booleans; a split is
labelled throughout or not at all, and one without labels converts with ``"labelled": false`` in its manifest.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

from mmoe.data.converters.common import ConversionError, Skip, write_split
from mmoe.data.converters.records import ImageSource, NLVR2Pair, with_image
from mmoe.data.shards import Manifest


def image_names(identifier: str) -> tuple[str, str]:
    """The left and right image file names of an NLVR2 identifier (the official rule:
    ``'-'.join(identifier.split('-')[:3]) + '-img0.png'`` and ``'-img1.png'``)."""
    stem = "-".join(identifier.split("-")[:3])
    return f"{stem}-img0.png", f"{stem}-img1.png"


def parse_label(value: Any, where: str, identifier: str = "") -> bool | None:
    """``"True"`` / ``"False"`` (any case) or a boolean; None for a missing (null) label."""
    if value is None:
        return None
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("true", "false"):
        return value.lower() == "true"
    of = f" of {identifier!r}" if identifier else ""
    raise ConversionError(f'{where}: field \'label\'{of} must be "True" or "False", got {value!r}')


def check_identifier(identifier: str, where: str, first_at: dict[str, str]) -> str:
    """A well-formed identifier (``split-set-pair-sentence``) not seen before (``first_at``: identifier -> how its
    record is cited), which is added to ``first_at``."""
    if len(identifier.split("-")) < 4 or "." in identifier or "/" in identifier:
        raise ConversionError(f"{where}: field 'identifier' must read split-set-pair-sentence, got {identifier!r}")
    if identifier in first_at:
        first = first_at[identifier]
        raise ConversionError(f"{where}: field 'identifier' = {identifier!r} appears twice (first at {first})")
    first_at[identifier] = where
    return identifier


def check_labels(pairs: Sequence[NLVR2Pair], source: str, unit: str, missing: Callable[[NLVR2Pair], str]) -> None:
    """A record without a label among labelled ones is an error naming both (``missing`` says what the first
    unlabelled record lacks); a split without labels is said so on stderr (``unit``: what ``source`` holds a record
    per, ``record`` or ``row``)."""
    labelled = next((pair for pair in pairs if pair.label is not None), None)
    unlabelled = next((pair for pair in pairs if pair.label is None), None)
    if labelled is not None and unlabelled is not None:
        raise ConversionError(
            f"{missing(unlabelled)}, but {labelled.cited} ({labelled.identifier!r}) has one; a split is labelled "
            "throughout or not at all"
        )
    if labelled is None:
        print(
            f"{source}: no {unit} has a 'label': converted as an unlabelled split (for predictions; training and "
            "evaluation need labels)",
            file=sys.stderr,
        )


def pair_sample(pair: NLVR2Pair, left: ImageSource, right: ImageSource) -> dict[str, Any] | Skip:
    """The sample of one statement with its two images, or the :class:`Skip` of the first unusable image."""
    sample: dict[str, Any] = {"__key__": pair.identifier, "txt": pair.sentence}
    for entry, image in (("left.png", left), ("right.png", right)):
        sample = with_image(sample, image, entry)
        if isinstance(sample, Skip):
            return sample
    left_name, right_name = image_names(pair.identifier)
    meta = {"identifier": pair.identifier, "sentence": pair.sentence, "label": pair.label}
    sample["json"] = {**meta, "left": left_name, "right": right_name}
    return sample


def write_nlvr2_split(
    out: str | os.PathLike,
    name: str,
    pairs: Iterable[tuple[NLVR2Pair, ImageSource, ImageSource]],
    labelled: bool,
    shard_size: int,
    extra: dict[str, Any],
) -> Manifest:
    """Writes one sample per statement as the split ``name`` in ``out``; the manifest says whether it is
    ``labelled``."""

    def samples() -> Iterator[dict[str, Any] | Skip]:
        for pair, left, right in pairs:
            yield pair_sample(pair, left, right)

    return write_split(out, name, samples(), shard_size, {**extra, "labelled": labelled})
