"""Sub-token assignment-diversity maps (MH-MoE, Wu et al., 2024, Fig. 1b, 8, 10).

For every image patch (or text token), the number of distinct experts its h sub-tokens are routed to: bright =
the sub-tokens go to many different experts, dark = they share experts. The values come from
:func:`mmoe.metrics.routing.image_diversity_maps` / :func:`~mmoe.metrics.routing.text_diversity`; this module only
draws them, as the pixels of :mod:`mmoe.routing.render` with axes, labels and a colour bar around them. A one-head
MoE has one expert per patch; its map shows which (:func:`draw_expert_grid`), numbered from 0 as everywhere.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
from matplotlib.axes import Axes
from matplotlib.figure import Figure

from mmoe.routing.render import count_colours, diversity_grid, tile_centres
from mmoe.viz.figures import count_colorbar, expert_colorbar, new_figure, save_figure

PATCH_LEGEND = "distinct experts among the sub-tokens of a patch"
TOKEN_LEGEND = "distinct experts among the sub-tokens of a token"
EXPERT_LEGEND = "top-1 expert of the patch (experts numbered from 0)"


def draw_patch_grid(
    pixels: Sequence[np.ndarray],
    columns: Mapping[str, np.ndarray],
    max_count: int,
    title: str,
    path: str | Path,
    overlay: bool = True,
    row_labels: Sequence[str] | None = None,
) -> Path:
    """Write :func:`patch_grid_figure` to ``path`` (a PNG, written atomically)."""
    return save_figure(patch_grid_figure(pixels, columns, max_count, title, overlay, row_labels), path)


def patch_grid_figure(
    pixels: Sequence[np.ndarray],
    columns: Mapping[str, np.ndarray],
    max_count: int,
    title: str,
    overlay: bool = True,
    row_labels: Sequence[str] | None = None,
) -> Figure:
    """Images × maps: column 0 the input image, then one column per map (layers, or checkpoints); the pixels of
    :func:`mmoe.routing.render.diversity_grid` (those of the training logger's ``routing/subtoken_maps``), labelled.

    Args:
        pixels: N images, (H, W, 3) uint8 of one size, as the model saw them.
        columns: column title -> (N, g, g) diversity counts (grids may differ between columns).
        max_count: top of the colour scale (the number of heads for top-1 maps).
        title: figure title.
        overlay: draw each map over a grey copy of the image (True) or on its own (False).
        row_labels: a label per image (e.g. its file name).
    """
    figure, ax, rows = _grid_figure(pixels, columns, max_count, overlay, row_labels)
    count_colorbar(figure, ax, max_count, PATCH_LEGEND, shrink=min(1.0, 0.4 + 0.2 * rows))
    figure.suptitle(title, fontsize=10)
    return figure


def draw_expert_grid(
    pixels: Sequence[np.ndarray], columns: Mapping[str, np.ndarray], num_experts: int, title: str, path: str | Path
) -> Path:
    """Images × layers of a one-head MoE: each patch coloured by its top-1 expert, numbered 0..``num_experts - 1``
    on the colour bar as the routing records, ``mmoe viz heatmap`` and ``mmoe infer``'s token list number them.

    Args:
        pixels: N images, (H, W, 3) uint8 of one size, as the model saw them.
        columns: column title -> (N, g, g) top-1 expert indices (0-based).
        num_experts: experts per layer (the colour scale's length).
        title: figure title.
        path: PNG to write (atomically).
    """
    # The renderer's scale runs from 1 (0 is its colour for nothing routed): expert e is drawn at level e + 1.
    levels = {key: np.asarray(values) + 1 for key, values in columns.items()}
    figure, ax, rows = _grid_figure(pixels, levels, num_experts, overlay=True, row_labels=None)
    expert_colorbar(figure, ax, num_experts, EXPERT_LEGEND, shrink=min(1.0, 0.4 + 0.2 * rows))
    figure.suptitle(title, fontsize=10)
    return save_figure(figure, path)


def _grid_figure(
    pixels: Sequence[np.ndarray],
    columns: Mapping[str, np.ndarray],
    max_count: int,
    overlay: bool,
    row_labels: Sequence[str] | None,
) -> tuple[Figure, Axes, int]:
    """The figure of :func:`mmoe.routing.render.diversity_grid`'s pixels with its column and row labels, without
    colour bar or title: (figure, its axes, rows)."""
    rows, cols = len(pixels), 1 + len(columns)
    height, width = pixels[0].shape[:2]
    figure = new_figure(1.0 + 1.9 * cols, 0.9 + 1.9 * rows)
    ax = figure.subplots()
    ax.imshow(diversity_grid(pixels, columns, max_count, overlay), interpolation="nearest")
    ax.xaxis.tick_top()
    ax.set_xticks(tile_centres(width, cols), ["input", *columns], fontsize=9)
    labels = [_shorten(label, 24, keep_end=True) for label in row_labels] if row_labels is not None else []
    ax.set_yticks(tile_centres(height, rows) if labels else [], labels, fontsize=7)
    ax.tick_params(length=0)
    ax.spines[:].set_visible(False)
    return figure, ax, rows


def draw_text_maps(
    tokens: Sequence[Sequence[str]],
    rows: Mapping[str, np.ndarray],
    max_count: int,
    title: str,
    path: str | Path,
    names: Sequence[str] | None = None,
) -> Path:
    """One panel per text: rows = layers (or checkpoint · layer), columns = its tokens, colour = distinct experts
    (coloured as :func:`mmoe.routing.render.count_colours` colours the image maps).

    Args:
        tokens: N token-string lists (padding excluded).
        rows: row label -> (N, T) diversity counts (0 at padding, drawn grey).
        max_count: top of the colour scale.
        title: figure title.
        path: PNG to write (atomically).
        names: a title per text (e.g. where it came from).
    """
    texts = len(tokens)
    longest = max(len(t) for t in tokens)
    figure = new_figure(2.5 + 0.42 * longest, 0.8 + texts * (0.9 + 0.3 * len(rows)))
    axes = figure.subplots(texts, 1, squeeze=False)[:, 0]
    for n, (ax, words) in enumerate(zip(axes, tokens, strict=True)):
        grid = np.stack([np.asarray(values[n][: len(words)]) for values in rows.values()])
        ax.imshow(count_colours(grid, max_count), aspect="auto", interpolation="nearest")
        ax.set_xticks(range(len(words)), [_shorten(w, 12) for w in words], rotation=60, ha="right", fontsize=8)
        ax.set_yticks(range(len(rows)), list(rows), fontsize=8)
        ax.set_xlim(-0.5, longest - 0.5)
        ax.set_xlabel("text token", fontsize=8)
        if names is not None:
            ax.set_title(_shorten(names[n], 60, keep_end=True), fontsize=8)
    count_colorbar(figure, list(axes), max_count, TOKEN_LEGEND)
    figure.suptitle(title, fontsize=10)
    return save_figure(figure, path)


def _shorten(text: str, limit: int, keep_end: bool = False) -> str:
    """At most ``limit`` characters; the end is kept for names (shard keys differ in their last characters)."""
    if len(text) <= limit:
        return text
    return "…" + text[1 - limit :] if keep_end else text[: limit - 1] + "…"
