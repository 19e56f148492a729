"""``mmoe eval``: score a predictions file against the official annotation files, one JSON object on stdout.

* ``mmoe eval vqa --questions Q.json --annotations A.json --results R.json`` — VQA accuracy in percent
  (:mod:`mmoe.metrics.vqa`).
* ``mmoe eval caption (--annotations captions_*.json | --karpathy dataset_coco.json [--split test]) --results R.json``
  — COCO caption metrics as fractions (:mod:`mmoe.metrics.captions`).
* ``mmoe eval nocaps --annotations nocaps_val_4500_captions.json --results R.json [--submission S.json]`` — the
  caption metrics per NoCaps domain (in, near, out and ``entire``), the table on stderr; with ``--submission`` the
  evaluation server's results file, every image once; an image-info file without captions is counted, not scored
  (:mod:`mmoe.metrics.nocaps`).
* ``mmoe eval nlvr2 --data dev.json --predictions predictions.csv`` — accuracy and consistency as fractions
  (:mod:`mmoe.metrics.nlvr2`).
* ``mmoe eval retrieval --embeddings E.pt [--results ranks.json]`` — image -> text and text -> image R@1/5/10 and
  their mean as fractions, each query's rank written to ``--results`` (:mod:`mmoe.metrics.retrieval`).
* ``mmoe eval classification --predictions P.json --solution LOC_val_solution.csv`` — top-1 / top-5 accuracy as
  fractions (:mod:`mmoe.metrics.classification`).

Warnings and the scorers' own chatter go to stderr. Exit codes: 0 scored, 2 bad input or usage (message on stderr,
naming the file and the entry), 1 a scorer that cannot run (Java missing or failing).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import warnings
from collections.abc import Callable, Sequence
from typing import Any

from mmoe.io import positive_int
from mmoe.metrics.captions import DEFAULT_SPICE_TIMEOUT, ScorerUnavailableError, evaluate_caption_files
from mmoe.metrics.classification import evaluate_classification_files
from mmoe.metrics.files import EvalInputError
from mmoe.metrics.nlvr2 import evaluate_nlvr2_files
from mmoe.metrics.nocaps import ENTIRE, domain_table, evaluate_nocaps_files
from mmoe.metrics.retrieval import DEFAULT_CHUNK, evaluate_retrieval_file
from mmoe.metrics.vqa import evaluate_vqa_files


def _vqa(args: argparse.Namespace) -> dict[str, Any]:
    return evaluate_vqa_files(args.questions, args.annotations, args.results)


def _caption(args: argparse.Namespace) -> dict[str, Any]:
    return evaluate_caption_files(args.results, args.annotations, args.karpathy, args.split, **_scorers(args))


def _scorers(args: argparse.Namespace) -> dict[str, Any]:
    """The options of :func:`_caption_scorers` as the caption scorers' keyword arguments."""
    return {"meteor": not args.no_meteor, "spice": not args.no_spice, "spice_timeout": args.spice_timeout}


def _nocaps(args: argparse.Namespace) -> dict[str, Any]:
    report = evaluate_nocaps_files(args.results, args.annotations, args.submission, **_scorers(args))
    if ENTIRE in report:
        print(domain_table({name: report[name] for name in report if name != "submission"}))  # stdout is stderr here
    return report


def _nlvr2(args: argparse.Namespace) -> dict[str, Any]:
    return evaluate_nlvr2_files(args.data, args.predictions)


def _retrieval(args: argparse.Namespace) -> dict[str, Any]:
    return evaluate_retrieval_file(args.embeddings, args.results, args.chunk)


def _classification(args: argparse.Namespace) -> dict[str, Any]:
    return evaluate_classification_files(args.predictions, args.solution)


