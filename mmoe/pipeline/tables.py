"""Plain-text tables of a pipeline's results: one row per task and metric, its value and chance level."""

from __future__ import annotations


def row(task: str, metric: str, value: float, chance: float, baseline: str) -> dict:
    """One table row: the task, the metric, its value, the chance level and what gives that level."""
    return {"task": task, "metric": metric, "value": value, "chance": chance, "baseline": baseline}


def number(value: float) -> str:
    return f"{value:.2f}" if abs(value) >= 2 else f"{value:.3f}"


def format_table(rows_by_variant: dict[str, list[dict]]) -> str:
    """A plain-text table: task, metric, one value column per variant, chance level and its baseline."""
    variants = list(rows_by_variant)
    first = rows_by_variant[variants[0]]
    header = ["task", "metric", *(variants if len(variants) > 1 else ["value"]), "chance", "chance baseline"]
    lines = [header]
    for index, base in enumerate(first):
        values = [number(rows_by_variant[v][index]["value"]) for v in variants]
        lines.append([base["task"], base["metric"], *values, number(base["chance"]), base["baseline"]])
    return aligned(lines)


def aligned(lines: list[list[str]]) -> str:
    """Rows of cells as plain text, each column as wide as its widest cell."""
    widths = [max(len(line[i]) for line in lines) for i in range(len(lines[0]))]
    return "\n".join(
        "  ".join(cell.ljust(width) for cell, width in zip(line, widths, strict=True)).rstrip() for line in lines
    )
