"""``mmoe study routers``: the bake-off of the routers at equal active compute (:mod:`mmoe.study.bakeoff_routers`).

```
mmoe study routers --plan FILE --out DIR [--scale fast|cpu|gpu] [--seeds S ...] [--jobs N] [--dry-run]
```

The plan is fixed before any run: where ``FILE`` does not exist, the design of ``--scale`` (at ``--seeds``) is
written there with its hash (a dry run writes it too, training nothing); where it exists, it is read, its hash
checked and its preset and seeds held to any ``--scale`` / ``--seeds`` given. ``DIR`` keeps the plan it was run under
(``DIR/plan.json``) and every stage's marker records its hash: a folder made under another plan is refused. Bad
input: one line, exit 2; a failed stage: exit 1."""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from mmoe.io import capped_jobs, positive_int, read_json, report_error
from mmoe.pipeline.stages import PipelineError, print_progress, quiet_lightning, run_stage
from mmoe.study.bakeoff_lanes import run_in_lanes
from mmoe.study.bakeoff_plan import BakeoffPlan, design, read_plan_file, write_plan_file
from mmoe.study.bakeoff_presets import PRESETS
from mmoe.study.bakeoff_report import write_report
from mmoe.study.bakeoff_runs import BakeoffRun, bakeoff_stages, run_name
from mmoe.study.plan import PlanError
from mmoe.study.plan_runs import PLAN_FIELD, under_plan

#: The preset a new plan is designed from without ``--scale``.
DEFAULT_SCALE = "cpu"
#: The plan a bake-off folder was run under, beside its ``stages/`` markers.
FOLDER_PLAN = "plan.json"


def add_parser(sub) -> None:
    """The ``routers`` subcommand's options on ``mmoe study``'s subparsers ``sub``."""
    routers = sub.add_parser("routers", help="the routers compared at equal active compute, decided over seeds")
    routers.add_argument("--plan", type=Path, required=True, help="the plan file (written from --scale if absent)")
    routers.add_argument("--out", type=Path, default=Path("runs/routers"), help="work folder (default runs/routers)")
    routers.add_argument(
        "--scale",
        choices=tuple(PRESETS),
        default=None,
        help=f"a new plan's preset (default {DEFAULT_SCALE}): fast, a few steps for tests; cpu, within 60 minutes on a "
        "2-core CPU; gpu, 5 seeds of 1,000 steps on one GPU",
    )
    routers.add_argument("--seeds", type=int, nargs="+", default=None, help="a new plan's seeds (at least 3)")
    routers.add_argument(
        "--jobs",
        type=positive_int,
        default=1,
        help="(router, seed) runs at once, each in a process of a pool (default 1; 2 on a 2-core CPU take about "
        "half the time)",
    )
    routers.add_argument(
        "--dry-run",
        action="store_true",
        help="print the runs and the estimated cost, train nothing (a plan file not there yet is written)",
    )


def fixed_plan(path: Path, scale: str | None, seeds: list[int] | None) -> tuple[BakeoffPlan, str, bool]:
    """(the plan, its hash, whether it was written now): ``path``'s, checked against ``scale`` and ``seeds`` where
    given, or the design of ``scale`` at ``seeds`` written there."""
    if path.exists():
        plan, digest = read_plan_file(path)
        if scale is not None and scale != plan.preset:
            raise PlanError(
                f"{path}: preset is {plan.preset!r}, but --scale {scale} was given: drop it or another --plan"
            )
        if seeds is not None and tuple(seeds) != plan.seeds:
            raise PlanError(
                f"{path}: seeds are {list(plan.seeds)}, but --seeds {seeds} was given: drop it or another --plan"
            )
        return plan, digest, False
    plan = design(PRESETS[scale or DEFAULT_SCALE], None if seeds is None else tuple(seeds))
    return plan, write_plan_file(plan, path), True


def refuse_other_plan(out: Path, digest: str) -> None:
    """PlanError when ``out`` holds a plan or a stage made under a plan other than ``digest``."""
    if (out / FOLDER_PLAN).is_file():
        _, recorded = read_plan_file(out / FOLDER_PLAN)
        if recorded != digest:
            raise PlanError(
                f"{out} holds runs made under plan {recorded} ({out / FOLDER_PLAN}), this plan is {digest}: "
                "use another --out"
            )
    for marker in sorted((out / "stages").glob("*.json")):
        recorded = (read_json(marker, "stage marker", PlanError).get("result") or {}).get(PLAN_FIELD)
        if recorded != digest:
            raise PlanError(f"{marker}: {PLAN_FIELD} is {recorded!r}, expected this plan's {digest}: use another --out")


def dry_run_text(plan: BakeoffPlan, digest: str, jobs: int = 1) -> str:
    """The runs of the plan and its estimated cost in ``jobs`` lanes."""
    preset = PRESETS[plan.preset]
    cost = preset.estimate(len(plan.seeds), len(plan.routers), jobs)
    lines = [
        f"plan {digest} (preset {plan.preset}): {len(plan.routers)} routers x seeds {list(plan.seeds)}, "
        f"{plan.pretrain_steps} pre-training + {plan.finetune_steps} VQA steps each",
    ]
    for router in plan.routers:
        runs = ", ".join(run_name(router.name, seed) for seed in plan.seeds)
        lines.append(
            f"  {router.name:<14} {router.active_flops_per_token / 1e6:8.3f} MFLOPs/token "
            f"({router.flops_gap:+.2%} of the dense FFNs'): {runs}"
        )
    lines.append(f"estimated cost: {cost.text()}")
    return "\n".join(lines) + "\n"


def routers_command(args: argparse.Namespace, argv: list[str]) -> int:
    """Runs ``mmoe study routers``; 0, 1 when a stage fails, 2 for a bad plan or a folder of another plan."""
    # Absolute, as the stages' configs name their shards both under the data root and from the work folder.
    args.out = args.out.resolve()
    try:
        plan, digest, written = fixed_plan(args.plan, args.scale, args.seeds)
        if written:
            print_progress(f"{args.plan}: plan {digest} written (preset {plan.preset}); commit it before the runs")
        if args.dry_run:
            print(dry_run_text(plan, digest, args.jobs), end="")
            return 0
        refuse_other_plan(args.out, digest)
    except PlanError as error:
        return report_error("study routers", error)
    quiet_lightning()
    run = BakeoffRun(args.out, plan.settings())
    write_plan_file(plan, args.out / FOLDER_PLAN)
    jobs = capped_jobs(args.jobs, "study routers")
    try:
        if jobs > 1:
            run_in_lanes(run, plan, digest, jobs)
        for stage in bakeoff_stages(run, plan):
            run_stage(run, under_plan(stage, digest))
    except PipelineError as error:
        print(f"mmoe study routers: error: {error}", file=sys.stderr)
        return 1
    write_report(run, plan, digest, shlex.join(["mmoe", "study", *argv]))
    print_progress(f"\n{args.out / 'report.md'}: plan {digest}")
    return 0
