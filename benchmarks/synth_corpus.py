"""Building the synthetic corpus (``mmoe data synth --shards``) in worker processes against one process.

One JSON line: the median seconds over ``--rounds`` rounds to generate the corpus of ``--size`` and convert every
split, with ``--workers`` processes and with one (alternating which goes first), and their ratio (workers / one).
The demo's corpus is ``--size small --nlvr2-eval-sets 400``.

Run: ``.venv/bin/python benchmarks/synth_corpus.py [--size small] [--nlvr2-eval-sets 400] [--workers 2] [--rounds 3]``
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

from mmoe.data.synth.convert import convert_layout
from mmoe.data.synth.corpus import SIZES, SynthSizes, build_corpus

sys.path.insert(0, str(Path(__file__).resolve().parent))
from timing import interleaved_medians  # noqa: E402


def corpus_builder(folder: Path, sizes: SynthSizes, workers: int):
    def build() -> None:
        shutil.rmtree(folder, ignore_errors=True)
        build_corpus(folder, 0, sizes, workers)
        convert_layout(folder, folder / "shards", workers=workers)

    return build


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=tuple(SIZES), default="small")
    parser.add_argument("--nlvr2-eval-sets", type=int, default=400, help="as the demo's corpus (400)")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    sizes = dataclasses.replace(SIZES[args.size], nlvr2_eval_sets=args.nlvr2_eval_sets)
    with tempfile.TemporaryDirectory() as scratch:
        builders = [corpus_builder(Path(scratch) / "one", sizes, 1)]
        builders.append(corpus_builder(Path(scratch) / "workers", sizes, args.workers))
        one, workers = interleaved_medians(builders, args.rounds, warmup=0)
    print(json.dumps({"case": "synth_corpus", "size": args.size, "nlvr2_eval_sets": args.nlvr2_eval_sets,
                      "workers": args.workers, "one_process_s": round(one, 2), "workers_s": round(workers, 2),
                      "ratio": round(workers / one, 3)}))  # fmt: skip


if __name__ == "__main__":
    main()
