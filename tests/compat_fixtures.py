"""Write the routing-compatibility fixtures of one mmoe version under ``tests/fixtures/<short sha>/``.

Run with the version whose files later versions must still read (its tree first on the path), e.g.::

    git worktree add --detach /tmp/old 251ec97
    PYTHONPATH=/tmp/old python tests/compat_fixtures.py --out tests/fixtures/251ec97

It writes, for two tiny MoE backbones that between them set most routing options (X-MoE with MH-MoE heads, top-2,
a capacity with batch priority, DeepSeek's all-choice balance loss, LIMoE's entropy losses; a linear router with a
sigmoid gate, loss-free balancing, group-limited top-k, routed scaling and a shared expert):

* ``routing.yaml``: an ``mmoe fit`` config whose ``moe`` part holds the first backbone's flat routing keys;
* ``<name>_backbone.pt``: the backbone as ``export_backbone`` writes it (its config as a dict);
* ``<name>_hparams.ckpt``: a Lightning-style checkpoint whose ``hyper_parameters`` hold the config as the pickled
  ``MultiwayConfig`` / ``MoEPlan`` instances (what a task built outside LightningCLI saves);
* ``<name>_export/``: what ``mmoe export --backbone-only`` writes from that checkpoint;
* ``outputs.pt``: the backbone's hidden states, balance losses and expert choices on :func:`fixed_input`, for the
  backbone built from the config (seeded) and for each weights file (all three give the same weights).
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import torch
import yaml

from mmoe.cli import main
from mmoe.model import MoEPlan, MultiwayConfig, MultiwayTransformer
from mmoe.model.config import config_to_dict
from mmoe.runtime.checkpoint import atomic_save, export_backbone

#: A backbone small enough that each weights file stays a few hundred kB.
SHAPE = dict(dim=16, depth=2, num_heads=2, ffn_dim=32, image_size=16, patch_size=8, vocab_size=64, max_text_positions=8)

PLANS = {
    "xmoe": dict(
        num_experts=4, top_k=2, router="xmoe", gate="softmax", heads=2, routing_dim=4, capacity_factor=1.5,
        eval_capacity_factor=1.0, capacity_priority="batch_priority", balance_choices="all",
        local_entropy_weight=0.01, global_entropy_weight=0.02, global_entropy_min_experts=2.0, router_jitter=0.01,
        every=1, mode="per_modality",
    ),
    "linear": dict(
        num_experts=4, top_k=2, router="linear", gate="sigmoid", renormalize=False, bias_update_rate=0.001,
        expert_groups=2, top_groups=1, group_score="top_sum", routed_scaling_factor=2.0, shared_experts=1,
        beta=0.5, balance_batch="sequence", every=2, mode="shared",
    ),
}  # fmt: skip

SEED = 0


def fixed_input() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(1234)
    image = torch.randn(2, 3, 16, 16, generator=generator)
    text = torch.randint(0, 64, (2, 6), generator=generator)
    padding = torch.zeros(2, 6, dtype=torch.bool)
    padding[1, 4:] = True
    return {"image": image, "text": text, "text_padding_mask": padding}


def outputs_of(backbone: MultiwayTransformer) -> dict[str, torch.Tensor]:
    backbone.eval()
    with torch.no_grad():
        out = backbone(**fixed_input())
    return {
        "hidden": out.hidden,
        "balance_loss": torch.stack([record.balance_loss for record in out.routing]),
    } | {f"expert_index_{i}": record.expert_index for i, record in enumerate(out.routing)}


def backbone_config(name: str) -> MultiwayConfig:
    return MultiwayConfig(**SHAPE, moe=MoEPlan(**PLANS[name]))


def seeded_backbone(config: MultiwayConfig) -> MultiwayTransformer:
    torch.manual_seed(SEED)
    return MultiwayTransformer(config)


def write_config(out: Path) -> None:
    config = {
        "seed_everything": SEED,
        "trainer": {"max_steps": 1, "accelerator": "cpu"},
        "model": {
            "class_path": "mmoe.tasks.pretraining.MaskedPretraining",
            "init_args": {"backbone": {**SHAPE, "moe": PLANS["xmoe"]}, "visual_codebook": "codebook.pt"},
        },
    }
    (out / "routing.yaml").write_text(yaml.safe_dump(config, sort_keys=False))


def main_(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    write_config(out)
    outputs = {}
    for name in PLANS:
        config = backbone_config(name)
        backbone = seeded_backbone(config)
        outputs[name] = outputs_of(backbone)
        export_backbone(backbone, out / f"{name}_backbone.pt")
        state = {f"backbone.{key}": value for key, value in backbone.state_dict().items()}
        atomic_save({"state_dict": state, "hyper_parameters": {"backbone": config}}, out / f"{name}_hparams.ckpt")
        code = main(["export", "--ckpt", str(out / f"{name}_hparams.ckpt"), "--out", str(out / f"{name}_export"),
                     "--backbone-only"])  # fmt: skip
        assert code == 0, code
        assert config_to_dict(config)["moe"] == dataclasses.asdict(config.moe)
    torch.save(outputs, out / "outputs.pt")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    main_(parser.parse_args().out)
