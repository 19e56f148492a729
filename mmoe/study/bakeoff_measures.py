"""What ``mmoe study routers`` measures of one (router, seed) run, from the files the run wrote and its exported
backbone: the held-out masked-modelling losses per modality and the zero-shot probes (the pre-training's validation
after its last step, on the Karpathy-val pairs, :func:`mmoe.pipeline.probes.last_validation`), the VQA accuracy of its
fixed fine-tuning (``scores.json``), and per modality the load CV and the experts per token of its MoE layers on the
held-out Karpathy-test pairs no run trains on.

Experts per token are counted from the routing records alone, as the routing logger counts its ``active_experts``
(:func:`mmoe.metrics.routing.active_experts_histogram`): a (sub-)token's non-negative entries of
:attr:`mmoe.moe.RoutingRecord.expert_index` (its kept choices; -1 marks padding, drops, empty choices and, under expert
choice, the experts that did not take it), over the layer's non-padding tokens, those no expert took included. A
router that gives tokens different numbers of experts needs nothing new here: its records say how many each took.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from mmoe.metrics.routing import RoutingTotals, load_summary, mean_active_experts
from mmoe.pipeline.probes import last_validation
from mmoe.runtime.layout import RunLayout
from mmoe.tasks.zero_shot_probes import PREFIX

#: A measure's key in the pre-training's validation row (``val/<loss>`` of the held-out pair stream, the probes; a
#: matching probe's ``pooled_`` key where the run trains without the contrastive loss).
VALIDATION_KEYS = {
    "mlm_loss": "val/pair_loss",
    "i2t_r1": f"{PREFIX}i2t_r1",
    "t2i_r1": f"{PREFIX}t2i_r1",
    "color_acc": f"{PREFIX}color_acc",
    "shape_acc": f"{PREFIX}shape_acc",
}
#: The matching probes' prefix without the contrastive loss (the pooled features: :mod:`mmoe.tasks.zero_shot_probes`).
POOLED = "pooled_"
#: The modalities the routing measures are kept for (each MoE layer's records say which it routed).
ROUTED_MODALITIES = ("vision", "language")


def layer_measures(totals: RoutingTotals) -> dict[str, dict[str, float]]:
    """Per MoE layer (``layer<i>/<modality>``) of the routing ``totals``: its ``load_cv``
    (:func:`mmoe.metrics.routing.load_summary`) and ``experts_per_token`` (the mean of its histogram of experts per
    (sub-)token, the routing logger's ``active_experts``)."""
    return {
        key: {
            "load_cv": float(load_summary(totals.counts[key])["load_cv"]),
            "experts_per_token": float(mean_active_experts(totals.active[key])),
        }
        for key in totals.counts
    }


def modality_means(layers: dict[str, dict[str, float]]) -> dict[str, float | None]:
    """``load_cv_<modality>`` and ``experts_<modality>``: the mean over the modality's MoE layers (None without one,
    as for the dense backbone)."""
    means: dict[str, float | None] = {}
    for modality in ROUTED_MODALITIES:
        kept = [value for key, value in layers.items() if key.endswith(f"/{modality}")]
        for name, field in (("load_cv", "load_cv"), ("experts", "experts_per_token")):
            means[f"{name}_{modality}"] = float(np.mean([layer[field] for layer in kept])) if kept else None
    return means


@torch.no_grad()
def routing_measures(backbone: Path, batches: Sequence) -> dict[str, dict[str, float]]:
    """Per MoE layer of the exported ``backbone``: load CV and experts per token over the held-out ``batches``
    (:func:`mmoe.study.measures.held_out_batches`)."""
    from mmoe.runtime.checkpoint import load_backbone

    model = load_backbone(backbone).eval()
    totals = RoutingTotals()
    for batch in batches:
        totals.add(model(**batch.inputs).routing)
    return layer_measures(totals)


def validation_values(layout: RunLayout) -> dict[str, float | None]:
    """The held-out losses and probes of the pre-training in ``layout``'s validation after its last step (None for
    one it did not log)."""
    row = last_validation(layout) or {}
    pooled = {key: key.replace(PREFIX, f"{PREFIX}{POOLED}", 1) for key in VALIDATION_KEYS.values()}
    return {name: row.get(key, row.get(pooled[key])) for name, key in VALIDATION_KEYS.items()}


#: The seed of the block masks the held-out masked image modelling loss is measured under (the same for every run).
MASK_SEED = 0


@torch.no_grad()
def held_out_mim_loss(checkpoint: Path, batches: Sequence) -> float:
    """The masked image modelling loss of the pre-training ``checkpoint`` on the held-out ``batches``' images, each
    masked alone (BEiT-3's image stream: block masks of :class:`mmoe.data.masking.MaskingConfig`'s ratio, drawn under
    :data:`MASK_SEED`), averaged over the masked patches: the vision counterpart of the validation's masked language
    modelling loss (the validation's pairs keep their images whole)."""
    from mmoe.data.batches import IMAGE
    from mmoe.data.masking import MaskingConfig, image_masks
    from mmoe.tasks.pretraining import MaskedPretraining

    task = MaskedPretraining.load_from_checkpoint(checkpoint, map_location="cpu").eval()
    config = task.backbone.config
    grid = (config.image_size // config.patch_size,) * 2
    rng = np.random.default_rng(MASK_SEED)
    total, patches = 0.0, 0
    for batch in batches:
        image = batch.inputs["image"]
        mask = image_masks(len(image), grid, MaskingConfig(), rng)
        losses, _ = task.masked_losses({"kind": IMAGE, "image": image, "image_mask": mask})
        total += float(losses[IMAGE]) * int(mask.sum())
        patches += int(mask.sum())
    return total / patches
