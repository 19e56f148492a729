"""The classification fine-tuning from the demo's pre-trained backbone against the same fine-tuning from a random
backbone of its architecture, over training seeds, under the plan fixed before the runs
(``docs/classification_seeds/plan.json``): per seed, ``scripts/demo_ablation.py imagenet`` from each start (the random
one drawn under the seed, as ``mmoe demo --random-init`` draws its own), the paired cluster bootstrap over the val
images (``scripts/demo_seed_compare.py``), then the per-seed top-1 differences' 95% paired t interval.

    .venv/bin/python scripts/classification_seeds.py runs/demo /tmp/classification_seeds --seeds 0 1 2
    .venv/bin/python scripts/classification_seeds.py runs/demo /tmp/classification_seeds --report-only \
        --ship docs/classification_seeds --page tasks/imagenet/README.md

``DEMO`` is a demo run folder with the corpus and the exported mhmoe backbone (``mmoe demo --out DEMO --stages corpus
codebook mhmoe/pretrain mhmoe/export``). Each seed's two runs and their comparison stay under ``OUT/seed<s>/``;
``OUT/results.json`` holds every number the table shows; ``--ship`` copies it beside the plan and ``--page`` writes
the table between the page's ``classification-seeds`` markers. A seed already scored is not run again.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import numpy as np

from mmoe.io import read_json, write_json
from mmoe.pipeline.layout import BACKBONE
from mmoe.pipeline.stages import StageKey
from mmoe.pipeline.standard_stages import random_backbone_stage
from mmoe.stats import t_975

sys.path.insert(0, str(Path(__file__).resolve().parent))
from marked_block import page_block, with_block  # noqa: E402, F401 (page_block: the tests read the page)

SCRIPTS = Path(__file__).resolve().parent
TASK = "imagenet"
VARIANT = "mhmoe"
STEPS = 300  # configs/finetune/imagenet_tiny.yaml's max_steps, the recipe under comparison
BEGIN, END = "<!-- classification-seeds:begin -->", "<!-- classification-seeds:end -->"
RESULTS = "results.json"


def fine_tune(backbone: Path, out: Path, corpus: Path, seed: int) -> dict:
    """``demo_ablation.py imagenet`` from ``backbone`` into ``out`` under ``seed`` (its ``result.json``, reused)."""
    if not (out / "result.json").is_file():
        command = [sys.executable, str(SCRIPTS / "demo_ablation.py"), TASK, str(backbone), str(out)]
        command += ["--corpus", str(corpus), "--steps", str(STEPS), "--seed", str(seed)]
        subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
    return read_json(out / "result.json", "ablation result")


def run_seed(demo: Path, out: Path, seed: int) -> dict:
    """Both starts fine-tuned and scored under ``seed``, and their paired comparison (``seed<s>/comparison.json``)."""
    folder = out / f"seed{seed}"
    pretrained = demo / "pretrain" / VARIANT / BACKBONE
    random = folder / "random-init" / BACKBONE
    if not random.is_file():
        random_backbone_stage(StageKey.of("random", str(seed)), pretrained, random, seed).run()
    scores = {
        "pretrained": fine_tune(pretrained, folder / "pretrained", demo / "data", seed)["scores"],
        "random_init": fine_tune(random, folder / "random", demo / "data", seed)["scores"],
    }
    comparison = folder / "comparison.json"
    if not comparison.is_file():
        command = [sys.executable, str(SCRIPTS / "demo_seed_compare.py"), str(folder / "pretrained")]
        command += [str(folder / "random"), "--out", str(comparison)]
        subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
    row = next(row for row in read_json(comparison, "comparison") if row["metric"] == "top-1 accuracy (%)")
    return {"seed": seed, "top1": {start: 100 * value["top1"] for start, value in scores.items()}, "paired": row}


def over_seeds(differences: list[float]) -> dict:
    """The plan's rule: the mean difference with its 95% paired t interval over the seeds, and the verdict."""
    n = len(differences)
    mean = float(np.mean(differences))
    half = t_975(n - 1) * float(np.std(differences, ddof=1)) / np.sqrt(n) if n > 1 else float("inf")
    interval = [mean - half, mean + half]
    verdict = "pre-trained ahead" if interval[0] > 0 else "random init ahead" if interval[1] < 0 else "not separated"
    return {"mean_difference": mean, "interval": interval, "verdict": verdict, "seeds": n}


def markdown(results: dict) -> str:
    """The results table and the verdict, every number read from ``results``."""
    lines = [
        "| seed | top-1 pre-trained (%) | top-1 random init (%) | difference (points) | 95% interval (images) "
        "| verdict |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for run in results["runs"]:
        paired, top1 = run["paired"], run["top1"]
        low, high = paired["interval"]
        lines.append(
            f"| {run['seed']} | {top1['pretrained']:.2f} | {top1['random_init']:.2f} | {paired['difference']:+.2f} "
            f"| [{low:+.2f}, {high:+.2f}] | {paired['verdict']} |"
        )
    summary = results["over_seeds"]
    low, high = summary["interval"]
    lines.append("")
    lines.append(
        f"Over the {summary['seeds']} seeds: mean difference {summary['mean_difference']:+.2f} points, 95% paired t "
        f"interval [{low:+.2f}, {high:+.2f}]: **{summary['verdict']}** (chance: the most common class "
        f"{results['chance_majority']:.2f}%)."
    )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("demo", type=Path, help="demo run folder (corpus and exported mhmoe backbone)")
    parser.add_argument("out", type=Path, help="folder of the runs and results.json")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--report-only", action="store_true", help="read OUT/results.json, run nothing")
    parser.add_argument("--ship", type=Path, help="copy results.json into this folder (docs/classification_seeds)")
    parser.add_argument("--page", type=Path, help="write the table between this page's classification-seeds markers")
    args = parser.parse_args()
    demo, out = args.demo.resolve(), args.out.resolve()
    if args.report_only:
        results = read_json(out / RESULTS, "results")
    else:
        runs = [run_seed(demo, out, seed) for seed in args.seeds]
        chance = read_json(demo / "data" / "synth.json", "corpus summary")["chance"]["classification_val"]
        results = {
            "plan": "docs/classification_seeds/plan.json",
            "steps": STEPS,
            "runs": runs,
            "over_seeds": over_seeds([run["paired"]["difference"] for run in runs]),
            "chance_majority": 100 * chance["accuracy_majority_class"],
        }
        write_json(out / RESULTS, results)
    text = markdown(results)
    if args.ship:
        write_json(args.ship / RESULTS, results)
    if args.page:
        args.page.write_text(with_block(args.page, BEGIN, END, text.rstrip("\n")), encoding="utf-8")
    print(text, end="")
    print(json.dumps(results["over_seeds"]))


if __name__ == "__main__":
    main()