def _caption_scorers(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--no-meteor", action="store_true", help="skip METEOR (reported as not requested)")
    parser.add_argument("--no-spice", action="store_true", help="skip SPICE (reported as not requested)")
    parser.add_argument(
        "--spice-timeout", type=float, default=DEFAULT_SPICE_TIMEOUT, help="seconds before SPICE gives up"
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mmoe eval",
        description="Score a predictions file against the official annotation files; one JSON object on stdout.",
    )
    benchmarks = parser.add_subparsers(
        dest="benchmark", required=True, metavar="{vqa,caption,nocaps,nlvr2,retrieval,classification}"
    )

    vqa = benchmarks.add_parser("vqa", help="VQAv2 accuracy (GT-Vision-Lab/VQA vqaEval.py)")
    vqa.add_argument("--questions", required=True, help="v2_OpenEnded_mscoco_<split>_questions.json")
    vqa.add_argument("--annotations", required=True, help="v2_mscoco_<split>_annotations.json")
    vqa.add_argument("--results", required=True, help='[{"question_id": int, "answer": str}, ...]')
    vqa.set_defaults(run=_vqa)

    caption = benchmarks.add_parser("caption", help="COCO caption metrics (pycocoevalcap)")
    source = caption.add_mutually_exclusive_group(required=True)
    source.add_argument("--annotations", help="COCO captions_<split>.json")
    source.add_argument("--karpathy", help="Karpathy's dataset_coco.json (image id = cocoid, references = raw)")
    caption.add_argument("--split", default="test", help="Karpathy split to score against (default: test)")
    caption.add_argument("--results", required=True, help='[{"image_id": int, "caption": str}, ...]')
    _caption_scorers(caption)
    caption.set_defaults(run=_caption)

    nocaps = benchmarks.add_parser("nocaps", help="NoCaps caption metrics per domain, the evaluation server's file")
    nocaps.add_argument(
        "--annotations", required=True, help="nocaps_val_4500_captions.json (scored) or nocaps_test_image_info.json"
    )
    nocaps.add_argument("--results", required=True, help='[{"image_id": int, "caption": str}, ...]')
    nocaps.add_argument("--submission", help="write the evaluation server's results file here (every image once)")
    _caption_scorers(nocaps)
    nocaps.set_defaults(run=_nocaps)

    nlvr2 = benchmarks.add_parser("nlvr2", help="NLVR2 accuracy and consistency (lil-lab/nlvr metrics.py)")
    nlvr2.add_argument("--data", required=True, help="dev.json / test1.json (JSON lines with identifier and label)")
    nlvr2.add_argument("--predictions", required=True, help="CSV lines 'identifier,prediction', no header")
    nlvr2.set_defaults(run=_nlvr2)

    retrieval = benchmarks.add_parser("retrieval", help="image-text retrieval R@1/5/10 (BEiT-3 average_score)")
    retrieval.add_argument("--embeddings", required=True, help="the embeddings file `mmoe predict` writes")
    retrieval.add_argument("--results", help="write each query's rank here (JSON, whole or absent)")
    retrieval.add_argument(
        "--chunk", type=positive_int, default=DEFAULT_CHUNK, help=f"queries scored at once (default {DEFAULT_CHUNK})"
    )
    retrieval.set_defaults(run=_retrieval)

    classification = benchmarks.add_parser("classification", help="ImageNet top-1 / top-5 accuracy")
    classification.add_argument("--predictions", required=True, help="the predictions file `mmoe predict` writes")
    classification.add_argument(
        "--solution",
        required=True,
        help="LOC_val_solution.csv (ImageId,PredictionString; ImageId = a prediction's image, its file name)",
    )
    classification.set_defaults(run=_classification)
    return parser


def eval_command(argv: Sequence[str]) -> int:
    """Runs ``mmoe eval <benchmark> ...``; returns the exit code (0 scored, 1 scorer unavailable, 2 bad input)."""
    try:
        args = build_parser().parse_args(list(argv))
    except SystemExit as stop:  # argparse has printed usage or help
        return stop.code if isinstance(stop.code, int) else 2
    prefix = f"mmoe eval {args.benchmark}"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        code, report = _run(args.run, args, prefix)
    for warning in caught:
        if issubclass(warning.category, UserWarning):  # ours; not the ResourceWarnings of pycocoevalcap's pipes
            print(f"{prefix}: warning: {warning.message}", file=sys.stderr)
    if report is not None:
        print(json.dumps(report, indent=2))
    return code


def _run(
    run: Callable[[argparse.Namespace], dict[str, Any]], args: argparse.Namespace, prefix: str
) -> tuple[int, dict[str, Any] | None]:
    """Calls the scorer with stdout sent to stderr, so that only the report reaches stdout."""
    with contextlib.redirect_stdout(sys.stderr):
        try:
            return 0, run(args)
        except EvalInputError as error:
            print(f"{prefix}: error: {error}", file=sys.stderr)
            return 2, None
        except ScorerUnavailableError as error:
            print(f"{prefix}: error: {error}", file=sys.stderr)
            return 1, None
