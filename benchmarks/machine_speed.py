"""This machine's speed today: a fixed workload whose seconds go beside every timing in the docs and notes.

The same CPU reads differently from day to day (``import torch`` takes 1.1 user-seconds on a quick day and 1.9 on a
slow one), so a timing alone cannot be compared with another day's. Three fixed measurements, each the median of its
repeats:

* ``import_torch_user_s`` / ``import_torch_wall_s``: a fresh interpreter that runs ``import torch`` (user CPU
  seconds of the child process, and wall seconds);
* ``gemm_s``: one fp32 ``(1024 x 1024) @ (1024 x 1024)`` matrix product with torch's default threads (2.1 GFLOP);
* ``train_step_s``: one training step of the demo's backbone (the tiny config: width 192, 4 layers, 3 heads, FFN 768,
  64 px images; MH-MoE h 4, 8 experts top-1 in every other layer, X-MoE routing) on a batch of 32 images and 32
  text tokens: forward, the balance loss, backward and an AdamW step, gradients left as ``None`` as the optimiser
  leaves them.

Scaling a timing to another day: ``seconds * (reference / today)`` with the same measurement on both days; which
measurement to scale by is the one nearest the timed work (``import_torch_user_s`` for process starts,
``train_step_s`` for training).

Output: one JSON line ``{"import_torch_user_s", "import_torch_wall_s", "gemm_s", "gemm_gflops", "train_step_s",
"threads", "python", "torch"}``.

Run: ``.venv/bin/python benchmarks/machine_speed.py [--repeats 5]``
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

import torch

from mmoe.model import MoEPlan, MultiwayConfig, MultiwayTransformer

GEMM_SIDE = 1024
BATCH, TEXT_TOKENS = 32, 32
#: The demo's backbone (configs/pretrain/tiny.yaml) with its MH-MoE part (configs/pretrain/tiny/mhmoe.yaml).
DEMO_BACKBONE = dict(dim=192, depth=4, num_heads=3, ffn_dim=768, image_size=64, max_text_positions=64)
DEMO_PLAN = MoEPlan(num_experts=8, every=2, heads=4)


def import_torch_seconds() -> tuple[float, float]:
    """(user CPU seconds, wall seconds) of a fresh interpreter running ``import torch``."""
    before = os.times()
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import torch"], check=True)
    wall = time.perf_counter() - start
    after = os.times()
    return after.children_user - before.children_user, wall


def median_seconds(fn: Callable[[], object], repeats: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def gemm_step() -> Callable[[], object]:
    generator = torch.Generator().manual_seed(0)
    a = torch.randn(GEMM_SIDE, GEMM_SIDE, generator=generator)
    b = torch.randn(GEMM_SIDE, GEMM_SIDE, generator=generator)
    return lambda: a @ b


def train_step() -> Callable[[], None]:
    torch.manual_seed(0)
    config = MultiwayConfig(**DEMO_BACKBONE, moe=DEMO_PLAN)
    model = MultiwayTransformer(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)  # as mmoe.runtime.optimizer on CPU
    image = torch.randn(BATCH, 3, config.image_size, config.image_size)
    text = torch.randint(0, config.vocab_size, (BATCH, TEXT_TOKENS))
    padding = torch.zeros(BATCH, TEXT_TOKENS, dtype=torch.bool)
    padding[:, TEXT_TOKENS // 2 :] = torch.rand(BATCH, 1) < 0.5  # half the captions half as long

    def step() -> None:
        out = model(image=image, text=text, text_padding_mask=padding)
        loss = out.hidden.square().mean() + sum(routing.balance_loss for routing in out.routing)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def measure(repeats: int) -> dict:
    starts = [import_torch_seconds() for _ in range(repeats)]
    gemm = median_seconds(gemm_step(), repeats * 4)
    return {
        "import_torch_user_s": round(statistics.median(user for user, _ in starts), 3),
        "import_torch_wall_s": round(statistics.median(wall for _, wall in starts), 3),
        "gemm_s": round(gemm, 5),
        "gemm_gflops": round(2 * GEMM_SIDE**3 / gemm / 1e9, 1),
        "train_step_s": round(median_seconds(train_step(), repeats * 2), 4),
        "threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "torch": torch.__version__,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5, help="repeats of each measurement (median taken)")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error(f"--repeats {args.repeats}: expected at least 1")
    print(json.dumps(measure(args.repeats)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
