"""Whether an adaptive router held its target: the mean experts per (sub-)token of a run's last routing window, per MoE
layer and over all of them (token-weighted), against the target, from the ``active_experts`` histograms that
:class:`mmoe.runtime.routing_callback.RoutingStatsCallback` writes to ``routing_stats.json``.

    PYTHONPATH=. .venv/bin/python -m mmoe.cli fit --config configs/pretrain/tiny.yaml \
        --config configs/pretrain/tiny/remoe.yaml --trainer.max_steps 100 --trainer.default_root_dir /tmp/remoe
    .venv/bin/python scripts/active_experts_vs_target.py /tmp/remoe --target 1

Prints one line per layer, the total over every layer's (sub-)tokens and the plain mean over the layers (what ReMoE's
model-wide controller compares with its target), each with its ratio to the target; exit 1 when the total is outside
``--tolerance`` (0.05 = +-5%) of the target.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from mmoe.metrics.routing import mean_active_experts, sort_keys
from mmoe.metrics.routing_stats import read_stats
from mmoe.runtime.layout import RunLayout


def last_window_histograms(run_dir: str) -> tuple[int, dict[str, torch.Tensor]]:
    """(step, per layer key the (E + 1,) histogram of experts used) of the run's last window."""
    payload = read_stats(RunLayout(Path(run_dir)).routing_stats)
    windows = [window for window in payload.get("windows", []) if window.get("active_experts")]
    if not windows:
        raise SystemExit(f"{run_dir}: no routing window with active_experts histograms")
    window = windows[-1]
    return window["step"], {key: torch.tensor(value) for key, value in window["active_experts"].items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", help="the run folder (its routing_stats.json)")
    parser.add_argument("--target", type=float, required=True, help="experts per (sub-)token the router aims at")
    parser.add_argument("--tolerance", type=float, default=0.05, help="allowed relative error of the total")
    args = parser.parse_args(argv)
    step, histograms = last_window_histograms(args.run_dir)
    print(f"last window ending at step {step}; target {args.target:g} experts per (sub-)token")
    for key in sort_keys(histograms):
        mean = float(mean_active_experts(histograms[key]))
        print(f"  {key:<24} {mean:.3f}  ({mean / args.target:.3f} x target)  histogram {histograms[key].tolist()}")
    used = sum(float(torch.arange(len(h)).double() @ h.double()) for h in histograms.values())
    total = used / max(1.0, sum(float(h.sum()) for h in histograms.values()))  # pools may differ in size
    over_layers = sum(float(mean_active_experts(h)) for h in histograms.values()) / len(histograms)
    print(f"  {'mean over layers':<24} {over_layers:.3f}  ({over_layers / args.target:.3f} x target)")
    held = abs(total / args.target - 1) <= args.tolerance
    print(f"  {'all layers':<24} {total:.3f}  ({total / args.target:.3f} x target): {'held' if held else 'missed'}")
    return 0 if held else 1


if __name__ == "__main__":
    sys.exit(main())
