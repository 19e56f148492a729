"""Steps/s and final losses of the tiny pre-training configs, one after another in one process.

Runs ``mmoe fit`` with ``configs/pretrain/tiny.yaml`` and the variant's part ``configs/pretrain/tiny/<variant>.yaml``
(none for dense; their own corpus paths: build it first with
``mmoe data synth --out data/synthetic --shards`` and ``mmoe tokenizer fit --data data/synthetic/shards/pretrain-images
data/synthetic/shards/pretrain-pairs --out data/synthetic/codebook.pt``), ``--steps`` steps each, no validation and no
checkpoints, and prints one JSON line per variant ``{"variant", "steps", "seconds", "steps_per_s", "train/..."}`` with
the mean of the last 10 logged values of each loss, then a summary line.

Run: ``.venv/bin/python benchmarks/pretrain_tiny.py [--variants dense xmoe mhmoe] [--steps 100]``
"""

from __future__ import annotations

import argparse
import csv
import json
import tempfile
import time
from pathlib import Path

import yaml

from mmoe.cli import main as mmoe_main

ROOT = Path(__file__).resolve().parents[1]
LOSSES = ("train/loss", "train/image_loss", "train/text_loss", "train/pair_loss", "train/balance_loss")


def run(variant: str, steps: int, out: Path) -> dict:
    configs = [ROOT / "configs/pretrain/tiny.yaml"]
    if variant != "dense":
        configs.append(ROOT / f"configs/pretrain/tiny/{variant}.yaml")
    trainer = yaml.safe_load(configs[0].read_text())["trainer"]
    trainer.update(
        max_steps=steps,
        limit_val_batches=0,
        enable_checkpointing=False,
        enable_progress_bar=False,
        log_every_n_steps=1,
        default_root_dir=str(out),
    )
    trainer["logger"] = [
        {
            "class_path": "lightning.pytorch.loggers.CSVLogger",
            "init_args": {"save_dir": str(out), "name": "csv", "version": 0},
        }
    ]
    trainer["callbacks"] = [c for c in trainer["callbacks"] if "ModelCheckpoint" not in c["class_path"]]
    path = out / "config.yaml"  # over the shipped ones
    path.write_text(yaml.safe_dump({"trainer": trainer}))
    start = time.perf_counter()
    mmoe_main(["fit", *(f"--config={config}" for config in [*configs, path])])
    seconds = time.perf_counter() - start
    with open(out / "csv" / "version_0" / "metrics.csv") as handle:
        rows = list(csv.DictReader(handle))
    result = {
        "variant": variant,
        "steps": steps,
        "seconds": round(seconds, 1),
        "steps_per_s": round(steps / seconds, 3),
    }
    for name in LOSSES:
        values = [float(row[name]) for row in rows if row.get(name)]
        if values:
            result[name] = round(sum(values[-10:]) / len(values[-10:]), 3)
            result[name + "_first"] = round(sum(values[:10]) / len(values[:10]), 3)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variants", nargs="+", default=["dense", "xmoe", "mhmoe"])
    parser.add_argument("--steps", type=int, default=100)
    args = parser.parse_args()
    results = []
    for variant in args.variants:
        with tempfile.TemporaryDirectory() as out:
            result = run(variant, args.steps, Path(out))
        results.append(result)
        print(json.dumps(result), flush=True)
    print(
        json.dumps(
            {
                "summary": {
                    r["variant"]: {"steps_per_s": r["steps_per_s"], "train/loss": r.get("train/loss")} for r in results
                }
            }
        )
    )


if __name__ == "__main__":
    main()
