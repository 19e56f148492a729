"""Inputs of the routing analyses: a directory of images, image files, or webdataset shards, made into batches.

* Images (``.jpg``, ``.jpeg``, ``.png``, ``.webp``: :data:`mmoe.data.decoders.IMAGE_EXTENSIONS`) are read with PIL
  (16-bit greyscale scaled, :func:`mmoe.data.transforms.to_rgb`), resized (shorter side, bicubic) and center-cropped
  to the checkpoint's ``image_size``, and normalised with the training data's mean and std. An unreadable file is an
  :class:`InputError` naming it.
* Shards are ``*.tar`` files in webdataset layout (members ``<key>.<ext>``): an image entry is the image, ``txt`` the
  text (its first line), ``json`` metadata (unused here). They are read with :mod:`tarfile`, one sample at a time.
* Texts are tokenised by the training data's tokenizer (:class:`mmoe.data.tokenizer.TextTokenizer`) and padded to
  the longest text of the batch.
"""

from __future__ import annotations

import io
import tarfile
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image, UnidentifiedImageError

from mmoe.data.batches import IMAGE, PAIR, TEXT, BatchKind
from mmoe.data.decoders import IMAGE_EXTENSIONS
from mmoe.data.tokenizer import CAPTION_MAX_TEXT_LENGTH, TextTokenizer
from mmoe.data.transforms import normalize, to_rgb

#: Image files and shard entries read, as the training data's decoders read them.
IMAGE_SUFFIXES = tuple(f".{extension}" for extension in IMAGE_EXTENSIONS)


class InputError(ValueError):
    """A bad input file or value; the message names it."""


@dataclass
class Sample:
    """One input: ``name`` says where it came from (a file, or ``shard.tar:key``)."""

    name: str
    image: Path | bytes | None = None
    text: str | None = None

    @property
    def kind(self) -> BatchKind:
        return {(True, True): PAIR, (True, False): IMAGE, (False, True): TEXT}[
            (self.image is not None, self.text is not None)
        ]


def find_samples(
    paths: Sequence[str | Path], limit: int | None = None, wanted: Callable[[Sample], bool] | None = None
) -> list[Sample]:
    """Samples from image files, ``.tar`` shards, or directories holding either (sorted by name, not recursive).

    Args:
        paths: files or directories.
        limit: stop after this many samples.
        wanted: keep only the samples it accepts (e.g. those with an image).

    Raises:
        FileNotFoundError: a path does not exist.
        InputError: a file is neither an image nor a shard, a shard is unreadable, or nothing was found.
    """
    samples: list[Sample] = []
    for raw in paths:
        path = Path(raw)
        if not path.exists():
            raise FileNotFoundError(f"input {path} does not exist")
        files = sorted(p for p in path.iterdir() if p.is_file()) if path.is_dir() else [path]
        usable = [p for p in files if p.suffix.lower() in IMAGE_SUFFIXES + (".tar",)]
        if path.is_file() and not usable:
            raise InputError(f"input {path} is neither an image ({', '.join(IMAGE_SUFFIXES)}) nor a .tar shard")
        for file in usable:
            found = read_shard(file) if file.suffix.lower() == ".tar" else [Sample(str(file), image=file)]
            for sample in found:
                if wanted is None or wanted(sample):
                    samples.append(sample)
                if limit is not None and len(samples) >= limit:
                    return samples
    if not samples:
        raise InputError(f"no usable images or .tar shard samples found in {', '.join(str(p) for p in paths)}")
    return samples


def read_shard(path: Path) -> Iterator[Sample]:
    """The samples of one webdataset shard in member order (a sample's members are contiguous), keeping those with
    an image or a text. Reading stops as soon as the caller stops iterating."""
    try:
        with tarfile.open(path) as archive:
            key, entries = None, {}
            for member in archive:
                if not member.isfile():
                    continue
                directory, _, base = member.name.rpartition("/")
                stem, dot, extension = base.partition(".")
                if not dot:
                    continue
                member_key = f"{directory}/{stem}" if directory else stem
                if member_key != key:
                    if key is not None and (sample := _shard_sample(path, key, entries)) is not None:
                        yield sample
                    key, entries = member_key, {}
                entries[extension.lower()] = archive.extractfile(member).read()
            if key is not None and (sample := _shard_sample(path, key, entries)) is not None:
                yield sample
    except (tarfile.TarError, OSError, EOFError) as error:
        raise InputError(f"shard {path} could not be read: {error}") from error


