"""MH-MoE's routing claims: claim 1, the share of activated experts (Fig. 1a / 5), and claim 2, the sub-token
diversity of object against background patches (Fig. 1b / 8)."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from mmoe.metrics.routing import activation_ratio, choice_activation_ratio
from mmoe.stats import bootstrap, percentile_interval
from mmoe.study.claims.claim import Claim, Statement, modality_claim
from mmoe.study.plan import ClaimPlan
from mmoe.study.plan_design import shipped_rules
from mmoe.study.verdicts import combined, describe, direction_verdict, gated, keys_of

# The plan's gates: diversity is saturated when both regions reach ``saturation_share`` of the ceiling min(h, E);
# activation ratios from ``activation_ceiling`` (every expert active); an expert is active above
# ``activation_threshold`` (:func:`mmoe.metrics.routing.activation_ratio`).

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


def _activation_modality(runs: list[tuple[str, dict]], keys: list[str], threshold: float, ceiling: float) -> dict:
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
        verdict = gated(direction_verdict(interval, +1), saturated=min(ends) >= ceiling)
        entry["views"][view] = {"difference": ends[1] - ends[0], "interval": interval, "verdict": verdict}
        verdicts.append(verdict)
    entry["verdict"] = combined(verdicts)
    return entry


ACTIVATION = Statement(
    "activation",
    "MH-MoE activates far more experts than X-MoE, more as h grows",
    "MH-MoE Fig. 1a: 6 MoE layers of 32 experts, top-2, fully trained, XNLI text: 8.33% of experts activated for "
    "X-MoE (SMoE) vs 90.71% for MH-MoE; §5.1 / Fig. 5 (h = 4, 8): activation rises with h",
)


#: Claim 1 read as its two statements, each decided by one of the plan's two gaps (one Holm family): 1a, MH-MoE
#: against X-MoE (most heads - h = 1); 1b, the rise with h (most heads - the next fewer heads).
MORE_THAN_XMOE = Statement(
    "activation/more_than_xmoe",
    "MH-MoE activates more experts than X-MoE",
    "MH-MoE Fig. 1a: 6 MoE layers of 32 experts, top-2, fully trained, XNLI text: 8.33% of experts activated for "
    "X-MoE (SMoE) vs 90.71% for MH-MoE",
)
MORE_AS_H_GROWS = Statement(
    "activation/more_as_h_grows",
    "MH-MoE activates more experts as h grows",
    "MH-MoE §5.1 / Fig. 5 (h = 4, 8): activation rises with h",
)
ACTIVATION_PARTS = (MORE_THAN_XMOE, MORE_AS_H_GROWS)


def activation_claim(activation: dict, rules: ClaimPlan | None = None) -> Claim:
    """MH-MoE Fig. 1a / 5: with 32 experts, the share of activated experts is far higher for MH-MoE than for X-MoE and
    rises with h.

    ``activation``: run name -> ``{"heads": h, "loads": {key: [loads per held-out batch]}, "tokens": {key: [tokens
    per batch]}}``, X-MoE with h = 1. Both views: per token (the paper's: each token makes h choices, so part of the
    rise with h is built in) and as a share of the layer's choices (independent of h). Per modality, the mean over
    its MoE layers; the difference largest h minus h = 1 gets an interval over held-out batches; the claim reproduces
    when both views rise beyond the noise. ``rules``: the plan's (its threshold, ceiling, modalities).
    """
    rules = rules or shipped_rules("activation")
    threshold, ceiling = rules.gate("activation_threshold"), rules.gate("activation_ceiling")
    runs = sorted(activation.items(), key=lambda item: item[1]["heads"])
    by_modality = {}
    for name in rules.modalities:
        keys = keys_of(runs[0][1]["loads"], name)
        if keys and len(runs) > 1:
            by_modality[name] = _activation_modality(runs, keys, threshold, ceiling)

    def text(entry: dict) -> str:
        values = ", ".join(
            f"h={run['heads']} {100 * run['per_token']:.1f}% ({100 * run['share_of_choices']:.1f}% of choices)"
            for run in entry["runs"].values()
        )
        view = entry["views"]["share_of_choices"]
        return f"{values}; share-of-choices rise {describe(view['interval'], 100)} points"

    measured = {"threshold": threshold, "paper_modality": rules.paper_modality, "by_modality": by_modality}
    return modality_claim(ACTIVATION, measured, text)


# -- claim 2: sub-token diversity -------------------------------------------------------------------------------------


def _region_means(entry: dict, images: np.ndarray) -> tuple[float | None, float | None]:
    objects = np.asarray(entry["object_patches"])[images].sum()
    background = np.asarray(entry["background_patches"])[images].sum()
    object_mean = np.asarray(entry["object_sum"])[images].sum() / objects if objects else None
    background_mean = np.asarray(entry["background_sum"])[images].sum() / background if background else None
    return object_mean, background_mean


def _diversity_run(per_key: dict, keys: list[str], saturation_share: float) -> dict:
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
    saturated = object_mean is not None and min(object_mean, background_mean) >= saturation_share * ceiling
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


def diversity_run_measure(per_key: dict, saturation_share: float) -> dict:
    """One run's claim-2 measure over its vision MoE layers (:func:`_diversity_run`): the difference and the
    within-run verdict."""
    return _diversity_run(per_key, keys_of(per_key, "vision"), saturation_share)


DIVERSITY = Statement(
    "diversity",
    "Object patches' sub-tokens reach more distinct experts than background patches'",
    "MH-MoE Fig. 1b / 8 / 10 (h = 8, top-2, maps at 100K-250K steps): sub-tokens of semantically rich image regions "
    "are assigned to more diverse experts, background regions to fewer (qualitative)",
)


def diversity_claim(diversity: dict, rules: ClaimPlan | None = None) -> Claim:
    """MH-MoE Fig. 1b / 8: sub-tokens of object (semantically rich) patches go to more distinct experts than those of
    background patches. ``diversity``: run name -> :func:`mmoe.study.measures.diversity_by_region`.

    Per run, over its vision MoE layers (the mean of the layers' region means): object minus background with an
    interval over held-out images. Saturated when both regions reach the plan's ``saturation_share`` of the ceiling
    min(h, E); the expected count of a uniform random router, E (1 - (1 - 1/E)^h), is shown beside it.
    """
    rules = rules or shipped_rules("diversity")
    runs = {}
    for run_name, per_key in diversity.items():
        keys = keys_of(per_key, rules.paper_modality)
        if keys:
            runs[run_name] = _diversity_run(per_key, keys, rules.gate("saturation_share"))
    summary = "; ".join(
        f"{name} (h={run['heads']}, E={run['experts']}): objects {run['object_mean']:.2f} vs background "
        f"{run['background_mean']:.2f} of at most {run['ceiling']} (random router {run['random_router']:.2f}), "
        f"difference {describe(run['interval'])}, {run['verdict']}"
        for name, run in runs.items()
        if run["object_mean"] is not None
    )
    return DIVERSITY.measured(
        {"paper_modality": rules.paper_modality, "runs": runs},
        combined(run["verdict"] for run in runs.values()),
        summary + " (vision tokens; the language tokens have no object / background split)",
    )
