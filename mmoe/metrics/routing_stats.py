"""The routing-statistics file: expert loads saved during training, drawn later by :mod:`mmoe.viz`.

One JSON object, written atomically (temporary file + rename) so a reader never sees a partial file::

    {"format": "mmoe-routing-stats", "activation_threshold": 0.1,
     "num_experts": {"layer1/vision": 8, ...},
     "total_loads": {"layer1/vision": [n_1, ..., n_E], ...},          # all windows summed
     "total_tokens": {"layer1/vision": T, ...},                       # the tokens those loads were made on
     "windows": [{"step": 100, "loads": {...}, "tokens": {...},
                  "stats": {"layer1/vision": {"activation_ratio": ..., ...}}}, ...]}

Files written before ``tokens`` existed lack them; readers then fall back to the share-of-choices view.

Each window holds the loads accumulated over ``every_n_steps`` training batches (X-MoE §4.5 correlates loads
accumulated over 100 steps for the inter-run consistency).
"""

from __future__ import annotations

from pathlib import Path

import torch

from mmoe.io import read_json

STATS_FORMAT = "mmoe-routing-stats"
STATS_FILENAME = "routing_stats.json"


def read_stats(path: str | Path) -> dict:
    """Read a routing-statistics file (or the one inside a directory); ValueError naming the file if it is not one."""
    path = Path(path)
    if path.is_dir():
        path = path / STATS_FILENAME
    payload = read_json(path, "routing statistics file", written_by="RoutingStatsCallback writes it in a run folder")
    if not isinstance(payload, dict) or payload.get("format") != STATS_FORMAT:
        raise ValueError(f'{path} is not a routing statistics file (expected "format": "{STATS_FORMAT}")')
    if not payload.get("total_loads"):
        raise ValueError(f"routing statistics file {path} holds no expert loads (no MoE layer was logged)")
    return payload


def total_loads(payload: dict) -> dict[str, torch.Tensor]:
    """Per key, the (E,) expert loads summed over all windows of a statistics file."""
    return {key: torch.tensor(loads, dtype=torch.long) for key, loads in payload["total_loads"].items()}


def window_loads(payload: dict) -> list[tuple[int, dict[str, torch.Tensor]]]:
    """``(step, {key: (E,) loads})`` of every window of a statistics file, in order."""
    return [
        (int(window["step"]), {key: torch.tensor(loads, dtype=torch.long) for key, loads in window["loads"].items()})
        for window in payload.get("windows", [])
    ]


def total_tokens(payload: dict) -> dict[str, float] | None:
    """Per key, the tokens the total loads were made on; None for a file that does not record them (or not for
    every layer)."""
    tokens = payload.get("total_tokens")
    if not isinstance(tokens, dict) or set(tokens) != set(payload["total_loads"]):
        return None
    return {key: float(value) for key, value in tokens.items()}
