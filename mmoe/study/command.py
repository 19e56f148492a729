"""``mmoe study claims``: its options, the runs, the measurements and the report; ``mmoe study report``: a report
written again from its files (:mod:`mmoe.study.rerender`)."""

from __future__ import annotations

import argparse
import dataclasses
import shlex
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from mmoe.io import capped_jobs, positive_int, read_json, report_error
from mmoe.pipeline.settings import refuse_other_settings, upgraded_settings
from mmoe.pipeline.stages import PipelineError, print_progress, quiet_lightning, run_stage
from mmoe.study.bakeoff_command import add_parser as add_bakeoff_parser
from mmoe.study.bakeoff_command import routers_command
from mmoe.study.claim_settings import claim_settings
from mmoe.study.decisions import run_decisions
from mmoe.study.judged import claims_from, rule_change_verdicts
from mmoe.study.lanes import run_in_lanes, study_stages
from mmoe.study.measure_runs import analysis_stage
from mmoe.study.plan import PlanError, plan_hash
from mmoe.study.plan_design import plan_markdown
from mmoe.study.plan_runs import check_runs_plan, plan_of_run, record_plan, refuse_other_plan, under_plan
from mmoe.study.provenance import decision_code, report_header, run_facts, stage_plans
from mmoe.study.report import write_report
from mmoe.study.rerender import rerender
from mmoe.study.routers import router_rows
from mmoe.study.runs import MEASURES_FILE, Measures, StudyRun, maps_stage, pretrainings
from mmoe.study.settings import CLAIM_IDS, PRESETS, ROUTER_VARIANTS, ROUTING_WINDOW, SCALES, StudySettings


def upgraded_study(stored: dict) -> dict:
    """Study settings as an older ``study.json`` stored them, in today's form (its training settings upgraded as a
    pipeline's; one from before the router table gets today's routers, whose runs a re-run adds; one from before
    the presets chose their claims ran every claim, one pre-training per task variant, the default's window)."""
    training = stored.get("training")
    stored = {"router_variants": list(ROUTER_VARIANTS)} | stored  # an older study adds the router runs
    stored = {"claims": list(CLAIM_IDS), "task_pretraining_seeds": 1, "routing_window": ROUTING_WINDOW} | stored
    return stored | ({"training": upgraded_settings(training)} if isinstance(training, dict) else {})


def parse(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="mmoe study",
        description="Train, at tiny scale on the synthetic world, what the papers' analysis sections compare, and "
        "write one report (Markdown, PNG, JSON) that states each claim, mmoe's measurement and whether it reproduces.",
    )
    sub = parser.add_subparsers(dest="study", required=True)
    claims = sub.add_parser("claims", help="the X-MoE and MH-MoE analysis claims")
    claims.add_argument("--out", default="runs/claims", help="output directory (default runs/claims)")
    size = claims.add_mutually_exclusive_group()
    size.add_argument("--fast", action="store_true", help="a few steps of a narrower model (for tests)")
    size.add_argument(
        "--scale",
        choices=SCALES,
        default=None,
        help="gpu: claims 2, 4 and 7 with 8 runs per arm, for one GPU loan (docs/claims/plan_gpu.md); gpu-tasks: the "
        "task order (claim 6) over 3 pre-training seeds per variant, for a longer loan (docs/claims/plan_gpu_tasks.md)",
    )
    claims.add_argument(
        "--dry-run",
        action="store_true",
        help="print the plan (arms, runs per arm, steps, rules) and its estimated cost; run nothing",
    )
    claims.add_argument(
        "--plan",
        type=Path,
        default=None,
        help="the plan file whose rules judge the claims (default: the design of the chosen settings; "
        "docs/claims/plan.json is the default settings')",
    )
    claims.add_argument(
        "--jobs",
        type=positive_int,
        default=1,
        help="trainings run at once, each in a process of a pool (default 1; about 8 on a GPU, 2 at most on a "
        "2-core CPU)",
    )
    claims.add_argument(
        "--precision",
        choices=("32-true", "bf16-mixed"),
        default=None,
        help="Lightning precision of every stage (default 32-true; bf16-mixed with --scale gpu)",
    )
    add_bakeoff_parser(sub)
    report = sub.add_parser("report", help="write a claims report again from its files, training nothing")
    report.add_argument("folder", type=Path, help="the report's folder: report.json and measures.json (docs/claims)")
    report.add_argument("--markdown", type=Path, default=None, help="where the Markdown goes (FOLDER/report.md)")
    return parser.parse_args(list(argv))


