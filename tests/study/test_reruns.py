"""Several runs under one plan read by the rerun rule (:mod:`mmoe.study.reruns`), and the decision code's commit as a
report records it (:func:`mmoe.study.provenance.decision_code`): in a git checkout, with uncommitted changes, and
outside any checkout."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from mmoe.study.plan import PlanError
from mmoe.study.provenance import decision_code, decision_code_text
from mmoe.study.reruns import read_reruns, rerun_reading
from mmoe.study.run_statistics import run_verdict


def _decision(pretrained: list[float], random_init: list[float]) -> dict:
    gap = run_verdict(pretrained, random_init, +1, None) | {"task": "vqav2"}
    return {"id": "pretraining", "verdict": gap["verdict"], "gaps": [gap]}


def test_runs_that_agree_read_as_their_verdict():
    runs = [_decision([5.0, 5.2, 4.9], [1.0, 1.1, 0.9]), _decision([5.1, 5.0, 5.2], [1.2, 0.8, 1.0])]
    assert {run["verdict"] for run in runs} == {"reproduces"}
    assert rerun_reading(runs, {"vqav2": " points"}) == "reproduces"


def test_runs_that_differ_read_as_the_gap_s_direction_size_and_separated_runs():
    """One run separated, one not, the same sign: the mean gap, how many runs separate it and each run's p."""
    runs = [
        _decision([51.7, 55.5, 56.2], [50.8, 50.9, 49.0]),
        _decision([53.7, 54.0, 53.9], [50.2, 50.4, 48.8]),
        _decision([53.0, 54.1, 53.6], [50.0, 50.6, 49.1]),
    ]
    verdicts = [run["verdict"] for run in runs]
    assert verdicts.count("reproduces") == 2 and "not separated" in verdicts
    p_values = ", ".join(f"{run['gaps'][0]['welch']['p_value']:.2g}" for run in runs)
    size = sum(run["gaps"][0]["welch"]["difference"] for run in runs) / 3
    expected = f"ahead by about {size:.1g} points in all three runs, separated in two of three (p {p_values})"
    assert rerun_reading(runs, {"vqav2": " points"}) == f"vqav2: {expected}"


def test_runs_whose_gaps_disagree_in_sign_say_so():
    runs = [_decision([5.0, 5.2, 4.9], [1.0, 1.1, 0.9]), _decision([1.0, 1.1, 0.9], [5.0, 5.2, 4.9])]
    assert rerun_reading(runs, {}).startswith("vqav2: the runs' differences disagree in sign, separated in one of two")


def _reruns(folder: Path, **fields) -> None:
    (folder / "m.json").write_text("{}")
    value = {
        "plan_sha256": "a" * 64,
        "rule": {"written": "2026-12-07", "text": "every run is reported"},
        "runs": [{"label": "r1", "date": "2026-12-05", "measures": "m.json", "note": "alone"}],
    } | fields
    (folder / "reruns.json").write_text(json.dumps(value))


def test_a_rerun_file_is_read_and_refused_naming_its_field(tmp_path):
    assert read_reruns(tmp_path) is None  # a study's own folder: no runs beside it
    _reruns(tmp_path)
    reruns = read_reruns(tmp_path)
    assert [run.measures for run in reruns.runs] == [tmp_path / "m.json"] and len(reruns.rule_sha256) == 64
    _reruns(tmp_path, runs=[{"label": "r1", "date": "2026-12-05", "measures": "gone.json", "note": "alone"}])
    with pytest.raises(PlanError, match=r"runs\[0\]: field 'measures' names 'gone.json'"):
        read_reruns(tmp_path)
    _reruns(tmp_path, rule={"written": "2026-12-07"})
    with pytest.raises(PlanError, match="missing field 'text'"):
        read_reruns(tmp_path)


def _git(root: Path, *args: str) -> None:
    subprocess.run(["git", "-C", str(root), *args], check=True, capture_output=True)


def test_the_decision_code_is_the_checkout_s_commit_with_its_uncommitted_files(tmp_path):
    _git(tmp_path, "init", "-q")
    (tmp_path / "mmoe").mkdir()
    (tmp_path / "mmoe" / "decide.py").write_text("RULE = 1\n")
    _git(tmp_path, "add", ".")
    _git(tmp_path, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "code")
    head = subprocess.run(["git", "-C", str(tmp_path), "rev-parse", "HEAD"], capture_output=True, text=True).stdout
    assert decision_code(tmp_path) == {"commit": head.strip(), "uncommitted": []}
    (tmp_path / "mmoe" / "decide.py").write_text("RULE = 2\n")
    code = decision_code(tmp_path)
    assert code == {"commit": head.strip(), "uncommitted": ["mmoe/decide.py"]}
    assert decision_code_text(code).endswith("with uncommitted changes to mmoe/decide.py")


def test_outside_a_git_checkout_the_report_says_no_commit_is_known(tmp_path):
    """An installed mmoe (here: a folder inside no checkout, or a sub-folder of another project's) records no commit
    and says why, never the commit of a repository it merely lies in."""
    code = decision_code(tmp_path)
    assert code["commit"] is None and code["why"].startswith("not a git checkout")
    _git(tmp_path, "init", "-q")
    (tmp_path / "site").mkdir()
    assert decision_code(tmp_path / "site")["commit"] is None
    assert "no known commit" in decision_code_text(code)
