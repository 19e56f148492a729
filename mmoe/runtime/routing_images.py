"""Routing images for the training logger, as plain pixel arrays: a load heatmap and sub-token diversity maps.

The logger shows an image as it is, so these are uint8 (H, W, 3) arrays made of coloured cells, with no axes or
labels (the tags say what they are), built with numpy in well under a millisecond: cheap enough to draw at every
logging window. The labelled figures of the same quantities (MH-MoE Fig. 1b and 5) are :mod:`mmoe.viz`'s
(``mmoe viz heatmap --stats``, ``mmoe viz subtoken-map``), drawn offline from a run's files; ``mmoe.tasks`` does not
import ``mmoe.viz`` (ARCHITECTURE.md), and a matplotlib figure per window would cost a training step's time.

Colours are matplotlib's ``inferno`` (the colour map of :mod:`mmoe.viz`): dark = low load / few experts, bright = high;
grey marks a cell with nothing to show (an expert a layer does not have, a layer that routed no token, padding).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import matplotlib
import numpy as np
import torch

from mmoe.data.transforms import denormalize

#: The colour of a cell without a value (an expert the layer does not have, no token, padding).
NO_VALUE = np.array([128, 128, 128], dtype=np.uint8)
#: The colour of the gaps between panels and tiles.
GAP = np.array([255, 255, 255], dtype=np.uint8)
#: Utilisation (an expert's load over the uniform share) at the top of the heatmap's scale: 1 (the uniform load) is
#: its middle, so the colours mean the same at every step; busier experts are drawn at the top colour.
HEATMAP_TOP = 2.0
#: The widest a heatmap panel gets, in pixels, and the side of one cell within these bounds.
PANEL_WIDTH = 512
CELL_SIDES = (4, 16)
#: The side of one tile of the sub-token map grid (images are shrunk to it; larger ones stay at their size).
TILE_SIDE = 96

_PALETTE: np.ndarray | None = None


def palette() -> np.ndarray:
    """(256, 3) uint8: ``inferno`` sampled at 256 levels (computed once)."""
    global _PALETTE
    if _PALETTE is None:
        colours = matplotlib.colormaps["inferno"](np.linspace(0.0, 1.0, 256))[:, :3]
        _PALETTE = np.round(colours * 255).astype(np.uint8)
    return _PALETTE


def colour(values: np.ndarray, top: float) -> np.ndarray:
    """(..., 3) uint8: ``values`` in [0, top] coloured (clipped); NaN drawn as :data:`NO_VALUE`."""
    values = np.asarray(values, dtype=np.float64)
    level = np.clip(np.nan_to_num(values / max(top, 1e-12), nan=0.0), 0.0, 1.0)
    pixels = palette()[np.round(level * 255).astype(np.int64)]
    pixels[np.isnan(values)] = NO_VALUE
    return pixels


def utilisation(counts_E: np.ndarray | torch.Tensor) -> np.ndarray:
    """Each expert's load over the uniform share (1 = its fair share, 0 = no token): ``E * counts / counts.sum()``;
    NaN everywhere when the layer made no choice."""
    counts = np.asarray(counts_E, dtype=np.float64)
    total = counts.sum()
    if total <= 0:
        return np.full(counts.shape, np.nan)
    return counts * counts.size / total


def load_heatmap(loads: Mapping[str, np.ndarray | torch.Tensor], layer_order: Sequence[str]) -> np.ndarray:
    """The load heatmap: one panel per modality (in order of first appearance), rows = its MoE layers top-down,
    columns = experts, colour = :func:`utilisation` on a fixed 0..:data:`HEATMAP_TOP` scale.

    Args:
        loads: ``"layer{i}/{modality}"`` -> (E,) expert counts of the window.
        layer_order: the keys in depth order (:func:`mmoe.metrics.routing.sort_keys`).

    Returns:
        (H, W, 3) uint8.
    """
    panels: dict[str, list[str]] = {}
    for key in layer_order:
        panels.setdefault(key.partition("/")[2], []).append(key)
    widest = max(len(loads[key]) for key in layer_order)
    cell = int(np.clip(PANEL_WIDTH // max(widest, 1), *CELL_SIDES))
    rows = max(len(keys) for keys in panels.values())
    drawn = []
    for keys in panels.values():
        grid = np.full((rows, widest), np.nan)
        for row, key in enumerate(keys):
            values = utilisation(loads[key])
            grid[row, : values.size] = values
        drawn.append(np.repeat(np.repeat(colour(grid, HEATMAP_TOP), cell, axis=0), cell, axis=1))
    return _joined(drawn, gap=max(cell // 2, 2), axis=1)


def subtoken_map_grid(images: torch.Tensor, maps: Mapping[str, np.ndarray], max_count: int) -> np.ndarray:
    """Images x layers: row n is held-out image n, then its sub-token diversity map under each MoE layer that routes
    images (MH-MoE Fig. 1b), drawn over a dimmed grey copy of the image.

    Args:
        images: (N, 3, S, S) normalised images, as the model saw them.
        maps: column key -> (N, g, g) distinct experts among each patch's sub-tokens.
        max_count: top of the colour scale (the number of heads for top-1 maps).

    Returns:
        (H, W, 3) uint8.
    """
    side = min(images.shape[-1], TILE_SIDE)
    pixels = _resized(images, side)  # (N, side, side, 3) uint8
    grey = pixels.mean(-1, keepdims=True)
    rows = []
    for n in range(images.shape[0]):
        tiles = [pixels[n]]
        for values in maps.values():
            counts = np.asarray(values[n], dtype=np.float64)
            counts[counts <= 0] = np.nan
            cells = colour(_nearest(counts, side), max_count).astype(np.float64)
            tiles.append(np.round(0.3 * grey[n] + 0.7 * cells).astype(np.uint8))
        rows.append(_joined(tiles, gap=2, axis=1))
    return _joined(rows, gap=2, axis=0)


def _resized(images: torch.Tensor, side: int) -> np.ndarray:
    pixels = denormalize(images.detach().float().cpu()).clamp(0.0, 1.0)
    if pixels.shape[-1] != side:
        pixels = torch.nn.functional.interpolate(pixels, size=(side, side), mode="area")
    return np.round(pixels.permute(0, 2, 3, 1).numpy() * 255).astype(np.uint8)


def _nearest(grid: np.ndarray, side: int) -> np.ndarray:
    """A (g, g) grid scaled to (side, side) by repeating cells (each pixel takes the cell it lies in)."""
    rows = np.arange(side) * grid.shape[0] // side
    cols = np.arange(side) * grid.shape[1] // side
    return grid[rows][:, cols]


def _joined(parts: Sequence[np.ndarray], gap: int, axis: int) -> np.ndarray:
    """``parts`` (H, W, 3) side by side along ``axis`` (1: left to right, 0: top-down) with :data:`GAP` between,
    padded to the tallest / widest."""
    across = 1 - axis
    size = max(part.shape[across] for part in parts)
    padded = []
    for index, part in enumerate(parts):
        pad = [(0, 0), (0, 0), (0, 0)]
        pad[across] = (0, size - part.shape[across])
        part = np.pad(part, pad, constant_values=255)
        if index:
            spacer_shape = [size, size, 3]
            spacer_shape[axis] = gap
            padded.append(np.broadcast_to(GAP, spacer_shape))
        padded.append(part)
    return np.ascontiguousarray(np.concatenate(padded, axis=axis))
