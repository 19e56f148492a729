"""The shipped claims report (``docs/claims/report.json``) is what today's code computes from the shipped measures
(``docs/claims/measures.json``, the run's ``analysis/measures.json``) under the shipped plan: every claim, decision,
rule change, router row and chance level, each number within 1e-9 of the shipped one; the runs under the same plan
(``reruns.json``) are each recomputed from their own measures; ``docs/claims.md`` is what ``mmoe study report``
writes from those files; the report names the commit of the code that decided it; and the plan's hash is the one
the report, ``plan.json``, ``reruns.json`` and the default settings share."""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

from mmoe.study.command import claims_from, rule_change_verdicts
from mmoe.study.decisions import no_unit_reason, run_decisions
from mmoe.study.plan import plan_from_json, plan_hash, read_plan
from mmoe.study.plan_design import study_plan
from mmoe.study.reruns import read_reruns, reruns_report
from mmoe.study.routers import router_rows
from mmoe.study.runs import Measures
from mmoe.study.settings import DEFAULT

REPO = Path(__file__).resolve().parents[2]
DOCS = REPO / "docs" / "claims"
#: The default plan's SHA-256, as ``docs/claims.md`` and ``plan.md`` print it.
PLAN_SHA256 = "e71dac89b9d6cf8450dc1dccf4fefc82817e7bdedd692a6b99267ab5db505bd5"


def differences(got: Any, shipped: Any, path: str = "") -> list[str]:
    """Where ``got`` differs from ``shipped``: structure, strings, integers and booleans exactly, floats beyond 1e-9
    relative (absolute near zero)."""
    if isinstance(shipped, dict):
        if not isinstance(got, dict) or got.keys() != shipped.keys():
            return [f"{path}: keys {sorted(got) if isinstance(got, dict) else got} != {sorted(shipped)}"]
        return [d for key in shipped for d in differences(got[key], shipped[key], f"{path}.{key}")]
    if isinstance(shipped, list):
        if not isinstance(got, list) or len(got) != len(shipped):
            return [f"{path}: {got} != {shipped}"]
        return [d for i, (a, b) in enumerate(zip(got, shipped, strict=True)) for d in differences(a, b, f"{path}[{i}]")]
    if isinstance(shipped, float) and isinstance(got, float):
        return [] if math.isclose(got, shipped, rel_tol=1e-9, abs_tol=1e-12) else [f"{path}: {got} != {shipped}"]
    return [] if type(got) is type(shipped) and got == shipped else [f"{path}: {got!r} != {shipped!r}"]


def float_count(value: Any) -> int:
    if isinstance(value, dict):
        return sum(float_count(item) for item in value.values())
    if isinstance(value, list):
        return sum(float_count(item) for item in value)
    return isinstance(value, float)


def test_the_shipped_report_is_recomputed_from_the_shipped_measures():
    report = json.loads((DOCS / "report.json").read_text())
    measures = Measures.from_json(json.loads((DOCS / "measures.json").read_text()))
    stored = {key: value for key, value in report["plan"].items() if key != "sha256"}
    plan = plan_from_json(stored, "report.json's plan")
    claims = claims_from(measures, plan)
    decisions = run_decisions(claims, plan, measures)
    got = {
        "claims": [claim.to_json() for claim in claims],
        "decisions": decisions,
        "rule_changes": rule_change_verdicts(measures, plan, decisions),
        "routers": router_rows(measures.router_variants, tuple(report["settings"]["router_variants"])),
        "chance": measures.chance,
    }
    got = json.loads(json.dumps(got))  # as the report writes them: tuples as lists, keys as strings
    assert differences(got, {key: report[key] for key in got}) == []
    assert float_count(got) > 500  # the check reached the numbers, not only empty lists


def test_the_plan_s_hash_is_unchanged():
    report = json.loads((DOCS / "report.json").read_text())
    assert report["plan"]["sha256"] == PLAN_SHA256
    assert plan_hash(read_plan(DOCS / "plan.json")) == PLAN_SHA256
    assert plan_hash(study_plan(DEFAULT, "default")) == PLAN_SHA256
    assert PLAN_SHA256 in (DOCS / "plan.md").read_text()


