"""Shared figure plumbing: Agg-only figures (no pyplot state) and atomic PNG writes."""

from __future__ import annotations

from pathlib import Path

import matplotlib
import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.colors import BoundaryNorm, Colormap
from matplotlib.figure import Figure

from mmoe.atomic import atomic_write

#: Sequential colour map of the routing figures: dark = few experts / low load, bright = many / high.
COLORMAP = "inferno"


def new_figure(width: float, height: float) -> Figure:
    """A figure drawn by the Agg canvas, independent of pyplot and of the process's backend."""
    figure = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(figure)
    return figure


def save_figure(figure: Figure, path: str | Path, dpi: int = 120) -> Path:
    """Write ``figure`` as a PNG to a temporary file beside ``path``, then rename it over ``path``."""
    return atomic_write(path, lambda temporary: figure.savefig(temporary, format="png", dpi=dpi))


def count_scale(max_count: int) -> tuple[Colormap, BoundaryNorm, list[int]]:
    """A discrete colour scale for integer counts 1..max_count (0 and masked cells drawn grey / white)."""
    max_count = max(int(max_count), 1)
    cmap = matplotlib.colormaps[COLORMAP].resampled(max(max_count, 2)).with_extremes(under="#bbbbbb", bad="white")
    norm = BoundaryNorm(np.arange(0.5, max_count + 1.5), cmap.N)
    return cmap, norm, list(range(1, max_count + 1))
