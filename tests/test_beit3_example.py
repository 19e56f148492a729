"""The end-to-end example from a released-layout BEiT-3 file to a MoE fine-tuning run (scripts/beit3_example.py)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from mmoe.runtime.checkpoint import load_backbone

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "beit3_example.py"


@pytest.mark.slow
def test_released_file_to_upcycled_fine_tuning_and_scores(tmp_path):
    pytest.importorskip("torchscale", reason="the example builds its stand-in BEiT-3 file with torchscale")
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--out", str(tmp_path / "run"), "--steps", "10"],
        capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads(done.stdout[done.stdout.index("{") :])
    assert 0.0 <= summary["vqa_val_accuracy"] <= 100.0 and summary["steps"] == 10
    assert all(Path(path).exists() for path in summary["files"])
    upcycled = load_backbone(tmp_path / "run" / "upcycled.pt")
    assert upcycled.config.moe is not None and upcycled.config.position_offset == 2
    assert upcycled.config.vocab_size == summary["tokenizer_pieces"] + 2 + 8
    assert len(json.loads((tmp_path / "run" / "val_results.json").read_text())) > 0


def test_the_example_script_imports():
    spec = importlib.util.spec_from_file_location("beit3_example", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.parse(["--steps", "5"]).steps == 5