def test_the_plan_s_hash_is_that_of_its_canonical_json_and_the_rerun_rule_names_it():
    """The header says what the hash is of (the canonical JSON, not the file's bytes, which hash otherwise); the rerun
    rule lives beside the plan, naming it by that hash, so the shipped runs stay the plan's."""
    import hashlib

    header = (REPO / "docs" / "claims.md").read_text().split("\n\n")[1]
    assert f"Plan `{PLAN_SHA256}` (SHA-256 of the plan's canonical JSON" in header
    assert hashlib.sha256((DOCS / "plan.json").read_bytes()).hexdigest() != PLAN_SHA256
    assert json.loads((DOCS / "reruns.json").read_text())["plan_sha256"] == PLAN_SHA256


def test_the_report_names_the_commit_of_the_code_that_decided_it():
    report = json.loads((DOCS / "report.json").read_text())
    code = report["decision_code"]
    assert re.fullmatch("[0-9a-f]{40}", code["commit"]) and code["uncommitted"] == []
    assert f"decided by the code of commit `{code['commit']}`" in (REPO / "docs" / "claims.md").read_text()
    git = subprocess.run(["git", "-C", str(REPO), "cat-file", "-t", code["commit"]], capture_output=True, text=True)
    if git.returncode == 0 or (REPO / ".git").exists():  # a checkout holds the commit; an unpacked sdist has no git
        assert git.stdout.strip() == "commit"
    # the shipped runs were made before reports kept the stages' plan records: said so, not claimed
    assert report["stage_plans"] is None and "plan records were not kept" in (REPO / "docs" / "claims.md").read_text()


def test_the_runs_under_the_plan_are_recomputed_from_their_own_measures():
    """Each run ``reruns.json`` names is judged again from its measures under the shipped plan, and the report's
    ``reruns`` (every run's decision per claim and the rule's reading) is what that gives."""
    report = json.loads((DOCS / "report.json").read_text())
    plan = read_plan(DOCS / "plan.json")
    reruns = read_reruns(DOCS)
    assert [run.label for run in reruns.runs] == ["fd60423", "80f5ee9"] and reruns.runs[
        -1
    ].measures == DOCS / "measures.json"
    results = []
    for run in reruns.runs:
        measures = Measures.from_json(json.loads(run.measures.read_text()))
        claims = claims_from(measures, plan)
        results.append((claims, run_decisions(claims, plan, measures)))
    got = json.loads(json.dumps(reruns_report(reruns, results)))
    assert differences(got, report["reruns"]) == []
    # claim 7: both runs shown, read as what the two support, not as the later run's verdict
    pretraining = report["reruns"]["claims"]["pretraining"]
    verdicts = [decisions[[d["id"] for d in decisions].index("pretraining")]["verdict"] for _, decisions in results]
    assert verdicts == ["not separated", "reproduces"]
    assert pretraining["reading"].startswith("vqav2: ahead by about 4 points in both runs, separated in one of two")
    markdown = (REPO / "docs" / "claims.md").read_text()
    row = next(line for line in markdown.splitlines() if line.startswith("| 7 |"))
    assert row.endswith(f"| {pretraining['reading']} (this run: reproduces) |")
    for run in reruns.runs:
        assert f"| {run.label} | vqav2 |" in markdown


