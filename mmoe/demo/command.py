"""``mmoe demo``: its options, the check that a run directory is not mixed, and the run of every stage."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from mmoe.demo.compare import comparison, format_comparison
from mmoe.demo.pipeline import (
    codebook_stage,
    corpus_stage,
    fine_tuning_groups,
    in_group,
    needs_fine_tunings,
    random_init_stages,
    variant_rows,
    variant_stages,
)
from mmoe.demo.report import format_table, results, say
from mmoe.demo.settings import FAST, FULL, MAPPING_FIELDS, OPTIMIZER_OVERRIDES, VARIANTS, DemoError, DemoRun
from mmoe.demo.stages import Stage, is_done, lanes_by_cost, run_parallel, run_stage
from mmoe.io import positive_int, read_json, report_error, write_json

#: The demo's summary in its output folder: settings, chance levels, rows, stage times, files.
RESULTS_FILE = "results.json"


def check_settings(run: DemoRun) -> None:
    """Records the settings in ``DIR/demo.json``; a directory made with other settings is refused, not mixed."""
    hint = "use another --out, or that run's --fast and --precision choices with the version that made it"
    refuse_other_settings(run.out / "demo.json", run.settings.to_json(), "a demo run", hint)


def upgraded_settings(stored: dict) -> dict:
    """Demo settings as an older ``demo.json`` stored them, in today's form: one written before the precision option
    or the learning-rate overrides has neither (those runs trained in 32-true with the configs' learning rates, head
    multipliers and layer decays), and
    the per-name fields were lists of ``[name, value]`` pairs."""
    stored = {"precision": "32-true", **{field: {} for field in OPTIMIZER_OVERRIDES}} | stored
    return stored | {
        key: dict(value) for key, value in stored.items() if key in MAPPING_FIELDS and isinstance(value, list)
    }


def refuse_other_settings(
    path: Path, settings: dict, what: str, hint: str, upgrade: Callable[[dict], dict] = upgraded_settings
) -> None:
    """Records ``settings`` in ``path`` (JSON, ``{"settings": ...}``); DemoError listing what differs when ``path``
    holds other settings, so a run directory is never mixed. ``upgrade``: an older file's settings in today's form."""
    if path.is_file():
        stored = read_json(path, "run settings", DemoError).get("settings")
        stored = upgrade(stored) if isinstance(stored, dict) else {}
        if stored != settings:
            keys = dict.fromkeys([*settings, *stored])
            changed = "; ".join(
                f"{key}: {stored.get(key)!r} there, {settings.get(key)!r} now"
                for key in keys
                if stored.get(key) != settings.get(key)
            )
            raise DemoError(f"{path.parent} holds {what} made with other settings ({changed}; see {path}): {hint}")
        return
    write_json(path, {"settings": settings})


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
        help="lanes of fine-tunings run at once, each lane in its own process with cores / jobs torch threads "
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


def run_stages(run: DemoRun, stages: list[Stage], args: argparse.Namespace, variants: list[str]) -> dict:
    """Runs the stages not done yet, the fine-tunings in ``args.jobs`` lanes at once, each lane a process that runs its
    groups one after the other (:func:`mmoe.demo.stages.lanes_by_cost`, with a group's fine-tuning steps as its cost,
    and :func:`mmoe.demo.stages.run_parallel`), after the stages they need and before the figures; returns every stage's
    marker by key."""
    done_before = {stage.key for stage in stages if is_done(run, stage)}
    if args.jobs > 1:
        steps = {
            group: count
            for variant in variants
            for group, count in fine_tuning_groups(run, variant, args.random_init).items()
            if any(in_group(stage, group) and stage.key not in done_before for stage in stages)
        }
        for stage in stages:
            if not any(in_group(stage, group) for group in steps) and not needs_fine_tunings(stage):
                run_stage(run, stage, reused_by="")
        lanes = lanes_by_cost(list(steps), steps.__getitem__, args.jobs)
        run_parallel(lanes, lambda lane: [*group_argv(args), "--stages", *lane, "--jobs", "1"], args.jobs)
    return {
        stage.key: run_stage(run, stage, reused_by="an earlier run" if stage.key in done_before else "")
        for stage in stages
    }


def group_argv(args: argparse.Namespace) -> list[str]:
    """``mmoe demo`` arguments of a run like ``args`` (its directory, variant, settings), for one of its groups."""
    argv = ["demo", "--out", str(args.out), "--variant", args.variant, "--precision", args.precision]
    return argv + ["--fast"] * args.fast + ["--random-init"] * args.random_init


def demo_command(argv: Sequence[str]) -> int:
    """Runs ``mmoe demo``; returns 0, or 1 when a stage fails (the message names it)."""
    args = parse(argv)
    if args.precision == "16-mixed":
        import torch

        if not torch.cuda.is_available():  # Lightning would quietly train in bf16 instead
            return report_error("demo", "--precision 16-mixed needs a CUDA GPU; use bf16-mixed on a CPU")
    run = DemoRun(Path(args.out), dataclasses.replace(FAST if args.fast else FULL, precision=args.precision))
    variants = list(VARIANTS) if args.variant == "all" else [args.variant]
    for name in ("lightning.pytorch", "lightning.fabric"):
        logging.getLogger(name).setLevel(logging.WARNING)
    start = time.perf_counter()
    try:
        check_settings(run)
        stages = [corpus_stage(run), codebook_stage(run)]
        for variant in variants:
            stages += variant_stages(run, variant)
            stages += random_init_stages(run, variant) if args.random_init else []
        if args.stages is not None:
            chosen = {prefix: [stage for stage in stages if in_group(stage, prefix)] for prefix in args.stages}
            for prefix, named in chosen.items():
                if not named:
                    return report_error("demo", f"--stages {prefix}: no stage of this run is named so or under it")
            for named in chosen.values():
                for stage in named:
                    run_stage(run, stage)
            return 0
        records = run_stages(run, stages, args, variants)
        compared = {variant: comparison(run, variant) for variant in variants} if args.random_init else {}
    except DemoError as error:
        print(f"mmoe demo: error: {error}", file=sys.stderr)
        return 1
    rows = {}
    for variant in variants:
        rows[variant] = variant_rows(run, variant, records)
        if args.random_init:
            rows[f"{variant}, random init"] = variant_rows(run, variant, records, random_init=True)
    report = results(run, rows, records, time.perf_counter() - start) | ({"comparison": compared} if compared else {})
    write_json(run.out / RESULTS_FILE, report)
    say(f"\nResults ({report['seconds_this_run']:.0f} s this run, {report['device']})\n")
    say(format_table(report["variants"]))
    if compared:
        say(f"\n{format_comparison(compared)}")
    say("\nFiles:")
    for path in [*report["files"], str(run.out / RESULTS_FILE)]:
        say(f"  {path}")
    return 0
