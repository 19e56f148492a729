"""The routing images as RGB arrays: the expert-load heatmap (layers x experts per modality, MH-MoE, Wu et al., 2024,
Fig. 5) and the sub-token assignment-diversity maps over images (Fig. 1b), uint8 (H, W, 3), made of coloured cells.

The training logger sends these arrays as they are (``routing/load_heatmap``, ``routing/subtoken_maps``); ``mmoe viz``
shows the same arrays with ``imshow`` and adds axes, labels and a colour bar around them. Plain numpy, with no
plotting library: a training process draws them at every logging window (about 1 ms for the tiny config's heatmap,
7 ms for its sub-token maps of 4 images, on a shared 2-core CPU).

* One colour map: ``inferno`` (van der Walt & Smith's perceptually uniform map of matplotlib), 17 stops sampled from
  it and interpolated linearly (:func:`palette`): dark = low load / few experts, bright = high.
* One normalisation: a value's level is ``value / top`` clipped to [0, 1] (:func:`colour`): an expert's load over the
  uniform share (:func:`utilisation`) on the fixed scale 0..:data:`HEATMAP_TOP`, a count of distinct experts on
  0..``max_count``. :data:`NO_VALUE` grey marks a cell with nothing to show (an expert a layer does not have, a layer
  that routed no token, a patch without a count).
* One layout rule: panels and tiles left to right, rows top-down, :data:`GAP` white between them, each padded to the
  tallest / widest (:func:`joined`).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
from numpy.typing import ArrayLike

#: ``inferno`` at 0, 1/16, ..., 1 as RGB hex: within 7/255 of matplotlib's 256 levels once interpolated.
INFERNO_STOPS = (
    "000004 0b0724 210c4a 3d0965 57106e 71196e 8a226a a32c61 bc3754 d24644 e45a31 f1731d f98e09 fcac11 f9cb35 f2ea69 "
    "fcffa4"
)
#: The colour of a cell without a value.
NO_VALUE = np.array([128, 128, 128], dtype=np.uint8)
#: The colour of the gaps between panels and tiles.
GAP = np.array([255, 255, 255], dtype=np.uint8)
#: Utilisation at the top of the heatmap's scale: 1 (the uniform load) is its middle, so the colours mean the same at
#: every step and in every figure; busier experts are drawn at the top colour.
HEATMAP_TOP = 2.0
#: The widest a heatmap panel gets, in pixels, and the bounds of one cell's side.
PANEL_WIDTH = 512
CELL_SIDES = (4, 16)
#: The gap between the tiles of the diversity grid, in pixels.
TILE_GAP = 2
#: The weight of a diversity map drawn over its image (the rest is the image in grey).
OVERLAY_WEIGHT = 0.7


@functools.cache
def palette() -> np.ndarray:
    """(256, 3) uint8: :data:`INFERNO_STOPS` interpolated linearly to 256 levels."""
    stops = np.array([[int(stop[i : i + 2], 16) for i in (0, 2, 4)] for stop in INFERNO_STOPS.split()], dtype=float)
    at = np.linspace(0.0, 1.0, len(stops))
    levels = np.linspace(0.0, 1.0, 256)
    colours = np.stack([np.interp(levels, at, stops[:, channel]) for channel in range(3)], axis=-1)
    colours = np.round(colours).astype(np.uint8)
    colours.flags.writeable = False
    return colours


def colour(values: ArrayLike, top: float) -> np.ndarray:
    """(..., 3) uint8: ``values`` coloured at level ``value / top`` clipped to [0, 1]; NaN drawn as :data:`NO_VALUE`."""
    values = np.asarray(values, dtype=np.float64)
    level = np.clip(np.nan_to_num(values / max(top, 1e-12), nan=0.0), 0.0, 1.0)
    pixels = palette()[np.round(level * 255).astype(np.int64)]
    pixels[np.isnan(values)] = NO_VALUE
    return pixels


def count_colours(counts: ArrayLike, max_count: int) -> np.ndarray:
    """(..., 3) uint8: counts of distinct experts on the scale 0..``max_count``; a count of 0 or less (nothing
    routed there, padding) drawn as :data:`NO_VALUE`."""
    counts = np.asarray(counts, dtype=np.float64)
    return colour(np.where(counts > 0, counts, np.nan), max(int(max_count), 1))


def utilisation(counts_E: ArrayLike) -> np.ndarray:
    """Each expert's load over the uniform share (1 = its fair share, 0 = no choice): ``E * counts / counts.sum()``;
    NaN everywhere when the layer made no choice."""
    counts = np.asarray(counts_E, dtype=np.float64)
    total = counts.sum()
    if total <= 0:
        return np.full(counts.shape, np.nan)
    return counts * counts.size / total


@dataclass(frozen=True)
class HeatmapPanel:
    """One modality's panel of the load heatmap.

    Attributes:
        modality: the modality of its layers' keys (``"layer{i}/{modality}"``).
        keys: its layers' keys top-down; the rows below them, up to the tallest panel's, are :data:`NO_VALUE`.
        pixels: (rows * cell, experts * cell, 3) uint8, one column per expert of the widest layer.
        cell: the side of one cell in pixels.
    """

    modality: str
    keys: tuple[str, ...]
    pixels: np.ndarray
    cell: int

    @property
    def cells(self) -> tuple[int, int]:
        """(rows, experts): the panel's size in cells."""
        return self.pixels.shape[0] // self.cell, self.pixels.shape[1] // self.cell


