"""Expert-load figures: activation heatmap layer × expert (MH-MoE Fig. 1a, 5), load bars, activation-ratio curve.

All take the per-layer expert loads ``{"layer{i}/{modality}": (E,) counts}`` accumulated by
:class:`mmoe.metrics.routing.RoutingTotals` or saved by :class:`mmoe.tasks.routing_callback.RoutingStatsCallback`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path

import matplotlib
import numpy as np
import torch

from mmoe.metrics.routing import (
    DEFAULT_ACTIVATION_THRESHOLD,
    DEFAULT_CURVE_THRESHOLDS,
    activation_ratio,
    activation_ratio_curve,
    load_summary,
    selection_frequency,
    sort_keys,
)
from mmoe.viz.figures import COLORMAP, new_figure, save_figure


def _by_modality(loads: Mapping[str, torch.Tensor]) -> dict[str, list[str]]:
    groups: dict[str, list[str]] = {}
    for key in sort_keys(loads):
        groups.setdefault(key.partition("/")[2], []).append(key)
    return groups


def draw_activation_heatmap(
    loads: Mapping[str, torch.Tensor],
    path: str | Path,
    threshold: float = DEFAULT_ACTIVATION_THRESHOLD,
    title: str = "Expert activation",
) -> Path:
    """Heatmap layer × expert per modality: each expert's share of its layer's choices (MH-MoE Fig. 5).

    The first MoE layer is at the top. Experts below the activation threshold are marked ×; each row's label gives
    the layer's activation ratio.
    """
    groups = _by_modality(loads)
    max_experts = max(int(v.numel()) for v in loads.values())
    max_rows = max(len(keys) for keys in groups.values())
    panel_width = 2.2 + min(0.3 * max_experts, 7.0)
    figure = new_figure(1.4 + panel_width * len(groups), max(3.0, 1.8 + 0.4 * max_rows))
    axes = figure.subplots(1, len(groups), squeeze=False)[0]
    peak = max(float(selection_frequency(v).max()) for v in loads.values()) * 100
    mappable = None
    for ax, (modality, keys) in zip(axes, groups.items(), strict=True):
        grid = np.full((len(keys), max_experts), np.nan)
        for row, key in enumerate(keys):
            counts = loads[key]
            share = selection_frequency(counts).numpy() * 100
            grid[row, : share.size] = share
            dead = np.flatnonzero(share < threshold * 100 / share.size - 1e-10)
            ax.scatter(dead, np.full(dead.size, row), marker="x", s=18, color="#4aa3ff", linewidths=1)
        mappable = ax.imshow(grid, cmap=COLORMAP, vmin=0, vmax=max(peak, 1e-6), aspect="auto", interpolation="nearest")
        labels = [f"{key.partition('/')[0]} (AR {float(activation_ratio(loads[key], threshold)):.0%})" for key in keys]
        ax.set_yticks(range(len(keys)), labels, fontsize=8)
        ax.set_xticks(range(max_experts), [str(e) for e in range(max_experts)], fontsize=7)
        ax.set_xlabel("expert")
        ax.set_title(modality, fontsize=9)
    figure.colorbar(mappable, ax=list(axes), label="share of the layer's choices (%)")
    figure.suptitle(
        f"{title}\n× = expert below the activation threshold ({threshold:g} × the uniform share 1/E); "
        "AR = activation ratio",
        fontsize=9,
    )
    return save_figure(figure, path)


def draw_load_histograms(
    loads: Mapping[str, torch.Tensor],
    path: str | Path,
    threshold: float = DEFAULT_ACTIVATION_THRESHOLD,
    title: str = "Expert load",
) -> Path:
    """One bar chart per MoE layer: each expert's share of the choices, with the uniform share and the threshold."""
    keys = sort_keys(loads)
    cols = min(4, len(keys))
    rows = math.ceil(len(keys) / cols)
    figure = new_figure(0.6 + 3.0 * cols, 0.7 + 2.3 * rows)
    axes = figure.subplots(rows, cols, squeeze=False)
    for ax, key in zip(axes.flat, keys, strict=False):
        counts = loads[key]
        share = selection_frequency(counts).numpy() * 100
        experts = np.arange(share.size)
        ax.bar(experts, share, color=matplotlib.colormaps[COLORMAP](0.55))
        uniform = 100 / share.size
        ax.axhline(uniform, color="black", linestyle="--", linewidth=1, label=f"uniform 1/E = {uniform:.1f}%")
        ax.axhline(threshold * uniform, color="#4aa3ff", linestyle=":", linewidth=1.2, label="activation threshold")
        cv = float(load_summary(counts)["load_cv"])
        ax.set_title(f"{key}  (cv {cv:.2f}, {int(counts.sum())} choices)", fontsize=8)
        ax.set_xticks(experts, [str(e) for e in experts], fontsize=7)
        ax.set_xlabel("expert", fontsize=8)
        ax.set_ylabel("share of choices (%)", fontsize=8)
    for ax in list(axes.flat)[len(keys) :]:
        ax.axis("off")
    figure.legend(*axes[0, 0].get_legend_handles_labels(), loc="outside upper right", fontsize=7, ncols=2)
    figure.suptitle(title, fontsize=10)
    return save_figure(figure, path)


def draw_activation_curve(
    loads: Mapping[str, torch.Tensor],
    path: str | Path,
    thresholds: Sequence[float] = DEFAULT_CURVE_THRESHOLDS,
    chosen: float = DEFAULT_ACTIVATION_THRESHOLD,
    title: str = "Activation ratio vs threshold",
) -> Path:
    """Activation ratio of each MoE layer as the threshold (a fraction of 1/E) grows."""
    figure = new_figure(8.5, 4.5)
    ax = figure.subplots()
    keys = sort_keys(loads)
    colors = matplotlib.colormaps["viridis"](np.linspace(0, 0.9, max(len(keys), 1)))
    for key, color in zip(keys, colors, strict=True):
        curve = activation_ratio_curve(loads[key], thresholds).numpy() * 100
        style = "-" if key.endswith("vision") else "--" if key.endswith("language") else ":"
        ax.plot(thresholds, curve, style, color=color, label=key, linewidth=1.4)
    ax.axvline(chosen, color="gray", linestyle=":", label=f"default threshold {chosen:g}")
    ax.set_xlabel("threshold (fraction of the uniform share 1/E)")
    ax.set_ylabel("activation ratio (% of experts at or above)")
    ax.set_ylim(-3, 103)
    ax.grid(alpha=0.3)
    figure.legend(fontsize=7, ncols=2 if len(keys) > 12 else 1, loc="outside right upper")
    ax.set_title(title, fontsize=10)
    return save_figure(figure, path)
