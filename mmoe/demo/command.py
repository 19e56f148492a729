"""``mmoe demo``: its options, the check that a run directory is not mixed, and the run of every stage."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from mmoe.demo.recipe import (
    in_group,
    pool_jobs,
    random_init_stages,
    variant_rows,
    variant_stages,
)
from mmoe.demo.report import RESULTS_FILE, results
from mmoe.io import capped_jobs, positive_int, report_error, write_json
from mmoe.pipeline.compare import format_comparison, rows_from_items
from mmoe.pipeline.comparison_items import ITEMS_FILE, comparison_items
from mmoe.pipeline.launch import VARIANTS
from mmoe.pipeline.layout import PipelineRun
from mmoe.pipeline.pool import WorkerPool
from mmoe.pipeline.probes import probes_text
from mmoe.pipeline.settings import DEMO, DEMO_FAST, record_demo_settings
from mmoe.pipeline.stages import PipelineError, Stage, StageKey, is_done, print_progress, quiet_lightning, run_stage
from mmoe.pipeline.standard_stages import codebook_stage, corpus_stage
from mmoe.pipeline.tables import format_table


def parse(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="mmoe demo",
        description="Synthetic corpus -> codebook -> tiny MoE pre-training -> VQAv2 / NLVR2 / captioning / retrieval "
        "fine-tuning and official scores -> routing maps. Finished stages are reused on a re-run.",
    )
    parser.add_argument("--out", default="runs/demo", help="output directory (default runs/demo)")
    parser.add_argument("--variant", choices=(*VARIANTS, "all"), default="mhmoe", help="MoE variant (default mhmoe)")
    parser.add_argument("--fast", action="store_true", help="smaller corpus, model and step counts (for tests)")
    parser.add_argument(
        "--random-init",
        action="store_true",
        help="also fine-tune each task from a randomly initialised backbone of the same architecture, with the same "
        "steps, and show it beside the pre-trained start (what pre-training adds)",
    )
    parser.add_argument(
        "--jobs",
        type=positive_int,
        default=min(2, os.cpu_count() or 1),
        help="processes that run the fine-tunings and evaluations at once, each with cores / jobs torch threads "
        "(default: 2 where there are 2 cores; 1 runs every stage in this process, one after the other)",
    )
    parser.add_argument(
        "--stages",
        metavar="PREFIX",
        nargs="+",
        help="run only the stages named PREFIX or under it, each PREFIX's in turn (e.g. mhmoe/nlvr2: that fine-tuning "
        "and its evaluation; the stages before them must be done) and print no table",
    )
    parser.add_argument(
        "--precision",
        choices=("32-true", "bf16-mixed", "16-mixed"),
        default="32-true",
        help="Lightning precision of every training and prediction stage (default 32-true; bf16-mixed on a GPU)",
    )
    return parser.parse_args(list(argv))


def earlier_layout(out: Path) -> Path | None:
    """What in ``out`` shows a demo run of the folder layout before :class:`mmoe.pipeline.layout.WorkLayout` (a folder
    per variant holding ``pretrain/`` and ``backbone_pretrained.pt``), whose stages this version would not find; None
    when nothing does."""
    earlier = [out / variant / name for variant in VARIANTS for name in ("pretrain", "backbone_pretrained.pt")]
    return next((path for path in earlier if path.exists()), None)


def demo_stages(run: PipelineRun, variants: Sequence[str], random_init: bool) -> list[Stage]:
    """Every stage of a demo run, in order: corpus, codebook, then each variant's (and its fine-tunings from random
    init with ``random_init``)."""
    stages = [corpus_stage(run), codebook_stage(run)]
    for variant in variants:
        stages += variant_stages(run, variant)
        stages += random_init_stages(run, variant) if random_init else []
    return stages


def stages_under(stages: Sequence[Stage], prefixes: Sequence[str]) -> list[Stage]:
    """The stages named by each of ``prefixes`` or under it, each prefix's in turn; PipelineError naming a prefix no
    stage has, before any stage runs."""
    chosen = {prefix: [stage for stage in stages if in_group(stage, prefix)] for prefix in prefixes}
    for prefix, named in chosen.items():
        if not named:
            raise PipelineError(f"--stages {prefix}: no stage of this run is named so or under it")
    return [stage for named in chosen.values() for stage in named]


def run_job(run: PipelineRun, variants: Sequence[str], random_init: bool, name: str) -> None:
    """Runs the stage named ``name`` (the stages it needs must be done): a job of the pool's processes."""
    quiet_lightning()
    run_stage(run, next(stage for stage in demo_stages(run, variants, random_init) if str(stage.key) == name))


