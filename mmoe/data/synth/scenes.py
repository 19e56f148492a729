"""Scenes of the synthetic corpus: 1-3 coloured, textured shapes, each in its own horizontal band (top / middle /
bottom) of a dark background, drawn with PIL.

Positions are vertical only, so the horizontal flip of training augmentation never changes what a text says.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
from PIL import Image, ImageDraw

COLORS: dict[str, tuple[int, int, int]] = {
    "red": (225, 45, 40),
    "green": (45, 185, 65),
    "blue": (55, 95, 235),
    "yellow": (240, 215, 45),
    "purple": (155, 65, 205),
    "white": (238, 238, 238),
}
SHAPES = ("circle", "square", "triangle", "cross")
PLURALS = {"circle": "circles", "square": "squares", "triangle": "triangles", "cross": "crosses"}
TEXTURES = ("plain", "striped", "dotted")
SIZES = ("small", "large")
ROWS = ("top", "middle", "bottom")
_COLOR_NAMES = tuple(COLORS)


@dataclass(frozen=True)
class Shape:
    """One object of a scene."""

    shape: str
    color: str
    texture: str
    size: str
    row: str
    x: float  # horizontal centre, 0..1 of the width

    def phrase(self, size: bool = True, texture: bool = True) -> str:
        """``large red striped circle`` (plain textures are not named)."""
        words = [self.size if size else "", self.color, self.texture if texture and self.texture != "plain" else ""]
        return " ".join(word for word in [*words, self.shape] if word)


@dataclass(frozen=True)
class Scene:
    """Objects listed top to bottom, and the background shade."""

    shapes: tuple[Shape, ...]
    background: tuple[int, int, int]

    def count(self, **attributes: str) -> int:
        """Objects whose attributes equal the given ones (e.g. ``color="red"``)."""
        return sum(all(getattr(s, name) == value for name, value in attributes.items()) for s in self.shapes)

    def find(self, **attributes: str) -> list[Shape]:
        return [s for s in self.shapes if all(getattr(s, name) == value for name, value in attributes.items())]


def sample_scene(rng: np.random.Generator, min_objects: int = 1, max_objects: int = 3) -> Scene:
    """A random scene: 1-3 objects in distinct rows, independent attributes."""
    count = int(rng.integers(min_objects, max_objects + 1))
    rows = np.sort(rng.permutation(len(ROWS))[:count])
    attributes = rng.integers(0, [len(SHAPES), len(_COLOR_NAMES), len(TEXTURES), len(SIZES)], size=(count, 4))
    xs = rng.uniform(0.25, 0.75, size=count)
    shapes = tuple(
        Shape(SHAPES[a[0]], _COLOR_NAMES[a[1]], TEXTURES[a[2]], SIZES[a[3]], ROWS[row], float(x))
        for a, row, x in zip(attributes, rows, xs, strict=True)
    )
    shade, *tint = rng.integers([20, -8, -8, -8], [60, 9, 9, 9])
    return Scene(shapes, tuple(int(np.clip(shade + t, 0, 255)) for t in tint))


def _outline(draw: ImageDraw.ImageDraw, shape: str, cx: float, cy: float, r: float) -> None:
    if shape == "circle":
        draw.ellipse((cx - r, cy - r, cx + r, cy + r), fill=255)
    elif shape == "square":
        side = r * 0.88
        draw.rectangle((cx - side, cy - side, cx + side, cy + side), fill=255)
    elif shape == "triangle":
        draw.polygon([(cx, cy - r), (cx + r, cy + r * 0.8), (cx - r, cy + r * 0.8)], fill=255)
    elif shape == "cross":
        arm = r * 0.38
        draw.rectangle((cx - r, cy - arm, cx + r, cy + arm), fill=255)
        draw.rectangle((cx - arm, cy - r, cx + arm, cy + r), fill=255)
    else:
        raise ValueError(f"unknown shape {shape!r}")


@functools.lru_cache(maxsize=512)
def _texture(texture: str, color: tuple[int, int, int], size: int, period: int) -> np.ndarray:
    """(size, size) RGB fill: plain colour, diagonal stripes, or a dot grid (dark on colour)."""
    fill = np.empty((size, size, 3), dtype=np.float32)
    fill[:] = color
    ys, xs = np.mgrid[0:size, 0:size]
    if texture == "striped":
        fill[((xs + ys) // max(1, period // 2)) % 2 == 1] *= 0.3
    elif texture == "dotted":
        half = period // 2
        dots = ((xs % period) - half) ** 2 + ((ys % period) - half) ** 2 <= max(1.0, (period / 4) ** 2)
        fill[dots] *= 0.25
    return Image.fromarray(fill.astype(np.uint8))


def render(scene: Scene, size: int = 64) -> Image.Image:
    """Draws a scene as a ``size`` x ``size`` RGB image on a background that darkens from top to bottom."""
    shade = np.linspace(1.15, 0.75, size, dtype=np.float32)[:, None, None]
    canvas = np.broadcast_to(np.asarray(scene.background, dtype=np.float32) * shade, (size, size, 3))
    image = Image.fromarray(np.clip(canvas, 0, 255).astype(np.uint8))
    band = size / len(ROWS)
    period = max(3, round(size / 16))
    for obj in scene.shapes:
        radius = size * (0.095 if obj.size == "small" else 0.15)
        cy = (ROWS.index(obj.row) + 0.5) * band
        mask = Image.new("L", (size, size), 0)
        _outline(ImageDraw.Draw(mask), obj.shape, obj.x * size, cy, radius)
        image.paste(_texture(obj.texture, COLORS[obj.color], size, period), (0, 0), mask)
    return image
