"""``mmoe analyze routing | consistency``: routing metrics of checkpoints on data, or of runs' saved statistics, as
one JSON object on stdout (X-MoE Eq. 11, §4.5; MH-MoE Fig. 1a)."""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence

from mmoe.metrics.routing import DEFAULT_ACTIVATION_THRESHOLD
from mmoe.metrics.routing_stats import read_stats
from mmoe.viz.cli import TEXT_TOKENIZER_HELP, _device, _load, _run, data_samples, run_over
from mmoe.viz.inputs import InputError


def analyze_command(argv: Sequence[str]) -> int:
    """``mmoe analyze routing``: routing metrics of checkpoints on data, as one JSON object on stdout."""
    parser = argparse.ArgumentParser(prog="mmoe analyze", description="Routing metrics as JSON.")
    sub = parser.add_subparsers(dest="analysis", required=True)
    routing = sub.add_parser("routing", help="activation ratio, representation collapse, fluctuation, consistency")
    routing.add_argument("--ckpt", required=True, help="checkpoint A")
    routing.add_argument("--compare", help="checkpoint B: routing fluctuation ratio A vs B on the same inputs")
    routing.add_argument("--runs", nargs="+", help="checkpoints of m >= 2 runs: inter-run consistency of their loads")
    routing.add_argument("--data", nargs="+", required=True, help="directory of images or .tar shards")
    routing.add_argument("--batches", type=int, default=100, help="batches (X-MoE accumulates loads over 100 steps)")
    routing.add_argument("--batch-size", type=int, default=16)
    routing.add_argument("--threshold", type=float, default=DEFAULT_ACTIVATION_THRESHOLD, help="fraction of 1/E")
    routing.add_argument(
        "--max-rows", type=int, default=10_000, help="router-input rows per MoE layer kept for representation collapse"
    )
    routing.add_argument("--max-text-length", type=int, default=32)
    routing.add_argument("--text-tokenizer", help=TEXT_TOKENIZER_HELP)
    routing.add_argument("--no-text", action="store_true", help="feed images only")
    routing.add_argument("--device", default=None)
    through = sub.add_parser(
        "consistency",
        help="inter-run consistency through fine-tuning from the runs' routing_stats.json (X-MoE Fig. 3b)",
    )
    through.add_argument("--stats", nargs="+", required=True, help="m >= 2 runs' routing_stats.json (or their folders)")
    through.add_argument("--plot", help="also draw the curve to this PNG")
    args = parser.parse_args(list(argv))
    if args.analysis == "consistency":
        if len(args.stats) < 2:
            parser.error(f"--stats needs at least 2 runs, got {len(args.stats)}")
        return _run("analyze", _analyze_consistency, args)
    if args.runs is not None and len(args.runs) < 2:
        parser.error(f"--runs needs at least 2 checkpoints, got {len(args.runs)}")
    if args.threshold < 0:
        parser.error(f"--threshold must be >= 0, got {args.threshold}")
    if args.max_rows < 2:
        parser.error(f"--max-rows must be >= 2, got {args.max_rows}")
    return _run("analyze", _analyze_routing, args)


def _analyze_consistency(args: argparse.Namespace) -> int:
    from mmoe.metrics.routing_collect import consistency_through_training
    from mmoe.metrics.routing_stats import window_loads

    runs = [window_loads(read_stats(path)) for path in args.stats]
    report = {"runs": list(args.stats)} | consistency_through_training(runs, args.stats)
    if args.plot:
        from mmoe.viz.plots import draw_consistency_curve

        report["plot"] = str(draw_consistency_curve(report["windows"], args.plot))
    print(json.dumps(report, indent=1))
    return 0


def _analyze_routing(args: argparse.Namespace) -> int:
    from mmoe.metrics.routing_collect import fluctuation_between, load_consistency, routing_report

    samples = data_samples(args.data, args.batches, args.batch_size)
    backbone = _load(args.ckpt, device=_device(args.device))
    run = run_over(backbone, args.ckpt, samples, args, capture_rows=args.max_rows)
    if not run.totals.counts:
        raise InputError(f"the data in {', '.join(args.data)} produced no routing for checkpoint {args.ckpt}")
    report: dict = {"checkpoint": args.ckpt} | routing_report(run, args.threshold)
    if args.compare:
        other = _load(args.compare, device=_device(args.device))
        if other.config.image_size != backbone.config.image_size:
            raise ValueError(
                f"--compare {args.compare} takes {other.config.image_size} px images but {args.ckpt} takes "
                f"{backbone.config.image_size} px: the fluctuation needs the same inputs"
            )
        report["fluctuation"] = {"compare": args.compare} | fluctuation_between(
            run, run_over(other, args.compare, samples, args)
        )
    if args.runs:
        loads = []
        for path in args.runs:
            loads.append(run_over(_load(path, device=_device(args.device)), path, samples, args).totals.counts)
        report["inter_run_consistency"] = {"runs": list(args.runs)} | load_consistency(loads, args.runs)
    print(json.dumps(report, indent=1))
    return 0
