"""Run a backbone over inputs and collect what the routing analyses need: records, loads and router inputs.

The representation-collapse metric (X-MoE Eq. 11) needs the hidden states *fed into* each router (h, not W h), which
the routing records do not carry. :class:`RouterInputs` reads them with forward hooks on the
:class:`mmoe.moe.router.Router` modules (the hook sees the router's input ``x_SD`` and ``valid_S`` and its output's
top-1 experts), so no model code changes. A Stratified MoE layer is analysed at its first gate, which every token
passes.

The MoE layers are found through the backbone's public ``moe_layers()``
(:meth:`mmoe.model.MultiwayTransformer.moe_layers`) and their routers through ``gate_routers()``
(:meth:`mmoe.moe.MoEFeedForward.gate_routers`); this module does not import :mod:`mmoe.model`.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

from mmoe.metrics.routing import (
    RoutingTotals,
    inter_run_consistency,
    layer_key,
    record_key,
    representation_collapse,
    sort_keys,
)
from mmoe.moe import MoEFeedForward, Router, RoutingRecord


def moe_layers_by_key(backbone: nn.Module) -> dict[str, MoEFeedForward]:
    """The MoE layers of ``backbone`` (a :class:`mmoe.model.MultiwayTransformer`), by :func:`record_key` key.

    Where two layers share a key (a layer's shared FFN and its VL-FFN), the first one the backbone lists is kept.
    """
    found: dict[str, MoEFeedForward] = {}
    for slot in backbone.moe_layers():
        found.setdefault(layer_key(slot.index, slot.modality), slot.layer)
    return found


def first_router(layer: MoEFeedForward) -> Router | None:
    """The router every (sub-)token of ``layer`` meets first: a plain layer's router, a Stratified layer's gate 1;
    None for a Soft MoE layer, which has slots, not a router."""
    routers = layer.gate_routers()
    return routers[0] if routers else None


@dataclass
class RouterCapture:
    """Router inputs of one MoE layer: rows of h (float32, CPU) and the top-1 expert of each row."""

    hidden: list[torch.Tensor] = field(default_factory=list)
    top1: list[torch.Tensor] = field(default_factory=list)
    rows: int = 0

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.cat(self.hidden), torch.cat(self.top1)


class RouterInputs:
    """Context manager that records each MoE layer's router inputs while a backbone runs.

    Args:
        module: the backbone (a :class:`mmoe.model.MultiwayTransformer`).
        max_rows: keep at most this many (sub-)token rows per layer (the first ones), to bound memory.
    """

    def __init__(self, module: nn.Module, max_rows: int = 10_000) -> None:
        # A Soft MoE layer has no router to capture.
        layers = moe_layers_by_key(module).items()
        self.layers = {key: layer for key, layer in layers if first_router(layer) is not None}
        self.max_rows = max_rows
        self.captures: dict[str, RouterCapture] = {key: RouterCapture() for key in self.layers}
        self._handles: list = []

    def __enter__(self) -> RouterInputs:
        for key, layer in self.layers.items():
            self._handles.append(first_router(layer).register_forward_hook(self._hook(key)))
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _hook(self, key: str):
        capture = self.captures[key]

        def hook(module: Router, args: tuple, output) -> None:
            room = self.max_rows - capture.rows
            if room <= 0:
                return
            x_SD = args[0].detach()
            valid_S = args[1] if len(args) > 1 else None
            top1_S = output.expert_SK[:, 0].detach()
            if valid_S is not None:
                x_SD, top1_S = x_SD[valid_S], top1_S[valid_S]
            x_SD, top1_S = x_SD[:room], top1_S[:room]
            capture.hidden.append(x_SD.float().cpu())
            capture.top1.append(top1_S.cpu())
            capture.rows += x_SD.shape[0]

        return hook


@dataclass
class RoutingRun:
    """What one backbone did on a sequence of batches.

    Attributes:
        totals: accumulated loads and statistics per MoE layer.
        top1: per batch, per key, the (B, L, heads) top-1 experts (int16, -1 at padding / drops) for fluctuation.
        router_inputs: per key, (h rows, top-1 experts) when captured, for representation collapse.
    """

    totals: RoutingTotals
    top1: list[dict[str, torch.Tensor]]
    router_inputs: dict[str, tuple[torch.Tensor, torch.Tensor]] | None = None


@torch.no_grad()
def run_routing(
    backbone: nn.Module, batches: Iterable[dict], capture_inputs: bool = False, max_rows: int = 10_000
) -> RoutingRun:
    """Run ``backbone`` in eval mode over ``batches`` (keyword arguments of its forward) and collect the routing.

    Args:
        backbone: a :class:`mmoe.model.MultiwayTransformer`.
        batches: dicts with ``image`` / ``text`` / ``text_padding_mask``.
        capture_inputs: also record the router inputs (:class:`RouterInputs`) for representation collapse.
        max_rows: router-input rows kept per layer.
    """
    backbone.eval()
    totals, top1 = RoutingTotals(), []
    recorder = RouterInputs(backbone, max_rows) if capture_inputs else None
    with recorder if recorder is not None else contextlib.nullcontext():
        for batch in batches:
            records: list[RoutingRecord] = backbone(**batch).routing
            totals.add(records)
            top1.append({record_key(r): r.expert_index[..., 0].to(torch.int16).cpu() for r in records})
    inputs = None
    if recorder is not None:
        inputs = {key: capture.tensors() for key, capture in recorder.captures.items() if capture.rows}
    return RoutingRun(totals, top1, inputs)


def routing_report(run: RoutingRun, threshold: float) -> dict:
    """The per-layer routing metrics of one run: activation ratio at ``threshold``, representation collapse (X-MoE
    Eq. 11; None without captured router inputs), requested capacity, entropy, dropped fraction and load CV."""
    summary = run.totals.summary(threshold)
    inputs = run.router_inputs or {}
    return {
        "batches": len(run.top1),
        "activation_threshold": threshold,
        "activation_ratio": {key: stats["activation_ratio"] for key, stats in summary.items()},
        "representation_collapse": {
            key: finite_or_none(representation_collapse(*inputs[key])) if key in inputs else None for key in summary
        },
        "requested_capacity": {key: stats["requested_capacity"] for key, stats in summary.items()},
        "entropy": {key: stats["entropy"] for key, stats in summary.items()},
        "dropped_fraction": {key: stats["dropped_fraction"] for key, stats in summary.items()},
        "load_cv": {key: stats["load_cv"] for key, stats in summary.items()},
    }


def fluctuation_counts(run_a: RoutingRun, run_b: RoutingRun) -> dict[str, dict[str, list[int]]]:
    """Per MoE layer and batch, the (sub-)tokens routed in both runs over the same batches (``compared``) and those
    whose top-1 expert differs (``changed``): routing fluctuation (X-MoE §4.5) is their ratio."""
    counts: dict[str, dict[str, list[int]]] = {}
    for batch_a, batch_b in zip(run_a.top1, run_b.top1, strict=True):
        for key in sort_keys(batch_a.keys() & batch_b.keys()):
            a, b = batch_a[key], batch_b[key]
            if a.shape != b.shape:
                raise ValueError(
                    f"{key} routes {tuple(a.shape)} (batch, tokens, heads) in one checkpoint and {tuple(b.shape)} in "
                    "the other: fluctuation needs checkpoints with the same heads"
                )
            both = (a >= 0) & (b >= 0)
            entry = counts.setdefault(key, {"changed": [], "compared": []})
            entry["changed"].append(int((both & (a != b)).sum()))
            entry["compared"].append(int(both.sum()))
    return counts


def fluctuation_between(run_a: RoutingRun, run_b: RoutingRun) -> dict:
    """Routing fluctuation (X-MoE §4.5) per MoE layer and overall: the share of (sub-)tokens whose top-1 expert differs
    between two runs over the same batches (tokens routed in both)."""
    counts = fluctuation_counts(run_a, run_b)
    changed = {key: sum(entry["changed"]) for key, entry in counts.items() if sum(entry["compared"])}
    compared = {key: sum(counts[key]["compared"]) for key in changed}
    if not compared:
        raise ValueError("the two checkpoints share no MoE layer: no fluctuation to measure")
    per_key = {key: changed[key] / compared[key] for key in sort_keys(compared)}
    return per_key | {"overall": sum(changed.values()) / sum(compared.values())}


def load_consistency(loads: list[dict[str, torch.Tensor]], names: Sequence[str]) -> dict:
    """Inter-run consistency IC (X-MoE §4.5) per MoE layer over the runs' loads (``names`` name the runs in errors),
    and the mean over layers (NaN-free: an undefined IC is None)."""
    common = set.intersection(*(set(run) for run in loads))
    if not common:
        raise ValueError(f"the runs {', '.join(names)} share no MoE layer")
    per_key = {}
    for key in sort_keys(common):
        sizes = {run[key].numel() for run in loads}
        if len(sizes) > 1:
            raise ValueError(f"{key} has different numbers of experts across the runs: {sorted(sizes)}")
        per_key[key] = finite_or_none(inter_run_consistency(torch.stack([run[key] for run in loads])))
    defined = [v for v in per_key.values() if v is not None]
    return per_key | {"mean": float(np.mean(defined)) if defined else None}


def consistency_through_training(
    runs: Sequence[list[tuple[int, dict[str, torch.Tensor]]]], names: Sequence[str]
) -> dict:
    """Inter-run consistency through fine-tuning (X-MoE §4.5, Fig. 3b): IC of the runs' expert loads accumulated over
    each logging window (X-MoE: 100 steps), window by window; ``runs`` as :func:`mmoe.metrics.routing_stats
    .window_loads` gives them, one per run. Windows are matched by position and must be at the same step in every
    run (the same ``every_n_steps``); the curve stops at the shortest run.

    Returns:
        ``{"steps": [...], "windows": [{"step": s, "mean": IC, "layer1/vision": IC, ...}, ...]}``.
    """
    if len(runs) < 2:
        raise ValueError(f"inter-run consistency needs at least 2 runs, got {len(runs)}")
    length = min(len(run) for run in runs)
    if length == 0:
        empty = next(name for name, run in zip(names, runs, strict=True) if not run)
        raise ValueError(f"{empty} holds no logging window")
    windows = []
    for position in range(length):
        steps = [run[position][0] for run in runs]
        if len(set(steps)) > 1:
            where = ", ".join(f"{name} at step {step}" for name, step in zip(names, steps, strict=True))
            raise ValueError(
                f"window {position + 1} is not at the same step in every run ({where}): log the runs "
                "with the same RoutingStatsCallback.every_n_steps"
            )
        windows.append({"step": steps[0]} | load_consistency([run[position][1] for run in runs], names))
    return {"steps": [window["step"] for window in windows], "windows": windows}


def finite_or_none(value: float | None) -> float | None:
    """``value``, or None where it is None, NaN or infinite (JSON has no NaN)."""
    return None if value is None or not math.isfinite(value) else value
