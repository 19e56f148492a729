"""Each claim decided over training runs, as its plan says: the unit is the run (a seed), the interval Welch's over
the runs per arm (:mod:`mmoe.study.run_statistics`) at the level, alpha and power of the claim's noise rule, a claim of
several gaps corrected by Holm at that alpha where the plan says so (each gap's p-value compared with alpha where it
says none), and a claim whose arms have one run each undecidable; the claim's within-run verdict (batches, images,
rows or windows of one run) is kept beside it as a secondary term, never in its place.

Decided today: the routing claims 1, 3 and 4 over the routing seeds (:mod:`mmoe.study.routing_decisions`), the task
order (claim 6) over the pre-trainings of each variant (their fine-tuning seeds averaged; over the fine-tuning
seeds where a variant has one pre-training), pre-training against random init (claim 7) over the backbones, and the
inter-run consistency (claim 5, one row per fine-tuning rule) over the seeds' leave-one-out jackknife pseudo-values of
the mean correlation between runs (Tukey's jackknife: a pair of runs is not an independent unit, a run is). A claim
the preset does not run keeps its not-run verdict (:func:`mmoe.study.verdicts.is_not_run`).
"""

from __future__ import annotations

import numpy as np

from mmoe.stats import POWER
from mmoe.study.claims import Claim, judged_window, mean_correlation, order_verdict
from mmoe.study.claims.mhmoe_routing import diversity_run_measure
from mmoe.study.claims.task_scores import TASK_SCORES
from mmoe.study.plan import ClaimPlan, StudyPlan
from mmoe.study.plan_design import TASK_ORDER
from mmoe.study.routing_decisions import DECIDERS, activation_parts, image_interval, routing_decision
from mmoe.study.run_statistics import UNDECIDABLE, family_verdicts, one_sample_verdict, run_verdict
from mmoe.study.runs import Measures
from mmoe.study.verdicts import NOT_SEPARATED, SATURATED, UNINFORMATIVE, combined, is_not_run, keys_of

#: The consistency claim's verdict where the measures hold no leave-one-out values (made before they were saved).
NO_SEED_VALUES = "undecidable: the measures hold no per-seed values"


def _decision(rules: ClaimPlan, claim: Claim, verdict: str, runs_per_arm: list[int] | None = None, **fields) -> dict:
    """A claim's decision entry; ``runs_per_arm``: the plan's deciding units per arm where they are not its runs
    (claim 6's pre-trainings, each averaging its fine-tunings, which stand beside as ``fine_tunings_per_arm``)."""
    noise = rules.noise_rule
    entry = {"id": claim.id, "runs_per_arm": rules.runs_per_arm() if runs_per_arm is None else runs_per_arm}
    if runs_per_arm is not None and runs_per_arm != rules.runs_per_arm():
        entry["fine_tunings_per_arm"] = rules.runs_per_arm()
    entry["unit"] = noise.unit
    entry |= {"level": noise.level, "alpha": noise.alpha, "power": noise.power}
    entry |= {"multiplicity": rules.multiplicity, "within_run_verdict": claim.verdict}
    return entry | {"verdict": verdict} | fields


def _gap(a: list[float], b: list[float], rules: ClaimPlan, within_run: list[float] | None = None) -> dict:
    """One gap a - b (predicted positive) decided over runs at the level, alpha and power of the claim's noise rule."""
    noise = rules.noise_rule
    return run_verdict(a, b, +1, within_run, level=noise.level, alpha=noise.alpha, power=noise.power)


def _corrected(gaps: list[dict], rules: ClaimPlan) -> list[dict]:
    """The claim's gaps under its multiplicity rule: Holm at the plan's alpha, or (none) as :func:`_gap` left them,
    each compared with that alpha alone."""
    return family_verdicts(gaps, rules.noise_rule.alpha) if rules.multiplicity == "holm" else gaps


def pretraining_means(by_pretraining: dict, variant: str, task: str, score: str) -> list[float] | None:
    """Claim 6's unit where a variant has several pre-trainings: per pre-training, the mean of ``score`` over its
    fine-tuning seeds (None where the measures hold one pre-training, or none, of the variant)."""
    per_pretraining = by_pretraining.get(variant, {}).get(task, [])
    if len(per_pretraining) < 2:
        return None
    return [float(np.mean([run[score] for run in runs])) for runs in per_pretraining]