def test_claim_1_is_read_as_its_two_statements_and_claim_9_by_the_plan_s_reason():
    report = json.loads((DOCS / "report.json").read_text())
    by_id = {decision["id"]: decision for decision in report["decisions"]}
    activation = by_id["activation"]
    markdown = (REPO / "docs" / "claims.md").read_text().splitlines()
    for position, (letter, part) in enumerate(zip("ab", activation["parts"], strict=True)):
        for name, verdict in part["modalities"].items():
            assert activation["by_modality"][name]["gaps"][position]["verdict"] == verdict
        cells = "; ".join(f"{name}: {verdict}" for name, verdict in part["modalities"].items())
        row = next(line for line in markdown if line.startswith(f"| 1{letter} | {part['title']} |"))
        assert row.endswith(f"| {cells} |")
    assert [set(part["modalities"].values()) for part in activation["parts"]] == [{"reproduces"}, {"not separated"}]
    plan = read_plan(DOCS / "plan.json")
    assert (
        by_id["frequency"]["verdict"]
        == no_unit_reason(plan.claim("frequency"))
        == "undecidable on the synthetic corpus"
    )
    # claim 5's within-run term from two windows describes; it reads no verdict
    for claim in report["claims"]:
        if claim["id"].startswith("consistency"):
            assert {entry["verdict"] for entry in claim["measured"]["by_modality"].values()} == {
                "descriptive, no verdict"
            }


def test_docs_claims_md_is_what_the_report_command_writes_from_the_shipped_files(tmp_path):
    """``mmoe study report`` over a copy of ``docs/claims`` writes ``docs/claims.md`` and ``report.json`` again, equal
    but for the command's own paths and the commit the checkout is at."""
    folder = tmp_path / "claims"
    shutil.copytree(DOCS, folder)
    env = os.environ | {"PYTHONPATH": str(REPO)}
    command = [
        sys.executable,
        "-m",
        "mmoe.cli",
        "study",
        "report",
        str(folder),
        "--markdown",
        str(tmp_path / "claims.md"),
    ]
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr

    def normalised(text: str) -> str:
        text = re.sub(r"Verdicts decided by [^(]*\(", "Verdicts decided by (", text)
        return re.sub(r"Written from its files by `[^`]*`", "Written from its files", text)

    assert normalised((tmp_path / "claims.md").read_text()) == normalised((REPO / "docs" / "claims.md").read_text())
    written, shipped = (json.loads(path.read_text()) for path in (folder / "report.json", DOCS / "report.json"))
    keys = set(shipped) - {"decision_code", "written_by", "figures"}
    assert (
        set(written) == set(shipped) and differences({k: written[k] for k in keys}, {k: shipped[k] for k in keys}) == []
    )


def test_the_report_command_refuses_a_rerun_file_of_another_plan_in_one_line(tmp_path):
    folder = tmp_path / "claims"
    folder.mkdir()
    for name in ("report.json", "measures.json"):
        shutil.copy(DOCS / name, folder / name)
    reruns = json.loads((DOCS / "reruns.json").read_text())
    reruns["runs"] = reruns["runs"][-1:]
    (folder / "reruns.json").write_text(json.dumps(reruns | {"plan_sha256": "0" * 64}))
    env = os.environ | {"PYTHONPATH": str(REPO)}
    done = subprocess.run(
        [sys.executable, "-m", "mmoe.cli", "study", "report", str(folder)], capture_output=True, text=True, env=env
    )
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1
    assert "reruns.json" in done.stderr and "plan_sha256" in done.stderr and PLAN_SHA256 in done.stderr


def test_the_how_to_page_gives_claim_4_s_rate_against_random_from_the_shipped_report():
    """``docs/how-to/claims_study.md`` says how often claim 4's routers change expert against a random reassignment
    with their loads as the shipped report's numbers give it (each arm's mean over the mean of its random level)."""
    import numpy as np

    report = json.loads((DOCS / "report.json").read_text())
    fluctuation = next(d for d in report["decisions"] if d["id"] == "fluctuation")
    ratios = {
        name: [np.mean(entry["per_run"][arm]) / np.mean(entry["random_reassignment"][arm]) for arm in entry["per_run"]]
        for name, entry in fluctuation["by_modality"].items()
    }
    every = [ratio for values in ratios.values() for ratio in values]
    page = " ".join((REPO / "docs" / "how-to" / "claims_study.md").read_text().split())
    assert f"{min(every):.1f}–{max(every):.1f} times as often as a random reassignment" in page
    per_modality = ", ".join(f"{name} {min(v):.2f}–{max(v):.2f}" for name, v in ratios.items())
    assert per_modality in page
    assert "as often as a random reassignment once the rate" not in page