def heatmap_panels(loads: Mapping[str, ArrayLike], layer_order: Sequence[str]) -> list[HeatmapPanel]:
    """The panels of :func:`load_heatmap`, one per modality in order of first appearance: rows = its MoE layers
    top-down, columns = experts, colour = :func:`utilisation` on the fixed scale 0..:data:`HEATMAP_TOP`.

    Args:
        loads: ``"layer{i}/{modality}"`` -> (E,) expert counts.
        layer_order: the keys in depth order (:func:`mmoe.metrics.routing.sort_keys`).
    """
    groups: dict[str, list[str]] = {}
    for key in layer_order:
        groups.setdefault(key.partition("/")[2], []).append(key)
    widest = max(np.asarray(loads[key]).size for key in layer_order)
    cell = int(np.clip(PANEL_WIDTH // max(widest, 1), *CELL_SIDES))
    rows = max(len(keys) for keys in groups.values())
    panels = []
    for modality, keys in groups.items():
        grid = np.full((rows, widest), np.nan)
        for row, key in enumerate(keys):
            values = utilisation(loads[key])
            grid[row, : values.size] = values
        pixels = np.repeat(np.repeat(colour(grid, HEATMAP_TOP), cell, axis=0), cell, axis=1)
        panels.append(HeatmapPanel(modality, tuple(keys), pixels, cell))
    return panels


def load_heatmap(loads: Mapping[str, ArrayLike], layer_order: Sequence[str]) -> np.ndarray:
    """The load heatmap: the :func:`heatmap_panels` left to right, half a cell (at least 2 pixels) apart.

    Returns:
        (H, W, 3) uint8.
    """
    panels = heatmap_panels(loads, layer_order)
    return joined([panel.pixels for panel in panels], gap=max(panels[0].cell // 2, 2), axis=1)


def diversity_tile(counts: ArrayLike, max_count: int, image: np.ndarray, overlay: bool = True) -> np.ndarray:
    """A (g, g) map of distinct-expert counts at the size of ``image`` (each pixel takes the cell it lies in),
    coloured by :func:`count_colours`; with ``overlay`` drawn at :data:`OVERLAY_WEIGHT` over a grey copy of the image.

    Args:
        counts: (g, g) counts of one image under one layer.
        max_count: top of the scale (the number of heads for top-1 maps).
        image: (H, W, 3) uint8, the image as the model saw it.
        overlay: over the image (True) or on its own (False).

    Returns:
        (H, W, 3) uint8.
    """
    counts = np.asarray(counts)
    height, width = image.shape[:2]
    rows = np.arange(height) * counts.shape[0] // height
    cols = np.arange(width) * counts.shape[1] // width
    cells = count_colours(counts[rows][:, cols], max_count)
    if not overlay:
        return cells
    grey = image.astype(np.float64).mean(-1, keepdims=True)
    return np.round((1 - OVERLAY_WEIGHT) * grey + OVERLAY_WEIGHT * cells).astype(np.uint8)


def diversity_grid(
    images: Sequence[np.ndarray], maps: Mapping[str, ArrayLike], max_count: int, overlay: bool = True
) -> np.ndarray:
    """Images x maps: row n is image n, then its :func:`diversity_tile` under each map (a layer, or a checkpoint),
    :data:`TILE_GAP` apart.

    Args:
        images: N images (H, W, 3) uint8 of one size, as the model saw them.
        maps: column -> (N, g, g) distinct experts among each patch's sub-tokens (grids may differ between columns).
        max_count: top of the colour scale (the number of heads for top-1 maps).
        overlay: each map over a grey copy of its image (True) or on its own (False).

    Returns:
        (H, W, 3) uint8.
    """
    rows = []
    for n, image in enumerate(images):
        tiles = [diversity_tile(np.asarray(values)[n], max_count, image, overlay) for values in maps.values()]
        rows.append(joined([np.asarray(image, dtype=np.uint8), *tiles], gap=TILE_GAP, axis=1))
    return joined(rows, gap=TILE_GAP, axis=0)


def tile_centres(size: int, count: int) -> np.ndarray:
    """The pixel coordinates of the centres of ``count`` tiles of ``size`` pixels along one axis of
    :func:`diversity_grid` (where a figure puts their labels)."""
    return np.arange(count) * (size + TILE_GAP) + (size - 1) / 2


def joined(parts: Sequence[np.ndarray], gap: int, axis: int) -> np.ndarray:
    """``parts`` (H, W, 3) side by side along ``axis`` (1: left to right, 0: top-down) with :data:`GAP` between,
    each padded with it to the tallest / widest."""
    across = 1 - axis
    size = max(part.shape[across] for part in parts)
    padded = []
    for index, part in enumerate(parts):
        pad = [(0, 0), (0, 0), (0, 0)]
        pad[across] = (0, size - part.shape[across])
        if index:
            spacer_shape = [size, size, 3]
            spacer_shape[axis] = gap
            padded.append(np.broadcast_to(GAP, spacer_shape))
        padded.append(np.pad(part, pad, constant_values=255))
    return np.ascontiguousarray(np.concatenate(padded, axis=axis))
