"""The task-score claims: claim 6, MH-MoE > X-MoE > dense on the vision-language tasks at equal steps (MH-MoE Table 4),
and the claim every reader assumes, that pre-training helps (BEiT-3 §3), both from the fine-tuned runs'
``scores.json`` with Student-t intervals over seeds."""

from __future__ import annotations

import numpy as np

from mmoe.pipeline.benchmarks import benchmark_named
from mmoe.stats import pooled_std, seed_interval
from mmoe.study.claims.claim import Claim, Statement
from mmoe.study.plan_design import TASK_ORDER
from mmoe.study.plan_gpu import SHIPPED_NOT_RUN_UNIT
from mmoe.study.verdicts import (
    NOT_RUN,
    NOT_SEPARATED,
    OPPOSITE,
    REPRODUCES,
    SHIPPED_NOT_RUN,
    UNINFORMATIVE,
    combined,
    describe,
    direction_verdict,
    gated,
)
from mmoe.tasks.captioning import CaptioningFineTuning
from mmoe.tasks.nlvr2 import NLVR2FineTuning
from mmoe.tasks.vqa import VQAFineTuning

# -- claim 6: task scores ---------------------------------------------------------------------------------------------

#: The tasks MH-MoE Table 4 reports: VQAv2, NLVR2 and COCO captioning.
TABLE_4_TASKS = (VQAFineTuning, NLVR2FineTuning, CaptioningFineTuning)
#: The tasks' scores: (task, score name in scores.json, label), each its benchmark's headline.
TASK_SCORES = tuple((task.name, *benchmark_named(task.name).headline) for task in TABLE_4_TASKS)


def spread(values: list[float]) -> dict:
    """Mean, sample standard deviation (0 for one value) and the values."""
    return {
        "mean": float(np.mean(values)),
        "std": float(np.std(values, ddof=1)) if len(values) > 1 else 0.0,
        "values": values,
    }


def order_verdict(gaps: list[str]) -> str:
    """The verdict on an order a > b > c from its gaps' verdicts: one gap reversed beyond the noise contradicts it."""
    if OPPOSITE in gaps:
        return OPPOSITE
    return REPRODUCES if all(gap == REPRODUCES for gap in gaps) else NOT_SEPARATED


TASKS = Statement(
    "tasks",
    "MH-MoE > X-MoE > dense on the three tasks at equal steps",
    "MH-MoE Table 4 (BEiT-3 base, 8 experts, fully pre-trained): dense / X-MoE / MH-MoE score VQAv2 test-dev 65.9 / "
    "68.4 / 70.1, NLVR2 dev 73.8 / 75.5 / 77.0, COCO CIDEr 120.5 / 122.9 / 124.1",
)


def tasks_claim(scores: dict, chance: dict[str, float]) -> Claim:
    """MH-MoE Table 4: at equal steps, MH-MoE > X-MoE > dense on the vision-language tasks. ``scores``: variant ->
    task -> list over seeds of that run's ``scores.json``; ``chance``: task -> its chance level.

    Each gap of the order gets a Student-t interval over seeds from the task's pooled seed standard deviation
    (:func:`mmoe.stats.seed_interval`; not separated when no cell has two seeds); a task's order is
    contradicted by one reversed gap (:func:`order_verdict`). A task where no variant beats its chance level is
    uninformative; the claim combines the informative tasks (:func:`mmoe.study.verdicts.combined`)."""
    table = {
        variant: {task: spread([run[score] for run in per_task[task]]) for task, score, _ in TASK_SCORES}
        for variant, per_task in scores.items()
    }
    per_task = {}
    for task, _, label in TASK_SCORES:
        noise = pooled_std(cells[task]["values"] for cells in table.values())
        gaps = []
        for upper, lower in zip(TASK_ORDER, TASK_ORDER[1:], strict=False):
            a, b = table[upper][task]["values"], table[lower][task]["values"]
            interval = seed_interval(a, b, noise)
            gaps.append(
                {
                    "pair": [upper, lower],
                    "difference": float(np.mean(a) - np.mean(b)),
                    "interval": interval,
                    "verdict": direction_verdict(interval, +1),
                }
            )
        level = chance.get(task)
        below_chance = level is not None and all(cells[task]["mean"] <= level for cells in table.values())
        verdict = UNINFORMATIVE if below_chance else order_verdict([gap["verdict"] for gap in gaps])
        std = None if noise is None else noise[0]
        per_task[task] = {"label": label, "pooled_seed_std": std, "chance": level, "gaps": gaps, "verdict": verdict}
    summary = "; ".join(
        f"{entry['label']}: {entry['verdict']} (gaps "
        + ", ".join(f"{g['pair'][0]} - {g['pair'][1]} {describe(g['interval'])}" for g in entry["gaps"])
        + ")"
        for entry in per_task.values()
    )
    overall = combined(entry["verdict"] for entry in per_task.values())
    return TASKS.measured({"scores": table, "tasks": per_task}, overall, summary)


def not_run_claim(statement: Statement, unit: str = SHIPPED_NOT_RUN_UNIT) -> Claim:
    """``statement`` where the preset trains none of its runs, in its plan's words ``unit`` (which preset runs it;
    the default plan's words keep that plan's verdict)."""
    verdict = SHIPPED_NOT_RUN if unit == SHIPPED_NOT_RUN_UNIT else NOT_RUN
    return statement.measured({"scores": {}, "tasks": {}}, verdict, unit)


# -- pre-training helps ------------------------------------------------------------------------------------------------


PRETRAINING = Statement(
    "pretraining",
    "Pre-training helps: the pre-trained backbone fine-tunes above random init",
    "BEiT-3 and MH-MoE fine-tune only pre-trained backbones (BEiT-3 base: VQAv2 77.7 after 1M pre-training steps); the "
    "gain over random init is assumed, not reported",
)


def pretraining_claim(variant: str, pretrained: dict, random_init: dict, chance: dict[str, float]) -> Claim:
    """The claim every reader assumes: at equal fine-tuning steps and seeds, a backbone pre-trained by mmoe scores
    above the same architecture fine-tuned from random init (BEiT-3 §3; MH-MoE Table 4 fine-tunes pre-trained models
    only). ``pretrained`` / ``random_init``: task -> the runs' ``scores.json`` (fine-tuning seeds of one backbone,
    or one fine-tuning of each backbone); the tasks of the three that both hold.

    Per task, the difference of the means with a Student-t interval over seeds (pooled seed standard deviation of the
    two cells); uninformative where neither side beats the task's chance level."""
    per_task = {}
    for task, score, label in TASK_SCORES:
        if task not in pretrained or task not in random_init:
            continue
        a = [run[score] for run in pretrained[task]]
        b = [run[score] for run in random_init[task]]
        interval = seed_interval(a, b, pooled_std([a, b]))
        level = chance.get(task)
        below_chance = level is not None and max(np.mean(a), np.mean(b)) <= level
        per_task[task] = {
            "label": label,
            "pretrained": spread(a),
            "random_init": spread(b),
            "chance": level,
            "difference": float(np.mean(a) - np.mean(b)),
            "interval": interval,
            "verdict": gated(direction_verdict(interval, +1), uninformative=below_chance),
        }
    summary = "; ".join(
        f"{entry['label']} {entry['pretrained']['mean']:.3f} vs {entry['random_init']['mean']:.3f} from random "
        f"init, difference {describe(entry['interval'])}, {entry['verdict']}"
        for entry in per_task.values()
    )
    verdict = combined(entry["verdict"] for entry in per_task.values())
    return PRETRAINING.measured({"variant": variant, "tasks": per_task}, verdict, f"{variant}: {summary}")
