"""What a claims report says about where it comes from: the run's facts (trainings, minutes, bytes, versions), the
commit of the code that decided its verdicts, each stage's plan hash, and the header that states them."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from mmoe.pipeline.layout import RANDOM_INIT
from mmoe.study.plan import StudyPlan
from mmoe.study.plan_runs import PLAN_FIELD

#: The repository root of this checkout of mmoe (a git work tree when mmoe runs from its sources).
SOURCE_ROOT = Path(__file__).resolve().parents[2]


def run_facts(out: Path, records: dict, seconds: float) -> dict:
    """What the run took, for the report: trainings, seconds in all stages and this run, bytes on disk, versions."""
    import platform
    from importlib.metadata import version

    # a random init's stage draws weights, it trains nothing
    trainings = [
        key
        for key in records
        if key.parts[0] in ("pretrain", "finetune")
        and len(key.parts) in (2, 3)
        and key.parts[-1] not in ("export", "eval")
        and not (key.parts[0] == "pretrain" and RANDOM_INIT in key.parts[-1])
    ]
    return {
        "trainings": len(trainings),
        "stage_seconds": sum(record["seconds"] for record in records.values()),
        "seconds_this_run": seconds,
        "disk_bytes": sum(path.stat().st_size for path in out.rglob("*") if path.is_file()),
        "machine": f"{os.cpu_count()} CPU cores" + (", a CUDA GPU" if torch_cuda() else ""),
        "versions": {name: version(name) for name in ("torch", "lightning")} | {"python": platform.python_version()},
    }


def torch_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _git(root: Path, *args: str) -> str | None:
    try:
        done = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout if done.returncode == 0 else None


def decision_code(root: Path = SOURCE_ROOT) -> dict:
    """The code that decides the verdicts, as the report records it when written: ``commit`` (git's HEAD of the
    checkout mmoe runs from) and ``uncommitted`` (the files under ``mmoe/`` that differ from it); where mmoe does not
    run from a git checkout (an installed wheel), ``commit`` is None and ``why`` says so, with the package's version."""
    top = _git(root, "rev-parse", "--show-toplevel")
    commit = _git(root, "rev-parse", "HEAD")
    if top is None or commit is None or Path(top.strip()).resolve() != root.resolve():
        from importlib.metadata import version

        return {"commit": None, "why": f"not a git checkout: mmoe {version('mmoe')} from {root}", "uncommitted": []}
    status = _git(root, "status", "--porcelain", "--", "mmoe") or ""
    return {"commit": commit.strip(), "uncommitted": sorted(line[3:] for line in status.splitlines())}


def decision_code_text(code: dict) -> str:
    """The decision code's commit in words, uncommitted changes or the missing checkout said plainly."""
    if code["commit"] is None:
        return f"decided by code of no known commit ({code['why']})"
    changed = f", with uncommitted changes to {', '.join(code['uncommitted'])}" if code["uncommitted"] else ""
    return f"decided by the code of commit `{code['commit']}`{changed}"


def stage_plans(records: dict) -> dict[str, str | None]:
    """Each stage's plan hash as its marker recorded it (``run_stage``'s records by stage key), for the report."""
    return {"/".join(key.parts): (record.get("result") or {}).get(PLAN_FIELD) for key, record in records.items()}


def stage_plans_text(plans: dict | None, digest: str) -> str:
    """Where the per-stage plan records are: in ``report.json`` (how many name the plan), or not kept."""
    if plans is None:
        return "its stages' plan records were not kept with this report (the run was made before reports held them)"
    same = sum(value == digest for value in plans.values())
    return f"{same} of its {len(plans)} stages recorded it (`stage_plans` in `report.json`)"


def report_header(command: str, facts: dict, plan: StudyPlan, digest: str, provenance: dict) -> str:
    """The report's first paragraph: the command, what it took, the plan's hash (of its canonical JSON), the decision
    code's commit, the stages' plan records, runs per arm and every interval's unit. ``provenance``: the report's
    ``decision_code`` and ``stage_plans``."""
    runs = ", ".join(f"{claim.id} {claim.runs_text()}" for claim in plan.claims)
    return (
        f"# Claims of the X-MoE, MH-MoE and Stratified MoE papers, measured by mmoe\n\nMade by `{command}`: "
        f"{facts['trainings']} trainings, {facts['stage_seconds'] / 60:.1f} min in its stages on "
        f"{facts['machine']}, {facts['disk_bytes'] / 1e9:.1f} GB written; torch {facts['versions']['torch']}, "
        f"Lightning {facts['versions']['lightning']}. Plan `{digest}` (SHA-256 of the plan's canonical JSON: "
        "`plan.json` read, its keys sorted, compact separators; `mmoe.study.plan.plan_hash`), fixed before the runs; "
        f"{stage_plans_text(provenance['stage_plans'], digest)}. Verdicts "
        f"{decision_code_text(provenance['decision_code'])} (the plan's hash does not cover the decision code). "
        f"Runs per arm: {runs}. Tiny scale on the synthetic world. **The unit is the "
        "training run:** a claim is decided over independent runs per arm (Welch's t interval over runs, 95%; Holm's "
        "correction over a claim's gaps where the plan says so; the smallest effect the runs can detect at power 0.8 "
        "beside it), and a claim with 1 run per arm is not decided. The within-run intervals (95% bootstrap over "
        "held-out batches, images, router-input rows or fine-tuning windows of one run; Student-t over seeds for the "
        "task scores) are shown as secondary terms with the verdicts of `mmoe.study.verdicts`: reproduces / opposite "
        "(the interval on one side of zero), not separated (across zero), saturated (at a ceiling), uninformative (at "
        "the no-learning level), descriptive (claim 5's two fine-tuning windows: no verdict; labelled so after the "
        "runs, the reading of earlier reports beside it). Every number below is "
        "recomputed from `analysis/measures.json` by `mmoe.study.command.claims_from` and "
        "`mmoe.study.decisions.run_decisions`."
    )
