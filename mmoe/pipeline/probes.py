"""The zero-shot probes a pipeline's pre-training logged at its validation after the last step
(:mod:`mmoe.tasks.zero_shot_probes`), read back from its ``metrics.csv`` with their chance levels."""

from __future__ import annotations

import csv

from mmoe.pipeline.launch import metrics_csv
from mmoe.runtime.layout import RunLayout
from mmoe.tasks.zero_shot_probes import PREFIX, probe_chance


def last_validation(layout: RunLayout) -> dict[str, float] | None:
    """The last validation row of the pre-training in ``layout`` that holds probe values: every value it logged there
    (``step``, ``val/<loss>``, ``val/probe/...``) as a number; None when none was logged (a run made without probes,
    or one stopped before its validation)."""
    path = metrics_csv(layout)
    if not path.is_file():
        return None
    with open(path, newline="", encoding="utf-8") as file:
        rows = [row for row in csv.DictReader(file) if row.get(f"{PREFIX}pairs")]
    return {key: float(value) for key, value in rows[-1].items() if value} if rows else None


def logged_probes(layout: RunLayout) -> dict | None:
    """``{"step", "values", "chance"}`` of :func:`last_validation`: its probe values (``val/probe/...`` -> value) and
    the chance level of each; None when none was logged."""
    row = last_validation(layout)
    if row is None:
        return None
    values = {key: value for key, value in row.items() if key.startswith(PREFIX)}
    return {"step": int(row["step"]), "values": values, "chance": probe_chance(values)}


def probes_text(probes: dict) -> str:
    """The probe values on one line, each beside its chance level."""
    chance = probes["chance"]
    parts = [
        f"{key.removeprefix(PREFIX)} {value:.3f} (chance {chance[key]:.3f})"
        for key, value in probes["values"].items()
        if key in chance
    ]
    return f"{int(probes['values'][f'{PREFIX}pairs'])} held-out pairs at step {probes['step']}: " + ", ".join(parts)
