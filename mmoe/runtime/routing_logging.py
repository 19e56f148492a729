"""Routing statistics in the training logger beyond scalars: per-expert loads as histograms, a load heatmap and
sub-token maps as images, sent to TensorBoard and Weights & Biases through Lightning's public logger API.

:class:`mmoe.runtime.routing_callback.RoutingStatsCallback` calls :func:`log_media` at the end of every logging window,
on global rank 0. Two tiers (``RoutingStatsCallback(tier=...)``):

* ``brief`` (the default): the scalars per MoE layer and modality (:data:`LAYER_SCALARS`, through ``log_dict``, so
  every logger, CSV included, gets them) and one image, ``{prefix}/load_heatmap`` (layers x experts per modality,
  :func:`mmoe.routing.render.load_heatmap`).
* ``detailed``: also, per MoE layer and modality, ``{prefix}/{key}/expert_load`` (a histogram with one bucket per
  expert holding the choices it took in the window), ``{prefix}/{key}/utilisation`` (the distribution of the
  experts' load over the uniform share) and ``{prefix}/{key}/active_experts`` (bucket n holds the (sub-)tokens that
  used n experts: one bucket for top-k, several for an adaptive router), and one image ``{prefix}/subtoken_maps``
  (the sub-token diversity maps of a few held-out images fixed at the start of the fit, MH-MoE Fig. 1b;
  :class:`HeldOutImages`).

The images are :mod:`mmoe.routing.render`'s arrays, the pixels ``mmoe viz`` shows with axes and labels afterwards.

Per-expert values never become scalar keys: the number of keys depends on the MoE layers, never on the experts
(:func:`metric_key_bound`: at most ``len(LAYER_SCALARS) * K + 1`` scalars, 2 images and ``3 * K`` histograms for K
MoE (layer, modality) keys: 63 keys (50 brief) for the tiny config's 2 MoE layers x 2 modalities, whether they have
8 experts or 32). Images and histograms go to a ``TensorBoardLogger`` (``experiment.add_image``, ``add_histogram_raw``,
``add_histogram``) and a ``WandbLogger`` (``log_image``, ``experiment.log`` with ``wandb.Histogram``); other loggers
(CSV) and a run without logger get the scalars only. Media are written at ``trainer.global_step`` (the optimiser
steps done, the ``step`` of the window in ``routing_stats.json``); Lightning writes the window's scalars at its own
logging step, which counts the steps before this one (one lower).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import lightning as L
import numpy as np
import torch
from lightning.pytorch.loggers import Logger, TensorBoardLogger, WandbLogger

from mmoe.data.transforms import denormalize
from mmoe.metrics.routing import image_diversity_maps
from mmoe.model import MultiwayTransformer
from mmoe.routing.render import diversity_grid, load_heatmap, utilisation

Tier = Literal["brief", "detailed"]
TIERS: tuple[Tier, ...] = ("brief", "detailed")

#: The scalars logged per MoE layer and modality in both tiers: numbers of the layer, never of one expert.
LAYER_SCALARS = (
    "activation_ratio",
    "choice_activation_ratio",
    "tokens",
    "entropy",
    "load_min",
    "load_max",
    "load_cv",
    "dropped_fraction",
    "requested_capacity",
    "dead_experts",
    "busiest_share",
    "active_experts",
)
#: The histograms per MoE layer and modality of the detailed tier.
LAYER_HISTOGRAMS = ("expert_load", "utilisation", "active_experts")
#: The images of each tier.
IMAGES: dict[str, tuple[str, ...]] = {"brief": ("load_heatmap",), "detailed": ("load_heatmap", "subtoken_maps")}
#: Bucket edges of the utilisation histogram: 0 (dead) to 4 x the uniform share, busier experts in the last bucket.
UTILISATION_EDGES = np.linspace(0.0, 4.0, 17)
#: The side of one tile of the sub-token maps: held-out images are shrunk to it (smaller ones keep their size).
TILE_SIDE = 96


def metric_key_bound(layer_keys: int, tier: Tier, depth_routed: bool = False) -> int:
    """The most metric keys (scalars, images, histograms) a run logs with ``layer_keys`` MoE (layer, modality) keys:
    :data:`LAYER_SCALARS` per key and their mean activation ratio, the tier's images, and in the detailed tier
    :data:`LAYER_HISTOGRAMS` per key; ``depth_routed`` (Mixture-of-Depths) adds the patches' mean depth and, in the
    detailed tier, its histogram (:mod:`mmoe.runtime.depth_logging`). It does not grow with the number of experts."""
    histograms = len(LAYER_HISTOGRAMS) * layer_keys if tier == "detailed" else 0
    depth = (2 if tier == "detailed" else 1) if depth_routed else 0
    return len(LAYER_SCALARS) * layer_keys + 1 + len(IMAGES[tier]) + histograms + depth


def load_scalars(counts_E: torch.Tensor) -> dict[str, float]:
    """``dead_experts``: experts that took no choice in the window; ``busiest_share``: the busiest expert's share of
    the layer's choices (1 / E when balanced, 1 when one expert takes everything; 0 without a choice)."""
    total = counts_E.sum()
    busiest = counts_E.max() / total if total > 0 else torch.zeros(())
    return {"dead_experts": float((counts_E == 0).sum()), "busiest_share": float(busiest)}


