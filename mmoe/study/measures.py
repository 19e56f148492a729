"""The study's routing measurements, each from exported backbones on the same held-out batches, saved as plain
numbers from which the report's claims are computed. Each is kept per unit the noise rule resamples
(:mod:`mmoe.study.verdicts`): loads and fluctuation counts per held-out batch, sub-token diversity per image, and
bootstrap replicates of RC over router-input rows (RC is not a sum over rows, so its replicates are computed here)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from mmoe.data.synth.layout import CAPTION_TEST_SPLIT, CorpusLayout
from mmoe.data.tokenizer import CAPTION_MAX_TEXT_LENGTH
from mmoe.metrics.routing import RoutingTotals, image_diversity_maps, record_key, representation_collapse, sort_keys
from mmoe.metrics.routing_collect import (
    finite_or_none,
    first_router,
    fluctuation_counts,
    moe_layers_by_key,
    run_routing,
)
from mmoe.runtime.checkpoint import load_backbone
from mmoe.viz.inputs import Batch, TextEncoder, find_samples, make_batches

#: A patch holds an object when one of its pixels has a channel above this level. The synthetic scenes'
#: backgrounds stay below 80 ((60 + 8) x 1.15, :func:`mmoe.data.synth.scenes.render`) and every object colour has a
#: channel of 185 or more (textures darken only part of an object).
OBJECT_LEVEL = 120
#: Bootstrap replicates of each snapshot's RC over its router-input rows.
RC_RESAMPLES = 100


def held_out_batches(shards: Path, image_size: int, batches: int, batch_size: int, max_text_length: int) -> list[Batch]:
    """The first ``batches * batch_size`` image-text pairs of ``shards`` (the study uses the Karpathy test split,
    which no run trains on), as batches with their pixels."""
    samples = find_samples([str(shards)], limit=batches * batch_size)
    return list(make_batches(samples, image_size, batch_size, TextEncoder(max_text_length)))


def analysis_pairs(corpus: CorpusLayout, image_size: int, batches: int, batch_size: int) -> list[Batch]:
    """:func:`held_out_batches` of the corpus's Karpathy-test split, captions at their tokenized length: the held-out
    pairs every routing measurement of the studies runs on."""
    shards = corpus.shard(CAPTION_TEST_SPLIT)
    return held_out_batches(shards, image_size, batches, batch_size, max_text_length=CAPTION_MAX_TEXT_LENGTH)


def inputs(batches: Sequence[Batch]) -> list[dict[str, torch.Tensor]]:
    return [batch.inputs for batch in batches]


def batch_totals(backbone_path: Path, batches: Sequence[Batch]) -> list[RoutingTotals]:
    """The routing totals of the backbone on each held-out batch apart (the noise rule resamples batches)."""
    backbone = load_backbone(backbone_path)
    return [run_routing(backbone, [batch]).totals for batch in inputs(batches)]


def expert_loads(backbone_path: Path, batches: Sequence[Batch]) -> dict:
    """Per MoE layer and held-out batch, the expert loads (choices per expert) and the tokens they were made on: what
    :func:`mmoe.metrics.routing.activation_ratio` takes (MH-MoE Fig. 1a), per batch for the bootstrap."""
    return loads_of(batch_totals(backbone_path, batches))


def loads_of(totals: Sequence[RoutingTotals]) -> dict:
    """:func:`expert_loads` of the routing totals of each held-out batch."""
    tokens = [batch.tokens() for batch in totals]
    keys = sort_keys(totals[0].counts)
    return {
        "loads": {key: [batch.counts[key].tolist() for batch in totals] for key in keys},
        "tokens": {key: [batch_tokens[key] for batch_tokens in tokens] for key in keys},
    }


@torch.no_grad()
def router_variant_measures(backbone_path: Path, batches: Sequence[Batch]) -> dict:
    """:func:`expert_loads` of a router of the router table, with per MoE layer its expert count, the share of
    real (sub-)tokens no expert took on each held-out batch (expert choice, Zhou et al. 2022 §3.2; absent for token
    choice) and the loss-free selection bias b of its first router (Wang et al. 2024 Eq. 3; absent without)."""
    backbone = load_backbone(backbone_path).eval()
    totals: list[RoutingTotals] = []
    unrouted: dict[str, list[float]] = {}
    for batch in inputs(batches):
        records = backbone(**batch).routing
        totals.append(RoutingTotals())
        totals[-1].add(records)
        for record in records:
            if record.unrouted_fraction is not None:
                unrouted.setdefault(record_key(record), []).append(float(record.unrouted_fraction))
    layers = moe_layers_by_key(backbone)
    biases = {key: getattr(first_router(layer), "selection_bias", None) for key, layer in layers.items()}
    return loads_of(totals) | {
        "experts": {key: layers[key].config.num_experts for key in sort_keys(layers)},
        "unrouted": {key: unrouted[key] for key in sort_keys(unrouted)},
        "selection_bias": {key: biases[key].tolist() for key in sort_keys(biases) if biases[key] is not None},
    }


def collapse_with_resamples(hidden: torch.Tensor, top1: torch.Tensor, resamples: int, seed: int = 0) -> dict:
    """RC (X-MoE Eq. 11) of one layer's router inputs, the number of classes K it saw, and ``resamples`` bootstrap
    replicates over the rows (None where RC is undefined)."""
    generator = torch.Generator().manual_seed(seed)
    rows = hidden.shape[0]
    replicates = []
    for _ in range(resamples):
        index = torch.randint(0, rows, (rows,), generator=generator)
        replicates.append(finite_or_none(representation_collapse(hidden[index], top1[index])))
    return {
        "rc": finite_or_none(representation_collapse(hidden, top1)),
        "classes": int(torch.unique(top1).numel()),
        "resamples": replicates,
    }


def snapshot_measures(paths: Sequence[Path], steps: Sequence[int], batches: Sequence[Batch], rows: int) -> list[dict]:
    """Per snapshot and MoE layer: representation collapse RC of the router inputs with its bootstrap replicates
    (X-MoE Eq. 11, Fig. 2c), the expert loads, and the routing fluctuation counts against the previous snapshot per
    held-out batch (X-MoE §4.5, Fig. 3a: "between the current and the last checkpoints"; None for the first)."""
    measures, previous = [], None
    for path, step in zip(paths, steps, strict=True):
        run = run_routing(load_backbone(path), inputs(batches), capture_inputs=True, max_rows=rows)
        collapse = {
            key: collapse_with_resamples(*run.router_inputs[key], RC_RESAMPLES, seed=step)
            for key in sort_keys(run.router_inputs)
        }
        loads = {key: run.totals.counts[key].tolist() for key in sort_keys(run.totals.counts)}
        fluctuation = None if previous is None else fluctuation_counts(previous, run)
        measures.append({"step": step, "collapse": collapse, "loads": loads, "fluctuation": fluctuation})
        previous = run
    return measures


def object_patches(pixels: np.ndarray, patch_size: int) -> np.ndarray:
    """(g, g) bool: the patches of an (H, W, 3) uint8 image that hold part of an object (:data:`OBJECT_LEVEL`)."""
    side = pixels.shape[0] // patch_size
    grid = pixels[: side * patch_size, : side * patch_size].reshape(side, patch_size, side, patch_size, 3)
    return grid.max(axis=(1, 3, 4)) > OBJECT_LEVEL


@torch.no_grad()
def diversity_by_region(backbone_path: Path, batches: Sequence[Batch]) -> dict:
    """MH-MoE Fig. 1b / 8: per MoE layer and held-out image, the sum and number of its object and background patches'
    sub-token diversity (distinct experts among a patch's h sub-tokens' first choices), with the layer's h and E."""
    backbone = load_backbone(backbone_path).eval()
    patch = backbone.config.patch_size
    layers = {key: layer.config for key, layer in moe_layers_by_key(backbone).items()}
    per_key: dict[str, dict[str, list]] = {}
    for batch in batches:
        output = backbone(**batch.inputs)
        masks = torch.from_numpy(np.stack([object_patches(p, patch) for p in batch.pixels]))
        for key, diversity in image_diversity_maps(output.routing, output.image_len).items():
            entry = per_key.setdefault(
                key, {"object_sum": [], "object_patches": [], "background_sum": [], "background_patches": []}
            )
            for image, mask in zip(diversity, masks, strict=True):
                entry["object_sum"].append(float(image[mask].sum()))
                entry["object_patches"].append(int(mask.sum()))
                entry["background_sum"].append(float(image[~mask].sum()))
                entry["background_patches"].append(int((~mask).sum()))
    shapes = {key: {"heads": layers[key].heads, "experts": layers[key].num_experts} for key in per_key}
    return {key: per_key[key] | shapes[key] for key in sort_keys(per_key)}


