"""Training steps with freed host memory kept for reuse (:func:`mmoe.host_memory.keep_freed_memory`, what the ``mmoe``
command does) against glibc's default thresholds.

A step is the default demo's captioning fine-tuning step on the CPU: forward, backward of the masked-token loss and
the fused AdamW update of the demo's captioning task (``mmoe demo``'s backbone, its image size, the synthetic
captions' output vocabulary, batch 32), gradients set to None between steps as Lightning does. Each setting runs in
its own process (glibc's thresholds cannot be put back once set), the two alternating for ``--rounds`` rounds; each
process times ``--steps`` steps after 3 warm-up steps and reads its own page faults and system time
(``getrusage``).

Output: one JSON line per process ``{"keep_freed_memory", "step_s", "minor_faults_per_step", "system_s_per_step",
"max_rss_mb"}``, then the medians over rounds as ``{"comparison": "kept_step / default_step", "ratio"}`` and
``{"comparison": "kept_minor_faults / default_minor_faults", "ratio"}``.

Run: ``.venv/bin/python benchmarks/host_memory.py [--rounds 3] [--steps 20] [--threads 1]``
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

SETTINGS = {"default": "0", "kept": "1"}  # MMOE_KEEP_FREED_MEMORY


def child(steps: int, threads: int) -> dict:
    import torch

    from mmoe.host_memory import keep_freed_memory

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from optimizer_step import demo_captioning_step

    kept = keep_freed_memory()
    torch.set_num_threads(threads)
    step = demo_captioning_step()

    for _ in range(3):
        step()
    before, start = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    for _ in range(steps):
        step()
    seconds, after = time.perf_counter() - start, resource.getrusage(resource.RUSAGE_SELF)
    return {
        "keep_freed_memory": kept,
        "step_s": round(seconds / steps, 4),
        "minor_faults_per_step": round((after.ru_minflt - before.ru_minflt) / steps),
        "system_s_per_step": round((after.ru_stime - before.ru_stime) / steps, 4),
        "max_rss_mb": round(after.ru_maxrss / 1024),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.steps, args.threads)))
        return
    results: dict[str, list[dict]] = {name: [] for name in SETTINGS}
    for _ in range(args.rounds):
        for name, value in SETTINGS.items():
            environment = {key: item for key, item in os.environ.items() if not key.startswith("MALLOC_")}
            done = subprocess.run(
                [sys.executable, __file__, "--child", "--steps", str(args.steps), "--threads", str(args.threads)],
                env=environment | {"MMOE_KEEP_FREED_MEMORY": value}, capture_output=True, text=True, check=True,
            )  # fmt: skip
            line = json.loads(done.stdout.splitlines()[-1])
            results[name].append(line)
            print(json.dumps(line), flush=True)
    for field, comparison in (("step_s", "kept_step / default_step"),
                              ("minor_faults_per_step", "kept_minor_faults / default_minor_faults")):  # fmt: skip
        kept, default = (statistics.median(line[field] for line in results[name]) for name in ("kept", "default"))
        print(json.dumps({"comparison": comparison, "ratio": round(kept / default, 3)}))


if __name__ == "__main__":
    main()
