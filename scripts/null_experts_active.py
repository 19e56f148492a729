"""Mean real experts per token of a run with null / zero-computation experts, from its ``routing_stats.json``: each
window's ``active_experts`` histograms (tokens by the real experts they used, per MoE layer and modality), and the
token-weighted mean over the layers, against the expected value of a router balanced over the pool,
``top_k * E / (E + Z)`` (what ``mmoe info`` counts).

Run: ``python scripts/null_experts_active.py RUN_FOLDER --top-k 2 --experts 8 --pool 16``; one JSON line per window
(``step``, ``mean``, ``target``, ``deviation`` = mean / target - 1, ``by_layer``).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def window_means(window: dict) -> tuple[float, dict[str, float]]:
    """(token-weighted mean over the window's layers, each layer's mean) of the real experts per token."""
    by_layer, used, tokens = {}, 0, 0
    for key, histogram in window["active_experts"].items():
        count = sum(histogram)
        total = sum(experts * n for experts, n in enumerate(histogram))
        by_layer[key] = round(total / max(count, 1), 4)
        used, tokens = used + total, tokens + count
    return used / max(tokens, 1), by_layer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run", type=Path, help="the run folder holding routing_stats.json")
    parser.add_argument("--top-k", type=int, required=True)
    parser.add_argument("--experts", type=int, required=True, help="E, the real experts")
    parser.add_argument("--pool", type=int, required=True, help="E + Z, the experts the router scores")
    args = parser.parse_args()
    target = args.top_k * args.experts / args.pool
    for window in json.loads((args.run / "routing_stats.json").read_text())["windows"]:
        mean, by_layer = window_means(window)
        line = {"step": window["step"], "mean": round(mean, 4), "target": target}
        print(json.dumps(line | {"deviation": round(mean / target - 1, 4), "by_layer": by_layer}))


if __name__ == "__main__":
    main()
