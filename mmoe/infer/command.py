"""``mmoe infer``'s options (one subcommand per fine-tuning task, built from the task's inference spec), its output
and its one-line errors."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from mmoe.infer.folder import run_folder
from mmoe.infer.load import InferError, load_fine_tuned
from mmoe.infer.modes import run_shards, run_single
from mmoe.infer.results import ShardResults
from mmoe.infer.search import is_search, run_search, search_problem
from mmoe.io import INPUT_ERROR_EXIT, check_output_path, report_error
from mmoe.tasks.catalog import INFER_SPECS, class_path
from mmoe.tasks.inference import InferResult, InferSpec

#: What each input option of a task (its spec's ``images``, ``alternatives`` and ``text``) reads.
INPUT_HELP = {
    "image": "an image, or a folder of images (needs --out)",
    "left": "the left image (with --right and --sentence)",
    "right": "the right image",
    "question": "the question (with --image)",
    "sentence": "the statement about the pair",
    "images": "a folder of images to rank against --text (retrieval)",
    "text": "the query text (with --images), or the text to score --image against",
}


class OneLineParser(argparse.ArgumentParser):
    """argparse whose errors are one line, ``mmoe infer: error: ...``, and exit 2."""

    def error(self, message: str):
        raise SystemExit(report_error("infer", message))


def option(name: str) -> str:
    return f"--{name.replace('_', '-')}"


def add_task_parser(tasks, spec: InferSpec) -> None:
    task = spec.task
    parser = tasks.add_parser(task.name, aliases=list(spec.aliases), help=(task.__doc__ or "").split("\n")[0])
    parser.set_defaults(task=task, spec=spec)
    parser.add_argument(
        "--ckpt",
        required=True,
        help=f"a checkpoint of `mmoe fit` with {class_path(task)}, or a folder of `mmoe export`",
    )
    inputs = parser.add_mutually_exclusive_group(required=True)
    inputs.add_argument("--shards", help="a converted split (folder, shard or glob): results file (needs --out)")
    first, *others = spec.images
    inputs.add_argument(option(first), help=INPUT_HELP.get(first))
    for name in spec.alternatives:
        inputs.add_argument(option(name), help=INPUT_HELP.get(name))
    for name in [*others, *filter(None, [spec.text])]:
        parser.add_argument(option(name), help=INPUT_HELP.get(name))
    for task_option in spec.options:
        task_option.add_to(parser)
    for name in task.file_arguments:
        parser.add_argument(option(name), help=f"the {name.replace('_', ' ')}, when the one the checkpoint names moved")
    parser.add_argument(
        "--routing", help="single input: write the image's expert map to this PNG and list the text's experts"
    )
    parser.add_argument("--out", help="results file (JSON) for a folder of images or a shard split")
    parser.add_argument(
        "--allow-partial-results",
        action="store_true",
        help="--shards: exit 0 when results were written for fewer samples than the split's manifests hold (the "
        "shortfall is still reported)",
    )
    parser.add_argument("--json", action="store_true", help="one JSON object on stdout")
    parser.add_argument("--device", default="cpu", help="torch device (default cpu; e.g. cuda)")


def parser() -> argparse.ArgumentParser:
    root = OneLineParser(prog="mmoe infer", description=__doc__.split("\n\n")[0])
    tasks = root.add_subparsers(dest="command", required=True, parser_class=OneLineParser)
    for spec in INFER_SPECS.values():
        add_task_parser(tasks, spec)
    return root


def missing_inputs(args: argparse.Namespace) -> str:
    """The options a single-input run lacks ('' when complete or reading shards)."""
    if args.shards:
        return ""
    spec = args.spec
    needed = [*spec.images[1:], *filter(None, [spec.text])]
    return ", ".join(option(name) for name in needed if not getattr(args, name))


def folder_input(args: argparse.Namespace) -> bool:
    """Whether the input is a folder of images (one-image tasks)."""
    images = args.spec.images
    return not args.shards and len(images) == 1 and Path(getattr(args, images[0])).is_dir()


def infer_command(argv: Sequence[str]) -> int:
    """``mmoe infer``; exit 2 with one line on bad input."""
    try:
        args = parser().parse_args(list(argv))
    except SystemExit as stop:
        return stop.code if isinstance(stop.code, int) else INPUT_ERROR_EXIT
    try:
        search = is_search(args)
        problem = search_problem(args) if search else missing_inputs(args)
        if problem:
            raise InferError(problem if search else f"{problem} needed (or --shards)")
        if args.routing and (args.shards or folder_input(args)):
            raise InferError("--routing works on a single input (one image or one pair)")
        for name, path in (("--out", args.out), ("--routing", args.routing)):
            if path is not None:
                check_output_path(path, name)  # before the work, not after it
        model = load_fine_tuned(args.ckpt, args.task, args.device, args.spec.task_arguments(vars(args)))
        result: InferResult
        if search:
            result = run_search(model, args)
        elif args.shards:
            result = run_shards(model, args)
        elif folder_input(args):
            result = run_folder(model, args)
        else:
            result = run_single(model, args)
    except (InferError, FileNotFoundError, ValueError) as error:
        return report_error("infer", error)
    print(json.dumps(result.record()) if args.json else result.formatted())
    shortfall = result.shortfall if isinstance(result, ShardResults) else None
    if shortfall and not args.allow_partial_results:
        return report_error("infer", f"{shortfall} (pass --allow-partial-results to accept them)")
    if shortfall:
        print(f"mmoe infer: {shortfall} (accepted: --allow-partial-results)", file=sys.stderr)
    return 0