def chosen_settings(args: argparse.Namespace) -> tuple[str, StudySettings]:
    """The preset the options name (``default``, ``fast`` or a ``--scale``) and its settings at ``--precision``."""
    preset = args.scale or ("fast" if args.fast else "default")
    settings = PRESETS[preset]
    if args.precision is not None:
        settings = dataclasses.replace(
            settings, training=dataclasses.replace(settings.training, precision=args.precision)
        )
    return preset, settings


def study_command(argv: Sequence[str]) -> int:
    """Runs ``mmoe study claims``; 0, 1 when a stage fails (the message names it), 2 for a bad plan file or runs made
    under another plan (one line naming both plans' hashes)."""
    args = parse(argv)
    if args.study == "report":
        return report_command(args.folder, args.markdown)
    if args.study == "routers":
        return routers_command(args, list(argv))
    args.jobs = capped_jobs(args.jobs, "study")
    preset, settings = chosen_settings(args)
    if args.dry_run:
        return dry_run(settings, preset, args.plan)
    study = StudyRun(Path(args.out), settings.training)
    quiet_lightning()
    start = time.perf_counter()
    try:
        plan = plan_of_run(settings, preset, args.plan)
        hint = "use another --out, or that run's --fast / --scale gpu / --precision with the version that made it"
        refuse_other_settings(study.out / "study.json", settings.to_json(), "a claims study", hint, upgraded_study)
        refuse_other_plan(study.out, plan)
        record_plan(study.out, plan)
        runs = pretrainings(settings)
        if args.jobs > 1:
            run_in_lanes(study, settings, plan_hash(plan), args.jobs)
        stages = study_stages(study, settings)
        stages += [analysis_stage(study, settings, runs), maps_stage(study, settings, runs)]
        records = {stage.key: run_stage(study, under_plan(stage, plan_hash(plan))) for stage in stages}
        digest = check_runs_plan(records, plan)
    except PlanError as error:
        return report_error("study", error)
    except PipelineError as error:
        print(f"mmoe study: error: {error}", file=sys.stderr)
        return 1
    seconds = time.perf_counter() - start
    measures = Measures.from_json(read_json(study.analysis / MEASURES_FILE, "measures"))
    command = shlex.join(["mmoe", "study", *argv])
    facts = run_facts(study.out, records, seconds)
    claims = claims_from(measures, plan)
    decisions = run_decisions(claims, plan, measures)
    provenance = {"decision_code": decision_code(), "stage_plans": stage_plans(records)}
    report = write_report(
        claims,
        study.out,
        report_header(command, facts, plan, digest, provenance),
        {"command": command, "settings": settings.to_json(), "run": facts, "plan": {"sha256": digest} | plan.to_json()}
        | provenance,
        measures.chance,
        claim_settings(settings, preset),
        router_rows(measures.router_variants, settings.router_variants),
        decisions,
        rule_change_verdicts(measures, plan, decisions),
    )
    print_progress(
        f"\n{study.out / 'report.md'} ({seconds:.0f} s this run, {facts['stage_seconds']:.0f} s in all stages)"
    )
    for claim, decision in zip(report["claims"], decisions, strict=True):
        print_progress(f"  {decision['verdict']:>40}  {claim['title']}")  # the report's JSON form
    return 0


def report_command(folder: Path, markdown: Path | None) -> int:
    """``mmoe study report``: 0, or 2 with one line for a report whose files are not a report's."""
    try:
        report = rerender(folder, markdown)
    except PlanError as error:
        return report_error("study", error)
    print_progress(f"{markdown or folder / 'report.md'}: {len(report['claims'])} claims, written from {folder}")
    return 0


def dry_run(settings: StudySettings, preset: str, path: Path | None) -> int:
    """Prints the plan of ``preset`` (or the plan file ``path``, checked against the settings) with its estimated
    cost; runs and writes nothing. 0, or 2 for a bad plan file."""
    try:
        plan = plan_of_run(settings, preset, path)
    except PlanError as error:
        return report_error("study", error)
    print(plan_markdown(plan, settings), end="")
    return 0
