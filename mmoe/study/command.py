"""``mmoe study claims``: its options, the runs, the measurements and the report."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import shlex
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from mmoe.io import capped_jobs, positive_int, read_json, report_error
from mmoe.pipeline.layout import RANDOM_INIT
from mmoe.pipeline.settings import refuse_other_settings, upgraded_settings
from mmoe.pipeline.stages import PipelineError, print_progress, run_stage
from mmoe.study.claim_settings import claim_settings
from mmoe.study.claims import (
    TASKS,
    TRAINED,
    Claim,
    activation_claim,
    capacity_claim,
    collapse_claim,
    consistency_claim,
    diversity_claim,
    fluctuation_claim,
    frequency_claim,
    not_run_claim,
    pretraining_claim,
    tasks_claim,
)
from mmoe.study.claims.mhmoe_routing import ACTIVATION, DIVERSITY
from mmoe.study.claims.stratified import CAPACITY, FREQUENCY
from mmoe.study.claims.task_scores import PRETRAINING
from mmoe.study.claims.xmoe_routing import COLLAPSE, CONSISTENCY, FLUCTUATION
from mmoe.study.decisions import run_decisions
from mmoe.study.lanes import run_in_lanes, study_stages
from mmoe.study.measure_runs import analysis_stage
from mmoe.study.plan import PlanError, StudyPlan, plan_hash
from mmoe.study.plan_design import plan_markdown, study_plan
from mmoe.study.plan_runs import check_runs_plan, plan_of_run, record_plan, refuse_other_plan, under_plan
from mmoe.study.report import write_report
from mmoe.study.routers import router_rows
from mmoe.study.runs import (
    MEASURES_FILE,
    PRETRAINING_VARIANT,
    Measures,
    StudyRun,
    maps_stage,
    pretrainings,
)
from mmoe.study.settings import CLAIM_IDS, DEFAULT, PRESETS, ROUTER_VARIANTS, ROUTING_WINDOW, SCALES, StudySettings


def upgraded_study(stored: dict) -> dict:
    """Study settings as an older ``study.json`` stored them, in today's form (its training settings upgraded as a
    pipeline's; one from before the router table gets today's routers, whose runs a re-run adds; one from before
    the presets chose their claims ran every claim, one pre-training per task variant, the default's window)."""
    training = stored.get("training")
    stored = {"router_variants": list(ROUTER_VARIANTS)} | stored  # an older study adds the router runs
    stored = {"claims": list(CLAIM_IDS), "task_pretraining_seeds": 1, "routing_window": ROUTING_WINDOW} | stored
    return stored | ({"training": upgraded_settings(training)} if isinstance(training, dict) else {})


#: Every claim's statement by id (a claim the plan does not run is its statement, not measured).
STATEMENTS = {
    statement.id: statement
    for statement in (
        ACTIVATION,
        DIVERSITY,
        COLLAPSE,
        FLUCTUATION,
        CONSISTENCY,
        TRAINED,
        TASKS,
        PRETRAINING,
        CAPACITY,
        FREQUENCY,
    )
}


def claims_from(measures: Measures, plan: StudyPlan | None = None) -> list[Claim]:
    """Every claim of the report from ``analysis/measures.json`` (recomputable from that file alone), each judged by
    its rules in ``plan`` (the default settings' plan without one); a claim the plan does not run is not measured and
    says so in the plan's words (which preset runs it)."""
    plan = plan or study_plan(DEFAULT, "default")
    rules = plan.claim
    ids = [claim.id for claim in plan.claims]

    def pretraining() -> Claim:
        if measures.backbones:
            backbones = measures.backbones
            return pretraining_claim(
                PRETRAINING_VARIANT, backbones["pretrained"], backbones["random_init"], measures.chance
            )
        # a measures.json from before claim 7's backbones: one pre-trained xmoe against its random init
        return pretraining_claim("xmoe", measures.scores["xmoe"], measures.random_init, measures.chance)

    measured = {
        "activation": lambda: activation_claim(measures.activation, rules("activation")),
        "diversity": lambda: diversity_claim(measures.diversity, rules("diversity")),
        "collapse": lambda: collapse_claim(measures.snapshots, rules("collapse")),
        "fluctuation": lambda: fluctuation_claim(measures.snapshots, rules("fluctuation")),
        "consistency": lambda: consistency_claim(measures.consistency, rules("consistency")),
        "consistency_trained": lambda: consistency_claim(
            measures.consistency_trained, rules("consistency_trained"), TRAINED
        ),
        "tasks": lambda: tasks_claim(measures.scores, measures.chance),
        "pretraining": pretraining,
        "capacity": lambda: capacity_claim(measures.capacity, rules("capacity")),
        "frequency": lambda: frequency_claim(
            measures.token_capacity["passes"], measures.token_capacity["training_counts"], rules("frequency")
        ),
    }
    claims = []
    for claim_id in CLAIM_IDS:
        if claim_id == "consistency_trained" and claim_id not in ids:  # a plan from before its row
            continue
        not_run = claim_id in ids and rules(claim_id).not_run
        claims.append(
            not_run_claim(STATEMENTS[claim_id], rules(claim_id).noise_rule.unit) if not_run else measured[claim_id]()
        )
    return claims


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
        help="trainings run at once, each lane a process (default 1; about 8 on a GPU, 2 at most on a 2-core CPU)",
    )
    claims.add_argument(
        "--precision",
        choices=("32-true", "bf16-mixed"),
        default=None,
        help="Lightning precision of every stage (default 32-true; bf16-mixed with --scale gpu)",
    )
    return parser.parse_args(list(argv))


