"""The routing renderer (mmoe.routing.render) against per-cell and per-pixel loops: the colour map, the heatmap's
cells and layout, the diversity grid's tiles; and that it loads no plotting library."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import matplotlib
import numpy as np
import pytest

from mmoe.routing.render import (
    GAP,
    HEATMAP_TOP,
    NO_VALUE,
    OVERLAY_WEIGHT,
    diversity_grid,
    heatmap_panels,
    load_heatmap,
    palette,
    tile_centres,
)

ROOT = Path(__file__).resolve().parents[2]


def palette_colour(value: float | None, top: float) -> np.ndarray:
    """One cell's colour: the palette at round(255 * value / top), clipped; grey without a value."""
    if value is None:
        return NO_VALUE
    return palette()[round(min(max(value / top, 0.0), 1.0) * 255)]


def test_the_palette_is_matplotlib_s_inferno():
    reference = matplotlib.colormaps["inferno"](np.linspace(0.0, 1.0, 256))[:, :3] * 255
    assert palette().shape == (256, 3) and palette().dtype == np.uint8
    assert np.abs(palette().astype(float) - reference).max() <= 8
    assert np.array_equal(palette()[[0, -1]], np.round(reference[[0, -1]]))


def heatmap_reference(loads: dict[str, list[int]]) -> np.ndarray:
    """The heatmap cell by cell: a panel per modality, a row per layer, a cell per expert of the widest layer."""
    panels: dict[str, list[str]] = {}
    for key in loads:
        panels.setdefault(key.split("/")[1], []).append(key)
    widest = max(len(counts) for counts in loads.values())
    cell = min(max(512 // widest, 4), 16)
    rows = max(len(keys) for keys in panels.values())
    gap = max(cell // 2, 2)
    image = np.full((rows * cell, len(panels) * (widest * cell + gap) - gap, 3), 255, dtype=np.uint8)
    for p, keys in enumerate(panels.values()):
        for row in range(rows):
            for expert in range(widest):
                counts = loads[keys[row]] if row < len(keys) else []
                total = sum(counts)
                value = counts[expert] * len(counts) / total if expert < len(counts) and total > 0 else None
                left = p * (widest * cell + gap) + expert * cell
                image[row * cell : (row + 1) * cell, left : left + cell] = palette_colour(value, HEATMAP_TOP)
    return image


@pytest.mark.parametrize("experts", [4, 200])
def test_the_heatmap_is_its_cells_coloured_one_by_one(experts):
    rng = np.random.default_rng(experts)
    loads = {
        "layer0/vision": rng.integers(0, 9, experts).tolist(),
        "layer0/language": rng.integers(0, 9, experts).tolist(),
        "layer2/vision": [0] * experts,  # no token: a grey row
        "layer2/language": rng.integers(0, 9, experts // 2).tolist(),  # fewer experts: grey beyond them
        "layer3/shared": rng.integers(0, 9, experts).tolist(),  # a one-row panel: grey below
        "layer3/vision": [1] * experts,  # balanced: the middle of the scale
    }
    order = ["layer0/vision", "layer0/language", "layer2/vision", "layer2/language", "layer3/shared", "layer3/vision"]
    pixels = load_heatmap(loads, order)
    assert np.array_equal(pixels, heatmap_reference({key: loads[key] for key in order}))
    panels = heatmap_panels(loads, order)
    assert [(panel.modality, panel.keys, panel.cells) for panel in panels] == [
        ("vision", ("layer0/vision", "layer2/vision", "layer3/vision"), (3, experts)),
        ("language", ("layer0/language", "layer2/language"), (3, experts)),
        ("shared", ("layer3/shared",), (3, experts)),
    ]
    cell = panels[0].cell
    assert np.array_equal(pixels[2 * cell + cell // 2, cell // 2], palette()[128])  # utilisation 1 of 2


def grid_reference(images: list[np.ndarray], maps: dict[str, np.ndarray], top: int, overlay: bool) -> np.ndarray:
    """The diversity grid pixel by pixel: each map pixel takes its cell's count, coloured and laid over grey."""
    height, width = images[0].shape[:2]
    cols = 1 + len(maps)
    image = np.full((len(images) * (height + 2) - 2, cols * (width + 2) - 2, 3), 255, dtype=np.uint8)
    for n, picture in enumerate(images):
        top_row = n * (height + 2)
        image[top_row : top_row + height, :width] = picture
        for c, counts in enumerate(maps.values(), start=1):
            g_rows, g_cols = counts.shape[1:]
            for y in range(height):
                for x in range(width):
                    count = counts[n, y * g_rows // height, x * g_cols // width]
                    colour = palette_colour(count if count > 0 else None, top).astype(float)
                    if overlay:
                        grey = picture[y, x].astype(float).mean()
                        colour = np.round((1 - OVERLAY_WEIGHT) * grey + OVERLAY_WEIGHT * colour)
                    image[top_row + y, c * (width + 2) + x] = colour
    return image


@pytest.mark.parametrize("overlay", [True, False])
def test_the_diversity_grid_is_its_pixels_coloured_one_by_one(overlay):
    rng = np.random.default_rng(1)
    images = [rng.integers(0, 256, (12, 12, 3), dtype=np.uint8) for _ in range(2)]
    maps = {"layer 0": rng.integers(0, 5, (2, 3, 3)), "layer 1": rng.integers(0, 5, (2, 2, 2))}
    maps["layer 0"][0, 0, 0] = 0  # nothing counted: grey
    grid = diversity_grid(images, maps, 4, overlay)
    assert np.array_equal(grid, grid_reference(images, maps, 4, overlay))
    rows, cols = tile_centres(12, 2), tile_centres(12, 3)
    assert np.array_equal(grid[int(rows[1]), int(cols[0])], images[1][5, 5])  # a tile's centre: its image's
    assert np.array_equal(grid[12, 0], GAP) and np.array_equal(grid[0, 13], GAP)


def test_the_renderer_loads_no_plotting_library():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    code = "import sys, mmoe.routing.render; print(sorted(m for m in sys.modules if m.startswith('matplotlib')))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert result.stdout.strip() == "[]"