def first_images(batch: Any, limit: int) -> torch.Tensor | None:
    """Up to ``limit`` images (N, 3, S, S) of a batch: its ``image`` tensor, or the first one found in the batch's
    mappings (a joint pre-training batch holds one per stream); None when it has none."""
    if isinstance(batch, Mapping):
        image = batch.get("image")
        if isinstance(image, torch.Tensor) and image.dim() == 4 and image.shape[1] == 3:
            return image[:limit]
        for value in batch.values():
            found = first_images(value, limit) if isinstance(value, Mapping) else None
            if found is not None:
                return found
    return None


def image_pixels(images: torch.Tensor, side: int) -> np.ndarray:
    """(N, s, s, 3) uint8 with s = min(S, ``side``): normalised images (N, 3, S, S), as the model saw them, shrunk by
    area averaging when they are larger than ``side``."""
    pixels = denormalize(images.detach().float().cpu()).clamp(0.0, 1.0)
    if pixels.shape[-1] > side:
        pixels = torch.nn.functional.interpolate(pixels, size=(side, side), mode="area")
    return np.round(pixels.permute(0, 2, 3, 1).numpy() * 255).astype(np.uint8)


class HeldOutImages:
    """A few held-out images fixed once per fit (the first ``limit`` of the first validation batch that has images:
    the sanity check's, or the first validation's without one) and their sub-token diversity maps under the model
    being trained."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.images: torch.Tensor | None = None

    def offer(self, batch: Any) -> None:
        """Keep the images of ``batch`` (a validation batch) unless images are kept already."""
        if self.images is None and self.limit > 0:
            found = first_images(batch, self.limit)
            if found is not None:
                self.images = found.detach().clone()

    @torch.no_grad()
    def diversity_grid(self, trainer: L.Trainer, pl_module: L.LightningModule) -> np.ndarray | None:
        """The images x layers grid of their sub-token maps under the current weights (:func:`diversity_grid` over
        their :func:`image_pixels` at :data:`TILE_SIDE`), in eval mode under the trainer's precision; None without
        images or an image-routing MoE layer. Every rank runs the forward (a sharded backbone needs them all); the
        caller logs rank 0's."""
        backbone = next((m for m in pl_module.modules() if isinstance(m, MultiwayTransformer)), None)
        if self.images is None or backbone is None or backbone.config.moe is None:
            return None
        weight = next(backbone.parameters())
        was_training = backbone.training
        backbone.eval()
        try:
            with trainer.precision_plugin.forward_context():
                output = backbone(image=self.images.to(weight.device, weight.dtype))
        finally:
            backbone.train(was_training)
        maps = image_diversity_maps(output.routing, output.image_len)
        if not maps:
            return None
        maps_np = {key: value.cpu().numpy() for key, value in maps.items()}
        return diversity_grid(image_pixels(self.images, TILE_SIDE), maps_np, backbone.config.moe.heads)


@dataclass
class WindowMedia:
    """What one window sends to the loggers beside its scalars.

    Attributes:
        step: the trainer's global step at the window's end.
        loads: key -> (E,) the window's expert counts (summed over the ranks), keys in depth order.
        heatmap: (H, W, 3) uint8, :func:`load_heatmap` of ``loads``.
        subtoken_maps: (H, W, 3) uint8 or None (brief tier, no held-out image).
        detailed: whether the histograms are sent.
        active: key -> (E + 1,) the (sub-)tokens that used 0 to E experts in the window; empty: none sent.
    """

    step: int
    loads: dict[str, np.ndarray]
    heatmap: np.ndarray
    subtoken_maps: np.ndarray | None = None
    detailed: bool = False
    active: dict[str, np.ndarray] = field(default_factory=dict)


