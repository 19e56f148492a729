"""Claims 1, 3 and 4 decided over the routing seeds (the pre-training run is the unit): per run, the claim's
statistic over every MoE layer of the measured modality and the plan's window, then Welch's t over the runs of each
arm at the claim's noise rule (claim 1: its two gaps under Holm), the within-run interval of routing seed 0 beside it
as the secondary term. Both modalities are decided; the paper's is the claim's verdict. Claim 7's within-run term,
a paired bootstrap over the evaluation's images, is here too (:func:`image_interval`)."""

from __future__ import annotations

import numpy as np
import torch

from mmoe.metrics.routing import choice_activation_ratio
from mmoe.stats import LEVEL, bootstrap, percentile_interval
from mmoe.study.claims.mhmoe_routing import ACTIVATION_PARTS
from mmoe.study.claims.task_scores import order_verdict
from mmoe.study.claims.xmoe_routing import _fluctuation, _random_fluctuation, judged_window
from mmoe.study.plan import ClaimPlan
from mmoe.study.run_statistics import UNDECIDABLE, family_verdicts, run_verdict
from mmoe.study.verdicts import UNINFORMATIVE, keys_of

#: The verdict of a modality no run measured.
NOT_MEASURED = "not measured"


def _verdict(a: list[float], b: list[float], sign: int, rules: ClaimPlan, within: list[float] | None) -> dict:
    noise = rules.noise_rule
    return run_verdict(a, b, sign, within, level=noise.level, alpha=noise.alpha, power=noise.power)


def share_of_choices(entry: dict, keys: list[str], threshold: float) -> float:
    """One run's share of choices activated (MH-MoE Fig. 1a's view independent of h), the loads summed over the
    held-out batches, the mean over ``keys``."""
    ratios = [
        float(choice_activation_ratio(torch.tensor(entry["loads"][k], dtype=torch.float64).sum(0), threshold))
        for k in keys
    ]
    return float(np.mean(ratios))


def activation_gaps(seeds: list[dict], rules: ClaimPlan, name: str, within: list[float] | None) -> dict | None:
    """Claim 1 on modality ``name``: per run the share of choices of X-MoE (h = 1) and of each MH-MoE arm, the gaps
    most heads - X-MoE and most heads - the next fewer heads over runs, Holm over the two."""
    threshold = rules.gate("activation_threshold")
    arms: dict[int, list[float]] = {}
    for seed in seeds:
        for entry in seed["activation"].values():
            keys = keys_of(entry["loads"], name)
            if not keys:
                return None
            arms.setdefault(entry["heads"], []).append(share_of_choices(entry, keys, threshold))
    heads = sorted(arms)
    pairs = [(heads[-1], heads[0]), (heads[-1], heads[-2])] if len(heads) > 2 else [(heads[-1], heads[0])]
    gaps = [
        _verdict(arms[high], arms[low], +1, rules, within if low == 1 else None) | {"pair": [f"h={high}", f"h={low}"]}
        for high, low in pairs
    ]
    gaps = family_verdicts(gaps, rules.noise_rule.alpha) if rules.multiplicity == "holm" else gaps
    per_run = {f"h={h}": values for h, values in arms.items()}
    return {"gaps": gaps, "per_run": per_run, "verdict": order_verdict([gap["verdict"] for gap in gaps])}


def activation_parts(by_modality: dict) -> list[dict]:
    """Claim 1 as its two statements (:data:`ACTIVATION_PARTS`): each one's verdict per modality is that of its gap
    over runs (Holm-adjusted with the other, as the plan says); :data:`NOT_MEASURED` where the runs have no such gap
    (one MH-MoE arm)."""
    parts = []
    for position, statement in enumerate(ACTIVATION_PARTS):
        modalities = {}
        for name, entry in by_modality.items():
            gaps = entry.get("gaps", [])
            modalities[name] = gaps[position]["verdict"] if position < len(gaps) else NOT_MEASURED
        parts.append({"id": statement.id, "title": statement.title, "modalities": modalities})
    return parts


def late_log_rc(measures: list[dict], keys: list[str], window_from: float) -> float | None:
    """One run's mean over the window's snapshots of log RC, RC the geometric mean over ``keys``; None where RC is
    undefined at one of them."""
    values = []
    for snapshot in judged_window(measures, window_from):
        rcs = [snapshot["collapse"][key]["rc"] for key in keys]
        if any(rc is None or not rc > 0 for rc in rcs):
            return None
        values.append(float(np.mean(np.log(rcs))))
    return float(np.mean(values)) if values else None


#: Claim 3's verdict where fewer than two runs of an arm have RC defined in the window (the plan's rule: such a run
#: leaves its arm), followed by how many runs of each arm had it undefined.
RC_UNDEFINED = "undecidable: RC undefined in the window"


