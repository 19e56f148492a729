"""A Mixture-of-Depths layer (``MultiwayConfig.depth_routing``, :mod:`mmoe.model.depth_router`) against its floor.

Three sides, one multiway block each, timed interleaved (median of the rounds), a step being forward + backward of
``(image_out * g).sum() + (text_out * g').sum()`` in fp32 on the CPU:

* ``plain``: the block on every image token and the text;
* ``routed``: the depth-routed block at capacity C (the router, the gather of the kept tokens, the block on them and
  the text, the weighted scatter back);
* ``floor``: the plain block on ceil(C n) + 1 image tokens and the text, what the routed block cannot beat.

The shape: 192 wide, 3 heads, FFN 768 (the tiny backbone's layer) at 224 px (196 patches + CLS) and 32 text tokens,
batch 8. Output: one JSON line per side and capacity ``{"case", "capacity", "step_s"}``, then per capacity
``{"comparison", "ratio", "target", "ok"}`` (routed / floor, target 1.25) and the routed block's speed-up over the
plain one.

Run: ``.venv/bin/python benchmarks/depth_routing.py [--rounds 20] [--capacities 0.5 0.125] [--cpu-time]``
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from mmoe.model import MultiwayConfig, MultiwayTransformer
from mmoe.model.depth_router import DepthRouting

sys.path.insert(0, str(Path(__file__).resolve().parent))
from timing import interleaved_medians  # noqa: E402

SHAPE = dict(dim=192, depth=1, num_heads=3, ffn_dim=768, image_size=224, patch_size=16)
BATCH, TEXT = 8, 32
TARGET = 1.25


def block(capacity: float | None):
    routing = None if capacity is None else DepthRouting(capacity=capacity, layers=[0])
    torch.manual_seed(0)
    return MultiwayTransformer(MultiwayConfig.preset("tiny", **SHAPE, depth_routing=routing)).layers[0]


def step_of(layer, image_tokens: int):
    generator = torch.Generator().manual_seed(1)
    image = torch.randn(BATCH, image_tokens, SHAPE["dim"], generator=generator, requires_grad=True)
    text = torch.randn(BATCH, TEXT, SHAPE["dim"], generator=generator, requires_grad=True)
    grads = torch.randn_like(image), torch.randn_like(text)

    def step() -> None:
        image_out, text_out, _ = layer(image, text, None, None)
        ((image_out * grads[0]).sum() + (text_out * grads[1]).sum()).backward()

    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--capacities", type=float, nargs="+", default=[0.5, 0.125])
    parser.add_argument("--cpu-time", action="store_true", help="time by this thread's CPU seconds, one torch thread")
    args = parser.parse_args()
    if args.cpu_time:
        torch.set_num_threads(1)
    clock = time.thread_time if args.cpu_time else time.perf_counter
    patches = (SHAPE["image_size"] // SHAPE["patch_size"]) ** 2
    plain = block(None)
    for capacity in args.capacities:
        routing = DepthRouting(capacity=capacity, layers=[0])
        steps = {
            "plain": step_of(plain, 1 + patches),
            "routed": step_of(block(capacity), 1 + patches),
            "floor": step_of(plain, 1 + routing.kept(patches)),
        }
        medians = dict(zip(steps, interleaved_medians(list(steps.values()), args.rounds, clock=clock), strict=True))
        for case, seconds in medians.items():
            print(json.dumps({"case": case, "capacity": capacity, "step_s": round(seconds, 6)}))
        ratio = medians["routed"] / medians["floor"]
        comparison = f"C={capacity:g}: routed step / floor step"
        print(json.dumps({"comparison": comparison, "ratio": round(ratio, 3), "target": TARGET, "ok": ratio <= TARGET}))
        speedup = medians["plain"] / medians["routed"]
        print(json.dumps({"comparison": f"C={capacity:g}: plain step / routed step", "ratio": round(speedup, 3)}))


if __name__ == "__main__":
    main()