def study_command(argv: Sequence[str]) -> int:
    """Runs ``mmoe study claims``; 0, 1 when a stage fails (the message names it), 2 for a bad plan file or runs made
    under another plan (one line naming both plans' hashes)."""
    args = parse(argv)
    args.jobs = capped_jobs(args.jobs, "study")
    preset = args.scale or ("fast" if args.fast else "default")
    settings = PRESETS[preset]
    if args.precision is not None:
        settings = dataclasses.replace(
            settings, training=dataclasses.replace(settings.training, precision=args.precision)
        )
    if args.dry_run:
        return dry_run(settings, preset, args.plan)
    study = StudyRun(Path(args.out), settings.training)
    for name in ("lightning.pytorch", "lightning.fabric"):
        logging.getLogger(name).setLevel(logging.WARNING)
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
    report = write_report(
        claims,
        study.out,
        report_header(command, facts, plan, digest),
        {"command": command, "settings": settings.to_json(), "run": facts, "plan": {"sha256": digest} | plan.to_json()},
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


def dry_run(settings: StudySettings, preset: str, path: Path | None) -> int:
    """Prints the plan of ``preset`` (or the plan file ``path``, checked against the settings) with its estimated
    cost; runs and writes nothing. 0, or 2 for a bad plan file."""
    try:
        plan = plan_of_run(settings, preset, path)
    except PlanError as error:
        return report_error("study", error)
    print(plan_markdown(plan, settings), end="")
    return 0


def report_header(command: str, facts: dict, plan: StudyPlan, digest: str) -> str:
    """The report's first paragraph: the command, what it took, the plan's hash, runs per arm and every interval's
    unit."""
    runs = ", ".join(f"{claim.id} {claim.runs_text()}" for claim in plan.claims)
    return (
        f"# Claims of the X-MoE, MH-MoE and Stratified MoE papers, measured by mmoe\n\nMade by `{command}`: "
        f"{facts['trainings']} trainings, {facts['stage_seconds'] / 60:.1f} min in its stages on "
        f"{facts['machine']}, {facts['disk_bytes'] / 1e9:.1f} GB written; torch {facts['versions']['torch']}, "
        f"Lightning {facts['versions']['lightning']}. Plan `{digest}` (SHA-256 of `plan.json`, fixed before the "
        f"runs; every stage recorded it). Runs per arm: {runs}. Tiny scale on the synthetic world. **The unit is the "
        "training run:** a claim is decided over independent runs per arm (Welch's t interval over runs, 95%; Holm's "
        "correction over a claim's gaps where the plan says so; the smallest effect the runs can detect at power 0.8 "
        "beside it), and a claim with 1 run per arm is not decided. The within-run intervals (95% bootstrap over "
        "held-out batches, images, router-input rows or fine-tuning windows of one run; Student-t over seeds for the "
        "task scores) are shown as secondary terms with the verdicts of `mmoe.study.verdicts`: reproduces / opposite "
        "(the interval on one side of zero), not separated (across zero), saturated (at a ceiling), uninformative (at "
        "the no-learning level). Every number below is recomputed from `analysis/measures.json` by "
        "`mmoe.study.command.claims_from` and `mmoe.study.decisions.run_decisions`."
    )


def rule_change_verdicts(measures: Measures, plan: StudyPlan, decisions: list[dict]) -> list[dict]:
    """Each of the plan's rule changes with the affected claim's verdicts (within one run and over runs) under the old
    rule and under the plan's."""
    by_id = {decision["id"]: decision for decision in decisions}
    changes = []
    for change in plan.rule_changes:
        old_plan = plan.under_old_rule(change)
        old_claims = claims_from(measures, old_plan)
        old = next(d for d in run_decisions(old_claims, old_plan, measures) if d["id"] == change.claim)
        new = by_id[change.claim]
        changes.append(
            dataclasses.asdict(change)
            | {
                "old_verdicts": {"within_run": old["within_run_verdict"], "over_runs": old["verdict"]},
                "new_verdicts": {"within_run": new["within_run_verdict"], "over_runs": new["verdict"]},
            }
        )
    return changes