def collapse_gap(seeds: list[dict], rules: ClaimPlan, name: str, within: list[float] | None) -> dict | None:
    """Claim 3 on modality ``name``: per run the window's mean log RC over every MoE layer, X-MoE - Switch over runs
    (a run whose RC is undefined in the window leaves its arm, and is counted)."""
    per_run: dict[str, list[float | None]] = {"xmoe": [], "switch": []}
    for seed in seeds:
        for router in per_run:
            measures = seed["snapshots"][router]
            keys = keys_of(measures[0]["collapse"], name)
            if not keys:
                return None
            per_run[router].append(late_log_rc(measures, keys, rules.window_from))
    defined = {router: [v for v in values if v is not None] for router, values in per_run.items()}
    undefined = {router: len(values) - len(defined[router]) for router, values in per_run.items()}
    gap = _verdict(defined["xmoe"], defined["switch"], +1, rules, within)
    if gap["verdict"] == UNDECIDABLE and any(undefined.values()):  # the runs were there; RC was not defined in them
        counts = ", ".join(f"{router} {undefined[router]} of {len(per_run[router])}" for router in per_run)
        gap["verdict"] = f"{RC_UNDEFINED} ({counts} runs)"
    return gap | {"per_run": per_run, "undefined_runs": undefined}


def fluctuation_gap(seeds: list[dict], rules: ClaimPlan, name: str, within: list[float] | None) -> dict | None:
    """Claim 4 on modality ``name``: per run the mean over the window's snapshot pairs of the share of (sub-)tokens
    that changed expert, X-MoE - Switch over runs (predicted negative); uninformative where both arms' mean is at the
    plan's share of a random reassignment with their loads."""
    per_run: dict[str, list[float]] = {"xmoe": [], "switch": []}
    random: dict[str, list[float]] = {"xmoe": [], "switch": []}
    for seed in seeds:
        for router in per_run:
            pairs = judged_window(
                [m for m in seed["snapshots"][router] if m["fluctuation"] is not None], rules.window_from
            )
            keys = keys_of(pairs[0]["fluctuation"], name) if pairs else []
            if not keys:
                return None
            batches = np.arange(len(pairs[0]["fluctuation"][keys[0]]["compared"]))
            per_run[router].append(_fluctuation(pairs, keys, batches))
            random[router].append(_random_fluctuation(pairs, keys))
    gap = _verdict(per_run["xmoe"], per_run["switch"], -1, rules, within)
    share = rules.gate("random_fluctuation_share")
    if all(np.mean(per_run[r]) >= share * np.mean(random[r]) for r in per_run):
        gap["verdict"] = UNINFORMATIVE
    return gap | {"per_run": per_run, "random_reassignment": random}


DECIDERS = {"activation": activation_gaps, "collapse": collapse_gap, "fluctuation": fluctuation_gap}


def within_interval(measured: dict, claim_id: str, name: str) -> list[float] | None:
    """The within-run interval of the claim's modality ``name`` (routing seed 0; for claim 1 the share-of-choices
    view's)."""
    entry = measured.get("by_modality", {}).get(name)
    if entry is None:
        return None
    return entry["views"]["share_of_choices"]["interval"] if claim_id == "activation" else entry["interval"]


def routing_decision(claim_id: str, measured: dict, rules: ClaimPlan, seeded: dict) -> dict[str, dict]:
    """Modality -> claim ``claim_id`` decided over the routing seeds of ``seeded`` (the paper's modality first)."""
    seeds = seeded.get("seeds", [])
    order = (rules.paper_modality, *[m for m in rules.modalities if m != rules.paper_modality])
    by_modality = {}
    for name in order:
        within = within_interval(measured, claim_id, name)
        entry = DECIDERS[claim_id](seeds, rules, name, within) if seeds else None
        by_modality[name] = entry if entry is not None else {"verdict": NOT_MEASURED}
    return by_modality


def image_interval(images: dict, level: float = LEVEL) -> list[float] | None:
    """Claim 7's within-run term: a bootstrap over the evaluation's images (each image's questions a cluster, the same
    draw for every run) of the pre-trained arm's mean accuracy minus the random inits' (percent)."""
    arms = [images.get("pretrained"), images.get("random_init")]
    if None in arms or not arms[0] or not arms[1]:
        return None
    sums = [np.asarray([run["sums"] for run in arm]) for arm in arms]
    questions = np.asarray(arms[0][0]["questions"], dtype=np.float64)

    def difference(index: np.ndarray) -> float:
        means = [float(np.mean(arm[:, index].sum(1) / questions[index].sum())) for arm in sums]
        return 100 * (means[0] - means[1])

    return percentile_interval(bootstrap(difference, len(questions)), level)