def _task_values(claim: Claim, by_pretraining: dict) -> tuple[dict, dict]:
    """Per variant and task, the values each arm is decided over (the pre-trainings' means where a variant has
    several, else the fine-tuning runs' scores), and per task whether a variant is at or below its chance level
    there (the plan's gate of the pre-training design)."""
    scores, tasks = claim.measured["scores"], claim.measured["tasks"]
    values: dict = {variant: {} for variant in TASK_ORDER}
    at_chance = {}
    for task, score, _ in TASK_SCORES:
        means = {variant: pretraining_means(by_pretraining, variant, task, score) for variant in TASK_ORDER}
        for variant, unit_values in means.items():
            values[variant][task] = scores[variant][task]["values"] if unit_values is None else unit_values
        chance = tasks[task]["chance"]
        at_chance[task] = chance is not None and any(
            unit_values is not None and np.mean(unit_values) <= chance for unit_values in means.values()
        )
    return values, at_chance


def _task_decision(claim: Claim, rules: ClaimPlan, by_pretraining: dict) -> dict:
    """Claim 6 over runs: each adjacent gap of the order per task, Welch t over the pre-trainings' means (the
    fine-tuning seeds averaged within each) where a variant has several pre-trainings, else over the fine-tuning
    seeds; Holm over the gaps where the plan says so; a task uninformative where no variant beats its chance level,
    or (pre-trainings as the unit) where one does not."""
    tasks = claim.measured["tasks"]
    values, at_chance = _task_values(claim, by_pretraining)
    gaps, where = [], []
    for task, _, _ in TASK_SCORES:
        for upper, lower in zip(TASK_ORDER, TASK_ORDER[1:], strict=False):
            gaps.append(_gap(values[upper][task], values[lower][task], rules))
            where.append((task, [upper, lower]))
    corrected = zip(_corrected(gaps, rules), where, strict=True)
    gaps = [gap | {"task": task, "pair": pair} for gap, (task, pair) in corrected]
    per_task = {}
    for task, _, _ in TASK_SCORES:
        verdicts = [gap["verdict"] for gap in gaps if gap["task"] == task]
        uninformative = tasks[task]["verdict"] == UNINFORMATIVE or at_chance[task]
        per_task[task] = UNINFORMATIVE if uninformative else order_verdict(verdicts)
    # Several pre-trainings per variant: each is one unit (its fine-tunings averaged), as the plan's noise rule says.
    backbones = rules.backbones_per_arm()
    units = backbones if min(backbones, default=0) >= 2 else None
    return _decision(rules, claim, combined(per_task.values()), units, gaps=gaps, tasks=per_task)


def _pretraining_decision(claim: Claim, rules: ClaimPlan, images: dict | None = None) -> dict:
    """Claim 7 over the backbones (or, in a file from before them, the fine-tuning seeds), each task's gap with the
    bootstrap over its evaluation's images as the within-run term where the images were saved."""
    tasks, images = claim.measured["tasks"], images or {}
    gaps = [
        _gap(entry["pretrained"]["values"], entry["random_init"]["values"], rules, image_interval(images[task]))
        if task in images
        else _gap(entry["pretrained"]["values"], entry["random_init"]["values"], rules)
        for task, entry in tasks.items()
    ]
    gaps = [gap | {"task": task} for gap, task in zip(_corrected(gaps, rules), tasks, strict=True)]
    per_task = {
        gap["task"]: UNINFORMATIVE if tasks[gap["task"]]["verdict"] == UNINFORMATIVE else gap["verdict"] for gap in gaps
    }
    return _decision(rules, claim, combined(per_task.values()), gaps=gaps, tasks=per_task)


def _mean_rho(window: dict, keys: list[str], runs: int) -> float | None:
    values = [mean_correlation(window.get(key), runs) for key in keys]
    return None if None in values else float(np.mean(values))


def pseudo_values(result: dict, keys: list[str], window_from: float) -> list[float] | None:
    """Per seed, the jackknife pseudo-value m θ - (m - 1) θ_(-i) of θ, the mean correlation between runs over
    ``keys`` averaged over the judged windows; None without leave-one-out values or where a window's ρ is undefined."""
    runs, windows, left_out = result["runs"], result["windows"], result.get("leave_one_out") or []
    if len(left_out) != runs or runs < 3:
        return None
    judged = judged_window(list(range(len(windows))), window_from)
    values = []
    for seed in range(runs):
        per_window = []
        for position in judged:
            full, part = _mean_rho(windows[position], keys, runs), _mean_rho(left_out[seed][position], keys, runs - 1)
            if None in (full, part):
                return None
            per_window.append(runs * full - (runs - 1) * part)
        values.append(float(np.mean(per_window)))
    return values


