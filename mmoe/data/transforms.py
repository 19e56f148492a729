"""Image transforms (BEiT-3 ``build_transform``): RandomResizedCrop + horizontal flip for training, resize + center
crop for evaluation, bicubic, normalised with mean = std = 0.5 per channel (BEiT-3's IMAGENET_INCEPTION constants)."""

from __future__ import annotations

import io

import numpy as np
from PIL import Image
from torchvision import transforms as T

IMAGE_MEAN = (0.5, 0.5, 0.5)
IMAGE_STD = (0.5, 0.5, 0.5)


def _whole_image(size: int) -> list:
    """Resize the shorter side to ``size`` and center crop ``size`` x ``size``."""
    return [T.Resize(size, interpolation=T.InterpolationMode.BICUBIC), T.CenterCrop(size)]


def _to_normalized_tensor() -> list:
    return [T.ToTensor(), T.Normalize(IMAGE_MEAN, IMAGE_STD)]


def train_transform(size: int, scale: tuple[float, float] | None = (0.5, 1.0), hflip: bool = True) -> T.Compose:
    """RandomResizedCrop to ``size`` (area share in ``scale``, BEiT-3: 0.5..1), optional flip, tensor, normalise.

    ``scale=None`` keeps the whole image (resize + center crop, as evaluation): for data whose labels depend on
    where things are, how big they are or how many there are (the synthetic corpus), a random crop changes the answer.
    """
    if scale is None:
        stages = _whole_image(size)
    else:
        stages = [T.RandomResizedCrop(size, scale=scale, interpolation=T.InterpolationMode.BICUBIC)]
    if hflip:
        stages.append(T.RandomHorizontalFlip())
    return T.Compose(stages + _to_normalized_tensor())


def eval_transform(size: int) -> T.Compose:
    """Resize the shorter side to ``size``, center crop ``size`` x ``size``, tensor, normalise."""
    return T.Compose(_whole_image(size) + _to_normalized_tensor())


def to_rgb(image: Image.Image) -> Image.Image:
    """``image`` as 8-bit RGB. 16-bit greyscale (Pillow modes ``I;16*``, and ``I``, which Pillow gives 16-bit PNG,
    PGM and TIFF files) is scaled from 0..65535 to 0..255, rounding; ``convert("RGB")`` alone clips it at 255, which
    turns nearly every pixel white."""
    if image.mode == "I" or image.mode.startswith("I;16"):
        values = np.asarray(image).astype(np.int64)
        image = Image.fromarray(((np.clip(values, 0, 65535) + 128) // 257).astype(np.uint8))
    return image.convert("RGB")


def decode_image(data: bytes, min_side: int | None = None) -> Image.Image:
    """Decodes image bytes to 8-bit RGB (16-bit greyscale scaled, :func:`to_rgb`). For JPEGs ``min_side`` lets
    libjpeg decode at a reduced scale (1/2, 1/4, 1/8) that keeps both sides at least ``min_side`` pixels, which is
    much faster for large photos."""
    image = Image.open(io.BytesIO(data))
    if min_side is not None and image.format == "JPEG":
        image.draft("RGB", (min_side, min_side))
    return to_rgb(image)
