"""Lightning callback that logs routing statistics during training without slowing it down.

The training tasks return ``{"loss": loss, "routing": list[RoutingRecord]}`` from ``training_step`` (records
detached). After every batch the callback adds each record's expert counts and token-weighted entropy, dropped
fraction and requested capacity into small tensors on the model's device (no host sync). Every ``every_n_steps``
batches it sums them over the ranks (``trainer.strategy.reduce``), logs per layer and modality, through
``pl_module.log_dict`` (so TensorBoard, CSV and any other logger get them)::

    routing/layer{i}/{modality}/activation_ratio    MH-MoE Fig. 1a / 5, per token (threshold: a fraction of 1/E)
    routing/layer{i}/{modality}/choice_activation_ratio  the same on each expert's share of the choices
    routing/layer{i}/{modality}/tokens              tokens routed in the window
    routing/layer{i}/{modality}/entropy             mean entropy of the routing distribution
    routing/layer{i}/{modality}/load_min|load_max   smallest / largest expert share over the uniform share 1/E
    routing/layer{i}/{modality}/load_cv             std / mean of the expert counts
    routing/layer{i}/{modality}/dropped_fraction    share of choices dropped by the capacity
    routing/layer{i}/{modality}/requested_capacity  Stratified MoE RC (1 for a plain layer)
    routing/layer{i}/{modality}/dead_experts        experts that took no choice in the window
    routing/layer{i}/{modality}/busiest_share       the busiest expert's share of the choices
    routing/layer{i}/{modality}/active_experts      mean experts a (sub-)token used (adaptive routers vary it)
    routing/activation_ratio                        mean over the MoE layers
    routing/patch_depth                             mean layers an image patch ran (Mixture-of-Depths only)

and, to TensorBoard and Weights & Biases loggers, a load heatmap image per window; ``tier="detailed"`` adds per-layer
expert-load, utilisation and active-experts histograms and the sub-token maps of a few held-out images
(:mod:`mmoe.runtime.routing_logging`). Per-expert values are never scalar keys: the number of keys is bounded by the
MoE layers, whatever the number of experts (:func:`mmoe.runtime.routing_logging.metric_key_bound`). With
``save_dir``, it also appends the window's loads to ``save_dir/routing_stats.json``
(:mod:`mmoe.metrics.routing_stats`) for :mod:`mmoe.viz`.

The callback's state (batches seen, the window being accumulated, the windows and totals so far) is saved in the
checkpoint, so a resumed run writes the windows and totals of the run that was never interrupted.

Lightning writes ``on_step`` values at its ``log_every_n_steps``; choose ``every_n_steps`` as a multiple of it (a
warning says so otherwise), or a window's values are written at the next logging step or overwritten.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import lightning as L
import torch

from mmoe.atomic import write_json_atomic
from mmoe.metrics.routing import (
    DEFAULT_ACTIVATION_THRESHOLD,
    RoutingTotals,
    active_experts_histogram,
    layer_key,
    record_key,
    sort_keys,
    valid_tokens,
)
from mmoe.metrics.routing_stats import STATS_FILENAME, STATS_FORMAT
from mmoe.model import MultiwayTransformer
from mmoe.moe import RoutingRecord
from mmoe.runtime.depth_logging import PATCH_DEPTH, PatchDepths, log_depth_histogram, mean_depth
from mmoe.runtime.routing_logging import TIERS, HeldOutImages, Tier, load_scalars, log_media, window_media


def moe_experts(module: torch.nn.Module) -> dict[str, int]:
    """Experts per MoE layer of every backbone inside ``module`` (a task), by :func:`record_key` key."""
    found: dict[str, int] = {}
    for backbone in module.modules():
        if isinstance(backbone, MultiwayTransformer):
            for slot in backbone.moe_layers():
                found.setdefault(layer_key(slot.index, slot.modality), slot.layer.config.num_experts)
    return found


class RoutingStatsCallback(L.Callback):
    """Log per-layer routing statistics every ``every_n_steps`` training batches.

    Args:
        every_n_steps: batches per logging window; statistics cover the window's tokens. X-MoE's inter-run
            consistency accumulates loads over 100 steps.
        activation_threshold: activation-ratio threshold as a fraction of the uniform share 1/E
            (:data:`mmoe.metrics.routing.DEFAULT_ACTIVATION_THRESHOLD`).
        save_dir: directory for ``routing_stats.json`` (written atomically by global rank 0); None = do not save.
        prefix: prefix of the logged names.
        tier: ``"brief"`` (scalars and a load heatmap image) or ``"detailed"`` (also per-expert load and utilisation
            histograms and held-out sub-token maps); see :mod:`mmoe.runtime.routing_logging`.
        map_images: held-out images of the detailed tier's sub-token maps (the first of the first validation batch).
    """

    def __init__(
        self,
        every_n_steps: int = 100,
        activation_threshold: float = DEFAULT_ACTIVATION_THRESHOLD,
        save_dir: str | Path | None = None,
        prefix: str = "routing",
        tier: Tier = "brief",
        map_images: int = 4,
    ) -> None:
        if every_n_steps <= 0:
            raise ValueError(f"RoutingStatsCallback.every_n_steps must be a positive integer, got {every_n_steps!r}")
        if activation_threshold < 0:
            raise ValueError(f"RoutingStatsCallback.activation_threshold must be >= 0, got {activation_threshold!r}")
        if tier not in TIERS:
            raise ValueError(f"RoutingStatsCallback.tier must be one of {list(TIERS)}, got {tier!r}")
        if map_images < 0:
            raise ValueError(f"RoutingStatsCallback.map_images must be >= 0, got {map_images!r}")
        self.every_n_steps = every_n_steps
        self.activation_threshold = activation_threshold
        self.save_dir = None if save_dir is None else Path(save_dir)
        self.prefix = prefix
        self.tier = tier
        self.held_out = HeldOutImages(map_images if tier == "detailed" else 0)
        self._keys: dict[str, int] = {}  # key -> row
        self._num_experts: dict[str, int] = {}
        self._counts: torch.Tensor | None = None  # (K, max E) long
        self._sums: torch.Tensor | None = None  # (K, 4): tokens, tokens * entropy, * dropped, * requested capacity
        self._active: torch.Tensor | None = None  # (K, max E + 1) long: (sub-)tokens by the experts they used
        self._depths = PatchDepths()  # the image patches by the layers they ran (Mixture-of-Depths)
        self._batches = 0
        self._windows: list[dict] = []
        self._total_loads: dict[str, list[int]] = {}
        self._total_tokens: dict[str, float] = {}
        self._warned_no_routing = False
        self._global_zero = True
        self._strategy = None  # the trainer's, for summing the open window over the ranks when it is saved
        self._restored: dict[str, Any] | None = None  # a checkpoint's state, until the accumulators exist

    # -- accumulation ------------------------------------------------------------------------------------------------

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # Rows are fixed from the model's structure, so every rank reduces tensors of the same shape even when a
        # modality is absent from some rank's batches.
        self._num_experts = moe_experts(pl_module)
        self._keys = {key: row for row, key in enumerate(sort_keys(self._num_experts))}
        self._allocate(pl_module.device)
        self._depths.allocate(pl_module, pl_module.device)
        self._strategy = trainer.strategy
        self._global_zero = trainer.is_global_zero
        if self._restored is not None:
            self._restore(self._restored)
        log_every = getattr(trainer, "log_every_n_steps", 0)
        if log_every and self.every_n_steps % log_every:
            warnings.warn(
                f"RoutingStatsCallback.every_n_steps={self.every_n_steps} is not a multiple of the Trainer's "
                f"log_every_n_steps={log_every}: windows are written at the next logging step",
                stacklevel=2,
            )

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0) -> None:
        self.held_out.offer(batch)

    def _allocate(self, device: torch.device) -> None:
        max_experts = max(self._num_experts.values(), default=1)
        self._counts = torch.zeros(len(self._keys), max_experts, dtype=torch.long, device=device)
        self._sums = torch.zeros(len(self._keys), 4, dtype=torch.float64, device=device)
        self._active = torch.zeros(len(self._keys), max_experts + 1, dtype=torch.long, device=device)

    def _add_key(self, record: RoutingRecord, trainer: L.Trainer) -> None:
        """A record of a layer not found in the model's structure (single process only: shapes must match)."""
        key = record_key(record)
        if trainer.world_size > 1:
            raise RuntimeError(
                f"routing record {key} does not match any MoE layer found in the model; "
                "under DDP every rank must know the MoE layers up front"
            )
        num_experts = record.expert_counts.numel()
        self._num_experts[key], self._keys[key] = num_experts, len(self._keys)
        old_counts, old_sums, old_active = self._counts, self._sums, self._active
        self._allocate(old_counts.device)
        self._counts[: old_counts.shape[0], : old_counts.shape[1]] = old_counts
        self._sums[: old_sums.shape[0]] = old_sums
        self._active[: old_active.shape[0], : old_active.shape[1]] = old_active

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx) -> None:
        records = outputs.get("routing") if isinstance(outputs, Mapping) else None
        if records is None:
            if not self._warned_no_routing:
                warnings.warn(
                    "RoutingStatsCallback: training_step returned no 'routing' list; nothing is logged", stacklevel=2
                )
                self._warned_no_routing = True
        else:
            self._accumulate(records, trainer)
        self._depths.take(pl_module)
        self._batches += 1
        if self._batches % self.every_n_steps == 0:
            self._flush(trainer, pl_module, log=True)

    @torch.no_grad()
    def _accumulate(self, records: list[RoutingRecord], trainer: L.Trainer) -> None:
        for record in records:
            if record_key(record) not in self._keys:
                self._add_key(record, trainer)
            row = self._keys[record_key(record)]
            counts = record.expert_counts.detach()
            self._counts[row, : counts.numel()] += counts.to(self._counts.device)
            self._active[row, : counts.numel() + 1] += active_experts_histogram(record, counts.numel() + 1).to(
                self._active.device
            )
            tokens = valid_tokens(record).sum().to(self._sums)
            values = torch.stack([record.router_entropy, record.dropped_fraction, record.requested_capacity])
            self._sums[row, 0] += tokens
            self._sums[row, 1:] += tokens * values.detach().to(self._sums)

    # -- checkpointing ----------------------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """What a resumed run continues from: the batches seen, the open window's sums per layer key (summed over
        the ranks: every rank saves a checkpoint, global rank 0 writes it), and the windows and totals so far."""
        open_window = {}
        if self._counts is not None:
            counts, sums, active = self._counts, self._sums, self._active
            if self._strategy is not None and self._strategy.world_size > 1:
                counts = self._strategy.reduce(counts.clone(), reduce_op="sum")
                sums = self._strategy.reduce(sums.clone(), reduce_op="sum")
                active = self._strategy.reduce(active.clone(), reduce_op="sum")
            for key, row in self._keys.items():
                experts = self._num_experts[key]
                open_window[key] = {
                    "counts": counts[row, :experts].cpu(),
                    "sums": sums[row].cpu(),
                    "active": active[row, : experts + 1].cpu(),
                }
        return {
            "batches": self._batches,
            "open_window": open_window,
            "windows": copy.deepcopy(self._windows),
            "total_loads": copy.deepcopy(self._total_loads),
            "total_tokens": dict(self._total_tokens),
            "open_patch_depth": self._depths.state(self._strategy),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Continues from a checkpoint's :meth:`state_dict` (applied once the accumulators exist, at fit start)."""
        if self._counts is None:
            self._restored = state_dict
        else:
            self._restore(state_dict)

    def _restore(self, state: dict[str, Any]) -> None:
        self._restored = None
        self._batches = state["batches"]
        self._windows = copy.deepcopy(state["windows"])
        self._total_loads = copy.deepcopy(state["total_loads"])
        self._total_tokens = dict(state["total_tokens"])
        if not self._global_zero:
            return  # the open window's sums over all ranks go to one rank only, so that their sum stays the same
        self._depths.restore(state.get("open_patch_depth"))
        for key, window in state["open_window"].items():
            if key in self._keys:
                counts = window["counts"]
                self._counts[self._keys[key], : counts.numel()] = counts.to(self._counts)
                self._sums[self._keys[key]] = window["sums"].to(self._sums)
                if "active" in window:  # a checkpoint written before the active experts were counted has none
                    self._active[self._keys[key], : window["active"].numel()] = window["active"].to(self._active)

    # -- reporting ---------------------------------------------------------------------------------------------------

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._batches % self.every_n_steps:
            self._flush(trainer, pl_module, log=False)  # save the last partial window; logging is over by now

    def _flush(self, trainer: L.Trainer, pl_module: L.LightningModule, log: bool) -> None:
        depth = self._depths.reduce(trainer.strategy)
        summary, totals = self._window_totals(trainer)
        if depth is not None and depth.sum() > 0:
            if log:
                pl_module.log(f"{self.prefix}/{PATCH_DEPTH}", mean_depth(depth), on_step=True, batch_size=1)
        else:
            depth = None
        if not summary and depth is None:
            return
        if log and summary:
            self._log(trainer, pl_module, summary, totals)
        if log and depth is not None and self.tier == "detailed" and trainer.is_global_zero:
            log_depth_histogram(trainer.loggers, depth.cpu().numpy(), trainer.global_step, self.prefix)
        if self.save_dir is not None and trainer.is_global_zero:
            loads = {key: totals.counts[key].tolist() for key in summary}
            tokens = {key: stats["tokens"] for key, stats in summary.items()}
            for key, values in loads.items():
                previous = self._total_loads.get(key, [0] * len(values))
                self._total_loads[key] = [a + b for a, b in zip(previous, values, strict=True)]
                self._total_tokens[key] = self._total_tokens.get(key, 0.0) + tokens[key]
            window = {"step": trainer.global_step, "batches": self._batches, "loads": loads, "tokens": tokens}
            window["active_experts"] = {key: totals.active[key].tolist() for key in summary}
            if depth is not None:
                window[PATCH_DEPTH] = depth.tolist()
            self._windows.append(window | {"stats": summary})
            self.save(self.save_dir / STATS_FILENAME)

    def _window_totals(self, trainer: L.Trainer) -> tuple[dict, RoutingTotals]:
        """The window's routing totals summed over the ranks and their summary; the accumulators start again."""
        totals = RoutingTotals()
        if self._counts is None or not self._keys:
            return {}, totals
        counts = trainer.strategy.reduce(self._counts.clone(), reduce_op="sum")
        sums = trainer.strategy.reduce(self._sums.clone(), reduce_op="sum")
        active = trainer.strategy.reduce(self._active.clone(), reduce_op="sum")
        for key, row in self._keys.items():
            if counts[row].sum() > 0 or sums[row, 0] > 0:
                totals.counts[key] = counts[row, : self._num_experts[key]]
                totals.sums[key] = sums[row]
                totals.active[key] = active[row, : self._num_experts[key] + 1]
        summary = totals.summary(self.activation_threshold)
        self._counts.zero_()
        self._sums.zero_()
        self._active.zero_()
        return summary, totals

    def _log(self, trainer: L.Trainer, pl_module: L.LightningModule, summary: dict, totals: RoutingTotals) -> None:
        """The window's scalars to every logger (``log_dict``), its media to TensorBoard and W&B (rank 0)."""
        loads = {key: totals.counts[key].cpu() for key in summary}  # one copy to the host per layer
        active = {key: totals.active[key].cpu().numpy() for key in summary}
        metrics = {}
        for key, stats in summary.items():
            for name, value in (stats | load_scalars(loads[key])).items():
                metrics[f"{self.prefix}/{key}/{name}"] = value
        ratios = [stats["activation_ratio"] for stats in summary.values()]
        metrics[f"{self.prefix}/activation_ratio"] = sum(ratios) / len(ratios)
        pl_module.log_dict(metrics, on_step=True, on_epoch=False, batch_size=1)
        maps = self.held_out.diversity_grid(trainer, pl_module) if self.tier == "detailed" else None
        if trainer.is_global_zero and trainer.loggers:
            media = window_media(trainer.global_step, {k: v.numpy() for k, v in loads.items()}, maps, self.tier)
            media.active = active
            log_media(trainer.loggers, media, self.prefix)

    def save(self, path: str | Path) -> None:
        """Write the windows logged so far (:mod:`mmoe.metrics.routing_stats` format), atomically."""
        payload = {
            "format": STATS_FORMAT,
            "activation_threshold": self.activation_threshold,
            "every_n_steps": self.every_n_steps,
            "num_experts": {key: self._num_experts[key] for key in sort_keys(self._total_loads)},
            "total_loads": {key: self._total_loads[key] for key in sort_keys(self._total_loads)},
            "total_tokens": {key: self._total_tokens[key] for key in sort_keys(self._total_tokens)},
            "windows": self._windows,
        }
        write_json_atomic(path, payload, indent=1)
