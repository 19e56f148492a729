"""Backbone step time and tokens/s: dense vs X-MoE vs MH-MoE, and against torchscale's released BEiT3.

All models of a shape are timed in one process, interleaved round by round (the order alternating), median of the
rounds; a step is forward + backward of ``(hidden * fixed_grad).sum()`` plus the balance losses for MoE models, fp32
on CPU. MoE models use 8 experts in every other layer (per-modality MoE), X-MoE routing, top-1, dropless.

Shapes:

* ``tiny``: 192 wide, 4 layers, 3 heads, FFN 768, 64 px images (17 image tokens) + 32 text tokens, batch 16.
* ``small``: 256 wide, 4 layers, 4 heads, FFN 1024, 128 px (65 image tokens) + 32 text tokens, batch 64, so that
  every expert gets >= 256 tokens on average (520 image, 256 text).
* ``--cuda``: BEiT-3 base, batch 128, 224 px + 64 text tokens, bf16 autocast, on the GPU.

Output: one JSON line per model ``{"shape", "model", "step_s", "tokens_per_s"}``, one per comparison
``{"comparison", "ratio", "target", "ok"}``, and a final summary line.

Run: ``.venv/bin/python benchmarks/backbone.py [--rounds 5] [--shapes tiny small] [--cuda]``
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from collections.abc import Callable
from pathlib import Path

import torch

from mmoe.model import MoEPlan, MultiwayConfig, MultiwayTransformer

sys.path.insert(0, str(Path(__file__).resolve().parent))
from timing import interleaved_medians  # noqa: E402

SHAPES = {
    "tiny": dict(config=dict(dim=192, depth=4, num_heads=3, ffn_dim=768, image_size=64), batch=16, text=32),
    "small": dict(config=dict(dim=256, depth=4, num_heads=4, ffn_dim=1024, image_size=128), batch=64, text=32),
    "base": dict(config=dict(dim=768, depth=12, num_heads=12, ffn_dim=3072, image_size=224), batch=128, text=64),
}
VARIANTS = {
    "dense": None,
    "xmoe": MoEPlan(num_experts=8, every=2),
    "mhmoe_h4": MoEPlan(num_experts=8, every=2, heads=4),
}


def torchscale_beit3(config: MultiwayConfig):
    """torchscale's BEiT3 at the same shape, or None when torchscale is not installed."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from torchscale.architecture.config import EncoderConfig
            from torchscale.model.BEiT3 import BEiT3
    except ImportError:
        return None
    args = EncoderConfig(
        encoder_embed_dim=config.dim,
        encoder_attention_heads=config.num_heads,
        encoder_ffn_embed_dim=config.ffn_dim,
        encoder_layers=config.depth,
        img_size=config.image_size,
        patch_size=config.patch_size,
        vocab_size=config.vocab_size,
        multiway=True,
        subln=True,
        normalize_output=True,
        no_output_layer=True,
        layernorm_embedding=False,
        max_source_positions=config.max_text_positions + 2,  # its text positions start at 2 (fairseq offset)
    )
    return BEiT3(args)


def make_step(model, batch: dict, grad: torch.Tensor, torchscale: bool, autocast: bool) -> Callable[[], None]:
    device_type = grad.device.type

    def step() -> None:
        with torch.autocast(device_type, dtype=torch.bfloat16, enabled=autocast):
            if torchscale:
                hidden = model(
                    textual_tokens=batch["text"],
                    visual_tokens=batch["image"],
                    text_padding_position=batch["padding"],
                )["encoder_out"]
                loss = (hidden.float() * grad).sum()
            else:
                out = model(image=batch["image"], text=batch["text"], text_padding_mask=batch["padding"])
                loss = (out.hidden.float() * grad).sum() + sum(r.balance_loss for r in out.routing)
        loss.backward()
        model.zero_grad(set_to_none=True)

    return step


def run_shape(name: str, rounds: int, device: str) -> list[dict]:
    spec = SHAPES[name]
    torch.manual_seed(0)
    batch_size, text_len = spec["batch"], spec["text"]
    base_config = MultiwayConfig(**spec["config"], max_text_positions=max(64, text_len))
    batch = {
        "image": torch.randn(batch_size, 3, base_config.image_size, base_config.image_size, device=device),
        "text": torch.randint(0, 49408, (batch_size, text_len), device=device),
        "padding": torch.zeros(batch_size, text_len, dtype=torch.bool, device=device),
    }
    tokens = batch_size * (base_config.num_patches + 1 + text_len)
    grad = torch.randn(batch_size, base_config.num_patches + 1 + text_len, base_config.dim, device=device)
    autocast = device == "cuda"
    models: dict[str, Callable[[], None]] = {}
    for variant, plan in VARIANTS.items():
        config = MultiwayConfig(**spec["config"], max_text_positions=max(64, text_len), moe=plan)
        model = MultiwayTransformer(config).to(device)
        models[variant] = make_step(model, batch, grad, torchscale=False, autocast=autocast)
    reference = torchscale_beit3(base_config)
    if reference is not None:
        models["torchscale_beit3"] = make_step(reference.to(device), batch, grad, torchscale=True, autocast=autocast)

    seconds = dict(zip(models, interleaved_medians(list(models.values()), rounds, device), strict=True))
    results = [
        {"shape": name, "model": model, "step_s": round(s, 4), "tokens_per_s": round(tokens / s), "tokens": tokens}
        for model, s in seconds.items()
    ]
    dense = seconds["dense"]
    targets = {"xmoe": 1.15 if name == "small" else None, "mhmoe_h4": None}
    for variant in ("xmoe", "mhmoe_h4"):
        if variant in seconds:
            ratio = seconds[variant] / dense
            target = targets[variant]
            results.append(
                {
                    "comparison": f"{name}: {variant} step / dense step",
                    "ratio": round(ratio, 3),
                    "target": target,
                    "ok": None if target is None else ratio <= target,
                }
            )
    if "torchscale_beit3" in seconds:
        speedup = seconds["torchscale_beit3"] / dense
        target = {"tiny": 1.3, "base": 2.0}.get(name)
        results.append(
            {
                "comparison": f"{name}: mmoe dense tokens/s / torchscale BEiT3 tokens/s",
                "ratio": round(speedup, 3),
                "target_min": target,
                "ok": None if target is None else speedup >= target,
            }
        )
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--shapes", nargs="*", default=["tiny", "small"], choices=["tiny", "small"])
    parser.add_argument("--cuda", action="store_true", help="also run the base shape on the GPU in bf16")
    args = parser.parse_args()
    results = []
    runs = [(shape, "cpu") for shape in args.shapes] + ([("base", "cuda")] if args.cuda else [])
    for shape, device in runs:
        for result in run_shape(shape, args.rounds, device):
            results.append(result)
            print(json.dumps(result), flush=True)
    checked = [r for r in results if r.get("ok") is not None]
    print(
        json.dumps(
            {
                "summary": {r["comparison"]: r["ratio"] for r in results if "comparison" in r},
                "all_ok": all(r["ok"] for r in checked),
                "threads": torch.get_num_threads(),
            }
        )
    )


if __name__ == "__main__":
    main()
