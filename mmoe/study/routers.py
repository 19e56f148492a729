"""The study's table of the routers beyond top-1 token choice (fine-grained and shared experts, DeepSeekMoE §3.1-3.2;
loss-free bias, Wang et al. 2024; expert choice, Zhou et al. 2022) beside Switch top-1 of the same size: activation
ratio and load balance per modality, measured on the held-out batches like claim 1's runs. No paper claims a number
here, so the table has no verdict; a router the measures lack (a file made before they were measured) is a row saying
"not run"."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from mmoe.metrics.routing import DEFAULT_ACTIVATION_THRESHOLD, activation_ratio, choice_activation_ratio, load_summary
from mmoe.study.verdicts import MODALITIES, keys_of

#: What a row of a router the measures lack says in each measured column.
NOT_RUN = "not run"

#: (row field, Markdown column) of the measured columns, in order.
COLUMNS = (
    ("layers", "MoE layers"),
    ("experts", "experts"),
    ("per_token", "activated per token (%)"),
    ("share_of_choices", "activated, share of choices (%)"),
    ("load_cv_mean", "load CV, mean"),
    ("load_cv_worst", "load CV, worst layer"),
    ("busiest", "busiest expert ÷ mean load"),
    ("unrouted", "tokens no expert took (%)"),
    ("bias_spread", "selection-bias spread max b − min b"),
)


def _modality_row(measured: dict, keys: list[str], threshold: float) -> dict:
    """The mean over one modality's MoE layers of each measure, the loads summed over the held-out batches;
    ``unrouted`` the mean over the held-out batches (None without expert choice), ``bias_spread`` the mean
    max b − min b (None without a selection bias)."""
    loads = {key: torch.tensor(measured["loads"][key], dtype=torch.float64).sum(0) for key in keys}
    tokens = {key: float(np.sum(measured["tokens"][key])) for key in keys}
    balance = {key: load_summary(loads[key]) for key in keys}
    unrouted = [key for key in keys if key in measured["unrouted"]]
    biases = [np.asarray(measured["selection_bias"][key]) for key in keys if key in measured["selection_bias"]]
    return {
        "layers": len(keys),
        "experts": sorted({measured["experts"][key] for key in keys}),
        "per_token": float(np.mean([activation_ratio(loads[key], tokens[key], threshold) for key in keys])),
        "share_of_choices": float(np.mean([choice_activation_ratio(loads[key], threshold) for key in keys])),
        "load_cv_mean": float(np.mean([balance[key]["load_cv"] for key in keys])),
        "load_cv_worst": float(max(balance[key]["load_cv"] for key in keys)),
        "busiest": float(max(balance[key]["load_max"] for key in keys)),
        "unrouted": float(np.mean([np.mean(measured["unrouted"][key]) for key in unrouted])) if unrouted else None,
        "bias_spread": float(np.mean([bias.max() - bias.min() for bias in biases])) if biases else None,
    }


#: The routing keys' modality of an MoE FFN that both modalities share (``MoEPlan.mode="shared"``).
SHARED_POOL = "shared"


def router_rows(
    router_variants: dict, names: Sequence[str], threshold: float = DEFAULT_ACTIVATION_THRESHOLD
) -> list[dict]:
    """One row per router of ``names`` and modality with its measures (:func:`_modality_row`; ``shared`` for the
    layers of a shared pool, as LIMoE's), or one row marked ``not_run`` for a router ``router_variants`` lacks."""
    rows = []
    for name in names:
        if name not in router_variants:
            rows.append({"router": name, "modality": None, "not_run": True})
            continue
        measured = router_variants[name]
        for wanted in (*MODALITIES, SHARED_POOL):
            keys = keys_of(measured["loads"], wanted)
            if keys:
                row = _modality_row(measured, keys, threshold)
                rows.append({"router": name, "modality": wanted, "not_run": False} | row)
    return rows


def _cell(field: str, value) -> str:
    if value is None:
        return "—"
    if field in ("per_token", "share_of_choices", "unrouted"):
        return f"{100 * value:.1f}"
    if field == "experts":
        return ", ".join(map(str, value))
    return str(value) if isinstance(value, int) else f"{value:.3f}"


def router_table(rows: list[dict]) -> list[str]:
    """The rows as Markdown table lines (a router not run: "not run" in every measured column)."""
    lines = ["| router | modality | " + " | ".join(label for _, label in COLUMNS) + " |"]
    lines.append("| --- | --- |" + " --- |" * len(COLUMNS))
    for row in rows:
        if row["not_run"]:
            cells = [NOT_RUN] * len(COLUMNS)
        else:
            cells = [_cell(field, row[field]) for field, _ in COLUMNS]
        lines.append(f"| {row['router']} | {row['modality'] or '—'} | " + " | ".join(cells) + " |")
    return lines
