"""The study's routing measurements, each from exported backbones on the same held-out batches, saved as plain
numbers (loads, token counts, per-snapshot values) from which the report's claims are computed."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from mmoe.metrics.routing import image_diversity_maps, sort_keys
from mmoe.metrics.routing_collect import finite_or_none, fluctuation_between, routing_report, run_routing
from mmoe.tasks.checkpoint import load_backbone
from mmoe.viz.inputs import Batch, TextEncoder, find_samples, make_batches

#: A patch holds an object when one of its pixels has a channel above this level. The synthetic scenes'
#: backgrounds stay below 80 ((60 + 8) x 1.15, :func:`mmoe.data.synth.scenes.render`) and every object colour has a
#: channel of 185 or more (textures darken only part of an object).
OBJECT_LEVEL = 120


def held_out_batches(shards: Path, image_size: int, batches: int, batch_size: int, max_text_length: int) -> list[Batch]:
    """The first ``batches * batch_size`` image-text pairs of ``shards`` (the study uses the Karpathy test split,
    which no run trains on), as batches with their pixels."""
    samples = find_samples([str(shards)], limit=batches * batch_size)
    return list(make_batches(samples, image_size, batch_size, TextEncoder(max_text_length)))


def inputs(batches: Sequence[Batch]) -> list[dict[str, torch.Tensor]]:
    return [batch.inputs for batch in batches]


def expert_loads(backbone_path: Path, batches: Sequence[Batch]) -> dict:
    """Per MoE layer, the expert loads (choices per expert) and the tokens they were made on, on ``batches``:
    what :func:`mmoe.metrics.routing.activation_ratio` takes (MH-MoE Fig. 1a)."""
    totals = run_routing(load_backbone(backbone_path), inputs(batches)).totals
    keys, tokens = sort_keys(totals.counts), totals.tokens()
    return {
        "loads": {key: totals.counts[key].tolist() for key in keys},
        "tokens": {key: tokens[key] for key in keys},
    }


def snapshot_measures(paths: Sequence[Path], steps: Sequence[int], batches: Sequence[Batch], rows: int) -> list[dict]:
    """Per snapshot: representation collapse RC of each MoE layer's router inputs (X-MoE Eq. 11, Fig. 2c) and the
    routing fluctuation against the previous snapshot (X-MoE §4.5, Fig. 3a: "between the current and the last
    checkpoints"; None for the first)."""
    measures, previous = [], None
    for path, step in zip(paths, steps, strict=True):
        run = run_routing(load_backbone(path), inputs(batches), capture_inputs=True, max_rows=rows)
        collapse = routing_report(run, threshold=0.0)["representation_collapse"]
        fluctuation = None if previous is None else fluctuation_between(previous, run)
        measures.append({"step": step, "representation_collapse": collapse, "fluctuation": fluctuation})
        previous = run
    return measures


def object_patches(pixels: np.ndarray, patch_size: int) -> np.ndarray:
    """(g, g) bool: the patches of an (H, W, 3) uint8 image that hold part of an object (:data:`OBJECT_LEVEL`)."""
    side = pixels.shape[0] // patch_size
    grid = pixels[: side * patch_size, : side * patch_size].reshape(side, patch_size, side, patch_size, 3)
    return grid.max(axis=(1, 3, 4)) > OBJECT_LEVEL


@torch.no_grad()
def diversity_by_region(backbone_path: Path, batches: Sequence[Batch]) -> dict:
    """MH-MoE Fig. 1b / 8: per MoE layer, the sum and number of object and background patches' sub-token diversity
    (distinct experts among a patch's h sub-tokens' first choices)."""
    backbone = load_backbone(backbone_path).eval()
    patch = backbone.config.patch_size
    sums: dict[str, dict[str, float]] = {}
    for batch in batches:
        output = backbone(**batch.inputs)
        masks = torch.from_numpy(np.stack([object_patches(p, patch) for p in batch.pixels]))
        for key, diversity in image_diversity_maps(output.routing, output.image_len).items():
            entry = sums.setdefault(
                key, {"object_sum": 0.0, "object_patches": 0, "background_sum": 0.0, "background_patches": 0}
            )
            entry["object_sum"] += float(diversity[masks].sum())
            entry["object_patches"] += int(masks.sum())
            entry["background_sum"] += float(diversity[~masks].sum())
            entry["background_patches"] += int((~masks).sum())
    return {key: sums[key] for key in sort_keys(sums)}


def mean_defined(values) -> float | None:
    """Mean of the values that are numbers (None where there are none)."""
    defined = [float(v) for v in values if finite_or_none(v) is not None]
    return float(np.mean(defined)) if defined else None