def window_media(
    step: int, loads: Mapping[str, np.ndarray], subtoken_maps: np.ndarray | None, tier: Tier
) -> WindowMedia:
    """The :class:`WindowMedia` of a window's loads (keys in depth order)."""
    return WindowMedia(step, dict(loads), load_heatmap(loads, list(loads)), subtoken_maps, tier == "detailed")


def log_media(loggers: list[Logger], media: WindowMedia, prefix: str) -> None:
    """Send ``media`` to every TensorBoard and W&B logger of ``loggers``; any other logger is skipped."""
    for logger in loggers:
        if isinstance(logger, TensorBoardLogger):
            to_tensorboard(logger.experiment, media, prefix)
        elif isinstance(logger, WandbLogger):
            to_wandb(logger, media, prefix)


def to_tensorboard(writer: Any, media: WindowMedia, prefix: str) -> None:
    """Through a ``SummaryWriter``: images (HWC uint8), each key's per-expert load as a histogram of one bucket per
    expert (bucket e ends at e + 0.5 and holds expert e's choices) and its utilisation histogram."""
    writer.add_image(f"{prefix}/load_heatmap", media.heatmap, media.step, dataformats="HWC")
    if media.subtoken_maps is not None:
        writer.add_image(f"{prefix}/subtoken_maps", media.subtoken_maps, media.step, dataformats="HWC")
    if not media.detailed:
        return
    for key, counts in media.loads.items():
        integer_histogram(writer, f"{prefix}/{key}/expert_load", counts, media.step)
        if key in media.active:
            integer_histogram(writer, f"{prefix}/{key}/active_experts", media.active[key], media.step)
        counts = np.asarray(counts, dtype=np.float64)
        if counts.sum() > 0:
            share = np.minimum(utilisation(counts), UTILISATION_EDGES[-1])
            writer.add_histogram(f"{prefix}/{key}/utilisation", share, media.step, bins=UTILISATION_EDGES)


def integer_histogram(writer: Any, tag: str, counts: np.ndarray, step: int) -> None:
    """``counts[n]`` items of value n as a TensorBoard histogram of one bucket per n (bucket n ends at n + 0.5)."""
    counts = np.asarray(counts, dtype=np.float64)
    values = np.arange(counts.size, dtype=np.float64)
    writer.add_histogram_raw(
        tag,
        min=0.0,
        max=float(counts.size - 1),
        num=float(counts.sum()),
        sum=float(values @ counts),
        sum_squares=float(values**2 @ counts),
        bucket_limits=(values + 0.5).tolist(),
        bucket_counts=counts.tolist(),
        global_step=step,
    )


def to_wandb(logger: WandbLogger, media: WindowMedia, prefix: str) -> None:
    """Through a ``WandbLogger``: images with ``log_image``, histograms (``wandb.Histogram`` from the same buckets as
    TensorBoard's) with ``experiment.log`` at Lightning's ``trainer/global_step`` axis."""
    import wandb  # a WandbLogger exists only where wandb is installed (the mmoe[wandb] extra)

    images = {"load_heatmap": media.heatmap, "subtoken_maps": media.subtoken_maps}
    for name, pixels in images.items():
        if pixels is not None:
            logger.log_image(f"{prefix}/{name}", [pixels], step=media.step)
    if not media.detailed:
        return
    payload: dict[str, Any] = {"trainer/global_step": media.step}
    for key, counts in media.loads.items():
        counts = np.asarray(counts, dtype=np.float64)
        edges = np.arange(counts.size + 1, dtype=np.float64) - 0.5
        payload[f"{prefix}/{key}/expert_load"] = wandb.Histogram(np_histogram=(counts, edges))
        if key in media.active:
            used = np.asarray(media.active[key], dtype=np.float64)
            used_edges = np.arange(used.size + 1, dtype=np.float64) - 0.5
            payload[f"{prefix}/{key}/active_experts"] = wandb.Histogram(np_histogram=(used, used_edges))
        if counts.sum() > 0:
            share = np.minimum(utilisation(counts), UTILISATION_EDGES[-1])
            payload[f"{prefix}/{key}/utilisation"] = wandb.Histogram(
                np_histogram=np.histogram(share, bins=UTILISATION_EDGES)
            )
    logger.experiment.log(payload)
