"""Expert-load figures: activation heatmap layer × expert (MH-MoE Fig. 1a, 5; the pixels of
:mod:`mmoe.routing.render`), load bars, activation-ratio curve.

All take the per-layer expert loads ``{"layer{i}/{modality}": (E,) counts}`` accumulated by
:class:`mmoe.metrics.routing.RoutingTotals` or saved by :class:`mmoe.runtime.routing_callback.RoutingStatsCallback`,
and the tokens those counts were made on (``tokens``, same keys): with them an expert's frequency is its selections
per token, MH-MoE's definition (Fig. 1a, 5); without them (statistics files written before tokens were saved) the
figures show each expert's share of the layer's choices and say so.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path

import matplotlib
import numpy as np
import torch
from matplotlib.figure import Figure

from mmoe.metrics.routing import (
    DEFAULT_ACTIVATION_THRESHOLD,
    DEFAULT_CURVE_THRESHOLDS,
    activation_ratio_curve,
    load_summary,
    selection_frequency,
    sort_keys,
)
from mmoe.routing.render import heatmap_panels, palette
from mmoe.viz.figures import load_colorbar, new_figure, save_figure


def _frequency(loads: Mapping[str, torch.Tensor], tokens: Mapping[str, float] | None, key: str) -> torch.Tensor:
    """Selections per token of each expert of layer ``key`` (share of choices without ``tokens``)."""
    return selection_frequency(loads[key], None if tokens is None else tokens[key])


def _frequency_label(tokens: Mapping[str, float] | None) -> str:
    return "selections per 100 tokens" if tokens is not None else "share of the layer's choices (%)"


def draw_activation_heatmap(
    loads: Mapping[str, torch.Tensor],
    path: str | Path,
    threshold: float = DEFAULT_ACTIVATION_THRESHOLD,
    title: str = "Expert activation",
    tokens: Mapping[str, float] | None = None,
) -> Path:
    """Write :func:`activation_heatmap_figure` to ``path``."""
    return save_figure(activation_heatmap_figure(loads, threshold, title, tokens), path)


def activation_heatmap_figure(
    loads: Mapping[str, torch.Tensor],
    threshold: float = DEFAULT_ACTIVATION_THRESHOLD,
    title: str = "Expert activation",
    tokens: Mapping[str, float] | None = None,
) -> Figure:
    """Heatmap layer × expert per modality (MH-MoE Fig. 5): the panels of
    :func:`mmoe.routing.render.heatmap_panels`, the pixels the training logger logs as ``routing/load_heatmap``
    (each expert's load over the uniform share, on a fixed scale), one axes per panel.

    The first MoE layer is at the top. Experts below the activation threshold (selections per token, MH-MoE's
    definition; the share of the layer's choices without ``tokens``) are marked ×; each row's label gives the layer's
    activation ratio.
    """
    panels = heatmap_panels(loads, sort_keys(loads))
    rows, experts = panels[0].cells
    panel_width = 2.2 + min(0.3 * experts, 7.0)
    figure = new_figure(1.4 + panel_width * len(panels), max(3.0, 1.8 + 0.4 * rows))
    axes = figure.subplots(1, len(panels), squeeze=False)[0]
    for ax, panel in zip(axes, panels, strict=True):
        ax.imshow(panel.pixels, extent=(-0.5, experts - 0.5, rows - 0.5, -0.5), aspect="auto", interpolation="nearest")
        labels = []
        for row, key in enumerate(panel.keys):
            share = _frequency(loads, tokens, key).numpy()
            active = share >= threshold / share.size - 1e-12
            ratio = float(active.mean()) if share.sum() > 0 else 0.0
            labels.append(f"{key.partition('/')[0]} (AR {ratio:.0%})")
            dead = np.flatnonzero(~active)
            ax.scatter(dead, np.full(dead.size, row), marker="x", s=18, color="#4aa3ff", linewidths=1)
        ax.set_xlim(-0.5, experts - 0.5)
        ax.set_ylim(rows - 0.5, -0.5)
        ax.set_yticks(range(len(panel.keys)), labels, fontsize=8)
        ax.set_xticks(range(experts), [str(e) for e in range(experts)], fontsize=7)
        ax.set_xlabel("expert")
        ax.set_title(panel.modality, fontsize=9)
    load_colorbar(figure, list(axes), "load / uniform share")
    figure.suptitle(
        f"{title}\n× = expert below the activation threshold ({threshold:g} × 1/E"
        f"{' of the tokens' if tokens is not None else ' of the choices'}); AR = activation ratio",
        fontsize=9,
    )
    return figure


def draw_load_histograms(
    loads: Mapping[str, torch.Tensor],
    path: str | Path,
    threshold: float = DEFAULT_ACTIVATION_THRESHOLD,
    title: str = "Expert load",
    tokens: Mapping[str, float] | None = None,
) -> Path:
    """One bar chart per MoE layer: each expert's selections per 100 tokens (share of the choices without
    ``tokens``), with the uniform level and the threshold."""
    keys = sort_keys(loads)
    cols = min(4, len(keys))
    rows = math.ceil(len(keys) / cols)
    figure = new_figure(0.6 + 3.0 * cols, 0.7 + 2.3 * rows)
    axes = figure.subplots(rows, cols, squeeze=False)
    for ax, key in zip(axes.flat, keys, strict=False):
        counts = loads[key]
        share = _frequency(loads, tokens, key).numpy() * 100
        experts = np.arange(share.size)
        ax.bar(experts, share, color=palette()[140] / 255)
        uniform = share.sum() / share.size
        ax.axhline(uniform, color="black", linestyle="--", linewidth=1, label="uniform load")
        threshold_level = threshold * 100 / share.size
        ax.axhline(threshold_level, color="#4aa3ff", linestyle=":", linewidth=1.2, label="activation threshold")
        cv = float(load_summary(counts)["load_cv"])
        ax.set_title(f"{key}  (cv {cv:.2f}, {int(counts.sum())} choices)", fontsize=8)
        ax.set_xticks(experts, [str(e) for e in experts], fontsize=7)
        ax.set_xlabel("expert", fontsize=8)
        ax.set_ylabel(_frequency_label(tokens), fontsize=8)
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
    tokens: Mapping[str, float] | None = None,
) -> Path:
    """Activation ratio of each MoE layer as the threshold (a fraction of 1/E) grows (per token with ``tokens``,
    else of the choices)."""
    figure = new_figure(8.5, 4.5)
    ax = figure.subplots()
    keys = sort_keys(loads)
    colors = matplotlib.colormaps["viridis"](np.linspace(0, 0.9, max(len(keys), 1)))
    for key, color in zip(keys, colors, strict=True):
        curve = activation_ratio_curve(loads[key], None if tokens is None else tokens[key], thresholds).numpy() * 100
        style = "-" if key.endswith("vision") else "--" if key.endswith("language") else ":"
        ax.plot(thresholds, curve, style, color=color, label=key, linewidth=1.4)
    ax.axvline(chosen, color="gray", linestyle=":", label=f"default threshold {chosen:g}")
    ax.set_xlabel(f"threshold (fraction of 1/E {'of the tokens' if tokens is not None else 'of the choices'})")
    ax.set_ylabel("activation ratio (% of experts at or above)")
    ax.set_ylim(-3, 103)
    ax.grid(alpha=0.3)
    figure.legend(fontsize=7, ncols=2 if len(keys) > 12 else 1, loc="outside right upper")
    ax.set_title(title, fontsize=10)
    return save_figure(figure, path)


def draw_consistency_curve(
    windows: Sequence[Mapping], path: str | Path, title: str = "Inter-run consistency through fine-tuning"
) -> Path:
    """X-MoE Fig. 3b: IC of the runs' window loads against the step, the mean over MoE layers bold and each layer
    thin (windows as :func:`mmoe.metrics.routing_collect.consistency_through_training` returns them)."""
    figure = new_figure(7.5, 4.2)
    ax = figure.subplots()
    steps = [window["step"] for window in windows]
    keys = sort_keys({key for window in windows for key in window if key not in ("step", "mean")})
    for key in keys:
        values = [np.nan if window.get(key) is None else window[key] for window in windows]
        ax.plot(steps, values, linewidth=0.8, alpha=0.5, label=key)
    mean = [np.nan if window.get("mean") is None else window["mean"] for window in windows]
    ax.plot(steps, mean, color="black", linewidth=2.2, label="mean over layers")
    ax.set_xlabel("fine-tuning step")
    ax.set_ylabel("inter-run consistency IC")
    ax.set_ylim(-1.05, 1.05)
    ax.grid(alpha=0.3)
    figure.legend(fontsize=7, ncols=2 if len(keys) > 12 else 1, loc="outside right upper")
    ax.set_title(title, fontsize=10)
    return save_figure(figure, path)