#: What the pool's processes import while the main process still runs the pre-training.
POOL_PRELOAD = ("mmoe.config.cli", __name__)


def run_demo(run: PipelineRun, variants: Sequence[str], random_init: bool = False, jobs: int = 1) -> dict:
    """Runs the stages not done yet, with ``jobs`` > 1 the fine-tunings, their evaluations and the routing figures as
    jobs of a pool of ``jobs`` processes (:func:`mmoe.demo.recipe.pool_jobs`, :class:`mmoe.pipeline.pool.WorkerPool`)
    that start after the corpus and codebook, beside the stages before those jobs; returns every stage's marker by
    key."""
    stages = demo_stages(run, variants, random_init)
    done_before = {stage.key for stage in stages if is_done(run, stage)}
    if jobs > 1:
        every_job = [job for variant in variants for job in pool_jobs(run, variant, random_init)]
        pooled = {job.name for job in every_job}
        here = [stage for stage in stages if str(stage.key) not in pooled]
        pending = [job for job in every_job if StageKey.of(job.name) not in done_before]
        for stage in here[:2]:  # corpus and codebook
            run_stage(run, stage, reused_by="")
        with WorkerPool(jobs, POOL_PRELOAD) if pending else contextlib.nullcontext() as pool:
            for stage in here[2:]:
                run_stage(run, stage, reused_by="")
            if pool is not None:
                pool.run(pending, functools.partial(run_job, run, tuple(variants), random_init))
    return {
        stage.key: run_stage(run, stage, reused_by="an earlier run" if stage.key in done_before else "")
        for stage in stages
    }


def demo_command(argv: Sequence[str]) -> int:
    """Runs ``mmoe demo``; returns 0, or 1 when a stage fails (the message names it)."""
    args = parse(argv)
    args.jobs = capped_jobs(args.jobs, "demo")
    if args.precision == "16-mixed":
        import torch

        if not torch.cuda.is_available():  # Lightning would quietly train in bf16 instead
            return report_error("demo", "--precision 16-mixed needs a CUDA GPU; use bf16-mixed on a CPU")
    run = PipelineRun(Path(args.out), dataclasses.replace(DEMO_FAST if args.fast else DEMO, precision=args.precision))
    variants = list(VARIANTS) if args.variant == "all" else [args.variant]
    old = earlier_layout(run.out)
    if old is not None:
        return report_error("demo", f"{old} is a demo run's folder of an earlier layout; expected a new --out")
    quiet_lightning()
    start = time.perf_counter()
    try:
        record_demo_settings(run.out, run.settings)
        if args.stages is not None:
            try:
                chosen = stages_under(demo_stages(run, variants, args.random_init), args.stages)
            except PipelineError as error:  # a bad prefix is the user's input: exit 2
                return report_error("demo", error)
            for stage in chosen:
                run_stage(run, stage)
            return 0
        records = run_demo(run, variants, args.random_init, args.jobs)
        items = {variant: comparison_items(run, variant) for variant in variants} if args.random_init else {}
        compared = {
            variant: rows_from_items(document, f"{variant}'s comparison") for variant, document in items.items()
        }
    except PipelineError as error:
        print(f"mmoe demo: error: {error}", file=sys.stderr)
        return 1
    rows = {}
    for variant in variants:
        rows[variant] = variant_rows(run, variant, records)
        if args.random_init:
            rows[f"{variant}, random init"] = variant_rows(run, variant, records, random_init=True)
    report = results(run, rows, records, time.perf_counter() - start, variants)
    report |= {"comparison": compared} if compared else {}
    if items:  # compact: the counts of every evaluation item
        write_json(run.out / ITEMS_FILE, items, indent=None)
    else:  # an earlier --random-init run's items would not match this results.json
        (run.out / ITEMS_FILE).unlink(missing_ok=True)
    write_json(run.out / RESULTS_FILE, report)
    print_progress(f"\nResults ({report['seconds_this_run']:.0f} s this run, {report['device']})\n")
    print_progress(format_table(report["variants"]))
    for variant, probes in report["probes"].items():
        print_progress(f"\nZero-shot probes of the {variant} pre-training, {probes_text(probes)}")
    if compared:
        print_progress(f"\n{format_comparison(compared)}")
    print_progress("\nFiles:")
    for path in [*report["files"], *([str(run.out / ITEMS_FILE)] if items else []), str(run.out / RESULTS_FILE)]:
        print_progress(f"  {path}")
    return 0
