"""Routing-analysis metrics of sparse MoE layers, as pure functions over routing records and tensors.

* Expert load and **activation ratio** (MH-MoE, Wu et al., 2024, Fig. 1a and 5): "the ratio of each expert's
  selection frequency in each MoE layer to the total number of tokens, where those exceeding a threshold (< 1) are
  considered activated". An expert's frequency is its selections per token (``counts / tokens``): an MH-MoE token
  makes h·k choices, so its frequencies sum to h·k, which is why MH-MoE activates more experts at the same threshold.
  The paper states no threshold value, so it is an argument here, expressed as a fraction of 1/E
  (:data:`DEFAULT_ACTIVATION_THRESHOLD`). The alternative view, each expert's share of the layer's choices (summing
  to 1 whatever h and k), is :func:`choice_activation_ratio`; the two agree for a top-1 single-head layer.
* **Sub-token assignment diversity** (MH-MoE Fig. 1b, 8, 10): for each token, the number of distinct experts its h
  sub-tokens go to.
* **Representation collapse** RC = Tr(Σ_W Σ_B^†) (X-MoE, Chi et al., 2022, Eq. 11, after Zhu et al., 2021) of the
  hidden states fed into a router, classes = each (sub-)token's top-1 expert; larger = less collapse.
* **Routing fluctuation ratio** (X-MoE §4.5): share of (sub-)tokens whose top-1 expert differs between two
  checkpoints on the same input.
* **Inter-run consistency** IC = Σ_{i,j} ρ(l_i, l_j) / m² (X-MoE §4.5) over the expert-load vectors of m runs.
* Routing entropy, dropped fraction and Stratified MoE's requested capacity (Xu et al., 2023, §4), averaged over
  tokens by :class:`RoutingTotals`.

Keys: the statistics of one MoE layer are kept under ``"layer{index}/{modality}"`` (:func:`record_key`), with modality
``vision``, ``language`` or ``shared`` as in :class:`mmoe.moe.RoutingRecord`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Literal

import numpy as np
import torch

from mmoe.moe import RoutingRecord

#: Default activation threshold, as a fraction of the uniform share 1/E: an expert counts as activated when it takes
#: at least a tenth of the choices it would take under perfectly balanced routing. MH-MoE (Fig. 1a) gives no value
#: (only that it is below 1, in percent); at the paper's E = 32 this is 0.31% of all choices, so only experts that are
#: close to unused ("dead", the dark cells of Fig. 1a / 5) count as inactive, and the same value means the same
#: thing at any number of experts. Sampling noise hardly moves it: an expert with its fair share of 1,000 choices
#: falls below a tenth of it with vanishing probability.
DEFAULT_ACTIVATION_THRESHOLD = 0.1

#: Thresholds (fractions of 1/E) of the activation-ratio curve: dense below 0.2, where nearly dead experts drop out.
DEFAULT_CURVE_THRESHOLDS = tuple(
    float(x) for x in np.round(np.concatenate([np.linspace(0.0, 0.2, 21), np.linspace(0.25, 2.0, 36)]), 3)
)


def record_key(record: RoutingRecord) -> str:
    """``"layer{index}/{modality}"``, the key the statistics of one MoE layer are kept under."""
    return layer_key(record.layer, record.modality)


def layer_key(index: int | None, modality: str | None) -> str:
    """``"layer{index}/{modality}"`` for a layer index and a modality ("vision", "language" or "shared")."""
    return f"layer{index}/{modality}"


def selection_frequency(counts_E: torch.Tensor, tokens: float | torch.Tensor | None = None) -> torch.Tensor:
    """Each expert's selection frequency (MH-MoE Fig. 1a, 5): its selections per token with ``tokens`` (the paper's,
    summing to h·k over E when nothing is dropped), else its share of the layer's choices (summing to 1); zeros where
    no choice was made.

    Args:
        counts_E: (..., E) choices per expert.
        tokens: the tokens (not sub-tokens or choices) the counts were made on; None = share of choices.

    Returns:
        (..., E) float64.
    """
    counts = counts_E.to(torch.float64)
    total = counts.sum(-1, keepdim=True) if tokens is None else torch.as_tensor(tokens, dtype=torch.float64)
    if total.dim() and total.shape[-1] != 1:
        total = total.unsqueeze(-1)
    return torch.where(total > 0, counts / total.clamp_min(1.0), torch.zeros_like(counts))


def activation_ratio(
    counts_E: torch.Tensor, tokens: float | torch.Tensor, threshold: float = DEFAULT_ACTIVATION_THRESHOLD
) -> torch.Tensor:
    """MH-MoE Fig. 1a, 5: share of experts selected by at least ``threshold / E`` of the tokens (selections per
    token, :func:`selection_frequency` with ``tokens``).

    Args:
        counts_E: (..., E) choices per expert, accumulated over the tokens analysed.
        tokens: number of tokens those choices were made for.
        threshold: fraction of 1/E; 0 counts every expert.

    Returns:
        (...) float64 in [0, 1]; 0 for a layer that made no choice.
    """
    return _share_active(counts_E, selection_frequency(counts_E, tokens), threshold)


def choice_activation_ratio(counts_E: torch.Tensor, threshold: float = DEFAULT_ACTIVATION_THRESHOLD) -> torch.Tensor:
    """The share-of-choices alternative to :func:`activation_ratio`: share of experts that take at least
    ``threshold / E`` of the layer's choices (independent of h and k; equal to the paper's quantity at h = k = 1)."""
    return _share_active(counts_E, selection_frequency(counts_E), threshold)


def _share_active(counts_E: torch.Tensor, frequency: torch.Tensor, threshold: float) -> torch.Tensor:
    if threshold < 0:
        raise ValueError(f"activation threshold must be >= 0, got {threshold!r}")
    num_experts = counts_E.shape[-1]
    made_choices = counts_E.sum(-1) > 0
    # A tiny tolerance keeps an expert at exactly the threshold activated despite float rounding.
    active = (frequency >= threshold / num_experts - 1e-12).to(torch.float64).mean(-1)
    return torch.where(made_choices, active, torch.zeros_like(active))


def activation_ratio_curve(
    counts_E: torch.Tensor, tokens: float | torch.Tensor | None, thresholds: Sequence[float] = DEFAULT_CURVE_THRESHOLDS
) -> torch.Tensor:
    """Activation ratio at each threshold: (T, ...) for counts (..., E); ``tokens`` None = the share-of-choices
    view."""
    if tokens is None:
        return torch.stack([choice_activation_ratio(counts_E, t) for t in thresholds])
    return torch.stack([activation_ratio(counts_E, tokens, t) for t in thresholds])


def load_summary(counts_E: torch.Tensor) -> dict[str, torch.Tensor]:
    """Balance of one layer's expert load.

    Returns:
        ``load_min`` / ``load_max``: the smallest / largest expert share divided by the uniform share 1/E (1 = the
        expert took exactly its share); ``load_cv``: coefficient of variation std / mean of the counts (0 =
        perfectly balanced). All 0 for a layer that made no choice.
    """
    counts = counts_E.to(torch.float64)
    relative = selection_frequency(counts_E) * counts_E.shape[-1]
    mean = counts.mean(-1)
    cv = counts.std(-1, correction=0) / mean.clamp_min(1e-12)
    return {"load_min": relative.min(-1).values, "load_max": relative.max(-1).values, "load_cv": cv}


def subtoken_diversity(
    expert_index: torch.Tensor, choices: Literal["top1", "all"] = "top1", num_experts: int | None = None
) -> torch.Tensor:
    """Number of distinct experts the h sub-tokens of each token go to (MH-MoE Fig. 1b, 8, 10).

    Args:
        expert_index: (B, L, heads, top_k) chosen experts, -1 at padding and dropped choices (ignored).
        choices: ``"top1"`` counts each sub-token's first choice; ``"all"`` counts every one of the heads * top_k
            choices. MH-MoE (Fig. 1b, 7, 8: "the number of different experts they are routed to") does not say which
            choices count when k = 2 (its Table 9), so both are offered; ``top1`` keeps the count in [1, h].
        num_experts: number of experts; inferred from the largest index when None.

    Returns:
        (B, L) long in [0, heads] (``top1``) or [0, heads * top_k] (``all``); 0 where every choice is -1 (padding).
    """
    if expert_index.dim() != 4:
        raise ValueError(f"expert_index must be (B, L, heads, top_k), got shape {tuple(expert_index.shape)}")
    if choices not in ("top1", "all"):
        raise ValueError(f"choices must be 'top1' or 'all', got {choices!r}")
    chosen = expert_index[..., 0] if choices == "top1" else expert_index.flatten(2)  # (B, L, C)
    if num_experts is None:
        num_experts = int(chosen.max().clamp_min(0)) + 1
    # One-hot over E + 1 slots (the last one takes the -1s), then count the experts hit at least once.
    slot = torch.where(chosen >= 0, chosen, torch.full_like(chosen, num_experts))
    hits = torch.zeros(*chosen.shape[:2], num_experts + 1, dtype=torch.bool, device=chosen.device)
    hits.scatter_(-1, slot, True)
    return hits[..., :num_experts].sum(-1)


def image_diversity_maps(
    records: Iterable[RoutingRecord], image_len: int, choices: Literal["top1", "all"] = "top1"
) -> dict[str, torch.Tensor]:
    """Per-patch sub-token diversity over the image (MH-MoE Fig. 1b, 8, 10) for every record that routed images.

    Image tokens are ``[CLS, patches]`` (patch p is token 1 + p, row-major over the patch grid); a ``shared``
    record holds the image tokens first. The CLS token is left out.

    Args:
        records: routing records of one forward (``BackboneOutput.routing``).
        image_len: image tokens in the forward, CLS included (``BackboneOutput.image_len``).
        choices: see :func:`subtoken_diversity`.

    Returns:
        Per key, (B, g, g) long with g the patch grid side.
    """
    patches = image_len - 1
    side = math.isqrt(max(patches, 0))
    if image_len and side * side != patches:
        raise ValueError(f"image_len={image_len} is not 1 + a square number of patches")
    maps = {}
    for record in records:
        if record.modality not in ("vision", "shared") or not image_len:
            continue
        index = record.expert_index[:, 1:image_len]
        diversity = subtoken_diversity(index, choices, num_experts=record.expert_counts.numel())
        maps[record_key(record)] = diversity.reshape(index.shape[0], side, side)
    return maps


def text_diversity(
    records: Iterable[RoutingRecord], image_len: int, choices: Literal["top1", "all"] = "top1"
) -> dict[str, torch.Tensor]:
    """Per-token sub-token diversity of the text tokens, for every record that routed text.

    Returns:
        Per key, (B, T) long; 0 at padding.
    """
    maps = {}
    for record in records:
        if record.modality == "language":
            index = record.expert_index
        elif record.modality == "shared" and record.expert_index.shape[1] > image_len:
            index = record.expert_index[:, image_len:]
        else:
            continue
        maps[record_key(record)] = subtoken_diversity(index, choices, num_experts=record.expert_counts.numel())
    return maps


def representation_collapse(hidden_ND: torch.Tensor, classes_N: torch.Tensor) -> float:
    """RC = Tr(Σ_W Σ_B^†) (X-MoE Eq. 11; Zhu et al., 2021) of the representations fed into a router.

    Classes are the (sub-)tokens' top-1 experts; only the K experts that received a token count. With μ_k the class
    means, n_k the class sizes and μ_G the mean of all N rows::

        Σ_W = 1/K Σ_k 1/n_k Σ_{i in k} (h_i - μ_k)(h_i - μ_k)^T    (mean within-class covariance)
        Σ_B = 1/K Σ_k (μ_k - μ_G)(μ_k - μ_G)^T                     (covariance of the class means)

    For balanced classes this is Zhu et al.'s definition (whose NC1 metric divides once more by K). Larger RC means
    more within-class variability, i.e. less collapse. Computed in float64; † is the Moore-Penrose pseudo-inverse.

    Args:
        hidden_ND: (N, D) router inputs h (not the projected W h).
        classes_N: (N,) top-1 expert of each row.

    Returns:
        RC, or NaN when fewer than two classes occur (Σ_B is then 0 and RC undefined).
    """
    if hidden_ND.dim() != 2 or classes_N.shape != hidden_ND.shape[:1]:
        raise ValueError(
            f"expected hidden (N, D) and classes (N,), got {tuple(hidden_ND.shape)} and {tuple(classes_N.shape)}"
        )
    h_ND = hidden_ND.to(torch.float64)
    _, inverse_N, counts_K = torch.unique(classes_N, return_inverse=True, return_counts=True)
    num_classes = counts_K.numel()
    if num_classes < 2:
        return math.nan
    means_KD = torch.zeros(num_classes, h_ND.shape[1], dtype=torch.float64).index_add_(0, inverse_N, h_ND)
    means_KD /= counts_K[:, None].to(torch.float64)
    centered_ND = h_ND - means_KD[inverse_N]
    weight_N = 1.0 / (num_classes * counts_K[inverse_N].to(torch.float64))
    sigma_w = (centered_ND * weight_N[:, None]).T @ centered_ND
    between_KD = means_KD - h_ND.mean(0)
    sigma_b = between_KD.T @ between_KD / num_classes
    return float(torch.trace(sigma_w @ torch.linalg.pinv(sigma_b, hermitian=True)))


def routing_fluctuation(experts_a: torch.Tensor, experts_b: torch.Tensor) -> float:
    """Routing fluctuation ratio (X-MoE §4.5): share of (sub-)tokens whose top-1 expert changed.

    Args:
        experts_a: top-1 experts of every (sub-)token under one checkpoint, any shape, -1 where there is none
            (padding, dropped choice).
        experts_b: the same positions under another checkpoint on the same input.

    Returns:
        The share of positions, among those with an expert under both checkpoints, whose expert differs; NaN when
        there is no such position.
    """
    if experts_a.shape != experts_b.shape:
        raise ValueError(f"routing_fluctuation needs equal shapes, got {tuple(experts_a.shape)} and {experts_b.shape}")
    both = (experts_a >= 0) & (experts_b >= 0)
    total = int(both.sum())
    if total == 0:
        return math.nan
    return int(((experts_a != experts_b) & both).sum()) / total


def inter_run_consistency(loads_ME: torch.Tensor | np.ndarray | Sequence[Sequence[float]]) -> float:
    """IC = Σ_{i,j} ρ(l_i, l_j) / m² (X-MoE §4.5), the mean of the Pearson correlation matrix of m load vectors.

    The diagonal (ρ = 1) is included, as in the paper; one run gives 1. X-MoE accumulates each run's loads over
    100 steps before correlating them.

    Args:
        loads_ME: (m, E) expert loads (token counts) of m runs.

    Returns:
        IC in [-1, 1]; NaN when some run's load is constant over the experts (its ρ is undefined).
    """
    loads = np.asarray(loads_ME.cpu() if isinstance(loads_ME, torch.Tensor) else loads_ME, dtype=np.float64)
    if loads.ndim != 2 or loads.shape[0] < 1 or loads.shape[1] < 2:
        raise ValueError(f"inter_run_consistency needs loads of shape (runs, experts >= 2), got {loads.shape}")
    centered = loads - loads.mean(1, keepdims=True)
    norms = np.linalg.norm(centered, axis=1)
    if np.any(norms == 0):
        return math.nan
    unit = centered / norms[:, None]
    return float((unit @ unit.T).mean())


def valid_tokens(record: RoutingRecord) -> torch.Tensor:
    """(B, L) bool: the non-padding tokens of a record, those no expert took included (the record's ``token_mask``;
    without one, the tokens with a kept choice). Stratified records use the first gate's path."""
    if record.token_mask is not None:
        return record.token_mask
    if record.stratum_path is not None:
        return record.stratum_path[..., 0] >= 0
    return (record.expert_index >= 0).flatten(2).any(-1)


