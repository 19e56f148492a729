"""Sub-token assignment-diversity maps (MH-MoE, Wu et al., 2024, Fig. 1b, 8, 10).

For every image patch (or text token), the number of distinct experts its h sub-tokens are routed to: bright =
the sub-tokens go to many different experts, dark = they share experts. The values come from
:func:`mmoe.metrics.routing.image_diversity_maps` / :func:`~mmoe.metrics.routing.text_diversity`; this module only
draws them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

from mmoe.viz.figures import count_scale, new_figure, save_figure

PATCH_LEGEND = "distinct experts among the sub-tokens of a patch"
TOKEN_LEGEND = "distinct experts among the sub-tokens of a token"


def draw_patch_grid(
    pixels: Sequence[np.ndarray],
    columns: Mapping[str, np.ndarray],
    max_count: int,
    title: str,
    path: str | Path,
    overlay: bool = True,
    row_labels: Sequence[str] | None = None,
    legend: str = PATCH_LEGEND,
) -> Path:
    """Images × maps: column 0 the input image, then one column per map (layers, or checkpoints).

    Args:
        pixels: N images, (H, W, 3) uint8, as the model saw them.
        columns: column title -> (N, g, g) diversity counts (grids may differ between columns).
        max_count: top of the colour scale (the number of heads for top-1 maps).
        title: figure title.
        path: PNG to write (atomically).
        overlay: draw each map over a grey copy of the image (True) or on its own (False).
        row_labels: a label per image (e.g. its file name).
        legend: the colour bar's label (what the integers count).
    """
    rows, cols = len(pixels), 1 + len(columns)
    figure = new_figure(1.0 + 1.9 * cols, 0.9 + 1.9 * rows)
    axes = figure.subplots(rows, cols, squeeze=False)
    cmap, norm, ticks = count_scale(max_count)
    mappable = None
    for r, image in enumerate(pixels):
        height, width = image.shape[:2]
        axes[r, 0].imshow(image)
        if row_labels is not None:
            axes[r, 0].set_ylabel(_shorten(row_labels[r], 24, keep_end=True), fontsize=7)
        for c, (label, maps) in enumerate(columns.items(), start=1):
            ax = axes[r, c]
            if overlay:
                ax.imshow(image.mean(-1), cmap="gray", vmin=0, vmax=255)
            mappable = ax.imshow(
                np.asarray(maps[r]),
                cmap=cmap,
                norm=norm,
                alpha=0.7 if overlay else 1.0,
                extent=(0, width, height, 0),
                interpolation="nearest",
            )
            if r == 0:
                ax.set_title(label, fontsize=9)
    axes[0, 0].set_title("input", fontsize=9)
    for ax in axes.flat:
        ax.set_xticks([])
        ax.set_yticks([])
    if mappable is not None:
        figure.colorbar(mappable, ax=axes, ticks=ticks, label=legend, shrink=min(1.0, 0.4 + 0.2 * rows))
    figure.suptitle(title, fontsize=10)
    return save_figure(figure, path)


def draw_text_maps(
    tokens: Sequence[Sequence[str]],
    rows: Mapping[str, np.ndarray],
    max_count: int,
    title: str,
    path: str | Path,
    names: Sequence[str] | None = None,
) -> Path:
    """One panel per text: rows = layers (or checkpoint · layer), columns = its tokens, colour = distinct experts.

    Args:
        tokens: N token-string lists (padding excluded).
        rows: row label -> (N, T) diversity counts (0 at padding, not drawn).
        max_count: top of the colour scale.
        title: figure title.
        path: PNG to write (atomically).
        names: a title per text (e.g. where it came from).
    """
    texts = len(tokens)
    longest = max(len(t) for t in tokens)
    figure = new_figure(2.5 + 0.42 * longest, 0.8 + texts * (0.9 + 0.3 * len(rows)))
    axes = figure.subplots(texts, 1, squeeze=False)[:, 0]
    cmap, norm, ticks = count_scale(max_count)
    mappable = None
    for n, (ax, words) in enumerate(zip(axes, tokens, strict=True)):
        grid = np.stack([np.asarray(values[n][: len(words)]) for values in rows.values()]).astype(float)
        grid = np.ma.masked_where(grid <= 0, grid)
        mappable = ax.imshow(grid, cmap=cmap, norm=norm, aspect="auto", interpolation="nearest")
        ax.set_xticks(range(len(words)), [_shorten(w, 12) for w in words], rotation=60, ha="right", fontsize=8)
        ax.set_yticks(range(len(rows)), list(rows), fontsize=8)
        ax.set_xlim(-0.5, longest - 0.5)
        ax.set_xlabel("text token", fontsize=8)
        if names is not None:
            ax.set_title(_shorten(names[n], 60, keep_end=True), fontsize=8)
    if mappable is not None:
        figure.colorbar(mappable, ax=list(axes), ticks=ticks, label=TOKEN_LEGEND)
    figure.suptitle(title, fontsize=10)
    return save_figure(figure, path)


def _shorten(text: str, limit: int, keep_end: bool = False) -> str:
    """At most ``limit`` characters; the end is kept for names (shard keys differ in their last characters)."""
    if len(text) <= limit:
        return text
    return "…" + text[1 - limit :] if keep_end else text[: limit - 1] + "…"
