"""Image transforms (BEiT-3 ``build_transform``): RandomResizedCrop + horizontal flip (+ optional RandAugment) for
training, resize + center crop for evaluation, bicubic, normalised with mean = std = 0.5 per channel (BEiT-3's
IMAGENET_INCEPTION constants)."""

from __future__ import annotations

import io

import numpy as np
import torch
from PIL import Image, ImageOps
from torchvision import transforms as T
from torchvision.transforms import functional as TF

IMAGE_MEAN = (0.5, 0.5, 0.5)
IMAGE_STD = (0.5, 0.5, 0.5)


def _whole_image(size: int) -> list:
    """Resize the shorter side to ``size`` and center crop ``size`` x ``size``."""
    return [T.Resize(size, interpolation=T.InterpolationMode.BICUBIC), T.CenterCrop(size)]


def _to_normalized_tensor() -> list:
    return [T.ToTensor(), T.Normalize(IMAGE_MEAN, IMAGE_STD)]


def _channel_constants(images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:data:`IMAGE_MEAN` and :data:`IMAGE_STD` as (3, 1, 1) float tensors on ``images``' device (half-precision
    images are promoted to float, as the transforms compute)."""
    mean = torch.tensor(IMAGE_MEAN, device=images.device).view(3, 1, 1)
    std = torch.tensor(IMAGE_STD, device=images.device).view(3, 1, 1)
    return mean, std


def normalize(pixels: torch.Tensor) -> torch.Tensor:
    """(..., 3, H, W) float pixels in [0, 1] -> the normalised images the transforms give (``(x - mean) / std``)."""
    mean, std = _channel_constants(pixels)
    return (pixels - mean) / std


def denormalize(images: torch.Tensor) -> torch.Tensor:
    """The inverse of the transforms' normalisation: (..., 3, H, W) normalised float images -> pixels in [0, 1]
    (``x * std + mean``; not clamped)."""
    mean, std = _channel_constants(images)
    return images * std + mean


class RandAugment:
    """BEiT-3's RandAugment for vision-language fine-tuning (``RandomAugment(N=2, M=7)`` of its VQA, NLVR2 and
    captioning recipes): ``num_ops`` operations drawn uniformly (with repetition) from a list without colour changes
    (identity, autocontrast, equalize, brightness, sharpness, shear x / y, translate x / y, rotate), each applied with
    probability 0.5, at ``magnitude`` m of 10 with BEiT-3's strengths: brightness and sharpness by the factor
    0.18 m + 0.1 (1.36 at m = 7), shear ± 0.03 m (as a slope), translation ± m pixels, rotation ± 3 m degrees, the
    geometric ones with a random sign and grey (128) fill. The operations are torchvision's, on PIL images; random
    draws use torch's generator, so the data loader's per-sample seeding makes them repeatable.
    """

    OPERATIONS = (
        "identity",
        "autocontrast",
        "equalize",
        "brightness",
        "sharpness",
        "shear_x",
        "shear_y",
        "translate_x",
        "translate_y",
        "rotate",
    )

    def __init__(self, num_ops: int = 2, magnitude: int = 7) -> None:
        if num_ops < 0 or not 0 <= magnitude <= 10:
            raise ValueError(f"RandAugment needs num_ops >= 0 and magnitude in 0..10, got {num_ops}, {magnitude}")
        self.num_ops, self.magnitude = num_ops, magnitude

    def __call__(self, image: Image.Image) -> Image.Image:
        for index in torch.randint(len(self.OPERATIONS), (self.num_ops,)).tolist():
            applied, negative = (torch.rand(2) < 0.5).tolist()
            if applied:
                image = self.apply(self.OPERATIONS[index], image, -1.0 if negative else 1.0)
        return image

    def apply(self, name: str, image: Image.Image, sign: float) -> Image.Image:
        m = self.magnitude
        bicubic, fill = T.InterpolationMode.BICUBIC, [128, 128, 128]
        if name == "autocontrast":
            return TF.autocontrast(image)
        if name == "equalize":
            return TF.equalize(image)
        if name == "brightness":
            return TF.adjust_brightness(image, 0.18 * m + 0.1)
        if name == "sharpness":
            return TF.adjust_sharpness(image, 0.18 * m + 0.1)
        if name in ("shear_x", "shear_y"):
            degrees = float(np.degrees(np.arctan(sign * 0.03 * m)))
            shear = [degrees, 0.0] if name == "shear_x" else [0.0, degrees]
            return TF.affine(image, 0.0, [0, 0], 1.0, shear, interpolation=bicubic, fill=fill)
        if name in ("translate_x", "translate_y"):
            shift = [round(sign * m), 0] if name == "translate_x" else [0, round(sign * m)]
            return TF.affine(image, 0.0, shift, 1.0, [0.0, 0.0], interpolation=bicubic, fill=fill)
        if name == "rotate":
            return TF.rotate(image, sign * 3.0 * m, interpolation=bicubic, fill=fill)
        return image  # identity

    def __repr__(self) -> str:
        return f"RandAugment(num_ops={self.num_ops}, magnitude={self.magnitude})"


def train_transform(
    size: int, scale: tuple[float, float] | None = (0.5, 1.0), hflip: bool = True, randaugment: bool = False
) -> T.Compose:
    """RandomResizedCrop to ``size`` (area share in ``scale``, BEiT-3: 0.5..1), optional flip, optional
    :class:`RandAugment` (BEiT-3's N = 2, M = 7), tensor, normalise.

    ``scale=None`` keeps the whole image (resize + center crop, as evaluation): for data whose labels depend on
    where things are, how big they are or how many there are (the synthetic corpus), a random crop changes the answer.
    """
    if scale is None:
        stages = _whole_image(size)
    else:
        stages = [T.RandomResizedCrop(size, scale=scale, interpolation=T.InterpolationMode.BICUBIC)]
    if hflip:
        stages.append(T.RandomHorizontalFlip())
    if randaugment:
        stages.append(RandAugment())
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


def decode_image(data: bytes, min_side: int | None = None, upright: bool = False) -> Image.Image:
    """Decodes image bytes to 8-bit RGB (16-bit greyscale scaled, :func:`to_rgb`). For JPEGs ``min_side`` lets
    libjpeg decode at a reduced scale (1/2, 1/4, 1/8) that keeps both sides at least ``min_side`` pixels, which is
    much faster for large photos.

    ``upright`` turns the pixels as the file's EXIF orientation tag says (a phone photo stored sideways), for a
    user's own images (``mmoe infer``). The training and evaluation decoders leave it off: they read the benchmarks'
    files as the reference implementations do (``Image.open(...).convert("RGB")``), so that scores compare with the
    published ones."""
    image = Image.open(io.BytesIO(data))
    if min_side is not None and image.format == "JPEG":
        image.draft("RGB", (min_side, min_side))
    if upright:
        image = ImageOps.exif_transpose(image)
    return to_rgb(image)