def _consistency_decision(claim: Claim, rules: ClaimPlan, consistency: dict) -> dict:
    by_modality = {}
    for name, entry in claim.measured.get("by_modality", {}).items():
        keys = keys_of(entry["keys"], name)
        arms = [pseudo_values(consistency[router], keys, rules.window_from) for router in ("xmoe", "switch")]
        if None in arms:
            by_modality[name] = {"verdict": NO_SEED_VALUES, "within_run": entry["interval"]}
            continue
        gap = _gap(arms[0], arms[1], rules, within_run=entry["interval"])
        if entry["verdict"] in (SATURATED, UNINFORMATIVE):
            gap["verdict"] = entry["verdict"]
        by_modality[name] = gap | {"pseudo_values": {"xmoe": arms[0], "switch": arms[1]}}
    verdict = by_modality.get(rules.paper_modality, {}).get("verdict", NO_SEED_VALUES)
    modalities = {name: entry["verdict"] for name, entry in _paper_first(by_modality, rules).items()}
    return _decision(rules, claim, verdict, by_modality=by_modality, modalities=modalities)


def _paper_first(by_modality: dict, rules: ClaimPlan) -> dict:
    order = [rules.paper_modality, *[name for name in by_modality if name != rules.paper_modality]]
    return {name: by_modality[name] for name in order if name in by_modality}


def _routing_decision(claim: Claim, rules: ClaimPlan, seeded: dict) -> dict:
    by_modality = routing_decision(claim.id, claim.measured, rules, seeded)
    modalities = {name: entry["verdict"] for name, entry in by_modality.items()}
    parts = {"parts": activation_parts(by_modality)} if claim.id == "activation" else {}
    verdict = modalities[rules.paper_modality]
    return _decision(rules, claim, verdict, by_modality=by_modality, modalities=modalities, **parts)


#: The start of a noise rule's unit where the plan names none: the plan's reason the claim is undecidable follows.
NO_UNIT = "none: "


def no_unit_reason(rules: ClaimPlan) -> str | None:
    """The plan's reason a claim has no unit to decide over (claim 9: ``undecidable on the synthetic corpus``), the
    first clause of its noise rule's unit after :data:`NO_UNIT`; None where the plan names a unit."""
    unit = rules.noise_rule.unit
    return unit.removeprefix(NO_UNIT).split(" (")[0] if unit.startswith(NO_UNIT) else None


def _diversity_decision(claim: Claim, rules: ClaimPlan, diversity: dict) -> dict:
    """Claim 2 over runs: per arm with several runs, each run's object minus background (the mean over its vision
    layers) against zero; saturated where the interval contains zero and every run sits at the plan's share of its
    ceiling min(h, E). The arms of one run are not decided."""
    share, noise = rules.gate("saturation_share"), rules.noise_rule
    gaps = []
    for arm in rules.arms:
        measured = [diversity_run_measure(diversity[run.removeprefix("pretrain/")], share) for run in arm.runs]
        gap = one_sample_verdict(
            [m["difference"] for m in measured], +1, level=noise.level, alpha=noise.alpha, power=noise.power
        )
        if gap["verdict"] == NOT_SEPARATED and all(m["verdict"] == SATURATED for m in measured):
            gap["verdict"] = SATURATED
        gaps.append(gap | {"task": arm.name})
    verdict = combined(gap["verdict"] for gap in gaps if gap["verdict"] != UNDECIDABLE)
    return _decision(rules, claim, verdict, gaps=gaps)