def active_experts_histogram(record: RoutingRecord, buckets: int) -> torch.Tensor:
    """(buckets,) long: how many non-padding (sub-)tokens used 0, 1, 2, ... experts (the choices kept in
    ``expert_index``; more than ``buckets - 1`` go in the last bucket). A top-k router without drops fills bucket k
    only; an adaptive one (top-p, ReLU gates, null experts) spreads over several. No host sync."""
    used = (record.expert_index >= 0).sum(-1)  # (B, L, heads)
    valid = valid_tokens(record).to(used.device)[..., None].expand_as(used)
    histogram = torch.zeros(buckets, dtype=torch.long, device=used.device)
    return histogram.index_add_(0, used.clamp_max(buckets - 1).reshape(-1), valid.reshape(-1).long())


def mean_active_experts(histogram: torch.Tensor) -> torch.Tensor:
    """The mean experts per (sub-)token of an :func:`active_experts_histogram` (0 when it counted nothing)."""
    histogram = histogram.to(torch.float64)
    used = torch.arange(histogram.numel(), dtype=torch.float64, device=histogram.device)
    return (used @ histogram) / histogram.sum().clamp_min(1.0)


class RoutingTotals:
    """Per-layer routing statistics accumulated over many records, on the records' device, without host syncs.

    ``add(records)`` sums each layer's expert counts and the token-weighted router entropy, dropped fraction and
    requested capacity; ``summary(threshold)`` turns them into the numbers that are logged and reported.
    """

    def __init__(self) -> None:
        self.counts: dict[str, torch.Tensor] = {}
        #: per key: (tokens, tokens * entropy, tokens * dropped fraction, tokens * requested capacity)
        self.sums: dict[str, torch.Tensor] = {}
        #: per key: (E + 1,) the (sub-)tokens that used 0 to E experts (:func:`active_experts_histogram`)
        self.active: dict[str, torch.Tensor] = {}

    def add(self, records: Iterable[RoutingRecord]) -> None:
        for record in records:
            key = record_key(record)
            counts = record.expert_counts.detach()
            tokens = valid_tokens(record).sum().to(torch.float64)
            sums = torch.stack(
                [
                    tokens,
                    tokens * record.router_entropy.detach().to(torch.float64),
                    tokens * record.dropped_fraction.detach().to(torch.float64),
                    tokens * record.requested_capacity.detach().to(torch.float64),
                ]
            )
            active = active_experts_histogram(record, counts.numel() + 1)
            if key in self.counts:
                self.counts[key] = self.counts[key] + counts
                self.sums[key] = self.sums[key] + sums
                self.active[key] = self.active[key] + active
            else:
                self.counts[key], self.sums[key], self.active[key] = counts.clone(), sums, active

    def tokens(self) -> dict[str, float]:
        """Per key: the tokens routed (padding excluded)."""
        return {key: float(sums[0]) for key, sums in self.sums.items()}

    def summary(self, threshold: float = DEFAULT_ACTIVATION_THRESHOLD) -> dict[str, dict[str, float]]:
        """Per key: activation_ratio (MH-MoE's, per token), choice_activation_ratio, entropy, load_min, load_max,
        load_cv, dropped_fraction, requested_capacity, tokens, and active_experts (the mean experts a (sub-)token
        used) where the key's histogram was counted."""
        out = {}
        for key in sorted(self.counts, key=_layer_order):
            counts, sums = self.counts[key], self.sums[key]
            tokens = sums[0].clamp_min(1.0)
            stats = {
                "activation_ratio": activation_ratio(counts, sums[0], threshold),
                "choice_activation_ratio": choice_activation_ratio(counts, threshold),
            }
            stats |= load_summary(counts)
            stats |= {
                "tokens": sums[0],
                "entropy": sums[1] / tokens,
                "dropped_fraction": sums[2] / tokens,
                "requested_capacity": sums[3] / tokens,
            }
            if key in self.active:
                stats["active_experts"] = mean_active_experts(self.active[key])
            out[key] = {name: float(value) for name, value in stats.items()}
        return out


_MODALITY_ORDER = {"vision": 0, "language": 1, "shared": 2}


def _layer_order(key: str) -> tuple[int, int, str]:
    """Sort keys by layer index, then modality (vision, language, shared: the records' order)."""
    layer, _, modality = key.partition("/")
    digits = layer.removeprefix("layer")
    return (int(digits) if digits.isdigit() else -1, _MODALITY_ORDER.get(modality, 3), modality)


def sort_keys(keys: Iterable[str]) -> list[str]:
    """Keys in depth order (layer index, then modality)."""
    return sorted(keys, key=_layer_order)
