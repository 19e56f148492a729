"""The AdamW update of a task's parameters: torch's fused kernel (what
:func:`mmoe.runtime.optimizer.adamw_with_schedule` picks for plain CPU / CUDA parameters) against the for-each and
per-parameter implementations.

The parameters are those of the default demo's captioning task (``mmoe demo``: the backbone its settings train, read
from the tiny MH-MoE configs with ``DEMO``'s overrides, and the head over the synthetic captions' token ids) in mmoe's
parameter groups with the task config's weight decay; their gradients are random and fixed. One optimiser per
implementation, timed in one process, interleaved round by round, median of the rounds. The text embedding's 49,410
rows are most of the parameters.

Output: one JSON line per implementation ``{"implementation", "parameters", "step_s"}``, then ``{"comparison":
"default_step / fused_step", "ratio"}`` and ``{"comparison": "foreach_step / fused_step", "ratio"}``.

Run: ``.venv/bin/python benchmarks/optimizer_step.py [--rounds 15] [--device cpu|cuda]``
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

from mmoe.config.launch import read_config
from mmoe.data.converters.build_captions import CAPTION_TOKENS_FILE, write_caption_tokens
from mmoe.model import MultiwayConfig
from mmoe.model.config import config_from_dict
from mmoe.pipeline.launch import pretrain_configs
from mmoe.pipeline.settings import DEMO
from mmoe.runtime.optimizer import parameter_groups
from mmoe.tasks.captioning import CaptioningFineTuning

sys.path.insert(0, str(Path(__file__).resolve().parent))
from caption_head import masked_caption_batch, synthetic_captions  # noqa: E402
from timing import interleaved_medians  # noqa: E402

IMPLEMENTATIONS = {"fused": {"fused": True}, "foreach": {"foreach": True}, "default": {"foreach": False}}


def demo_backbone() -> MultiwayConfig:
    """The backbone the default demo pre-trains and fine-tunes: the tiny MH-MoE configs with ``DEMO``'s overrides."""
    configured = read_config(pretrain_configs("mhmoe")).fit.model.init_args.backbone.as_dict()
    return config_from_dict(configured | dict(DEMO.backbone) | {"image_size": DEMO.image_size})


def demo_captioning_step() -> Callable[[], None]:
    """One training step of the default demo's captioning on the CPU, as a function: forward, backward of the
    masked-token loss and the fused AdamW update (the demo's backbone, image size and batch 32 over the synthetic
    captions' output vocabulary), gradients set to None before each step as Lightning does."""
    texts = synthetic_captions(2000)
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        write_caption_tokens(tmp, texts)
        model = CaptioningFineTuning(backbone=demo_backbone(), output_vocab=str(Path(tmp) / CAPTION_TOKENS_FILE))
    optimizer = torch.optim.AdamW(parameter_groups(model, model.optimizer_config), lr=2e-4, fused=True)
    batch = masked_caption_batch(texts, 32, DEMO.image_size, torch.Generator().manual_seed(0))

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        logits, _ = model.forward_batch(batch)
        model.task_loss(logits, batch).backward()
        optimizer.step()

    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    args = parser.parse_args()

    backbone = demo_backbone()
    torch.manual_seed(0)
    optimizers = {}
    with tempfile.TemporaryDirectory() as tmp:
        write_caption_tokens(tmp, synthetic_captions(2000))
        for name, options in IMPLEMENTATIONS.items():
            module = CaptioningFineTuning(backbone=backbone, output_vocab=str(Path(tmp) / CAPTION_TOKENS_FILE))
            module = module.to(args.device)
            for parameter in module.parameters():
                parameter.grad = torch.randn_like(parameter)
            optimizers[name] = torch.optim.AdamW(parameter_groups(module, module.optimizer_config), lr=2e-4, **options)
    parameters = sum(parameter.numel() for parameter in module.parameters())
    seconds = interleaved_medians([optimizer.step for optimizer in optimizers.values()], args.rounds, args.device)
    step = dict(zip(optimizers, seconds, strict=True))
    for name, value in step.items():
        print(json.dumps({"implementation": name, "parameters": parameters, "step_s": value}))
    for other in ("default", "foreach"):
        print(json.dumps({"comparison": f"{other}_step / fused_step", "ratio": step[other] / step["fused"]}))


if __name__ == "__main__":
    main()
