"""Training epochs whose DataLoader worker is forked from the training process against one forked from a fork server
(:func:`mmoe.pipeline.pool.start_data_workers_from_a_server`, what the demo's and the studies' pool processes do).

A step is the default demo's captioning fine-tuning step on the CPU (``benchmarks/host_memory.py``'s: forward,
backward and the fused AdamW update, batch 32, gradients set to None between steps), with freed host memory kept for
reuse as the ``mmoe`` command does. An epoch starts a DataLoader with one worker, as each epoch and each prediction of
a fine-tuning does, and takes ``--steps`` steps, each drawing one batch from it: the demo's NLVR2 training batches
(32 pairs of 64 px images) over the tiny synthetic corpus with 400 training pairs, decoded by the worker on the other
core meanwhile. The two start methods alternate epoch by epoch in one process for ``--rounds`` rounds
after one warm-up epoch of each; each epoch reads this process's CPU seconds, system seconds and minor page faults
(``getrusage``) and its wall seconds.

Output: one JSON line per epoch ``{"start_method", "epoch_s", "cpu_s", "system_s", "minor_faults"}``, then the
medians as ``{"comparison": "server_epoch / forked_epoch", "ratio"}``, ``{"comparison": "server_cpu / forked_cpu",
"ratio"}`` and ``{"comparison": "server_minor_faults / forked_minor_faults", "ratio"}``.

Run: ``.venv/bin/python benchmarks/data_workers.py [--rounds 3] [--steps 20] [--threads 1]``
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import multiprocessing
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

METHODS = ("fork", "forkserver")


def nlvr2_loader(shards: Path) -> torch.utils.data.DataLoader:
    """The demo's NLVR2 training loader (batch 32 pairs, 64 px, one worker) over the tiny synthetic corpus."""
    from mmoe.data.datamodules import NLVR2DataModule
    from mmoe.pipeline.settings import DEMO

    module = NLVR2DataModule(
        train_shards=str(shards / "nlvr2-train"), image_size=DEMO.image_size, batch_size=32, num_workers=1
    )
    return module.train_dataloader()


def epoch(step, steps: int, method: str, shards: Path) -> dict:
    multiprocessing.set_start_method(method, force=True)
    loader = nlvr2_loader(shards)
    before, start = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    batches = itertools.cycle(loader)
    for _ in range(steps):
        next(batches)
        step()
    del batches  # the worker stops, as at an epoch's end
    seconds, after = time.perf_counter() - start, resource.getrusage(resource.RUSAGE_SELF)
    cpu = after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime
    return {
        "start_method": method,
        "epoch_s": round(seconds, 3),
        "cpu_s": round(cpu, 3),
        "system_s": round(after.ru_stime - before.ru_stime, 3),
        "minor_faults": after.ru_minflt - before.ru_minflt,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()

    from mmoe.data.synth.convert import convert_layout
    from mmoe.data.synth.corpus import SIZES, build_corpus
    from mmoe.host_memory import keep_freed_memory
    from mmoe.pipeline.pool import start_data_workers_from_a_server

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from optimizer_step import demo_captioning_step

    keep_freed_memory()
    start_data_workers_from_a_server("fork")
    torch.set_num_threads(args.threads)
    step = demo_captioning_step()
    with tempfile.TemporaryDirectory() as tmp:
        shards = Path(tmp) / "shards"
        build_corpus(Path(tmp), seed=0, sizes=dataclasses.replace(SIZES["tiny"], nlvr2_train_sets=100))
        convert_layout(Path(tmp), shards, shard_size=64)
        for method in METHODS:  # warm-up: the optimiser's state, the fork server's start
            epoch(step, 3, method, shards)
        results: dict[str, list[dict]] = {method: [] for method in METHODS}
        for _ in range(args.rounds):
            for method in METHODS:
                line = epoch(step, args.steps, method, shards)
                results[method].append(line)
                print(json.dumps(line), flush=True)
    for field, name in (("epoch_s", "epoch"), ("cpu_s", "cpu"), ("minor_faults", "minor_faults")):
        server, forked = (statistics.median(line[field] for line in results[method]) for method in METHODS[::-1])
        comparison = f"server_{name} / forked_{name}"
        print(json.dumps({"comparison": comparison, "ratio": round(server / forked, 3)}))


if __name__ == "__main__":
    multiprocessing.freeze_support()
    main()
