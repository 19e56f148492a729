"""Compare two ``scripts/demo_ablation.py`` folders fine-tuned from the pre-trained and from the random backbone
(e.g. under another training seed, ``--seed N --set '{"data": {"init_args": {"seed": N}}}'``) as ``mmoe demo
--random-init`` compares its two starts: per benchmark present in both, the difference with its 95% paired
bootstrap interval over the evaluation items and the verdict (:mod:`mmoe.pipeline.compare`).

    .venv/bin/python scripts/demo_seed_compare.py /tmp/seeds/pre_s1 /tmp/seeds/rand_s1 --out /tmp/seeds/s1.json

Each folder holds ``data`` (the corpus link ``demo_ablation.py`` makes) and ``TASK/<predictions file>`` per task.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from mmoe.io import write_json
from mmoe.pipeline.benchmarks import BENCHMARKS
from mmoe.pipeline.compare import compared_files, format_comparison
from mmoe.pipeline.layout import PipelineRun
from mmoe.pipeline.settings import DEMO
from mmoe.pipeline.stages import PipelineError
from mmoe.tasks.layout import RunLayout


def compare_folders(pretrained: Path, random_init: Path) -> list[dict]:
    """The comparison rows of every benchmark whose predictions both folders hold, scored on ``pretrained``'s
    corpus link."""
    run = PipelineRun(pretrained, DEMO)
    rows = []
    for benchmark in BENCHMARKS:
        files = [
            RunLayout(folder / benchmark.name).predictions(benchmark.predictions)
            for folder in (pretrained, random_init)
        ]
        if all(path.exists() for path in files):
            rows += compared_files(run, benchmark.name, *files)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "pretrained", type=Path, help="demo_ablation.py folder fine-tuned from the pre-trained backbone"
    )
    parser.add_argument("random_init", type=Path, help="the same fine-tunings from the random backbone")
    parser.add_argument("--out", type=Path, help="write the rows here as JSON")
    args = parser.parse_args()
    try:
        rows = compare_folders(args.pretrained, args.random_init)
    except PipelineError as error:
        print(f"demo_seed_compare.py: error: {error}", file=sys.stderr)
        raise SystemExit(2) from None
    if args.out:
        write_json(args.out, rows)
    print(format_comparison({"pre-trained vs random init": rows}))
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
