"""Compare two ``scripts/demo_ablation.py`` folders fine-tuned from the pre-trained and from the random backbone
(e.g. under another training seed, ``--seed N --set '{"data": {"init_args": {"seed": N}}}'``) as ``mmoe demo
--random-init`` compares its two starts: per benchmark present in both, the difference with its 95% paired
cluster bootstrap interval over the evaluation images or statement sets and the verdict
(:mod:`mmoe.pipeline.compare`); ``--items`` also writes the per-item document the rows are computed from
(:mod:`mmoe.pipeline.comparison_items`, recomputed by ``rows_from_items``).

    .venv/bin/python scripts/demo_seed_compare.py /tmp/seeds/pre_s1 /tmp/seeds/rand_s1 --out /tmp/seeds/s1.json

Each folder holds ``data`` (the corpus link ``demo_ablation.py`` makes) and ``TASK/<predictions file>`` per task.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from mmoe.io import one_line, write_json
from mmoe.pipeline.benchmarks import BENCHMARKS
from mmoe.pipeline.compare import format_comparison, rows_from_items
from mmoe.pipeline.comparison_items import document, files_entry
from mmoe.pipeline.layout import PipelineRun
from mmoe.pipeline.settings import DEMO
from mmoe.pipeline.stages import PipelineError
from mmoe.runtime.layout import RunLayout


def folder_items(pretrained: Path, random_init: Path) -> dict:
    """The per-item document of every benchmark whose predictions both folders hold, scored on ``pretrained``'s
    corpus link; PipelineError when they share none."""
    run = PipelineRun(pretrained, DEMO)
    entries = []
    for benchmark in BENCHMARKS:
        files = [
            RunLayout(folder / benchmark.name).predictions(benchmark.predictions)
            for folder in (pretrained, random_init)
        ]
        if all(path.exists() for path in files):
            entries.append(files_entry(run, benchmark.name, *files))
    if not entries:
        raise PipelineError(f"{pretrained} and {random_init} hold the predictions of no benchmark in common")
    return document(entries)


def compare_folders(pretrained: Path, random_init: Path) -> list[dict]:
    """The comparison rows of every benchmark whose predictions both folders hold (:func:`folder_items`)."""
    return rows_from_items(folder_items(pretrained, random_init), f"{pretrained} and {random_init}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "pretrained", type=Path, help="demo_ablation.py folder fine-tuned from the pre-trained backbone"
    )
    parser.add_argument("random_init", type=Path, help="the same fine-tunings from the random backbone")
    parser.add_argument("--out", type=Path, help="write the rows here as JSON")
    parser.add_argument("--items", type=Path, help="write the per-item document here as JSON")
    args = parser.parse_args()
    try:
        items = folder_items(args.pretrained, args.random_init)
        rows = rows_from_items(items, f"{args.pretrained} and {args.random_init}")
    except PipelineError as error:
        print(f"demo_seed_compare.py: error: {one_line(error)}", file=sys.stderr)
        raise SystemExit(2) from None
    if args.out:
        write_json(args.out, rows)
    if args.items:
        write_json(args.items, items, indent=None)
    print(format_comparison({"pre-trained vs random init": rows}))
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