def requested_capacity(backbone_path: Path, batches: Sequence[Batch]) -> dict:
    """Stratified MoE §5: per MoE layer and held-out batch, the requested capacity (mean FFN passes per token,
    Stratified MoE's RC) and the tokens it was measured on."""
    totals = batch_totals(backbone_path, batches)
    summaries = [(batch.summary(), batch.tokens()) for batch in totals]
    keys = sort_keys(summaries[0][0])
    return {
        key: {
            "capacity": [summary[key]["requested_capacity"] for summary, _ in summaries],
            "tokens": [tokens[key] for _, tokens in summaries],
        }
        for key in keys
    }


def training_token_counts(shards: Sequence[Path], max_text_length: int) -> dict[int, int]:
    """How often each text token id occurs in the texts of ``shards`` (the pre-training pairs and text the backbones
    learned from), tokenised as training tokenises them (start and end tokens included)."""
    encoder = TextEncoder(max_text_length)
    counts: Counter[int] = Counter()
    for sample in find_samples([str(path) for path in shards], wanted=lambda sample: sample.text is not None):
        counts.update(encoder.tokenizer.encode(sample.text))
    return dict(counts)


@torch.no_grad()
def token_passes(backbone_path: Path, batches: Sequence[Batch]) -> dict:
    """Stratified MoE §5 / Fig. 3: per language MoE layer of a Stratified MoE backbone and per text token id of the
    held-out batches, the FFN passes its occurrences made (the gates it reached, ``stratum_path >= 0``) and how many
    occurrences there were."""
    backbone = load_backbone(backbone_path).eval()
    sums: dict[str, Counter[int]] = {}
    counts: dict[str, Counter[int]] = {}
    for batch in batches:
        if "text" not in batch.inputs:
            continue
        ids, padding = batch.inputs["text"], batch.inputs["text_padding_mask"]
        for record in backbone(**batch.inputs).routing:
            if record.stratum_path is None or record.modality != "language":
                continue
            passes = (record.stratum_path >= 0).sum(-1)
            if passes.shape != ids.shape:
                raise ValueError(
                    f"{record_key(record)} routes {tuple(passes.shape)} text tokens, the batch has {tuple(ids.shape)}"
                )
            real = ~padding
            key = record_key(record)
            sums.setdefault(key, Counter())
            for token, value in zip(ids[real].tolist(), passes[real].tolist(), strict=True):
                sums[key][token] += value
                counts.setdefault(key, Counter())[token] += 1
    return {
        key: {
            "ids": sorted(counts[key]),
            "passes": [sums[key][t] for t in sorted(counts[key])],
            "occurrences": [counts[key][t] for t in sorted(counts[key])],
        }
        for key in sort_keys(counts)
    }
