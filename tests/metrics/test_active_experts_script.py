"""scripts/active_experts_vs_target.py: the mean experts per token of a run's last routing window against a target,
per layer, over every layer's tokens and over the layers, from the histograms in routing_stats.json."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "active_experts_vs_target.py"


def load_script():
    spec = importlib.util.spec_from_file_location("active_experts_vs_target", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_last_window_against_the_target(tmp_path, capsys):
    early = {"step": 50, "active_experts": {"layer1/vision": [0, 0, 10]}}
    # Layer 1: 30 tokens on 1 expert, 10 on 2 -> 1.25; layer 3: 10 tokens on 0, 10 on 1 -> 0.5 (pools of 4 and 2).
    late = {"step": 100, "active_experts": {"layer1/vision": [0, 30, 10, 0, 0], "layer3/language": [10, 10, 0]}}
    payload = {"format": "mmoe-routing-stats", "total_loads": {"layer1/vision": [1]}, "windows": [early, late]}
    (tmp_path / "routing_stats.json").write_text(json.dumps(payload))
    script = load_script()
    assert script.main([str(tmp_path), "--target", "1"]) == 0  # (30 + 20 + 10) experts used by 60 tokens
    out = capsys.readouterr().out
    assert "ending at step 100" in out and "1.250" in out and "0.500" in out
    assert "mean over layers         0.875" in out  # (1.25 + 0.5) / 2: not weighted by the layers' tokens
    assert "all layers               1.000  (1.000 x target): held" in out
    assert script.main([str(tmp_path), "--target", "1.06"]) == 1  # 6% off
    assert "missed" in capsys.readouterr().out
