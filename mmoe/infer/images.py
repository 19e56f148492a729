"""A user's image files as ``mmoe infer`` reads them: upright (EXIF orientation applied), and each file that cannot
be used named with what it is (missing, empty, not an image, cut short) in one line."""

from __future__ import annotations

from pathlib import Path

from PIL import Image, UnidentifiedImageError

from mmoe.data.transforms import decode_image
from mmoe.io import one_line

#: Image files read from a folder.
IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".webp", ".bmp", ".gif", ".tif", ".tiff")


class ImageFileError(ValueError):
    """An image file ``mmoe infer`` cannot use; the message names the file and why."""


def read_user_image(path: str | Path, min_side: int) -> Image.Image:
    """The 8-bit RGB image of the file at ``path``, turned as its EXIF orientation says (a photo stored sideways reads
    upright), decoded at no less than ``min_side`` pixels a side where the format allows it.

    Raises:
        ImageFileError: ``image <path> does not exist`` / ``is empty`` / ``is not an image (...)`` / ``could not be
            read: <reason>``.
    """
    path = Path(path)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise ImageFileError(f"image {path} does not exist") from None
    except OSError as error:
        raise ImageFileError(f"image {path} could not be read: {error.strerror or one_line(error)}") from None
    if not data:
        raise ImageFileError(f"image {path} is empty (0 bytes)")
    try:
        return decode_image(data, min_side, upright=True)
    except UnidentifiedImageError:
        raise ImageFileError(f"image {path} is not an image (Pillow cannot identify it)") from None
    except (OSError, ValueError, Image.DecompressionBombError) as error:
        raise ImageFileError(f"image {path} could not be read: {one_line(error)}") from None


def folder_images(folder: Path) -> list[Path]:
    """The image files of ``folder`` (by suffix, :data:`IMAGE_SUFFIXES`), sorted by name."""
    images = sorted(p for p in folder.iterdir() if p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES)
    if not images:
        raise ImageFileError(f"--image {folder} holds no image ({', '.join(IMAGE_SUFFIXES)})")
    return images
