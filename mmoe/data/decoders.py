"""Sample decoders: raw shard samples (bytes per extension) -> items with tensors and token ids.

Each decoder raises :class:`mmoe.data.samples.CorruptSampleError` (with the shard and key) for bad image bytes,
a missing entry or bad JSON, so the pipeline's handler skips and counts the sample.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch

from mmoe.data.samples import CorruptSampleError, Sample
from mmoe.data.tokenizer import TextTokenizer
from mmoe.data.transforms import decode_image
from mmoe.io import parse_json

ImageTransform = Callable[[Any], torch.Tensor]
IMAGE_EXTENSIONS = ("jpg", "jpeg", "png", "webp")


def _where(sample: Sample) -> tuple[str, str]:
    return str(sample.get("__url__", "?")), str(sample.get("__key__", "?"))


def entry(sample: Sample, *extensions: str) -> bytes:
    """The first present entry among ``extensions``; a missing one is a corrupt sample."""
    for extension in extensions:
        if extension in sample:
            return sample[extension]
    raise CorruptSampleError(*_where(sample), f"missing entry {'|'.join(extensions)} (has {_present(sample)})")


def _present(sample: Sample) -> str:
    return ", ".join(sorted(key for key in sample if not key.startswith("__"))) or "nothing"


def image_entry(sample: Sample, transform: ImageTransform, *extensions: str, min_side: int | None = None):
    """Decodes and transforms an image entry (default: any of jpg / jpeg / png / webp)."""
    data = entry(sample, *(extensions or IMAGE_EXTENSIONS))
    try:
        image = decode_image(data, min_side)
    except Exception as error:
        raise CorruptSampleError(*_where(sample), f"undecodable image ({type(error).__name__}: {error})") from None
    return transform(image)


def text_entry(sample: Sample, extension: str = "txt") -> str:
    try:
        return entry(sample, extension).decode("utf-8")
    except UnicodeDecodeError as error:
        raise CorruptSampleError(*_where(sample), f"{extension} is not UTF-8 ({error})") from None


def json_entry(sample: Sample, *required: str) -> dict[str, Any]:
    """Parses the ``json`` entry; it must be an object holding the ``required`` fields."""
    try:
        value = parse_json(entry(sample, "json"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise CorruptSampleError(*_where(sample), f"bad JSON ({error})") from None
    if not isinstance(value, dict):
        raise CorruptSampleError(*_where(sample), f"json is a {type(value).__name__}, expected an object")
    missing = [name for name in required if name not in value]
    if missing:
        raise CorruptSampleError(*_where(sample), f"json lacks {', '.join(missing)}")
    return value


@dataclass
class ImageDecoder:
    """Image-only samples -> ``{"image", "key"}``."""

    transform: ImageTransform
    min_side: int | None = None

    def __call__(self, sample: Sample) -> Sample:
        return {"image": image_entry(sample, self.transform, min_side=self.min_side), "key": sample["__key__"]}


@dataclass
class TextDecoder:
    """Text-only samples -> ``{"text_ids", "key"}``."""

    tokenizer: TextTokenizer

    def __call__(self, sample: Sample) -> Sample:
        return {"text_ids": self.tokenizer.encode(text_entry(sample)), "key": sample["__key__"]}


@dataclass
class PairDecoder:
    """Image-text pairs -> ``{"image", "text_ids", "key"}``."""

    transform: ImageTransform
    tokenizer: TextTokenizer
    min_side: int | None = None

    def __call__(self, sample: Sample) -> Sample:
        text = text_entry(sample)
        image = image_entry(sample, self.transform, min_side=self.min_side)
        return {"image": image, "text_ids": self.tokenizer.encode(text), "key": sample["__key__"]}


@dataclass
class VQADecoder:
    """VQAv2 samples -> image, question ids, original ids, the 10 human answers and types.

    Args:
        transform: image transform.
        tokenizer: question tokenizer.
        vocab: answer -> class label; with it, ``labels`` / ``scores`` (soft targets) are computed from the human
            answers (see :func:`mmoe.data.answers.soft_targets`).
        drop_unanswerable: drop questions for which no vocabulary answer earns credit (training, as BEiT-3 and ViLT
            do).
    """

    transform: ImageTransform
    tokenizer: TextTokenizer
    vocab: dict[str, int] | None = None
    drop_unanswerable: bool = False
    min_side: int | None = None

    def __post_init__(self) -> None:
        from mmoe.data.answers import VocabIndex

        self._vocab_index = VocabIndex.of(self.vocab) if self.vocab is not None else None

    def __call__(self, sample: Sample) -> Sample | None:
        from mmoe.data.answers import soft_targets

        meta = json_entry(sample, "question_id", "image_id", "question")
        item = {
            "image": image_entry(sample, self.transform, min_side=self.min_side),
            "text_ids": self.tokenizer.encode(meta["question"]),
            "question_id": int(meta["question_id"]),
            "image_id": int(meta["image_id"]),
            "question": meta["question"],
            "answers": list(meta.get("answers") or []),
            "answer_type": meta.get("answer_type", ""),
            "question_type": meta.get("question_type", ""),
        }
        if self._vocab_index is not None and item["answers"]:
            item["labels"], item["scores"] = soft_targets(item["answers"], self._vocab_index)
            if self.drop_unanswerable and not item["labels"]:
                return None
        elif self.drop_unanswerable:
            return None
        return item


@dataclass
class NLVR2Decoder:
    """NLVR2 samples -> ``image_left``, ``image_right``, sentence ids, ``label`` (1 true, 0 false, -1 unknown),
    ``identifier``."""

    transform: ImageTransform
    tokenizer: TextTokenizer
    min_side: int | None = None

    def __call__(self, sample: Sample) -> Sample:
        meta = json_entry(sample, "identifier", "sentence")
        label = meta.get("label")
        return {
            "image_left": image_entry(sample, self.transform, "left.png", min_side=self.min_side),
            "image_right": image_entry(sample, self.transform, "right.png", min_side=self.min_side),
            "text_ids": self.tokenizer.encode(meta["sentence"]),
            "label": -1 if label is None else int(bool(label)),
            "identifier": meta["identifier"],
            "sentence": meta["sentence"],
        }


@dataclass
class CaptionDecoder:
    """COCO caption samples (one image, all its captions).

    ``mode="train"`` gives one item per caption (``image``, ``text_ids``, ``image_id``), as BEiT-3 trains;
    ``mode="eval"`` one item per image with ``captions``, the references.
    """

    transform: ImageTransform
    tokenizer: TextTokenizer
    mode: Literal["train", "eval"] = "train"
    min_side: int | None = None

    def __call__(self, sample: Sample) -> Sample | list[Sample]:
        meta = json_entry(sample, "image_id", "captions")
        image = image_entry(sample, self.transform, min_side=self.min_side)
        image_id, captions = int(meta["image_id"]), [str(c) for c in meta["captions"]]
        if self.mode == "eval":
            return {"image": image, "image_id": image_id, "captions": captions}
        return [
            {"image": image, "text_ids": self.tokenizer.encode(caption), "image_id": image_id} for caption in captions
        ]


@dataclass
class RetrievalDecoder:
    """Retrieval samples (one image with all its captions, as the caption converters write them).

    ``mode="train"`` gives one item per image with one of its captions drawn uniformly (torch's generator, which the
    stream seeds from the sample's position): an image never meets a second caption of its own as an in-batch
    negative. ``mode="eval"`` gives one item per image with ``caption_ids``, the token ids of every caption, and
    ``captions``.
    """

    transform: ImageTransform
    tokenizer: TextTokenizer
    mode: Literal["train", "eval"] = "train"
    min_side: int | None = None

    def __call__(self, sample: Sample) -> Sample | None:
        meta = json_entry(sample, "image_id", "captions")
        captions = [str(c) for c in meta["captions"]]
        if not captions:
            raise CorruptSampleError(*_where(sample), "json 'captions' is empty: retrieval needs a caption per image")
        image = image_entry(sample, self.transform, min_side=self.min_side)
        image_id = int(meta["image_id"])
        if self.mode == "eval":
            ids = [self.tokenizer.encode(caption) for caption in captions]
            return {"image": image, "image_id": image_id, "caption_ids": ids, "captions": captions}
        caption = captions[int(torch.randint(len(captions), ()))]
        return {"image": image, "image_id": image_id, "text_ids": self.tokenizer.encode(caption)}
