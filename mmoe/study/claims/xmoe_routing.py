"""X-MoE's routing claims through training: claim 3, representation collapse (Fig. 2c), claim 4, routing
fluctuation (Fig. 3a), both through pre-training, and claim 5, the consistency of fine-tuning runs across seeds (Fig.
3b), each X-MoE's router against the linear (Switch) router."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from mmoe.stats import bootstrap, percentile_interval
from mmoe.study.claims.claim import Claim, Statement, empty_claim, modality_claim
from mmoe.study.plan import ClaimPlan
from mmoe.study.plan_design import shipped_rules
from mmoe.study.verdicts import DESCRIPTIVE, SATURATED, describe, direction_verdict, gated, keys_of, log_mean

# The plan's gates: fluctuation is uninformative when both routers change expert at least
# ``random_fluctuation_share`` as often as a random reassignment with the same loads would (1 - Σ_e p_e²): routing is
# then still being re-drawn. Agreement of seeds' loads (mean Pearson ρ between runs) is saturated from
# ``consistency_ceiling``.

# -- claims 3 and 4: through pre-training ----------------------------------------------------------------------------


def judged_window(values: Sequence, window_from: float) -> list:
    """The judged window of snapshots or windows: those from the share ``window_from`` of them on (0.5: the second
    half)."""
    return list(values[int(len(values) * window_from) :])


def collapse_keys(snapshots: dict, name: str, rules: ClaimPlan) -> list[str]:
    """The modality's MoE layers the plan's ``layers`` rule keeps: all; those whose RC is defined at every snapshot
    of every router; or at every snapshot of the window (both routers compared on the same keys)."""
    keys = None
    for measures in snapshots.values():
        kept = judged_window(measures, rules.window_from) if rules.layers == "defined_in_window" else measures
        for snapshot in kept:
            collapse = snapshot["collapse"]
            kept_keys = keys_of(collapse, name)
            defined = {key for key in kept_keys if rules.layers == "all" or (collapse[key]["rc"] or 0) > 0}
            keys = defined if keys is None else keys & defined
    return sorted(keys or [])


def _late_log_ratio(late: dict, keys: list[str], replicate: int | None) -> float | None:
    """Mean over the paired late snapshots of log(RC_xmoe / RC_switch), RC the geometric mean over ``keys``; of the
    ``replicate``-th bootstrap replicate, or of the measured RC (None)."""
    per_snapshot = []
    for switch, xmoe in zip(late["switch"], late["xmoe"], strict=True):
        values = []
        for snapshot in (xmoe, switch):
            collapse = snapshot["collapse"]
            rcs = [collapse[k]["rc"] if replicate is None else collapse[k]["resamples"][replicate] for k in keys]
            values.append(log_mean(rcs))
        if None in values:
            return None
        per_snapshot.append(np.log(values[0]) - np.log(values[1]))
    return float(np.mean(per_snapshot))


def _layer_collapse(late: list[dict], key: str) -> dict:
    """One layer's second-half RC (geometric mean over the snapshots) and the classes K it had at the last snapshot
    (RC grows with the K - 1 discriminant directions, so RC / (K - 1) is shown beside it)."""
    last = late[-1]["collapse"][key]
    return {
        "second_half_rc": log_mean(m["collapse"][key]["rc"] for m in late),
        "classes": last["classes"],
        "rc_per_direction": last["rc"] / max(1, last["classes"] - 1),
    }


def _collapse_modality(snapshots: dict, keys: list[str], window_from: float) -> dict:
    curves = {
        variant: {
            "steps": [m["step"] for m in measures],
            "rc": [log_mean(m["collapse"][key]["rc"] for key in keys) for m in measures],
            "classes": [{key: m["collapse"][key]["classes"] for key in keys} for m in measures],
        }
        for variant, measures in snapshots.items()
    }
    late = {variant: judged_window(measures, window_from) for variant, measures in snapshots.items()}
    resamples = min(len(m["collapse"][keys[0]]["resamples"]) for ms in late.values() for m in ms)
    replicates = [_late_log_ratio(late, keys, r) for r in range(resamples)]
    interval = percentile_interval(np.asarray([r for r in replicates if r is not None]))
    slopes = {}
    for variant, curve in curves.items():
        steps, rc = judged_window(curve["steps"], window_from), judged_window(curve["rc"], window_from)
        fit = len(steps) > 1 and None not in rc
        slopes[variant] = float(np.polyfit(steps, np.log(rc), 1)[0]) if fit else None
    per_layer = {key: {variant: _layer_collapse(measures, key) for variant, measures in late.items()} for key in keys}
    return {
        "keys": keys,
        "curves": curves,
        "per_layer": per_layer,
        "second_half_log_ratio": _late_log_ratio(late, keys, None),
        "interval": interval,
        "second_half_slope": slopes,
        "verdict": direction_verdict(interval, +1),
    }


COLLAPSE = Statement(
    "collapse",
    "X-MoE's routing keeps more within-class variability (larger RC) than a linear router",
    "X-MoE Fig. 2c: RC (Eq. 11) of one mid-depth 32-expert layer through 125K pre-training steps on MLM validation "
    "text; the SMoE baseline descends, X-MoE stays larger with an uptrend",
)


def collapse_claim(snapshots: dict, rules: ClaimPlan | None = None) -> Claim:
    """X-MoE Fig. 2c: X-MoE's router inputs keep a larger RC (less collapse) than the linear (Switch) router's through
    pre-training. ``snapshots``: variant -> :func:`mmoe.study.measures.snapshot_measures` (``switch`` and ``xmoe``).

    Per modality, RC of each snapshot is the geometric mean over the modality's MoE layers (the keys the plan's
    ``layers`` rule keeps, :func:`collapse_keys`); the trend is the plan's window of the snapshots (``window_from``):
    the mean log ratio X-MoE / Switch with an interval from the rows' bootstrap replicates, and each router's slope of
    log RC.
    """
    rules = rules or shipped_rules("collapse")
    by_modality = {}
    if set(snapshots) == {"switch", "xmoe"}:
        for name in rules.modalities:
            keys = collapse_keys(snapshots, name, rules)
            if keys:
                by_modality[name] = _collapse_modality(snapshots, keys, rules.window_from)

    def text(entry: dict) -> str:
        if entry["second_half_log_ratio"] is None:
            return "RC undefined in the window"
        ratio = np.exp(entry["second_half_log_ratio"])
        low, high = np.exp(entry["interval"]) if entry["interval"] else (np.nan, np.nan)
        slopes = ", ".join(f"{v} slope {s:+.2g}/step" for v, s in entry["second_half_slope"].items() if s is not None)
        layers = "; ".join(
            f"{key.split('/')[0]} switch {v['switch']['second_half_rc']:.3g} (K {v['switch']['classes']}), xmoe "
            f"{v['xmoe']['second_half_rc']:.3g} (K {v['xmoe']['classes']})"
            for key, v in entry["per_layer"].items()
        )
        return f"X-MoE / Switch RC {ratio:.2f}x [{low:.2f}, {high:.2f}] ({slopes}; {layers})"

    measured = {"paper_modality": rules.paper_modality, "by_modality": by_modality}
    note = _window_text(rules, "snapshots") + ", geometric mean over MoE layers)"
    return modality_claim(COLLAPSE, measured, text, note)


def _fluctuation(pairs: list[dict], keys: list[str], batches: np.ndarray) -> float | None:
    """Mean over snapshot pairs of the share of (sub-)tokens that changed expert, pooled over ``keys``."""
    shares = []
    for pair in pairs:
        changed = sum(np.asarray(pair["fluctuation"][key]["changed"])[batches].sum() for key in keys)
        compared = sum(np.asarray(pair["fluctuation"][key]["compared"])[batches].sum() for key in keys)
        if not compared:
            return None
        shares.append(changed / compared)
    return float(np.mean(shares))


def _random_fluctuation(pairs: list[dict], keys: list[str]) -> float:
    """1 - Σ_e p_e² of the later snapshot's loads (the chance that a token reassigned at random with the same loads
    changes expert), token-weighted over ``keys``, averaged over the pairs."""
    values = []
    for pair in pairs:
        weights, levels = [], []
        for key in keys:
            loads = np.asarray(pair["loads"][key], dtype=np.float64)
            weights.append(sum(pair["fluctuation"][key]["compared"]))
            levels.append(1 - np.sum((loads / loads.sum()) ** 2))
        values.append(float(np.average(levels, weights=weights)))
    return float(np.mean(values))


def _window_text(rules: ClaimPlan, what: str) -> str:
    """`` (second half of the snapshots``, or the share the window starts at (no closing parenthesis)."""
    return f" (second half of the {what}" if rules.window_from == 0.5 else f" ({what} from {rules.window_from:.0%} on"


def _fluctuation_modality(pairs: dict, keys: list[str], rules: ClaimPlan) -> dict:
    batches = len(pairs["xmoe"][0]["fluctuation"][keys[0]]["compared"])
    everything = np.arange(batches)
    late = {variant: judged_window(p, rules.window_from) for variant, p in pairs.items()}
    curves = {
        variant: {"steps": [p["step"] for p in ps], "fluctuation": [_fluctuation([p], keys, everything) for p in ps]}
        for variant, ps in pairs.items()
    }
    values = {variant: _fluctuation(ps, keys, everything) for variant, ps in late.items()}
    random = {variant: _random_fluctuation(ps, keys) for variant, ps in late.items()}
    replicates = bootstrap(
        lambda b: _fluctuation(late["xmoe"], keys, b) - _fluctuation(late["switch"], keys, b), batches
    )
    interval = percentile_interval(replicates)
    at_random = all(values[v] >= rules.gate("random_fluctuation_share") * random[v] for v in values)
    return {
        "keys": keys,
        "curves": curves,
        "second_half_mean": values,
        "random_reassignment": random,
        "difference": values["xmoe"] - values["switch"],
        "interval": interval,
        "verdict": gated(direction_verdict(interval, -1), uninformative=at_random),
    }


FLUCTUATION = Statement(
    "fluctuation",
    "X-MoE's routing fluctuates less through pre-training than a linear router's",
    "X-MoE Fig. 3a: the share of MLM validation tokens whose expert changes between consecutive checkpoints is much "
    "lower for X-MoE after 15K of 125K steps (one 32-expert layer)",
)


def fluctuation_claim(snapshots: dict, rules: ClaimPlan | None = None) -> Claim:
    """X-MoE Fig. 3a: X-MoE's routing fluctuates less between consecutive checkpoints than the linear router's (the
    paper sees it after 15K of 125K steps: compared here over the plan's window of the snapshot pairs).

    Per modality, pooled over its MoE layers: the difference X-MoE minus Switch with an interval over held-out
    batches; uninformative when both change expert about as often as a random reassignment with their loads would
    (the plan's ``random_fluctuation_share``)."""
    rules = rules or shipped_rules("fluctuation")
    by_modality = {}
    pairs = {variant: [m for m in measures if m["fluctuation"] is not None] for variant, measures in snapshots.items()}
    if set(pairs) != {"switch", "xmoe"} or not all(pairs.values()):
        return empty_claim("fluctuation")
    for name in rules.modalities:
        keys = keys_of(pairs["xmoe"][0]["fluctuation"], name)
        if keys:
            by_modality[name] = _fluctuation_modality(pairs, keys, rules)

    def text(entry: dict) -> str:
        values = ", ".join(
            f"{v} {100 * entry['second_half_mean'][v]:.1f}% (random {100 * entry['random_reassignment'][v]:.1f}%)"
            for v in ("switch", "xmoe")
        )
        return f"{values} change expert; X-MoE - Switch {describe(entry['interval'], 100)} points"

    measured = {"paper_modality": rules.paper_modality, "by_modality": by_modality}
    return modality_claim(FLUCTUATION, measured, text, _window_text(rules, "snapshot pairs") + ")")


# -- claim 5: inter-run consistency ----------------------------------------------------------------------------------


def mean_correlation(ic: float | None, runs: int) -> float | None:
    """The mean Pearson ρ between distinct runs from X-MoE's IC = Σ_{i,j} ρ_ij / m² (diagonal included): (m IC - 1) /
    (m - 1), which, unlike IC, does not depend on the number of runs m."""
    return None if ic is None else (runs * ic - 1) / (runs - 1)


def _consistency_modality(consistency: dict, keys: list[str], rules: ClaimPlan) -> dict | None:
    curves = {}
    for variant, result in consistency.items():
        rho = []
        for window in result["windows"]:
            values = [mean_correlation(window.get(key), result["runs"]) for key in keys]
            defined = [v for v in values if v is not None]
            rho.append(float(np.mean(defined)) if defined else None)
        curves[variant] = {"steps": result["steps"], "rho": rho, "runs": result["runs"]}
    late = {variant: judged_window(curve["rho"], rules.window_from) for variant, curve in curves.items()}
    paired = [(x, s) for x, s in zip(late["xmoe"], late["switch"], strict=False) if None not in (x, s)]
    if not paired:
        return None
    differences = np.asarray([x - s for x, s in paired])
    interval = percentile_interval(bootstrap(lambda b: float(differences[b].mean()), len(differences)))
    means = {variant: float(np.mean([v for v in values if v is not None])) for variant, values in late.items()}
    ceiling = rules.gate("consistency_ceiling")
    return {
        "keys": keys,
        "curves": curves,
        "second_half_mean": means,
        "windows": len(differences),
        "difference": float(differences.mean()),
        "interval": interval,
        "verdict": SATURATED if min(means.values()) >= ceiling else DESCRIPTIVE,
        # What reports before the two-window term was labelled descriptive read from the same interval, kept beside.
        "verdict_before": gated(direction_verdict(interval, +1), saturated=min(means.values()) >= ceiling),
    }


CONSISTENCY = Statement(
    "consistency",
    "X-MoE's fine-tuning runs agree more across seeds than a linear router's",
    "X-MoE Fig. 3b: inter-run consistency of 12 XNLI fine-tuning runs (routing frozen, §3.3), loads accumulated over "
    "100 steps; the SMoE baseline's runs diverge, X-MoE's converge to almost the same routing",
)


#: Claim 5 with both routers fine-tuned whole: the second row, under the other fine-tuning rule.
TRAINED = Statement(
    "consistency_trained",
    "X-MoE's fine-tuning runs agree more across seeds than a linear router's, both routers fine-tuned whole",
    "X-MoE Fig. 3b freezes X-MoE's routing (§3.3); this row fine-tunes both routers whole, so the routing itself "
    "decides whether seeds agree",
)


def consistency_claim(consistency: dict, rules: ClaimPlan | None = None, statement: Statement = CONSISTENCY) -> Claim:
    """X-MoE Fig. 3b: fine-tuning runs that differ only in the seed converge to more similar expert loads with X-MoE
    than with the linear router. ``consistency``: variant -> :func:`mmoe.metrics.routing_collect
    .consistency_through_training` plus ``runs`` (m).

    Per modality: each window's mean ρ between runs (:func:`mean_correlation`, averaged over the modality's MoE
    layers); the difference X-MoE minus Switch over the plan's window of the windows, with an interval over those
    windows (within-run: the decision over seeds is :mod:`mmoe.study.decisions`')."""
    rules = rules or shipped_rules("consistency")
    by_modality = {}
    if set(consistency) != {"switch", "xmoe"}:
        return empty_claim(statement.id)
    for name in rules.modalities:
        keys = keys_of([k for k in consistency["xmoe"]["windows"][0] if "/" in k], name)
        entry = _consistency_modality(consistency, keys, rules) if keys else None
        if entry is not None:
            by_modality[name] = entry

    def text(entry: dict) -> str:
        means = ", ".join(f"{v} ρ {entry['second_half_mean'][v]:.3f}" for v in ("switch", "xmoe"))
        before = entry.get("verdict_before")
        earlier = f" (earlier reports' reading: {before})" if before and before != entry["verdict"] else ""
        return f"{means}; X-MoE - Switch {describe(entry['interval'])} over {entry['windows']} windows{earlier}"

    runs = consistency["xmoe"]["runs"]
    measured = {"paper_modality": rules.paper_modality, "runs": runs, "by_modality": by_modality}
    return modality_claim(
        statement, measured, text, f" (mean ρ between {runs} seeds' loads, second half of fine-tuning)"
    )
