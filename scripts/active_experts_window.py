"""Print the mean number of experts per (sub-)token of a run's last routing window, per layer and modality and over
all, from the ``active_experts`` histograms of its ``routing_stats.json`` (:mod:`mmoe.runtime.routing_callback`),
and how far it is from a target (an adaptive router's, e.g. top-p's ``target_active_experts``).

    python scripts/active_experts_window.py RUN_FOLDER --target 2.0

exits 1 when a ``--tolerance`` is given and the overall mean is further than that fraction from the target.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def window_means(histograms: dict[str, list[int]]) -> tuple[dict[str, float], float]:
    """(mean experts per key, mean over every counted (sub-)token) of histograms whose bin n counts the (sub-)tokens
    that used n experts."""
    means = {key: sum(n * c for n, c in enumerate(h)) / max(sum(h), 1) for key, h in histograms.items()}
    total = sum(sum(h) for h in histograms.values())
    overall = sum(n * c for h in histograms.values() for n, c in enumerate(h)) / max(total, 1)
    return means, overall


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run", type=Path, help="the run folder (holding routing_stats.json) or the file itself")
    parser.add_argument("--target", type=float, default=None, help="the target mean experts per (sub-)token")
    parser.add_argument("--tolerance", type=float, default=None, help="allowed relative error, e.g. 0.05")
    args = parser.parse_args(argv)
    path = args.run / "routing_stats.json" if args.run.is_dir() else args.run
    window = json.loads(path.read_text())["windows"][-1]
    means, overall = window_means(window["active_experts"])
    print(f"{path}: last window at step {window['step']}")
    for key, mean in means.items():
        print(f"  {key}: {mean:.4f} experts per (sub-)token")
    print(f"  all: {overall:.4f}")
    if args.target is None:
        return 0
    error = (overall - args.target) / args.target
    print(f"  target {args.target}: relative error {error:+.2%}")
    return 1 if args.tolerance is not None and abs(error) > args.tolerance else 0


if __name__ == "__main__":
    sys.exit(main())
