"""The image patches' depth in the training logger: how many layers each patch ran when Mixture-of-Depths lets it skip
some (Raposo et al., 2024; ``MultiwayConfig.depth_routing``).

:class:`mmoe.runtime.routing_callback.RoutingStatsCallback` takes each backbone's counts after every training batch
(:meth:`mmoe.model.MultiwayTransformer.take_patch_depth_counts`, no host sync), sums them over the window and the
ranks, and logs ``{prefix}/patch_depth`` (the mean layers a patch ran; every logger) and, in the detailed tier, a
histogram of the same name with one bucket per number of layers (TensorBoard, W&B); ``routing_stats.json`` keeps each
window's counts (``patch_depth``). A backbone without depth routing logs none of it.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from lightning.pytorch.loggers import Logger, TensorBoardLogger, WandbLogger

from mmoe.model import MultiwayTransformer
from mmoe.runtime.routing_logging import integer_histogram

#: The logged name, under the callback's prefix.
PATCH_DEPTH = "patch_depth"


def depth_routed_layers(module: torch.nn.Module) -> int:
    """The most layers of a backbone inside ``module`` (a task) whose image patches are depth-routed; 0 for none."""
    depths = [
        backbone.config.depth
        for backbone in module.modules()
        if isinstance(backbone, MultiwayTransformer) and backbone.config.depth_routing is not None
    ]
    return max(depths, default=0)


class PatchDepths:
    """The patches' depth counts of one logging window: (depth + 1,) long, bucket n the patches that ran n layers."""

    def __init__(self) -> None:
        self.counts: torch.Tensor | None = None

    def allocate(self, module: torch.nn.Module, device: torch.device) -> None:
        """Buckets for the deepest depth-routed backbone of ``module`` (every rank the same shape); none without."""
        depth = depth_routed_layers(module)
        self.counts = torch.zeros(depth + 1, dtype=torch.long, device=device) if depth else None

    @torch.no_grad()
    def take(self, module: torch.nn.Module) -> None:
        """Add what every backbone of ``module`` counted since the last batch."""
        if self.counts is None:
            return
        for backbone in module.modules():
            if isinstance(backbone, MultiwayTransformer):
                counts = backbone.take_patch_depth_counts()
                if counts is not None:
                    self.counts[: counts.numel()] += counts.to(self.counts.device)

    def reduce(self, strategy: Any) -> torch.Tensor | None:
        """The window's counts summed over the ranks (a collective: every rank calls it), then zeroed; None without
        depth routing."""
        if self.counts is None:
            return None
        counts = strategy.reduce(self.counts.clone(), reduce_op="sum")
        self.counts.zero_()
        return counts

    def state(self, strategy: Any) -> list[int] | None:
        """The open window's counts over every rank, for a checkpoint."""
        if self.counts is None:
            return None
        counts = self.counts
        if strategy is not None and strategy.world_size > 1:
            counts = strategy.reduce(counts.clone(), reduce_op="sum")
        return counts.tolist()

    def restore(self, counts: list[int] | None) -> None:
        if self.counts is not None and counts is not None:
            self.counts[: len(counts)] = torch.tensor(counts, dtype=torch.long)


def mean_depth(counts: torch.Tensor) -> float:
    """The mean layers a patch ran, from :class:`PatchDepths` counts (0 when none was counted)."""
    counts = counts.to(torch.float64)
    layers = torch.arange(counts.numel(), dtype=torch.float64, device=counts.device)
    return float((layers @ counts) / counts.sum().clamp_min(1.0))


def log_depth_histogram(loggers: list[Logger], counts: np.ndarray, step: int, prefix: str) -> None:
    """``{prefix}/patch_depth`` as a histogram of one bucket per number of layers (bucket n ends at n + 0.5) to every
    TensorBoard and W&B logger of ``loggers``; any other logger is skipped."""
    for logger in loggers:
        if isinstance(logger, TensorBoardLogger):
            integer_histogram(logger.experiment, f"{prefix}/{PATCH_DEPTH}", counts, step)
        elif isinstance(logger, WandbLogger):
            import wandb  # a WandbLogger exists only where wandb is installed (the mmoe[wandb] extra)

            edges = np.arange(len(counts) + 1, dtype=np.float64) - 0.5
            histogram = wandb.Histogram(np_histogram=(np.asarray(counts, dtype=np.float64), edges))
            logger.experiment.log({"trainer/global_step": step, f"{prefix}/{PATCH_DEPTH}": histogram})
