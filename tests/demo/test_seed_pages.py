"""What the pages say about pre-training across seeds and tasks is what their own numbers support:
``docs/tutorials/demo.md``'s interval over the training seeds is the paired t interval of its seed table's
differences, and README names among what pre-training shows only the metrics whose shipped comparison
(``docs/demo_comparison/comparison.json``) has a paired interval above zero."""

from __future__ import annotations

import json
import re
from pathlib import Path

from mmoe.pipeline.compare import PRETRAINED_AHEAD
from mmoe.stats import one_sample

REPO = Path(__file__).resolve().parents[2]
DEMO = REPO / "docs" / "tutorials" / "demo.md"


def _table(text: str, header: str) -> dict[str, list[str]]:
    """The rows of the Markdown table whose header line starts with ``header``: first cell -> the other cells."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(header))
    rows = {}
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        rows[cells[0]] = cells[1:]
    return rows


def _number(text: str) -> float:
    return float(text.replace("−", "-"))


def _decimals(text: str) -> int:
    return len(text.split(".")[1]) if "." in text else 0


def test_the_demo_page_gives_each_metric_s_interval_over_the_training_seeds():
    """Per metric, the three seeds' differences (``a − b = d`` in the seed table) give Student's t interval over the
    seeds; the page's over-the-seeds table holds it, at the seed table's decimals."""
    text = DEMO.read_text()
    seeds = _table(text, "| metric | seed 0")
    over = _table(text, "| metric | mean difference over the 3 seeds")
    assert set(seeds) == set(over) and len(seeds) == 4
    for metric, cells in seeds.items():
        shown = [re.search(r"= (−?[0-9.]+)", cell).group(1) for cell in cells]
        test = one_sample([_number(value) for value in shown])
        places = _decimals(shown[0])
        low, high, mean = (f"{v:.{places}f}".replace("-", "−") for v in (*test.interval, test.difference))
        assert over[metric] == [mean, f"[{low}, {high}]", f"{test.p_value:.2g}"]
    assert "holds under every seed" not in " ".join(text.split()) and "the claim that holds" not in text


def test_readme_names_among_what_pre_training_shows_only_metrics_with_an_interval_above_zero():
    rows = json.loads((REPO / "docs" / "demo_comparison" / "comparison.json").read_text())
    readme = " ".join((REPO / "README.md").read_text().split())
    named = re.search(r"Pre-training shows[^(]*\(([^)]*)\)", readme).group(1)
    items = [item.strip() for item in named.split(",")]
    for item in items:
        matching = [row for row in rows if item.lower() in f"{row['task']} {row['metric']}".lower()]
        assert matching, f"README names {item!r}, which has no compared row (no interval)"
        assert all(row["verdict"] == PRETRAINED_AHEAD for row in matching), item
    ahead = [row for row in rows if row["verdict"] == PRETRAINED_AHEAD]
    assert all(any(item.lower() in f"{row['task']} {row['metric']}".lower() for item in items) for row in ahead)
