"""The typed records a reader yields, one per sample, and where a record's images come from.

A reader (the official files: :mod:`.vqav2`, :mod:`.nlvr2`, :mod:`.coco`; HF parquet: :mod:`.parquet_vqav2`,
:mod:`.parquet_nlvr2`, :mod:`.parquet_captions`; a user's own table: :mod:`.own_data`) checks its whole input and
yields these records, each beside the :class:`ImageSource` of its image(s); one builder per benchmark
(:mod:`.build_vqa`, :mod:`.build_nlvr2`, :mod:`.build_captions`) turns them into samples and writes the split. So
the samples of a benchmark are written by one function, whatever file they were read from.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from mmoe.data.converters.common import Skip, image_or_skip
from mmoe.data.converters.image_digests import IMAGE_ID_KEY, IMAGE_SOURCES_KEY, folder_image_id


class ImageSource(Protocol):
    """Where one image of a sample comes from, read only when its sample is written; ``where`` names it in errors."""

    where: str

    def load(self) -> tuple[bytes, str] | Skip:
        """The image's bytes and extension as a sample stores them, or a :class:`Skip` saying why it cannot be used."""
        ...

    def digest_id(self) -> str | None:
        """The image's id in ``image_digests.json`` when the sample's metadata does not give it, else None."""
        ...


@dataclass(frozen=True)
class ImageFile:
    """An image file; ``folder`` is set for a user's own image (``relative`` to it), whose digest id names the folder
    (:func:`mmoe.data.converters.image_digests.folder_image_id`)."""

    path: Path
    folder: Path | None = None
    relative: str = ""

    @property
    def where(self) -> str:
        return str(self.path)

    def load(self) -> tuple[bytes, str] | Skip:
        return image_or_skip(self.path)

    def digest_id(self) -> str | None:
        return folder_image_id(self.folder, self.relative) if self.folder is not None else None


def with_image(sample: dict[str, Any], source: ImageSource, entry: str | None = None) -> dict[str, Any] | Skip:
    """Adds the image of ``source`` to ``sample`` (under its format's extension, or under ``entry``), or a Skip."""
    image = source.load()
    if isinstance(image, Skip):
        return image
    digest_id = source.digest_id()
    if digest_id is not None:
        sample = {**sample, IMAGE_ID_KEY: digest_id}
    data, extension = image
    sample[entry or extension] = data
    sample[IMAGE_SOURCES_KEY] = {**sample.get(IMAGE_SOURCES_KEY, {}), entry or extension: source.where}
    return sample


@dataclass(frozen=True)
class VQAQuestion:
    """One VQA question; ``answers`` (the human answers) and the fields after it only in an annotated split."""

    question_id: int
    image_id: int
    question: str
    answers: list[str] | None = None
    multiple_choice_answer: str = ""
    answer_type: str = ""
    question_type: str = ""


@dataclass(frozen=True)
class NLVR2Pair:
    """One NLVR2 statement about a pair of images; ``label`` None in an unlabelled split. ``where`` names the record in
    errors (``dev.json:2``, ``dev.parquet: row 1``), ``cited`` in another record's errors (``line 2``)."""

    identifier: str
    sentence: str
    label: bool | None
    where: str
    cited: str


@dataclass(frozen=True)
class CaptionedImage:
    """One image with all its captions (captioning and retrieval); ``split`` is the Karpathy split it comes from,
    ``domain`` its NoCaps domain (:data:`mmoe.metrics.nocaps.DOMAINS`)."""

    image_id: int
    captions: list[str]
    file_name: str
    split: str | None = None
    domain: str | None = None
