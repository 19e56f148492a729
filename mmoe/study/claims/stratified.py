"""Stratified MoE's capacity claims (§5): the first SMoE block requests the most capacity (Fig. 4), and frequent
tokens request less (Fig. 3)."""

from __future__ import annotations

import numpy as np

from mmoe.stats import bootstrap, percentile_interval
from mmoe.study.claims.claim import Claim, Statement, modality_claim
from mmoe.study.plan import ClaimPlan
from mmoe.study.plan_design import shipped_rules
from mmoe.study.verdicts import NOT_SEPARATED, describe, direction_verdict, gated, keys_of

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


CAPACITY = Statement(
    "capacity",
    "Stratified MoE: the first SMoE block requests the most capacity",
    "Stratified MoE §5 / Fig. 4 (translation, 3 strata): early encoder blocks request more capacity (FFN passes per "
    "token) than later ones; requested capacity differs by language (Fig. 2)",
)


def capacity_claim(capacity: dict, rules: ClaimPlan | None = None) -> Claim:
    """Stratified MoE §5 / Fig. 4: the first SMoE block requests the most capacity (FFN passes per token), later
    blocks less. ``capacity``: :func:`mmoe.study.measures.requested_capacity` of the Stratified MoE run.

    Per modality (the paper's languages have a VL analogue in the two modalities, shown with their overall capacity):
    the first MoE layer's capacity minus the mean of the later ones, with an interval over held-out batches."""
    rules = rules or shipped_rules("capacity")
    by_modality = {}
    for name in rules.modalities:
        keys = keys_of(capacity, name)
        if len(keys) > 1:
            by_modality[name] = _capacity_modality(capacity, keys)
        if keys:
            tokens = sum(np.sum(capacity[key]["tokens"]) for key in keys)
            overall = (
                sum(
                    _capacity(capacity[k], np.arange(len(capacity[k]["tokens"]))) * np.sum(capacity[k]["tokens"])
                    for k in keys
                )
                / tokens
            )
            by_modality.setdefault(name, {"verdict": NOT_SEPARATED})["overall"] = float(overall)

    def text(entry: dict) -> str:
        layers = ", ".join(f"{key.split('/')[0]} {value:.2f}" for key, value in entry.get("per_layer", {}).items())
        return f"{layers} passes per token (overall {entry['overall']:.2f}); first minus later " + describe(
            entry.get("interval")
        )

    return modality_claim(CAPACITY, {"paper_modality": rules.paper_modality, "by_modality": by_modality}, text)


# -- Stratified MoE §5: token frequency ------------------------------------------------------------------------------


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


FREQUENCY = Statement(
    "frequency",
    "Stratified MoE: frequent tokens request less capacity",
    "Stratified MoE §5 / Fig. 3 (translation): low requested-capacity tokens tend to be highly frequent ones",
)


def frequency_claim(token_passes: dict, training_counts: dict[str, int], rules: ClaimPlan | None = None) -> Claim:
    """Stratified MoE §5 / Fig. 3: tokens that request little capacity (few FFN passes) tend to be frequent ones.
    ``token_passes``: :func:`mmoe.study.measures.token_passes` of the Stratified MoE run; ``training_counts``: token id
    (as text) -> occurrences in the pre-training text.

    Per token id seen at least the plan's ``min_occurrences`` times per layer on held-out text (rarer ones are too
    noisy to rank): its mean passes over the language MoE layers (pooled) against its training frequency; Spearman's
    ρ with an interval over token ids (the paper predicts ρ < 0). Uninformative when every token makes the same
    number of passes."""
    rules = rules or shipped_rules("frequency")
    least = rules.gate("min_occurrences")
    totals: dict[int, list[float]] = {}
    for entry in token_passes.values():
        for token, passes, occurrences in zip(entry["ids"], entry["passes"], entry["occurrences"], strict=True):
            total = totals.setdefault(token, [0.0, 0.0])
            total[0] += passes
            total[1] += occurrences
    layers = max(1, len(token_passes))
    kept = sorted(t for t, (_, n) in totals.items() if n / layers >= least)
    capacity = np.asarray([totals[t][0] / totals[t][1] for t in kept])
    frequency = np.asarray([training_counts.get(str(t), 0) for t in kept], dtype=np.float64)
    rho = spearman(frequency, capacity) if len(kept) > 2 else None
    interval = percentile_interval(bootstrap(lambda b: spearman(frequency[b], capacity[b]), len(kept))) if rho else None
    constant = len(kept) > 2 and capacity.std() == 0
    verdict = gated(direction_verdict(interval, -1), uninformative=constant)
    summary = (
        f"{len(kept)} token ids seen >= {least:g} times per layer on held-out text: Spearman ρ(training "
        f"frequency, passes per token) = {rho:.3f} {describe(interval)}"
        if rho is not None
        else f"{len(kept)} token ids: no rank correlation (constant passes or too few tokens)"
    )
    measured = {
        "paper_modality": rules.paper_modality,
        "layers": sorted(token_passes),
        "tokens": len(kept),
        "rho": rho,
        "interval": interval,
        "mean_passes": capacity.tolist(),
        "training_frequency": frequency.tolist(),
    }
    return FREQUENCY.measured(
        measured, verdict, summary + f", {verdict} (language tokens; image patches have no token frequency)"
    )