def _shard_sample(path: Path, key: str, entries: dict[str, bytes]) -> Sample | None:
    image = next((entries[k] for k in IMAGE_EXTENSIONS if k in entries), None)
    text = None
    if "txt" in entries:
        text = entries["txt"].decode("utf-8", errors="replace").strip().split("\n")[0] or None
    if image is None and text is None:
        return None
    return Sample(f"{path}:{key}", image=image, text=text)


def load_image(sample: Sample, size: int) -> np.ndarray:
    """(size, size, 3) uint8 RGB: shorter side resized to ``size`` (bicubic), then center-cropped."""
    try:
        source = sample.image if isinstance(sample.image, Path) else io.BytesIO(sample.image)
        with Image.open(source) as opened:
            image = to_rgb(opened)
    except (OSError, UnidentifiedImageError, ValueError) as error:
        raise InputError(f"image {sample.name} could not be read: {error}") from error
    width, height = image.size
    scale = size / min(width, height)
    resized = image.resize((max(size, round(width * scale)), max(size, round(height * scale))), Image.BICUBIC)
    left, top = (resized.width - size) // 2, (resized.height - size) // 2
    return np.asarray(resized.crop((left, top, left + size, top + size)), dtype=np.uint8)


def image_tensor(pixels: np.ndarray) -> torch.Tensor:
    """(H, W, 3) uint8 -> (3, H, W) float, normalised as the training data."""
    return normalize(torch.from_numpy(np.array(pixels)).permute(2, 0, 1).float() / 255.0)


class TextEncoder:
    """The training data's tokenizer (:class:`mmoe.data.tokenizer.TextTokenizer`), padded to the longest text, and
    the readable token strings.

    Args:
        max_length: longest sequence, start and end tokens included.
        text_tokenizer: the SentencePiece model the checkpoint was trained with (BEiT-3's ``beit3.spm``); None =
            open_clip's BPE.
    """

    def __init__(self, max_length: int = CAPTION_MAX_TEXT_LENGTH, text_tokenizer: str | None = None) -> None:
        if max_length < 2:
            raise InputError(f"text max length must be >= 2 (start and end tokens), got {max_length}")
        self.max_length = max_length
        try:
            self.tokenizer = TextTokenizer(max_length, text_tokenizer)
        except (FileNotFoundError, ValueError) as error:
            raise InputError(f"--text-tokenizer: {error}") from None

    def token_string(self, token_id: int) -> str:
        return self.tokenizer.token_string(token_id)

    def __call__(self, texts: Sequence[str]) -> tuple[torch.Tensor, torch.Tensor, list[list[str]]]:
        """Returns ids (B, T), padding mask (B, T) True = padding, and each text's token strings."""
        encoded = [self.tokenizer.encode(text) for text in texts]
        ids, padding = self.tokenizer.pad(encoded)
        strings = [[self.token_string(t) for t in tokens] for tokens in encoded]
        return ids, padding, strings


@dataclass
class Batch:
    """A batch of one kind (pairs, images or texts) and what the figures need to show it."""

    samples: list[Sample]
    inputs: dict[str, torch.Tensor]
    pixels: list[np.ndarray] | None = None
    tokens: list[list[str]] | None = None


def make_batches(
    samples: Sequence[Sample], image_size: int, batch_size: int, encoder: TextEncoder | None
) -> Iterator[Batch]:
    """Batches of consecutive samples of the same kind (the backbone takes one kind per forward).

    Without an encoder texts are ignored and text-only samples are skipped.
    """
    pending: dict[str, list[Sample]] = {}
    for sample in samples:
        if encoder is None and sample.text is not None:
            if sample.image is None:
                continue
            sample = Sample(sample.name, image=sample.image)
        group = pending.setdefault(sample.kind, [])
        group.append(sample)
        if len(group) == batch_size:
            yield _batch(pending.pop(sample.kind), image_size, encoder)
    for group in pending.values():
        yield _batch(group, image_size, encoder)


def _batch(samples: list[Sample], image_size: int, encoder: TextEncoder | None) -> Batch:
    batch = Batch(samples, {})
    if samples[0].image is not None:
        batch.pixels = [load_image(sample, image_size) for sample in samples]
        batch.inputs["image"] = torch.stack([image_tensor(p) for p in batch.pixels])
    if samples[0].text is not None and encoder is not None:
        ids, padding, batch.tokens = encoder([sample.text for sample in samples])
        batch.inputs["text"], batch.inputs["text_padding_mask"] = ids, padding
    return batch
