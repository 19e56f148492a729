"""The study's report: one figure per claim (PNG), ``report.json`` (every claim with its numbers) and ``report.md``
(claim, paper, measurement, verdict, figure)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from mmoe.atomic import write_text_atomic
from mmoe.io import write_json
from mmoe.study.claims import TASK_SCORES, Claim
from mmoe.viz.figures import new_figure, save_figure

#: The report's files in the study's folder.
REPORT_FILE, REPORT_MARKDOWN = "report.json", "report.md"


def _bars(path: Path, labels: list[str], values: list[float], ylabel: str, title: str, errors=None) -> Path:
    figure = new_figure(6.0, 3.6)
    ax = figure.subplots()
    ax.bar(labels, values, yerr=errors, capsize=4, color="#4c72b0")
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.grid(axis="y", alpha=0.3)
    return save_figure(figure, path)


def _curves(path: Path, curves: dict, x: str, y: str, ylabel: str, xlabel: str, title: str) -> Path:
    figure = new_figure(6.0, 3.6)
    ax = figure.subplots()
    for variant, curve in curves.items():
        values = [np.nan if v is None else v for v in curve[y]]
        ax.plot(curve[x], values, marker="o", label=variant)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return save_figure(figure, path)


def draw_figures(claims: list[Claim], out: Path, chance: dict[str, float]) -> dict[str, Path]:
    """One PNG per claim in ``out`` (the tasks' chance levels dashed); returns claim id -> figure."""
    by_id = {claim.id: claim.measured for claim in claims}
    figures = {}
    runs = sorted(by_id["activation"]["runs"].items(), key=lambda item: item[1]["heads"])
    figures["activation"] = _bars(
        out / "activation_ratio.png",
        [f"{name}\nh={run['heads']}" for name, run in runs],
        [100 * run["mean"] for _, run in runs],
        "experts activated (%)",
        "Activation ratio, 32 experts (MH-MoE Fig. 1a)",
    )
    diversity = by_id["diversity"]["runs"]
    figure = new_figure(6.0, 3.6)
    ax = figure.subplots()
    positions = np.arange(len(diversity))
    ax.bar(positions - 0.2, [r["object_mean"] or 0 for r in diversity.values()], 0.4, label="object patches")
    ax.bar(positions + 0.2, [r["background_mean"] or 0 for r in diversity.values()], 0.4, label="background patches")
    ax.set_xticks(positions, list(diversity), fontsize=8)
    ax.set_ylabel("distinct experts per patch")
    ax.set_title("Sub-token diversity, objects vs background (MH-MoE Fig. 1b / 8)", fontsize=10)
    ax.legend(fontsize=8)
    figures["diversity"] = save_figure(figure, out / "diversity_objects_background.png")
    collapse = by_id["collapse"]["curves"]
    figures["collapse"] = _curves(
        out / "representation_collapse.png",
        collapse,
        "steps",
        "rc",
        "RC (X-MoE Eq. 11)",
        "pre-training step",
        "Representation collapse (X-MoE Fig. 2c)",
    )
    fluctuation = by_id["fluctuation"]["curves"]
    figures["fluctuation"] = _curves(
        out / "routing_fluctuation.png",
        fluctuation,
        "steps",
        "fluctuation",
        "tokens that changed expert",
        "pre-training step",
        "Routing fluctuation (X-MoE Fig. 3a)",
    )
    consistency = by_id["consistency"]["curves"]
    figures["consistency"] = _curves(
        out / "inter_run_consistency.png",
        consistency,
        "steps",
        "ic",
        "IC",
        "fine-tuning step (VQAv2)",
        "Inter-run consistency (X-MoE Fig. 3b)",
    )
    scores = by_id["tasks"]["scores"]
    figure = new_figure(9.0, 3.4)
    axes = figure.subplots(1, len(TASK_SCORES))
    for ax, (task, _, label) in zip(axes, TASK_SCORES, strict=True):
        cells = [scores[variant][task] for variant in scores]
        ax.bar(list(scores), [c["mean"] for c in cells], yerr=[c["std"] for c in cells], capsize=3, color="#55a868")
        if task in chance:
            ax.axhline(chance[task], color="black", linestyle="--", linewidth=1, label="chance")
        ax.set_title(label, fontsize=9)
        ax.tick_params(axis="x", labelsize=7, rotation=30)
    figures["tasks"] = save_figure(figure, out / "tasks.png")
    return figures


def markdown(claims: list[Claim], figures: dict[str, Path], header: str, root: Path, chance: dict[str, float]) -> str:
    """The report as Markdown; figure links relative to ``root`` (where report.md lies)."""
    lines = [header, "", "| # | claim | paper | mmoe | verdict |", "| --- | --- | --- | --- | --- |"]
    for number, claim in enumerate(claims, 1):
        lines.append(f"| {number} | {claim.title} | {claim.paper} | {claim.summary} | {claim.verdict} |")
    for number, claim in enumerate(claims, 1):
        lines += ["", f"## {number}. {claim.title}", "", f"**Paper.** {claim.paper}.", ""]
        lines += [f"**mmoe.** {claim.summary}. **Verdict: {claim.verdict}.**", ""]
        if claim.id == "tasks":
            lines += _score_table(claim.measured["scores"], chance)
        if claim.id in figures:
            lines += [f"![{claim.title}]({figures[claim.id].relative_to(root)})"]
    return "\n".join(lines) + "\n"


def _score_table(scores: dict, chance: dict[str, float]) -> list[str]:
    head = "| variant | " + " | ".join(label for _, _, label in TASK_SCORES) + " |"
    lines = [head, "| --- |" + " --- |" * len(TASK_SCORES)]
    for variant, cells in scores.items():
        values = []
        for task, _, _ in TASK_SCORES:
            cell = cells[task]
            seeds = len(cell["values"])
            text = f"{cell['mean']:.3f}"
            values.append(f"{text} ± {cell['std']:.3f} ({seeds} seeds)" if seeds > 1 else text)
        lines.append(f"| {variant} | " + " | ".join(values) + " |")
    levels = [f"{chance[task]:.3f}" if task in chance else "" for task, _, _ in TASK_SCORES]
    lines.append(
        "| chance level (VQA prior per question type, constant NLVR2 answer, constant caption) | "
        + " | ".join(levels)
        + " |"
    )
    return [*lines, ""]


def write_report(claims: list[Claim], out: Path, header: str, extra: dict, chance: dict[str, float]) -> dict:
    """``out/report.json``, ``out/report.md`` and ``out/figures/*.png``; ``chance``: task -> its chance level on
    claim 5's score (context, not part of any claim). Returns the JSON object."""
    figures = draw_figures(claims, out / "figures", chance)
    claims_json = [claim.to_json() for claim in claims]
    report = extra | {
        "claims": claims_json,
        "chance": chance,
        "figures": {key: str(path) for key, path in figures.items()},
    }
    write_json(out / REPORT_FILE, report)
    text = markdown(claims, figures, header, out, chance)
    write_text_atomic(out / REPORT_MARKDOWN, text)
    return report
