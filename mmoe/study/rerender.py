"""``mmoe study report FOLDER``: a claims report written again from its own files, without training: the run's facts,
settings and plan from ``FOLDER/report.json``, the measures from ``FOLDER/measures.json`` (a shipped report) or
``FOLDER/analysis/measures.json`` (a study's folder), each claim judged and decided by today's code under that plan,
beside the other runs under the same plan where ``FOLDER/reruns.json`` names them (:mod:`mmoe.study.reruns`).
``docs/claims.md`` is written so: ``mmoe study report docs/claims --markdown docs/claims.md``."""

from __future__ import annotations

import shlex
from pathlib import Path

from mmoe.io import read_json, require_field
from mmoe.study.decisions import run_decisions
from mmoe.study.judged import claims_from, rule_change_verdicts
from mmoe.study.plan import PlanError, plan_from_json, plan_hash
from mmoe.study.provenance import decision_code, report_header
from mmoe.study.report import REPORT_FILE, write_report
from mmoe.study.reruns import read_reruns, reruns_report
from mmoe.study.routers import router_rows
from mmoe.study.runs import MEASURES_FILE, Measures


def measures_file(folder: Path) -> Path:
    """The measures beside a report: ``measures.json`` of a shipped report, else the study's analysis file."""
    shipped = folder / MEASURES_FILE
    return shipped if shipped.is_file() else folder / "analysis" / MEASURES_FILE


def _read_measures(path: Path) -> Measures:
    return Measures.from_json(read_json(path, "study measures", PlanError))


def rerender(folder: Path, markdown_path: Path | None = None) -> dict:
    """``folder``'s report written again from its files (``report.json``, figures, the Markdown at
    ``markdown_path``, ``folder/report.md`` by default); PlanError (one line naming the file and field) where the
    report's plan does not hash to the hash it records or ``reruns.json`` names another plan."""
    where = str(folder / REPORT_FILE)
    stored = read_json(folder / REPORT_FILE, "claims report", PlanError)
    recorded = require_field(stored, "plan", dict, where, PlanError)
    plan = plan_from_json({key: value for key, value in recorded.items() if key != "sha256"}, f"{where}, plan")
    digest = plan_hash(plan)
    if recorded.get("sha256") != digest:
        raise PlanError(f"{where}: field 'plan.sha256' is {recorded.get('sha256')!r}, its plan hashes to {digest}")
    path = measures_file(folder)
    measures = _read_measures(path)
    claims = claims_from(measures, plan)
    decisions = run_decisions(claims, plan, measures)
    reruns = read_reruns(folder)
    runs_json = None
    if reruns is not None:
        if reruns.plan_sha256 != digest:
            raise PlanError(
                f"{folder / 'reruns.json'}: field 'plan_sha256' is {reruns.plan_sha256}, the report's {digest}"
            )
        results = []
        for run in reruns.runs:
            run_measures = measures if run.measures.resolve() == path.resolve() else _read_measures(run.measures)
            run_claims = claims_from(run_measures, plan)
            results.append((run_claims, run_decisions(run_claims, plan, run_measures)))
        runs_json = reruns_report(reruns, results)
    provenance = {"decision_code": decision_code(), "stage_plans": stored.get("stage_plans")}
    command = require_field(stored, "command", str, where, PlanError)
    facts = require_field(stored, "run", dict, where, PlanError)
    settings = require_field(stored, "settings", dict, where, PlanError)
    again = shlex.join(
        ["mmoe", "study", "report", str(folder)] + ([] if markdown_path is None else ["--markdown", str(markdown_path)])
    )
    header = report_header(command, facts, plan, digest, provenance) + f" Written from its files by `{again}`."
    extra = {"command": command, "settings": settings, "run": facts, "plan": recorded} | provenance
    routers = router_rows(measures.router_variants, tuple(settings.get("router_variants", ())))
    return write_report(
        claims,
        folder,
        header,
        extra | {"written_by": again},
        measures.chance,
        stored.get("claim_settings") or {},
        routers,
        decisions,
        rule_change_verdicts(measures, plan, decisions),
        runs_json,
        markdown_path,
    )
