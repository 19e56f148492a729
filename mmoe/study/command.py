"""``mmoe study claims``: its options, the runs, the measurements and the report."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import shlex
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from mmoe.data.synth.corpus import ChanceLevels
from mmoe.demo.command import refuse_other_settings, upgraded_settings
from mmoe.demo.pipeline import codebook_stage, corpus_stage
from mmoe.demo.report import say
from mmoe.demo.settings import DemoError
from mmoe.demo.stages import run_stage
from mmoe.io import read_json
from mmoe.study.claims import (
    Claim,
    activation_claim,
    collapse_claim,
    consistency_claim,
    diversity_claim,
    fluctuation_claim,
    tasks_claim,
)
from mmoe.study.report import write_report
from mmoe.study.runs import (
    MEASURES_FILE,
    Measures,
    StudyRun,
    analysis_stage,
    finetune_stages,
    maps_stage,
    pretrain_stages,
    pretrainings,
)
from mmoe.study.settings import DEFAULT, FAST, SCALE


def upgraded_study(stored: dict) -> dict:
    """Study settings as an older ``study.json`` stored them, in today's form (its training settings upgraded as a
    demo's)."""
    training = stored.get("training")
    return stored | ({"training": upgraded_settings(training)} if isinstance(training, dict) else {})


def claims_from(measures: Measures) -> list[Claim]:
    """Every claim of the report from ``analysis/measures.json`` (recomputable from that file alone)."""
    return [
        activation_claim(measures.activation),
        diversity_claim(measures.diversity),
        collapse_claim(measures.snapshots),
        fluctuation_claim(measures.snapshots),
        consistency_claim(measures.consistency),
        tasks_claim(measures.scores),
    ]


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
    size.add_argument("--scale", action="store_true", help="longer runs on a larger corpus, bf16 (for a GPU)")
    claims.add_argument(
        "--precision",
        choices=("32-true", "bf16-mixed"),
        default=None,
        help="Lightning precision of every stage (default 32-true; bf16-mixed with --scale)",
    )
    return parser.parse_args(list(argv))


def study_command(argv: Sequence[str]) -> int:
    """Runs ``mmoe study claims``; 0, or 1 when a stage fails (the message names it)."""
    args = parse(argv)
    settings = SCALE if args.scale else FAST if args.fast else DEFAULT
    if args.precision is not None:
        settings = dataclasses.replace(
            settings, training=dataclasses.replace(settings.training, precision=args.precision)
        )
    study = StudyRun(Path(args.out), settings.training)
    for name in ("lightning.pytorch", "lightning.fabric"):
        logging.getLogger(name).setLevel(logging.WARNING)
    start = time.perf_counter()
    try:
        hint = "use another --out, or that run's --fast / --scale / --precision with the version that made it"
        refuse_other_settings(study.out / "study.json", settings.to_json(), "a claims study", hint, upgraded_study)
        runs = pretrainings(settings)
        stages = [corpus_stage(study), codebook_stage(study)]
        for run in runs:
            stages += pretrain_stages(study, run)
        for run in runs:
            if not run.moe:
                stages += finetune_stages(study, run, settings)
        stages += [analysis_stage(study, settings, runs), maps_stage(study, settings, runs)]
        records = {stage.key: run_stage(study, stage) for stage in stages}
    except DemoError as error:
        print(f"mmoe study: error: {error}", file=sys.stderr)
        return 1
    seconds = time.perf_counter() - start
    stage_seconds = sum(record["seconds"] for record in records.values())
    measures = Measures.from_json(read_json(study.analysis / MEASURES_FILE, "measures"))
    command = shlex.join(["mmoe", "study", *argv])
    header = (
        f"# Claims of the X-MoE and MH-MoE papers, measured by mmoe\n\nMade by `{command}` "
        f"({stage_seconds / 60:.1f} min in its stages). Tiny scale on the synthetic world: where a claim does not "
        "reproduce here, that is the measurement, not a failure. Every number below is recomputed from "
        "`analysis/measures.json` by `mmoe.study.command.claims_from`."
    )
    levels = ChanceLevels.from_summary(study.chance())
    chance = {"vqav2": levels.vqa_prior, "nlvr2": levels.nlvr2_constant, "captioning": levels.caption_constant["CIDEr"]}
    report = write_report(
        claims_from(measures),
        study.out,
        header,
        {
            "command": command,
            "settings": settings.to_json(),
            "stage_seconds": stage_seconds,
            "seconds_this_run": seconds,
        },
        chance,
    )
    say(f"\n{study.out / 'report.md'} ({seconds:.0f} s this run, {stage_seconds:.0f} s in all stages)")
    for claim in report["claims"]:
        say(f"  {claim['verdict']:>28}  {claim['title']}")  # the report's JSON form
    return 0
