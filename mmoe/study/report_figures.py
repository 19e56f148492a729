"""The study's figures: one PNG per claim, each modality's interval and verdict in its panel's title."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from mmoe.study.claims import TASK_SCORES, Claim
from mmoe.study.verdicts import describe, is_not_run
from mmoe.viz.figures import new_figure, save_figure


def _modality_axes(figure, by_modality: dict, paper_modality: str) -> list:
    """One subplot per measured modality, the paper's first."""
    names = sorted(by_modality, key=lambda name: name != paper_modality)
    axes = np.atleast_1d(figure.subplots(1, max(1, len(names))))
    return list(zip(names, axes, strict=False))


def _title(name: str, paper_modality: str, interval_text: str, verdict: str) -> str:
    label = f"{name} (paper's)" if name == paper_modality else name
    return f"{label}: {interval_text}\n{verdict}"


def _activation_figure(measured: dict, path: Path) -> Path:
    figure = new_figure(9.0, 3.8)
    for name, ax in _modality_axes(figure, measured["by_modality"], measured["paper_modality"]):
        entry = measured["by_modality"][name]
        runs = list(entry["runs"].items())
        positions = np.arange(len(runs))
        ax.bar(positions - 0.2, [100 * r["per_token"] for _, r in runs], 0.4, label="per token (paper)")
        ax.bar(positions + 0.2, [100 * r["share_of_choices"] for _, r in runs], 0.4, label="share of choices")
        ax.scatter(
            positions - 0.2,
            [100 * r["random_router"]["per_token"] for _, r in runs],
            marker="_",
            s=200,
            color="black",
            label="random router",
            zorder=3,
        )
        ax.set_xticks(positions, [f"h={r['heads']}" for _, r in runs], fontsize=8)
        view = entry["views"]["share_of_choices"]
        rise = f"share-of-choices rise {describe(view['interval'], 100)} pts"
        ax.set_title(_title(name, measured["paper_modality"], rise, entry["verdict"]), fontsize=8)
        ax.set_ylabel("experts activated (%)")
        ax.legend(fontsize=7)
    return save_figure(figure, path)


def _diversity_figure(measured: dict, path: Path) -> Path:
    runs = measured["runs"]
    figure = new_figure(6.5, 3.8)
    ax = figure.subplots()
    positions = np.arange(len(runs))
    values = list(runs.values())
    ax.bar(positions - 0.2, [r["object_mean"] or 0 for r in values], 0.4, label="object patches")
    ax.bar(positions + 0.2, [r["background_mean"] or 0 for r in values], 0.4, label="background patches")
    ax.scatter(positions, [r["ceiling"] for r in values], marker="_", s=300, color="black", label="ceiling min(h, E)")
    ax.scatter(positions, [r["random_router"] for r in values], marker="x", color="grey", label="random router")
    ax.set_xticks(positions, [f"{n}\n{describe(r['interval'])}\n{r['verdict']}" for n, r in runs.items()], fontsize=7)
    ax.set_ylabel("distinct experts per patch (vision)")
    ax.set_title("Sub-token diversity, objects vs background (MH-MoE Fig. 1b / 8)", fontsize=9)
    ax.legend(fontsize=7)
    return save_figure(figure, path)


@dataclass(frozen=True)
class Curve:
    """A claim drawn as curves through training: its PNG's ``file``, the curve's field ``y`` and its label, the x
    axis's label, the ``words`` before each panel's late interval, and what ``extra`` the panel draws."""

    file: str
    y: str
    ylabel: str
    xlabel: str
    words: str
    extra: Callable | None = None


def _curves_figure(measured: dict, path: Path, curve: Curve) -> Path:
    figure = new_figure(9.0, 3.8)
    for name, ax in _modality_axes(figure, measured["by_modality"], measured["paper_modality"]):
        entry = measured["by_modality"][name]
        for variant, values in entry["curves"].items():
            ax.plot(values["steps"], [np.nan if v is None else v for v in values[curve.y]], marker="o", label=variant)
        if curve.extra is not None:
            curve.extra(ax, entry)
        ax.set_xlabel(curve.xlabel)
        ax.set_ylabel(curve.ylabel)
        interval = f"{curve.words} {describe(entry['interval'])}"
        ax.set_title(_title(name, measured["paper_modality"], interval, entry["verdict"]), fontsize=8)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    return save_figure(figure, path)


def _random_levels(ax, entry: dict) -> None:
    for level in entry["random_reassignment"].values():
        ax.axhline(level, linestyle=":", linewidth=1, color="grey")
    ax.text(0.01, 0.02, "dotted: random reassignment", transform=ax.transAxes, fontsize=6)


