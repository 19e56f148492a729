"""The benchmarks still run and print their machine-readable lines (one small case each; no timing is asserted)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run_benchmark(*argv: str) -> list[dict]:
    done = subprocess.run([sys.executable, *argv], cwd=ROOT, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]


@pytest.mark.slow
def test_moe_layer_benchmark_runs_the_selected_case_and_writes_its_profile(tmp_path):
    lines = run_benchmark("benchmarks/moe_layer.py", "--only", "top1_1024", "--rounds", "1", "--profile", str(tmp_path))
    assert [line["case"] for line in lines[:-1]] == ["top1_1024"]
    assert lines[0]["ratio"] == pytest.approx(lines[0]["moe_s"] / lines[0]["baseline_s"], rel=0.05)
    assert set(lines[-1]["summary"]) == {"top1_1024"}
    assert "aten::" in (tmp_path / "top1_1024.txt").read_text()


@pytest.mark.slow
def test_moe_layer_benchmark_runs_the_stratified_case():
    lines = run_benchmark("benchmarks/moe_layer.py", "--only", "stratified_4_4_vs_top2_4096", "--rounds", "1")
    assert lines[0]["case"] == "stratified_4_4_vs_top2_4096" and lines[0]["strata"] == [4, 4]
    assert 1.0 <= lines[0]["requested_capacity"] <= 2.0  # FFN passes per token, one per stratum at most


@pytest.mark.slow
def test_backbone_benchmark_compares_the_tiny_shape():
    lines = run_benchmark("benchmarks/backbone.py", "--shapes", "tiny", "--rounds", "1")
    models = {line["model"] for line in lines if "model" in line}
    assert {"dense", "xmoe", "mhmoe_h4"} <= models
    comparisons = [line["comparison"] for line in lines if "comparison" in line]
    assert "tiny: xmoe step / dense step" in comparisons
