"""Several default runs under one plan, read together by the plan's rerun rule (``docs/claims/reruns.json``).

The rule was written after two runs of the default plan and before any later one. It lives in its own file, beside
the plan and not in it: the plan's hash is of its canonical JSON, and every stage of the shipped runs recorded that
hash, so a rule added inside ``plan.json`` would make those runs another plan's. ``reruns.json`` names the plan it
belongs to by that hash, the rule's text and date, and every run made under the plan, oldest first (each run's
``measures.json``, relative to the file). Each run is decided by today's code
(:func:`mmoe.study.decisions.run_decisions`); :func:`rerun_readings` applies the rule to their decisions.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from mmoe.io import read_json, require_field
from mmoe.study.decisions import short_verdict
from mmoe.study.plan import PlanError
from mmoe.study.verdicts import REPRODUCES

#: The file of the plan's rerun rule and of the runs made under the plan, in the report's folder.
RERUNS_FILE = "reruns.json"
_NUMBERS = {1: "one", 2: "two", 3: "three", 4: "four", 5: "five", 6: "six", 7: "seven", 8: "eight"}


@dataclass(frozen=True)
class Rerun:
    """One run made under the plan: ``label`` (the commit that shipped its report), ``date``, its ``measures``
    file and a ``note`` on how it ran."""

    label: str
    date: str
    measures: Path
    note: str


@dataclass(frozen=True)
class Reruns:
    """The plan's rerun rule (``rule``, written on ``written``; its SHA-256 ``rule_sha256``) and the runs made under
    the plan ``plan_sha256``, oldest first (the report's own run the last)."""

    plan_sha256: str
    written: str
    rule: str
    rule_sha256: str
    runs: tuple[Rerun, ...]


def read_reruns(folder: Path) -> Reruns | None:
    """``folder/reruns.json``, checked (PlanError naming the file and field); None where the folder has none."""
    path = folder / RERUNS_FILE
    if not path.is_file():
        return None
    where = str(path)
    value = read_json(path, "rerun rule", PlanError)
    rule = require_field(value, "rule", dict, where, PlanError)
    runs = require_field(value, "runs", list, where, PlanError)
    entries = []
    for index, run in enumerate(runs):
        at = f"{where}, runs[{index}]"
        fields = {name: require_field(run, name, str, at, PlanError) for name in ("label", "date", "measures", "note")}
        measures = folder / fields["measures"]
        if not measures.is_file():
            raise PlanError(f"{at}: field 'measures' names {fields['measures']!r}, not a file in {folder}")
        entries.append(Rerun(fields["label"], fields["date"], measures, fields["note"]))
    if len(entries) < 1:
        raise PlanError(f"{where}: field 'runs' must name at least the report's own run, got []")
    text = require_field(rule, "text", str, f"{where}, rule", PlanError)
    return Reruns(
        require_field(value, "plan_sha256", str, where, PlanError),
        require_field(rule, "written", str, f"{where}, rule", PlanError),
        text,
        hashlib.sha256(text.encode("utf-8")).hexdigest(),
        tuple(entries),
    )


def _count(n: int) -> str:
    return _NUMBERS.get(n, str(n))


def _gap_reading(gaps: list[dict], unit: str) -> str:
    """One gap decided in every run, read by the rule: its direction and size where every run's difference has the
    same sign, and in how many runs it is separated."""
    welch = [gap.get("welch") for gap in gaps]
    if None in welch:
        return "; ".join(gap["verdict"] for gap in gaps)
    differences = [w["difference"] for w in welch]
    separated = sum(gap["verdict"] == REPRODUCES for gap in gaps)
    p_values = ", ".join(f"{w['p_value']:.2g}" for w in welch)
    n = len(gaps)
    if len({np.sign(d) for d in differences}) > 1:
        return f"the runs' differences disagree in sign, separated in {_count(separated)} of {_count(n)} (p {p_values})"
    direction = "ahead" if differences[0] > 0 else "behind"
    every = "both" if n == 2 else f"all {_count(n)}"
    size = abs(float(np.mean(differences)))
    separated_in = f"separated in {_count(separated)} of {_count(n)}"
    return f"{direction} by about {size:.1g}{unit} in {every} runs, {separated_in} (p {p_values})"


def rerun_reading(decisions: list[dict], units: dict[str, str]) -> str:
    """One claim's decisions in every run under the plan (oldest first), read by the rule: the common verdict where
    every run gives the same; per gap, its direction, size and the runs where it is separated where the claim is
    decided by gaps; else each run's verdict, none preferred. ``units``: a gap's task -> its unit's words."""
    verdicts = [verdict_text(decision) for decision in decisions]
    if len(set(verdicts)) == 1:
        return verdicts[0]
    gapped = [decision.get("gaps") for decision in decisions]
    if all(gapped) and len({len(gaps) for gaps in gapped}) == 1:
        readings = []
        for gaps in zip(*gapped, strict=True):
            label = gaps[0].get("task", " - ".join(gaps[0].get("pair", [])))
            readings.append(f"{label}: {_gap_reading(list(gaps), units.get(label, ''))}")
        return "; ".join(readings)
    return "the runs differ: " + " / ".join(verdicts)


def verdict_text(decision: dict) -> str:
    """A decision's verdict in words: claim 1's per statement (1a, 1b) and modality, else :func:`short_verdict`."""
    parts = decision.get("parts")
    if not parts:
        return short_verdict(decision)
    return "; ".join(
        f"{part['title']}: " + ", ".join(f"{name} {verdict}" for name, verdict in part["modalities"].items())
        for part in parts
    )


def gap_cell(decision: dict) -> str:
    """One run's decision of a claim for the runs' table: its verdict and each gap's difference, interval and p."""
    gaps = [gap for gap in decision.get("gaps", []) if gap.get("welch")]
    details = [
        f"{gap.get('task', '')} {gap['welch']['difference']:+.3g} [{gap['welch']['interval'][0]:.3g}, "
        f"{gap['welch']['interval'][1]:.3g}], p {gap['welch']['p_value']:.2g}".strip()
        for gap in gaps
    ]
    return verdict_text(decision) + (f" ({'; '.join(details)})" if details else "")


def _units(claims: list) -> dict[str, str]:
    """A gap's task -> its unit's words (`` points`` for a score in percent)."""
    units = {}
    for claim in claims:
        for task, entry in (claim.measured.get("tasks") or {}).items():
            if isinstance(entry, dict) and "(%)" in str(entry.get("label", "")):
                units[task] = " points"
    return units


def reruns_report(reruns: Reruns, results: list[tuple[list, list[dict]]]) -> dict:
    """The runs under the plan as the report holds them (``report.json``'s ``reruns``): the rule with its date and
    hash, each run's label, date and note, and per claim each run's decision (:func:`gap_cell`) and the rule's
    reading over the runs; claim 7's per-backbone scores of each run. ``results``: per run of ``reruns.runs``, its
    claims and decisions."""
    by_run = [{decision["id"]: decision for decision in decisions} for _, decisions in results]
    units = _units(results[-1][0])
    claims = {
        claim_id: {
            "runs": [gap_cell(run[claim_id]) for run in by_run],
            "reading": rerun_reading([run[claim_id] for run in by_run], units),
        }
        for claim_id in by_run[-1]
        if all(claim_id in run for run in by_run)
    }
    scores = []
    for run, (run_claims, _) in zip(reruns.runs, results, strict=True):
        pretraining = next((claim for claim in run_claims if claim.id == "pretraining"), None)
        tasks = (pretraining.measured.get("tasks") or {}) if pretraining is not None else {}
        scores.append(
            {
                "label": run.label,
                "tasks": {
                    task: {arm: entry[arm]["values"] for arm in ("pretrained", "random_init")}
                    for task, entry in tasks.items()
                },
            }
        )
    return {
        "plan_sha256": reruns.plan_sha256,
        "rule": {"written": reruns.written, "text": reruns.rule, "sha256": reruns.rule_sha256},
        "runs": [{"label": run.label, "date": run.date, "note": run.note} for run in reruns.runs],
        "claims": claims,
        "pretraining_scores": scores,
    }
