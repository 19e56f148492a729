"""Pre-train router variants as ``mmoe demo`` does (its corpus, codebook and pre-training stage, reused when done) and
print their load balance from the files the runs wrote: the table of the routers compared.

    OMP_NUM_THREADS=1 nice -n 5 .venv/bin/python scripts/router_balance.py --out /tmp/routers --train \
        switch fine_grained shared_experts loss_free expert_choice
    .venv/bin/python scripts/router_balance.py --out /tmp/routers switch fine_grained   # the table only

Per variant, from ``pretrain/<variant>/routing_stats.json``'s last window: the load CV (std / mean of each MoE layer's
expert loads; mean and worst layer) and the busiest expert's load over the mean; from the run's CSV log: the last
``train/unrouted_fraction`` (expert choice), ``train/selection_bias_spread`` (loss-free bias) and ``train/loss``.
``--out`` is a demo run directory: ``mmoe demo --out DIR --variant X`` goes on from these pre-trainings.
"""

from __future__ import annotations

import argparse
import csv
from pathlib import Path

from mmoe.metrics.routing import load_summary, sort_keys
from mmoe.metrics.routing_stats import read_stats, window_loads
from mmoe.pipeline.launch import VARIANTS
from mmoe.pipeline.layout import PipelineRun
from mmoe.pipeline.settings import DEMO, record_demo_settings
from mmoe.pipeline.stages import run_stage
from mmoe.pipeline.standard_stages import codebook_stage, corpus_stage, variant_pretrain_stage

#: The CSV log's columns of the table, by column title.
LOGGED = {"unrouted (%)": "train/unrouted_fraction", "bias spread": "train/selection_bias_spread", "loss": "train/loss"}


def last_logged(metrics: Path) -> dict[str, tuple[int, float]]:
    """Per column of a Lightning CSV log, its last (step, value)."""
    last = {}
    with metrics.open() as file:
        for row in csv.DictReader(file):
            for name, value in row.items():
                if value not in ("", None) and name != "step":
                    last[name] = (int(row["step"]), float(value))
    return last


def balance_row(run: PipelineRun, variant: str) -> dict:
    """The table's numbers of one pre-trained variant, from its routing statistics and CSV log."""
    layout = run.pretraining(variant)
    step, loads = window_loads(read_stats(layout.root))[-1]
    summaries = [load_summary(loads[key]) for key in sort_keys(loads)]
    cv = [float(summary["load_cv"]) for summary in summaries]
    logged = last_logged(layout.csv_logs / "version_0" / "metrics.csv")
    row = {"variant": variant, "window step": step, "MoE layers": len(cv)}
    row |= {"load CV mean": sum(cv) / len(cv), "load CV worst": max(cv)}
    row["busiest / mean"] = max(float(summary["load_max"]) for summary in summaries)
    for title, name in LOGGED.items():
        value = logged.get(name, (None, None))[1]
        row[title] = None if value is None else 100 * value if title == "unrouted (%)" else value
    return row


def cell(value) -> str:
    return "—" if value is None else f"{value:.3f}" if isinstance(value, float) else str(value)


def table(rows: list[dict]) -> str:
    header = list(rows[0])
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    for row in rows:
        lines.append("| " + " | ".join(cell(row[title]) for title in header) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("variants", nargs="+", choices=[v for v in VARIANTS if v != "dense"])
    parser.add_argument("--out", type=Path, required=True, help="a demo run directory")
    parser.add_argument("--train", action="store_true", help="pre-train the variants missing from --out first")
    args = parser.parse_args()
    run = PipelineRun(args.out, DEMO)
    if args.train:
        record_demo_settings(run.out, run.settings)
        for stage in [corpus_stage(run), codebook_stage(run), *(variant_pretrain_stage(run, v) for v in args.variants)]:
            run_stage(run, stage)
    print(table([balance_row(run, variant) for variant in args.variants]))


if __name__ == "__main__":
    main()