def run_decisions(claims: list[Claim], plan: StudyPlan, measures: Measures) -> list[dict]:
    """Every claim decided over runs (one entry per claim, in order): ``runs_per_arm``, the deciding ``unit``,
    ``verdict`` over runs, ``within_run_verdict`` (the claim's), and the gaps with their Welch intervals, detectable
    effects and Holm-adjusted p-values where runs decide."""
    decisions = []
    for claim in claims:
        rules = plan.claim(claim.id)
        if rules.not_run:
            decisions.append(_decision(rules, claim, claim.verdict))
        elif no_unit_reason(rules) is not None:
            decisions.append(_decision(rules, claim, no_unit_reason(rules)))
        elif claim.id == "diversity" and max(rules.runs_per_arm()) >= 2:
            decisions.append(_diversity_decision(claim, rules, measures.diversity))
        elif min(rules.runs_per_arm(), default=1) < 2:
            decisions.append(_decision(rules, claim, UNDECIDABLE))
        elif claim.id in DECIDERS:
            decisions.append(_routing_decision(claim, rules, measures.seeded))
        elif claim.id == "tasks":
            decisions.append(_task_decision(claim, rules, measures.task_pretrainings))
        elif claim.id == "pretraining":
            decisions.append(_pretraining_decision(claim, rules, measures.backbones.get("images", {})))
        elif claim.id in ("consistency", "consistency_trained"):
            consistency = measures.consistency if claim.id == "consistency" else measures.consistency_trained
            decisions.append(_consistency_decision(claim, rules, consistency))
        else:
            raise ValueError(f"claim {claim.id!r} has several runs per arm in the plan but no decision over runs")
    return decisions


def _gap_text(gap: dict, power: float) -> str:
    if "welch" not in gap:
        return gap["verdict"]
    where = " - ".join(gap["pair"]) + " " if "pair" in gap else ""
    label = f"{gap['task']} " if "task" in gap else ""
    if gap["welch"] is None:
        return f"{label}{where}{gap['verdict']}"
    welch = gap["welch"]
    holm = "" if gap.get("holm_p") is None else f", Holm p {gap['holm_p']:.3g}"
    runs = " and ".join(map(str, welch["runs"]))
    return (
        f"{label}{where}{welch['difference']:.3g} [{welch['interval'][0]:.3g}, {welch['interval'][1]:.3g}] over "
        f"{runs} runs (p {welch['p_value']:.3g}{holm}; detectable at power "
        f"{power:g}: {gap['detectable']:.3g}{_within_text(gap)}), {gap['verdict']}"
    )


def _within_text(gap: dict) -> str:
    """The within-run interval beside a decision over runs (secondary: one run's resampling)."""
    within = gap.get("within_run")
    return "" if not within else f"; within one run [{within[0]:.3g}, {within[1]:.3g}]"


def decision_text(decision: dict) -> str:
    """The decision over runs in one line: runs per arm and unit, the level and alpha, then each gap's Welch interval,
    p-value, Holm's adjusted p-value and detectable effect (or why nothing is decided)."""
    runs = sorted(set(decision["runs_per_arm"]))
    head = f"{'/'.join(map(str, runs))} run(s) per arm"
    if "fine_tunings_per_arm" in decision:
        fine_tunings = sorted(set(decision["fine_tunings_per_arm"]))
        head += f" (of {'/'.join(map(str, fine_tunings))} fine-tunings per arm)"
    head += f"; unit: {decision['unit']}"
    power = decision.get("power", POWER)  # a report written before decisions named their noise rule
    if "level" in decision:
        head += f"; level {decision['level']:g}, alpha {decision['alpha']:g}"
    if decision["verdict"] == UNDECIDABLE and "by_modality" not in decision:
        return f"{head}: not decided (the within-run interval covers one run of each arm)"
    if decision["unit"].startswith(NO_UNIT):
        return f"{head}: not decided"
    if is_not_run(decision["verdict"]):
        return f"{head}: nothing trained under this preset"
    if "gaps" in decision:
        gaps = "; ".join(_gap_text(gap, power) for gap in decision["gaps"])
        return f"{head}; {decision['multiplicity']} correction: {gaps}"
    parts = []
    for name, entry in decision.get("by_modality", {}).items():
        gaps = entry.get("gaps", [entry])
        text = "; ".join(_gap_text(gap, power) for gap in gaps)
        parts.append(f"{name}: {text}" + (f" (order: {entry['verdict']})" if "gaps" in entry else ""))
    return f"{head}; " + "; ".join(parts)


def short_verdict(decision: dict) -> str:
    """The decision for the summary table (``1 run per arm: not decided`` where an arm has one run), each modality's
    verdict where the claim was decided per modality, the paper's first."""
    if decision["verdict"] == UNDECIDABLE and not decision.get("modalities"):
        return "1 run per arm: not decided"
    modalities = list(decision.get("modalities", {}).items())
    if not modalities:
        return decision["verdict"]
    (paper, verdict), rest = modalities[0], modalities[1:]
    return "; ".join([f"{paper} (the paper's): {verdict}", *(f"{name}: {v}" for name, v in rest)])
