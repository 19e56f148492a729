"""The papers' analysis claims, each computed from the study's saved measurements (``analysis/measures.json``): the
claim, the paper's figure and setting, mmoe's measurement per modality with a 95% interval, and a verdict under the
noise rule of :mod:`mmoe.study.verdicts` (reproduces / opposite / not separated / saturated / uninformative). Pure
functions of those numbers, so the report can be recomputed from the file."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from mmoe.metrics.routing import DEFAULT_ACTIVATION_THRESHOLD, activation_ratio, choice_activation_ratio
from mmoe.study.verdicts import (
    MODALITIES,
    NOT_SEPARATED,
    OPPOSITE,
    PAPER_MODALITY,
    REPRODUCES,
    UNINFORMATIVE,
    bootstrap,
    combined,
    describe,
    direction_verdict,
    gated,
    keys_of,
    log_mean,
    percentile_interval,
    pooled_std,
    seed_interval,
)

#: Diversity counts as saturated when both regions reach this share of the ceiling min(h, E).
SATURATION_SHARE = 0.97
#: Fluctuation is uninformative when both routers change expert at least this share as often as a random reassignment
#: with the same loads would (1 - Σ_e p_e²): routing is then still being re-drawn.
RANDOM_FLUCTUATION_SHARE = 0.9
#: Agreement of seeds' loads (mean Pearson ρ between runs) counts as saturated from here.
CONSISTENCY_CEILING = 0.99
#: Activation ratios count as saturated from here (every expert active).
ACTIVATION_CEILING = 0.999


@dataclass(frozen=True)
class Claim:
    """One claim of a paper, measured.

    Attributes:
        id: short name (``activation``, ``diversity``, ``collapse``, ``fluctuation``, ``consistency``, ``tasks``).
        title: the claim in one line.
        paper: the paper's figure or table, its setting and its numbers.
        measured: mmoe's numbers (JSON-able): per modality where the claim is about routing, each with its
            difference, interval and verdict.
        verdict: one of :data:`mmoe.study.verdicts.VERDICTS`: the paper's modality's, for routing claims.
        summary: the measurement in one line.
    """

    id: str
    title: str
    paper: str
    measured: dict[str, Any]
    verdict: str
    summary: str

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


#: The tasks' scores: (task, score name in scores.json, label). MH-MoE Table 4 reports VQAv2, NLVR2 and COCO captioning.
TASK_SCORES = (
    ("vqav2", "overall", "VQAv2 accuracy (%)"),
    ("nlvr2", "accuracy", "NLVR2 accuracy"),
    ("captioning", "CIDEr", "COCO CIDEr"),
)


def _modality_summary(by_modality: dict, paper_modality: str, text) -> str:
    """``language (paper's): ...; vision: ...`` with each modality's verdict."""
    parts = []
    for name in (paper_modality, *[m for m in MODALITIES if m != paper_modality]):
        if name in by_modality:
            label = f"{name} (the paper's)" if name == paper_modality else name
            parts.append(f"{label}: {text(by_modality[name])}, {by_modality[name]['verdict']}")
    return "; ".join(parts)


def _paper_verdict(by_modality: dict, paper_modality: str) -> str:
    return by_modality[paper_modality]["verdict"] if paper_modality in by_modality else NOT_SEPARATED


# -- claim 1: activation ratio ----------------------------------------------------------------------------------------


def random_activation(experts: int, choices_per_token: int, tokens: float, threshold: float, draws: int = 200) -> dict:
    """Activation ratio (both views) of a router that sends each of ``choices_per_token * tokens`` choices to a uniform
    random expert: what no learning gives. Monte Carlo with a fixed seed."""
    generator = np.random.default_rng(0)
    counts = generator.multinomial(int(round(choices_per_token * tokens)), [1 / experts] * experts, size=draws)
    counts = torch.from_numpy(counts).to(torch.float64)
    return {
        "per_token": float(activation_ratio(counts, tokens, threshold).mean()),
        "share_of_choices": float(choice_activation_ratio(counts, threshold).mean()),
    }


def _activation_modality(runs: list[tuple[str, dict]], keys: list[str], threshold: float) -> dict:
    """Claim 1 on one modality's MoE layers (the mean over them): every run's ratios in both views, and the rise from
    the fewest to the most heads with its interval over held-out batches."""
    views = {
        "per_token": lambda loads, tokens: activation_ratio(loads, tokens, threshold),
        "share_of_choices": lambda loads, tokens: choice_activation_ratio(loads, threshold),
    }

    def value(run: dict, view: str, batches: np.ndarray) -> float:
        ratios = []
        for key in keys:
            loads = torch.tensor(run["loads"][key], dtype=torch.float64)[torch.from_numpy(batches)].sum(0)
            tokens = float(np.asarray(run["tokens"][key])[batches].sum())
            ratios.append(float(views[view](loads, tokens)))
        return float(np.mean(ratios))

    batches = len(runs[0][1]["tokens"][keys[0]])
    everything = np.arange(batches)
    (low_name, low), (high_name, high) = runs[0], runs[-1]
    entry: dict[str, Any] = {"keys": keys, "runs": {}, "views": {}, "compared": [low_name, high_name]}
    for run_name, run in runs:
        tokens = float(np.sum(run["tokens"][keys[0]]))
        experts = len(run["loads"][keys[0]][0])
        entry["runs"][run_name] = {
            "heads": run["heads"],
            **{view: value(run, view, everything) for view in views},
            "random_router": random_activation(experts, run["heads"], tokens, threshold),
        }
    verdicts = []
    for view in views:
        interval = percentile_interval(bootstrap(lambda b, v=view: value(high, v, b) - value(low, v, b), batches))
        ends = (entry["runs"][low_name][view], entry["runs"][high_name][view])
        verdict = gated(direction_verdict(interval, +1), saturated=min(ends) >= ACTIVATION_CEILING)
        entry["views"][view] = {"difference": ends[1] - ends[0], "interval": interval, "verdict": verdict}
        verdicts.append(verdict)
    entry["verdict"] = combined(verdicts)
    return entry


def activation_claim(activation: dict, threshold: float = DEFAULT_ACTIVATION_THRESHOLD) -> Claim:
    """MH-MoE Fig. 1a / 5: with 32 experts, the share of activated experts is far higher for MH-MoE than for X-MoE and
    rises with h.

    ``activation``: run name -> ``{"heads": h, "loads": {key: [loads per held-out batch]}, "tokens": {key: [tokens
    per batch]}}``, X-MoE with h = 1. Both views: per token (the paper's: each token makes h choices, so part of the
    rise with h is built in) and as a share of the layer's choices (independent of h). Per modality, the mean over
    its MoE layers; the difference largest h minus h = 1 gets an interval over held-out batches; the claim reproduces
    when both views rise beyond the noise.
    """
    runs = sorted(activation.items(), key=lambda item: item[1]["heads"])
    by_modality = {}
    for name in MODALITIES:
        keys = keys_of(runs[0][1]["loads"], name)
        if keys and len(runs) > 1:
            by_modality[name] = _activation_modality(runs, keys, threshold)

    def text(entry: dict) -> str:
        values = ", ".join(
            f"h={run['heads']} {100 * run['per_token']:.1f}% ({100 * run['share_of_choices']:.1f}% of choices)"
            for run in entry["runs"].values()
        )
        view = entry["views"]["share_of_choices"]
        return f"{values}; share-of-choices rise {describe(view['interval'], 100)} points"

    paper_modality = PAPER_MODALITY["activation"]
    return Claim(
        id="activation",
        title="MH-MoE activates far more experts than X-MoE, more as h grows",
        paper="MH-MoE Fig. 1a: 6 MoE layers of 32 experts, top-2, fully trained, XNLI text: 8.33% of experts "
        "activated for X-MoE (SMoE) vs 90.71% for MH-MoE; §5.1 / Fig. 5 (h = 4, 8): activation rises with h",
        measured={"threshold": threshold, "paper_modality": paper_modality, "by_modality": by_modality},
        verdict=_paper_verdict(by_modality, paper_modality),
        summary=_modality_summary(by_modality, paper_modality, text),
    )


# -- claim 2: sub-token diversity -------------------------------------------------------------------------------------


def _region_means(entry: dict, images: np.ndarray) -> tuple[float | None, float | None]:
    objects = np.asarray(entry["object_patches"])[images].sum()
    background = np.asarray(entry["background_patches"])[images].sum()
    object_mean = np.asarray(entry["object_sum"])[images].sum() / objects if objects else None
    background_mean = np.asarray(entry["background_sum"])[images].sum() / background if background else None
    return object_mean, background_mean


def _diversity_run(per_key: dict, keys: list[str]) -> dict:
    """Claim 2 on one MH-MoE run's vision layers: the mean of the layers' region means, and object minus background
    with its interval over held-out images."""

    def means(index: np.ndarray) -> tuple[float | None, float | None]:
        pairs = [_region_means(per_key[key], index) for key in keys]
        if any(None in pair for pair in pairs):
            return None, None
        return float(np.mean([p[0] for p in pairs])), float(np.mean([p[1] for p in pairs]))

    def difference(index: np.ndarray) -> float | None:
        object_mean, background_mean = means(index)
        return None if object_mean is None else object_mean - background_mean

    images = len(per_key[keys[0]]["object_sum"])
    everything = np.arange(images)
    object_mean, background_mean = means(everything)
    heads, experts = per_key[keys[0]]["heads"], per_key[keys[0]]["experts"]
    ceiling = min(heads, experts)
    interval = percentile_interval(bootstrap(difference, images))
    saturated = object_mean is not None and min(object_mean, background_mean) >= SATURATION_SHARE * ceiling
    return {
        "keys": keys,
        "heads": heads,
        "experts": experts,
        "images": images,
        "object_mean": object_mean,
        "background_mean": background_mean,
        "difference": difference(everything),
        "interval": interval,
        "ceiling": ceiling,
        "random_router": experts * (1 - (1 - 1 / experts) ** heads),
        "verdict": gated(direction_verdict(interval, +1), saturated=saturated),
    }


def diversity_claim(diversity: dict) -> Claim:
    """MH-MoE Fig. 1b / 8: sub-tokens of object (semantically rich) patches go to more distinct experts than those of
    background patches. ``diversity``: run name -> :func:`mmoe.study.measures.diversity_by_region`.

    Per run, over its vision MoE layers (the mean of the layers' region means): object minus background with an
    interval over held-out images. Saturated when both regions reach :data:`SATURATION_SHARE` of the ceiling min(h,
    E); the expected count of a uniform random router, E (1 - (1 - 1/E)^h), is shown beside it.
    """
    runs = {}
    for run_name, per_key in diversity.items():
        keys = keys_of(per_key, "vision")
        if keys:
            runs[run_name] = _diversity_run(per_key, keys)
    verdict = combined(run["verdict"] for run in runs.values())
    return Claim(
        id="diversity",
        title="Object patches' sub-tokens reach more distinct experts than background patches'",
        paper="MH-MoE Fig. 1b / 8 / 10 (h = 8, top-2, maps at 100K-250K steps): sub-tokens of semantically rich image "
        "regions are assigned to more diverse experts, background regions to fewer (qualitative)",
        measured={"paper_modality": "vision", "runs": runs},
        verdict=verdict,
        summary="; ".join(
            f"{name} (h={run['heads']}, E={run['experts']}): objects {run['object_mean']:.2f} vs background "
            f"{run['background_mean']:.2f} of at most {run['ceiling']} (random router {run['random_router']:.2f}), "
            f"difference {describe(run['interval'])}, {run['verdict']}"
            for name, run in runs.items()
            if run["object_mean"] is not None
        )
        + " (vision tokens; the language tokens have no object / background split)",
    )


# -- claims 3 and 4: through pre-training ----------------------------------------------------------------------------


def _second_half(values: Sequence) -> list:
    return list(values[len(values) // 2 :])


def _defined_collapse_keys(snapshots: dict, name: str) -> list[str]:
    """The modality's MoE layers whose RC is defined at every snapshot of every router (both compared on the same
    keys)."""
    keys = None
    for measures in snapshots.values():
        for snapshot in measures:
            collapse = snapshot["collapse"]
            defined = {key for key in keys_of(collapse, name) if (collapse[key]["rc"] or 0) > 0}
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


def _collapse_modality(snapshots: dict, keys: list[str]) -> dict:
    curves = {
        variant: {
            "steps": [m["step"] for m in measures],
            "rc": [log_mean(m["collapse"][key]["rc"] for key in keys) for m in measures],
            "classes": [{key: m["collapse"][key]["classes"] for key in keys} for m in measures],
        }
        for variant, measures in snapshots.items()
    }
    late = {variant: _second_half(measures) for variant, measures in snapshots.items()}
    resamples = min(len(m["collapse"][keys[0]]["resamples"]) for ms in late.values() for m in ms)
    replicates = [_late_log_ratio(late, keys, r) for r in range(resamples)]
    interval = percentile_interval(np.asarray([r for r in replicates if r is not None]))
    slopes = {}
    for variant, curve in curves.items():
        steps, rc = _second_half(curve["steps"]), _second_half(curve["rc"])
        slopes[variant] = float(np.polyfit(steps, np.log(rc), 1)[0]) if len(steps) > 1 else None
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


def collapse_claim(snapshots: dict) -> Claim:
    """X-MoE Fig. 2c: X-MoE's router inputs keep a larger RC (less collapse) than the linear (Switch) router's through
    pre-training. ``snapshots``: variant -> :func:`mmoe.study.measures.snapshot_measures` (``switch`` and ``xmoe``).

    Per modality, RC of each snapshot is the geometric mean over the modality's MoE layers (keys defined for both
    routers at every snapshot); the trend is the second half of the snapshots: the mean log ratio X-MoE / Switch with
    an interval from the rows' bootstrap replicates, and each router's slope of log RC.
    """
    by_modality = {}
    if set(snapshots) == {"switch", "xmoe"}:
        for name in MODALITIES:
            keys = _defined_collapse_keys(snapshots, name)
            if keys:
                by_modality[name] = _collapse_modality(snapshots, keys)

    def text(entry: dict) -> str:
        ratio = np.exp(entry["second_half_log_ratio"])
        low, high = np.exp(entry["interval"]) if entry["interval"] else (np.nan, np.nan)
        slopes = ", ".join(f"{v} slope {s:+.2g}/step" for v, s in entry["second_half_slope"].items() if s is not None)
        layers = "; ".join(
            f"{key.split('/')[0]} switch {v['switch']['second_half_rc']:.3g} (K {v['switch']['classes']}), xmoe "
            f"{v['xmoe']['second_half_rc']:.3g} (K {v['xmoe']['classes']})"
            for key, v in entry["per_layer"].items()
        )
        return f"X-MoE / Switch RC {ratio:.2f}x [{low:.2f}, {high:.2f}] ({slopes}; {layers})"

    paper_modality = PAPER_MODALITY["collapse"]
    return Claim(
        id="collapse",
        title="X-MoE's routing keeps more within-class variability (larger RC) than a linear router",
        paper="X-MoE Fig. 2c: RC (Eq. 11) of one mid-depth 32-expert layer through 125K pre-training steps on MLM "
        "validation text; the SMoE baseline descends, X-MoE stays larger with an uptrend",
        measured={"paper_modality": paper_modality, "by_modality": by_modality},
        verdict=_paper_verdict(by_modality, paper_modality),
        summary=_modality_summary(by_modality, paper_modality, text)
        + " (second half of the snapshots, geometric mean over MoE layers)",
    )


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


def _fluctuation_modality(pairs: dict, keys: list[str]) -> dict:
    batches = len(pairs["xmoe"][0]["fluctuation"][keys[0]]["compared"])
    everything = np.arange(batches)
    late = {variant: _second_half(p) for variant, p in pairs.items()}
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
    at_random = all(values[v] >= RANDOM_FLUCTUATION_SHARE * random[v] for v in values)
    return {
        "keys": keys,
        "curves": curves,
        "second_half_mean": values,
        "random_reassignment": random,
        "difference": values["xmoe"] - values["switch"],
        "interval": interval,
        "verdict": gated(direction_verdict(interval, -1), uninformative=at_random),
    }


def fluctuation_claim(snapshots: dict) -> Claim:
    """X-MoE Fig. 3a: X-MoE's routing fluctuates less between consecutive checkpoints than the linear router's (the
    paper sees it after 15K of 125K steps: compared here over the second half of the snapshot pairs).

    Per modality, pooled over its MoE layers: the difference X-MoE minus Switch with an interval over held-out
    batches; uninformative when both change expert about as often as a random reassignment with their loads would
    (:data:`RANDOM_FLUCTUATION_SHARE`)."""
    by_modality = {}
    pairs = {variant: [m for m in measures if m["fluctuation"] is not None] for variant, measures in snapshots.items()}
    if set(pairs) != {"switch", "xmoe"} or not all(pairs.values()):
        return _empty_claim("fluctuation")
    for name in MODALITIES:
        keys = keys_of(pairs["xmoe"][0]["fluctuation"], name)
        if keys:
            by_modality[name] = _fluctuation_modality(pairs, keys)

    def text(entry: dict) -> str:
        values = ", ".join(
            f"{v} {100 * entry['second_half_mean'][v]:.1f}% (random {100 * entry['random_reassignment'][v]:.1f}%)"
            for v in ("switch", "xmoe")
        )
        return f"{values} change expert; X-MoE - Switch {describe(entry['interval'], 100)} points"

    paper_modality = PAPER_MODALITY["fluctuation"]
    return Claim(
        id="fluctuation",
        title="X-MoE's routing fluctuates less through pre-training than a linear router's",
        paper="X-MoE Fig. 3a: the share of MLM validation tokens whose expert changes between consecutive checkpoints "
        "is much lower for X-MoE after 15K of 125K steps (one 32-expert layer)",
        measured={"paper_modality": paper_modality, "by_modality": by_modality},
        verdict=_paper_verdict(by_modality, paper_modality),
        summary=_modality_summary(by_modality, paper_modality, text) + " (second half of the snapshot pairs)",
    )


def _empty_claim(claim_id: str) -> Claim:
    return Claim(claim_id, claim_id, "", {}, NOT_SEPARATED, "nothing measured")


# -- claim 5: inter-run consistency ----------------------------------------------------------------------------------


def mean_correlation(ic: float | None, runs: int) -> float | None:
    """The mean Pearson ρ between distinct runs from X-MoE's IC = Σ_{i,j} ρ_ij / m² (diagonal included): (m IC - 1) /
    (m - 1), which, unlike IC, does not depend on the number of runs m."""
    return None if ic is None else (runs * ic - 1) / (runs - 1)


def _consistency_modality(consistency: dict, keys: list[str]) -> dict | None:
    curves = {}
    for variant, result in consistency.items():
        rho = []
        for window in result["windows"]:
            values = [mean_correlation(window.get(key), result["runs"]) for key in keys]
            defined = [v for v in values if v is not None]
            rho.append(float(np.mean(defined)) if defined else None)
        curves[variant] = {"steps": result["steps"], "rho": rho, "runs": result["runs"]}
    late = {variant: _second_half(curve["rho"]) for variant, curve in curves.items()}
    paired = [(x, s) for x, s in zip(late["xmoe"], late["switch"], strict=False) if None not in (x, s)]
    if not paired:
        return None
    differences = np.asarray([x - s for x, s in paired])
    interval = percentile_interval(bootstrap(lambda b: float(differences[b].mean()), len(differences)))
    means = {variant: float(np.mean([v for v in values if v is not None])) for variant, values in late.items()}
    return {
        "keys": keys,
        "curves": curves,
        "second_half_mean": means,
        "windows": len(differences),
        "difference": float(differences.mean()),
        "interval": interval,
        "verdict": gated(direction_verdict(interval, +1), saturated=min(means.values()) >= CONSISTENCY_CEILING),
    }


def consistency_claim(consistency: dict) -> Claim:
    """X-MoE Fig. 3b: fine-tuning runs that differ only in the seed converge to more similar expert loads with X-MoE
    than with the linear router. ``consistency``: variant -> :func:`mmoe.metrics.routing_collect
    .consistency_through_training` plus ``runs`` (m).

    Per modality: each window's mean ρ between runs (:func:`mean_correlation`, averaged over the modality's MoE
    layers); the difference X-MoE minus Switch over the second half of the windows, with an interval over those
    windows."""
    by_modality = {}
    if set(consistency) != {"switch", "xmoe"}:
        return _empty_claim("consistency")
    for name in MODALITIES:
        keys = keys_of([k for k in consistency["xmoe"]["windows"][0] if "/" in k], name)
        entry = _consistency_modality(consistency, keys) if keys else None
        if entry is not None:
            by_modality[name] = entry

    def text(entry: dict) -> str:
        means = ", ".join(f"{v} ρ {entry['second_half_mean'][v]:.3f}" for v in ("switch", "xmoe"))
        return f"{means}; X-MoE - Switch {describe(entry['interval'])} over {entry['windows']} windows"

    runs = consistency["xmoe"]["runs"]
    paper_modality = PAPER_MODALITY["consistency"]
    return Claim(
        id="consistency",
        title="X-MoE's fine-tuning runs agree more across seeds than a linear router's",
        paper="X-MoE Fig. 3b: inter-run consistency of 12 XNLI fine-tuning runs (routing frozen, §3.3), loads "
        "accumulated over 100 steps; the SMoE baseline's runs diverge, X-MoE's converge to almost the same routing",
        measured={"paper_modality": paper_modality, "runs": runs, "by_modality": by_modality},
        verdict=_paper_verdict(by_modality, paper_modality),
        summary=_modality_summary(by_modality, paper_modality, text)
        + f" (mean ρ between {runs} seeds' loads, second half of fine-tuning)",
    )


# -- claim 6: task scores ---------------------------------------------------------------------------------------------


def spread(values: list[float]) -> dict:
    """Mean, sample standard deviation (0 for one value) and the values."""
    return {
        "mean": float(np.mean(values)),
        "std": float(np.std(values, ddof=1)) if len(values) > 1 else 0.0,
        "values": values,
    }


#: The order MH-MoE Table 4 reports: each variant above the next.
TASK_ORDER = ("mhmoe", "xmoe", "dense")


def order_verdict(gaps: list[str]) -> str:
    """The verdict on an order a > b > c from its gaps' verdicts: one gap reversed beyond the noise contradicts it."""
    if OPPOSITE in gaps:
        return OPPOSITE
    return REPRODUCES if all(gap == REPRODUCES for gap in gaps) else NOT_SEPARATED


