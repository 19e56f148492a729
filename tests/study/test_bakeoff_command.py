"""``mmoe study routers`` through the real command in a subprocess: a bad plan file, a plan edited after it was
fixed and a work folder made under another plan are refused in one line with exit 2; a dry run writes the plan
with its hash and prints the runs and the estimated cost, training nothing; the fast preset runs end to end in two
lanes, its report generated from the results files, and a re-run reuses every stage."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mmoe.cli import main
from mmoe.study.bakeoff_plan import design, read_plan_file, write_plan_file
from mmoe.study.bakeoff_presets import PRESETS
from mmoe.study.bakeoff_routers import ROUTERS
from mmoe.study.plan_runs import PLAN_FIELD

ROOT = Path(__file__).resolve().parents[2]


def _study(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    environment = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    command = [sys.executable, "-m", "mmoe.cli", "study", "routers", *args]
    return subprocess.run(command, cwd=cwd, env=environment, capture_output=True, text=True, timeout=600)


def _refused(done: subprocess.CompletedProcess, *words: str) -> None:
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("mmoe study routers: error: "), done.stderr
    assert all(word in lines[0] for word in words), lines[0]


def test_a_dry_run_fixes_the_plan_and_prints_the_runs_and_their_cost(tmp_path, capsys):
    plan = tmp_path / "plan.json"
    options = ["--plan", str(plan), "--out", str(tmp_path / "out"), "--scale", "fast", "--dry-run"]
    assert main(["study", "routers", *options]) == 0
    fixed, digest = read_plan_file(plan)
    printed = capsys.readouterr().out
    runs = 2 * 3 * len(ROUTERS)  # a pre-training and a VQA fine-tuning per router and seed
    assert f"plan {digest}" in printed and f"estimated cost: {runs} trainings" in printed and fixed.preset == "fast"
    assert all(f"{router.name}-seed2" in printed for router in ROUTERS) and not (tmp_path / "out").exists()
    stored = json.loads(plan.read_text())
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(stored | {"plan": stored["plan"] | {"seeds": [0, 1]}}))
    assert main(["study", "routers", "--plan", str(bad), "--out", str(tmp_path / "out")]) == 2
    error = capsys.readouterr().err.strip()
    assert "\n" not in error and "plan.seeds is [0, 1]" in error and str(bad) in error
    assert main(["study", "routers", "--plan", str(plan), "--scale", "cpu", "--dry-run"]) == 2
    assert "preset is 'fast', but --scale cpu" in capsys.readouterr().err
    assert main(["study", "routers", "--plan", str(plan), "--dry-run", "--jobs", "2"]) == 0
    assert f"plan {digest}" in capsys.readouterr().out


def test_an_edited_plan_and_a_folder_of_another_plan_are_refused_by_the_command(tmp_path):
    plan = tmp_path / "plan.json"
    digest = write_plan_file(design(PRESETS["fast"]), plan)
    stored = json.loads(plan.read_text())
    edited = tmp_path / "edited.json"
    edited.write_text(json.dumps(stored | {"plan": stored["plan"] | {"flops_tolerance": 0.5}}))
    _refused(_study("--plan", str(edited), "--out", str(tmp_path / "out"), cwd=tmp_path), str(edited), "sha256")
    out = tmp_path / "other"  # a folder whose stages ran under another plan
    (out / "stages").mkdir(parents=True)
    (out / "stages" / "corpus.json").write_text(json.dumps({"result": {PLAN_FIELD: "f" * 64}, "seconds": 1}))
    _refused(_study("--plan", str(plan), "--out", str(out), cwd=tmp_path), "corpus.json", "f" * 64, digest)
    assert not (tmp_path / "out").exists() and not (out / "plan.json").exists()


@pytest.mark.slow
def test_the_fast_preset_runs_end_to_end_in_two_lanes_and_resumes(tmp_path):
    """Four of the routers (the dense baseline, Switch, top-2 and an adaptive one, top-p) keep the test short; the
    other presets' plans are checked by tests/study/test_bakeoff_plan.py."""
    plan, out = tmp_path / "plan.json", tmp_path / "out"
    presets = tuple(router for router in ROUTERS if router.name in ("dense", "switch", "top2", "top_p"))
    write_plan_file(design(PRESETS["fast"], presets=presets), plan)
    # --out relative to the working folder, as a user types it (the VQA predictions once looked for their shards
    # under the data root twice)
    done = _study("--plan", str(plan), "--out", "out", "--scale", "fast", "--jobs", "2", cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    fixed, digest = read_plan_file(plan)
    results = sorted((out / "results").glob("*.json"))
    assert len(results) == len(fixed.routers) * len(fixed.seeds)
    switch = json.loads((out / "results" / "switch-seed1.json").read_text())["values"]
    dense = json.loads((out / "results" / "dense-seed1.json").read_text())["values"]
    assert switch["experts_vision"] == pytest.approx(1.0) and switch["experts_language"] == pytest.approx(1.0)
    assert dense["experts_vision"] is None and dense["load_cv_vision"] is None
    assert all(dense[name] is not None for name in ("mim_loss", "mlm_loss", "i2t_r1", "color_acc", "vqa"))
    report = json.loads((out / "report.json").read_text())
    assert report["plan"]["sha256"] == digest
    top2 = report["routers"]["top2"]["measures"]
    assert top2["experts_language"]["mean"] == pytest.approx(2.0) and len(top2["vqa"]["values"]) == 3
    decided = {(row["router"], row["measure"]) for row in report["decisions"]}
    assert ("top_p", "vqa") in decided and ("top2", "load_cv_vision") in decided
    top_p = report["routers"]["top_p"]["measures"]
    assert all(0 < value < 16 for value in top_p["experts_language"]["values"])  # counted from the records
    markdown = (out / "report.md").read_text()
    assert digest in markdown and "| top2 |" in markdown
    markers = [json.loads(path.read_text()) for path in (out / "stages").glob("*.json")]
    assert {marker["result"][PLAN_FIELD] for marker in markers} == {digest}
    again = _study("--plan", str(plan), "--out", str(out), cwd=tmp_path)
    assert again.returncode == 0 and again.stdout.count("reused") == len(markers), again.stdout[-2000:]
