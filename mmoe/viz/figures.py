"""Shared figure plumbing: Agg-only figures (no pyplot state), atomic PNG writes, and the colour bars of the
routing images, whose pixels :mod:`mmoe.routing.render` makes."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.cm import ScalarMappable
from matplotlib.colors import BoundaryNorm, ListedColormap, Normalize
from matplotlib.figure import Figure

from mmoe.atomic import atomic_write
from mmoe.routing.render import HEATMAP_TOP, count_colours, palette


def new_figure(width: float, height: float) -> Figure:
    """A figure drawn by the Agg canvas, independent of pyplot and of the process's backend."""
    figure = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(figure)
    return figure


def save_figure(figure: Figure, path: str | Path, dpi: int = 120) -> Path:
    """Write ``figure`` as a PNG to a temporary file beside ``path``, then rename it over ``path``."""
    return atomic_write(path, lambda temporary: figure.savefig(temporary, format="png", dpi=dpi))


def load_colorbar(figure: Figure, axes: Axes | Sequence[Axes], label: str) -> None:
    """The heatmap's scale: the renderer's palette over 0..:data:`HEATMAP_TOP` (busier experts at the top colour)."""
    mappable = ScalarMappable(Normalize(0.0, HEATMAP_TOP), ListedColormap(palette() / 255))
    figure.colorbar(mappable, ax=axes, extend="max", label=label)


def count_colorbar(figure: Figure, axes: Axes | Sequence[Axes], max_count: int, label: str, **options) -> None:
    """The diversity maps' scale: one band per count 1..``max_count``, each in the colour the renderer gives it."""
    counts = np.arange(1, max(int(max_count), 1) + 1)
    colours = ListedColormap(count_colours(counts, max_count) / 255)
    mappable = ScalarMappable(BoundaryNorm(np.arange(0.5, counts.size + 1.5), colours.N), colours)
    figure.colorbar(mappable, ax=axes, ticks=counts, label=label, **options)


def expert_colorbar(figure: Figure, axes: Axes | Sequence[Axes], num_experts: int, label: str, **options) -> None:
    """A top-1 expert map's scale: one band per expert, numbered 0..``num_experts - 1`` as every routing record,
    figure and printout numbers them; expert e in the colour the renderer gives the count e + 1 (its scale starts at
    1, 0 being its colour for nothing routed)."""
    experts = np.arange(max(int(num_experts), 1))
    colours = ListedColormap(count_colours(experts + 1, experts.size) / 255)
    mappable = ScalarMappable(BoundaryNorm(np.arange(-0.5, experts.size), colours.N), colours)
    figure.colorbar(mappable, ax=axes, ticks=experts, label=label, **options)