def tasks_claim(scores: dict, chance: dict[str, float]) -> Claim:
    """MH-MoE Table 4: at equal steps, MH-MoE > X-MoE > dense on the vision-language tasks. ``scores``: variant ->
    task -> list over seeds of that run's ``scores.json``; ``chance``: task -> its chance level.

    Each gap of the order gets a Student-t interval over seeds from the task's pooled seed standard deviation
    (:func:`mmoe.study.verdicts.seed_interval`; not separated when no cell has two seeds); a task's order is
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
            gaps.append({"pair": [upper, lower], "difference": float(np.mean(a) - np.mean(b)), "interval": interval,
                         "verdict": direction_verdict(interval, +1)})  # fmt: skip
        level = chance.get(task)
        below_chance = level is not None and all(cells[task]["mean"] <= level for cells in table.values())
        verdict = UNINFORMATIVE if below_chance else order_verdict([gap["verdict"] for gap in gaps])
        std = None if noise is None else noise[0]
        per_task[task] = {"label": label, "pooled_seed_std": std, "chance": level, "gaps": gaps, "verdict": verdict}
    overall = combined(entry["verdict"] for entry in per_task.values())
    return Claim(
        id="tasks",
        title="MH-MoE > X-MoE > dense on the three tasks at equal steps",
        paper="MH-MoE Table 4 (BEiT-3 base, 8 experts, fully pre-trained): dense / X-MoE / MH-MoE score VQAv2 "
        "test-dev 65.9 / 68.4 / 70.1, NLVR2 dev 73.8 / 75.5 / 77.0, COCO CIDEr 120.5 / 122.9 / 124.1",
        measured={"scores": table, "tasks": per_task},
        verdict=overall,
        summary="; ".join(
            f"{entry['label']}: {entry['verdict']} (gaps "
            + ", ".join(f"{g['pair'][0]} - {g['pair'][1]} {describe(g['interval'])}" for g in entry["gaps"])
            + ")"
            for entry in per_task.values()
        ),
    )


# -- pre-training helps ------------------------------------------------------------------------------------------------


def pretraining_claim(variant: str, pretrained: dict, random_init: dict, chance: dict[str, float]) -> Claim:
    """The claim every reader assumes: at equal fine-tuning steps and seeds, a backbone pre-trained by mmoe scores
    above the same architecture fine-tuned from random init (BEiT-3 §3; MH-MoE Table 4 fine-tunes pre-trained models
    only). ``pretrained`` / ``random_init``: task -> the seeds' ``scores.json``.

    Per task, the difference of the means with a Student-t interval over seeds (pooled seed standard deviation of the
    two cells); uninformative where neither side beats the task's chance level."""
    per_task = {}
    for task, score, label in TASK_SCORES:
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
    return Claim(
        id="pretraining",
        title="Pre-training helps: the pre-trained backbone fine-tunes above random init",
        paper="BEiT-3 and MH-MoE fine-tune only pre-trained backbones (BEiT-3 base: VQAv2 77.7 after 1M pre-training "
        "steps); the gain over random init is assumed, not reported",
        measured={"variant": variant, "tasks": per_task},
        verdict=combined(entry["verdict"] for entry in per_task.values()),
        summary=f"{variant}: "
        + "; ".join(
            f"{entry['label']} {entry['pretrained']['mean']:.3f} vs {entry['random_init']['mean']:.3f} from random "
            f"init, difference {describe(entry['interval'])}, {entry['verdict']}"
            for entry in per_task.values()
        ),
    )


