"""``scripts/demo_ablation.py``: one benchmark of the demo fine-tuned from a backbone file with option overrides,
predicted and scored."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

from mmoe.model import MultiwayConfig, MultiwayTransformer
from mmoe.runtime.checkpoint import export_backbone

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "demo_ablation.py"


def test_an_ablation_fine_tunes_with_its_options_and_writes_the_official_scores(tmp_path, synthetic_corpus):
    backbone = tmp_path / "backbone.pt"
    export_backbone(MultiwayTransformer(MultiwayConfig.preset("test", image_size=64, patch_size=16)), backbone)
    options = {"model": {"init_args": {"optimizer": {"learning_rate": 1e-3}}}, "data": {"init_args": {"batch_size": 4}}}
    out = tmp_path / "run"
    command = [sys.executable, str(SCRIPT), "vqav2", str(backbone), str(out), "--corpus", str(synthetic_corpus)]
    done = subprocess.run([*command, "--steps", "2", "--set", json.dumps(options)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((out / "result.json").read_text())
    assert result["steps"] == 2 and result["set"] == options and 0 <= result["scores"]["overall"] <= 100
    hparams = (out / "vqav2" / "csv" / "version_0" / "hparams.yaml").read_text()
    assert "learning_rate: 0.001" in hparams  # the option reached the fit
    assert json.loads((out / "vqav2" / "val_results.json").read_text())  # one answer per val question, scored


def test_the_cls_spread_script_measures_images_and_questions_apart(tmp_path, synthetic_corpus):
    backbone = tmp_path / "backbone.pt"
    export_backbone(MultiwayTransformer(MultiwayConfig.preset("test", image_size=64, patch_size=16)), backbone)
    script = SCRIPT.parent / "vqa_cls_spread.py"
    command = [sys.executable, str(script), str(backbone), "--corpus", str(synthetic_corpus), "--steps", "2"]
    done = subprocess.run([*command, "--prior-bias", "--batch-size", "8"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    records = [json.loads(line) for line in done.stdout.splitlines()]
    assert [record["step"] for record in records] == [0, 2] and "loss" in records[0] and "loss" not in records[1]
    # At random init both the images and the questions move the CLS.
    assert records[0]["over_images"] > 0 and records[0]["over_questions"] > 0
    assert records[0]["loss"] < 2 * math.log(2) * 8  # prior-biased start: far below K * ln 2 (K answers at 0.5)