_LATE, _RHO = "late X-MoE - Switch", "mean ρ between seeds' loads"
#: The claims drawn as curves through training, by claim id.
CURVES = {
    "collapse": Curve(
        "representation_collapse.png",
        "rc",
        "RC (X-MoE Eq. 11), geometric mean",
        "pre-training step",
        "late log(X-MoE/Switch)",
    ),
    "fluctuation": Curve(
        "routing_fluctuation.png",
        "fluctuation",
        "tokens that changed expert",
        "pre-training step",
        _LATE,
        _random_levels,
    ),
    "consistency": Curve("inter_run_consistency.png", "rho", _RHO, "fine-tuning step (VQAv2)", _LATE),
    "consistency_trained": Curve(
        "inter_run_consistency_trained.png", "rho", _RHO, "fine-tuning step (VQAv2), both routers trained", _LATE
    ),
}


def draw_figures(claims: list[Claim], out: Path, chance: dict[str, float]) -> dict[str, Path]:
    """One PNG per claim in ``out``, each modality's interval and verdict in its panel title (the tasks' chance
    levels dashed); returns claim id -> figure."""
    # a claim not run: nothing measured, no figure
    by_id = {claim.id: {} if is_not_run(claim.verdict) else claim.measured for claim in claims}
    figures = {}
    if by_id["activation"].get("by_modality"):
        figures["activation"] = _activation_figure(by_id["activation"], out / "activation_ratio.png")
    if by_id["diversity"].get("runs"):
        figures["diversity"] = _diversity_figure(by_id["diversity"], out / "diversity_objects_background.png")
    for claim_id, curve in CURVES.items():
        if by_id.get(claim_id, {}).get("by_modality"):
            figures[claim_id] = _curves_figure(by_id[claim_id], out / curve.file, curve)
    if by_id["tasks"].get("scores"):
        figures["tasks"] = _tasks_figure(by_id["tasks"], out / "tasks.png", chance)
    if by_id.get("pretraining"):
        figures["pretraining"] = _pretraining_figure(by_id["pretraining"], out / "pretraining.png")
    if by_id.get("capacity", {}).get("by_modality"):
        figures["capacity"] = _capacity_figure(by_id["capacity"], out / "requested_capacity.png")
    if by_id.get("frequency", {}).get("mean_passes"):
        figures["frequency"] = _frequency_figure(by_id["frequency"], out / "capacity_by_token_frequency.png")
    return figures


def _tasks_figure(measured: dict, path: Path, chance: dict[str, float]) -> Path:
    scores, tasks = measured["scores"], measured["tasks"]
    figure = new_figure(9.0, 3.6)
    axes = figure.subplots(1, len(TASK_SCORES))
    for ax, (task, _, label) in zip(axes, TASK_SCORES, strict=True):
        cells = [scores[variant][task] for variant in scores]
        ax.bar(list(scores), [c["mean"] for c in cells], yerr=[c["std"] for c in cells], capsize=3, color="#55a868")
        if task in chance:
            ax.axhline(chance[task], color="black", linestyle="--", linewidth=1, label="chance")
        ax.set_title(f"{label}\n{tasks[task]['verdict']}", fontsize=8)
        ax.tick_params(axis="x", labelsize=7, rotation=30)
    return save_figure(figure, path)


def _frequency_figure(measured: dict, path: Path) -> Path:
    figure = new_figure(6.0, 3.8)
    ax = figure.subplots()
    ax.scatter(np.asarray(measured["training_frequency"]) + 1, measured["mean_passes"], s=10, alpha=0.6)
    ax.set_xscale("log")
    ax.set_xlabel("occurrences in the pre-training text + 1")
    ax.set_ylabel("FFN passes per token (held-out)")
    rho = "undefined" if measured["rho"] is None else f"{measured['rho']:.3f} {describe(measured['interval'])}"
    ax.set_title(f"Requested capacity by token frequency (Stratified MoE Fig. 3)\nSpearman ρ {rho}", fontsize=9)
    return save_figure(figure, path)


def _pretraining_figure(measured: dict, path: Path) -> Path:
    figure = new_figure(9.0, 3.6)
    axes = np.atleast_1d(figure.subplots(1, len(measured["tasks"])))
    for ax, entry in zip(axes, measured["tasks"].values(), strict=True):
        cells = [entry["pretrained"], entry["random_init"]]
        ax.bar(
            ["pre-trained", "random init"],
            [c["mean"] for c in cells],
            yerr=[c["std"] for c in cells],
            capsize=3,
            color=["#4c72b0", "#c44e52"],
        )
        if entry["chance"] is not None:
            ax.axhline(entry["chance"], color="black", linestyle="--", linewidth=1)
        ax.set_title(f"{entry['label']}\ndifference {describe(entry['interval'])}\n{entry['verdict']}", fontsize=8)
    return save_figure(figure, path)


def _capacity_figure(measured: dict, path: Path) -> Path:
    figure = new_figure(8.0, 3.6)
    for name, ax in _modality_axes(figure, measured["by_modality"], measured["paper_modality"]):
        entry = measured["by_modality"][name]
        layers = entry.get("per_layer", {})
        ax.bar([key.split("/")[0] for key in layers], list(layers.values()), color="#8172b2")
        ax.set_ylabel("FFN passes per token")
        interval = f"first - later {describe(entry.get('interval'))}"
        ax.set_title(_title(name, measured["paper_modality"], interval, entry["verdict"]), fontsize=8)
    return save_figure(figure, path)