# -- Stratified MoE §5: requested capacity ---------------------------------------------------------------------------


def _layer_index(key: str) -> int:
    return int(key.split("/", 1)[0].removeprefix("layer"))


def _capacity(entry: dict, batches: np.ndarray) -> float:
    """Token-weighted mean requested capacity of one MoE layer over ``batches``."""
    capacity, tokens = np.asarray(entry["capacity"])[batches], np.asarray(entry["tokens"])[batches]
    return float(np.sum(capacity * tokens) / np.sum(tokens))


def _capacity_modality(capacity: dict, keys: list[str]) -> dict:
    keys = sorted(keys, key=_layer_index)
    first, later = keys[0], keys[1:]
    batches = len(capacity[first]["capacity"])

    def difference(index: np.ndarray) -> float:
        return _capacity(capacity[first], index) - float(np.mean([_capacity(capacity[k], index) for k in later]))

    everything = np.arange(batches)
    interval = percentile_interval(bootstrap(difference, batches))
    return {
        "keys": keys,
        "per_layer": {key: _capacity(capacity[key], everything) for key in keys},
        "difference": difference(everything),
        "interval": interval,
        "verdict": direction_verdict(interval, +1),
    }


def capacity_claim(capacity: dict) -> Claim:
    """Stratified MoE §5 / Fig. 4: the first SMoE block requests the most capacity (FFN passes per token), later
    blocks less. ``capacity``: :func:`mmoe.study.measures.requested_capacity` of the Stratified MoE run.

    Per modality (the paper's languages have a VL analogue in the two modalities, shown with their overall capacity):
    the first MoE layer's capacity minus the mean of the later ones, with an interval over held-out batches."""
    by_modality = {}
    for name in MODALITIES:
        keys = keys_of(capacity, name)
        if len(keys) > 1:
            by_modality[name] = _capacity_modality(capacity, keys)
        if keys:
            tokens = sum(np.sum(capacity[key]["tokens"]) for key in keys)
            overall = sum(_capacity(capacity[k], np.arange(len(capacity[k]["tokens"]))) * np.sum(capacity[k]["tokens"])
                          for k in keys) / tokens  # fmt: skip
            by_modality.setdefault(name, {"verdict": NOT_SEPARATED})["overall"] = float(overall)

    def text(entry: dict) -> str:
        layers = ", ".join(f"{key.split('/')[0]} {value:.2f}" for key, value in entry.get("per_layer", {}).items())
        return f"{layers} passes per token (overall {entry['overall']:.2f}); first minus later " + describe(
            entry.get("interval")
        )

    return Claim(
        id="capacity",
        title="Stratified MoE: the first SMoE block requests the most capacity",
        paper="Stratified MoE §5 / Fig. 4 (translation, 3 strata): early encoder blocks request more capacity (FFN "
        "passes per token) than later ones; requested capacity differs by language (Fig. 2)",
        measured={"paper_modality": "language", "by_modality": by_modality},
        verdict=_paper_verdict(by_modality, "language"),
        summary=_modality_summary(by_modality, "language", text),
    )


#: Token ids seen fewer times than this on held-out text are left out of the frequency claim (their mean passes are
#: too noisy to rank).
MIN_OCCURRENCES = 3


def average_ranks(values: np.ndarray) -> np.ndarray:
    """1-based ranks, ties sharing their average rank."""
    order = np.argsort(values, kind="mergesort")
    ranks = np.empty(len(values), dtype=np.float64)
    ranks[order] = np.arange(1, len(values) + 1)
    _, groups, sizes = np.unique(values, return_inverse=True, return_counts=True)
    sums = np.bincount(groups, weights=ranks)
    return sums[groups] / sizes[groups]


def spearman(x: np.ndarray, y: np.ndarray) -> float | None:
    """Spearman's rank correlation (Pearson of the average ranks); None where either side is constant."""
    rx, ry = average_ranks(np.asarray(x)), average_ranks(np.asarray(y))
    if rx.std() == 0 or ry.std() == 0:
        return None
    return float(np.corrcoef(rx, ry)[0, 1])


def frequency_claim(token_passes: dict, training_counts: dict[str, int]) -> Claim:
    """Stratified MoE §5 / Fig. 3: tokens that request little capacity (few FFN passes) tend to be frequent ones.
    ``token_passes``: :func:`mmoe.study.measures.token_passes` of the Stratified MoE run; ``training_counts``: token id
    (as text) -> occurrences in the pre-training text.

    Per token id seen at least :data:`MIN_OCCURRENCES` times on held-out text: its mean passes over the language MoE
    layers (pooled) against its training frequency; Spearman's ρ with an interval over token ids (the paper predicts
    ρ < 0). Uninformative when every token makes the same number of passes."""
    totals: dict[int, list[float]] = {}
    for entry in token_passes.values():
        for token, passes, occurrences in zip(entry["ids"], entry["passes"], entry["occurrences"], strict=True):
            total = totals.setdefault(token, [0.0, 0.0])
            total[0] += passes
            total[1] += occurrences
    layers = max(1, len(token_passes))
    kept = sorted(t for t, (_, n) in totals.items() if n / layers >= MIN_OCCURRENCES)
    capacity = np.asarray([totals[t][0] / totals[t][1] for t in kept])
    frequency = np.asarray([training_counts.get(str(t), 0) for t in kept], dtype=np.float64)
    rho = spearman(frequency, capacity) if len(kept) > 2 else None
    interval = percentile_interval(bootstrap(lambda b: spearman(frequency[b], capacity[b]), len(kept))) if rho else None
    constant = len(kept) > 2 and capacity.std() == 0
    verdict = gated(direction_verdict(interval, -1), uninformative=constant)
    summary = (
        f"{len(kept)} token ids seen >= {MIN_OCCURRENCES} times per layer on held-out text: Spearman ρ(training "
        f"frequency, passes per token) = {rho:.3f} {describe(interval)}"
        if rho is not None
        else f"{len(kept)} token ids: no rank correlation (constant passes or too few tokens)"
    )
    return Claim(
        id="frequency",
        title="Stratified MoE: frequent tokens request less capacity",
        paper="Stratified MoE §5 / Fig. 3 (translation): low requested-capacity tokens tend to be highly frequent ones",
        measured={"paper_modality": "language", "layers": sorted(token_passes), "tokens": len(kept), "rho": rho,
                  "interval": interval, "mean_passes": capacity.tolist(), "training_frequency": frequency.tolist()},
        verdict=verdict,
        summary=summary + f", {verdict} (language tokens; image patches have no token frequency)",
    )  # fmt: skip
