"""MoMa's modality-aware expert pools (``MoEPlan.experts_by_modality``): each modality's MoE FFN has its own number
of experts and routes only that modality's tokens (expert choice inside each pool, against a per-token, per-expert
top-C loop: outputs and every gradient), the counts of ``mmoe info`` against a hand count, and the plans refused."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mmoe.commands.info import variant_name
from mmoe.model import MoEPlan, MultiwayConfig, MultiwayTransformer
from mmoe.model.config import config_from_dict, config_to_dict
from mmoe.model.cost import backbone_cost, backbone_parameters, layer_cost
from tests.moe.reference import reference_forward

ROOT = Path(__file__).resolve().parents[2]

POOLS = {"vision": 4, "language": 8}


def moma_plan(**overrides) -> MoEPlan:
    fields = dict(num_experts=8, experts_by_modality=POOLS, routing="expert_choice", capacity_factor=1.0,
                  router="linear", every=1)  # fmt: skip
    return MoEPlan(**fields | overrides)


def realistic_(backbone: MultiwayTransformer, seed: int = 0) -> None:
    """Weights at the scale of a trained layer: routers that separate the tokens, experts and projections at
    1/sqrt(fan-in), LayerNorms near 1 (the from-scratch init's 0.02 would make every gate nearly uniform)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in backbone.named_parameters():
            noise = torch.randn(parameter.shape, generator=generator, dtype=parameter.dtype)
            if "router" in name:
                parameter.copy_(noise)
            elif parameter.ndim == 1 and "norm" in name and name.endswith("weight"):
                parameter.copy_(1 + 0.1 * noise)
            elif parameter.ndim == 1:
                parameter.copy_(0.1 * noise)
            else:
                parameter.copy_(noise / math.sqrt(parameter.shape[-1]))


def test_each_modality_gets_its_own_pool_and_the_vl_ffn_keeps_num_experts():
    config = MultiwayConfig.preset("test", vl_layers=1, moe=moma_plan(num_experts=6))
    slots = [
        (slot.index, slot.modality, slot.layer.config.num_experts) for slot in MultiwayTransformer(config).moe_layers()
    ]
    assert slots == [(0, "vision", 4), (0, "language", 8), (1, "vision", 4), (1, "language", 8), (1, "shared", 6)]
    language_only = MultiwayConfig.preset("test", moe=moma_plan(experts_by_modality={"language": 2}))
    assert [slot.layer.config.num_experts for slot in MultiwayTransformer(language_only).moe_layers()][:2] == [8, 2]


def test_a_saved_config_reads_back_with_its_pools():
    config = MultiwayConfig.preset("test", moe=moma_plan())
    assert config_from_dict(config_to_dict(config)).moe.experts_by_modality == POOLS


@pytest.mark.parametrize(
    "overrides,message",
    [
        (dict(mode="shared"), r"experts_by_modality=.* with mode='shared': one shared MoE is one pool"),
        (dict(experts_by_modality={"audio": 4}), r"experts_by_modality\['audio'\]: unknown modality"),
        (dict(experts_by_modality={"vision": 0}), r"experts_by_modality\['vision'\] must be a positive integer"),
        (dict(experts_by_modality={"vision": True}), r"experts_by_modality\['vision'\] must be a positive integer"),
        (dict(experts_by_modality={}), r"experts_by_modality must map"),
        (dict(routing="token_choice", capacity_factor=None, top_k=6),
         r"experts_by_modality\['vision'\]=4: RoutingChoices.top_k=6 exceeds RoutingChoices.num_experts=4"),
        (dict(routing="token_choice", capacity_factor=None, expert_groups=8, top_groups=2),
         r"experts_by_modality\['vision'\]=4: RoutingChoices.expert_groups=8: must divide num_experts=4"),
        (dict(expert_parallel=2), r"with expert_parallel=2: pools of different sizes are not expert-sharded"),
    ],
)  # fmt: skip
def test_pools_that_make_no_sense_are_refused_in_one_line(overrides, message):
    with pytest.raises(ValueError, match=message) as error:
        moma_plan(**overrides)
    assert "\n" not in str(error.value)


def test_info_counts_each_pool_as_a_hand_count_does():
    """Test preset: D = 32, FFN 64 with Sub-LN, linear router, expert choice c = 1 (one expert per token on average),
    every layer MoE."""
    config = MultiwayConfig.preset("test", moe=moma_plan())
    expert = 2 * 32 * 64 + 64 + 32 + 2 * 64  # both linears with biases, Sub-LN over 64
    vision_pool, language_pool = 4 * expert + 32 * 4, 8 * expert + 32 * 8  # experts + a 32 x N linear router
    attention_way = 2 * 32 + 3 * 32 * 32 + 3 * 32 + 2 * 32 + 32 * 32 + 32
    layer = layer_cost(config, 0)
    assert layer["parameters"] == 2 * attention_way + 2 * 2 * 32 + vision_pool + language_pool
    backbone = MultiwayTransformer(config)
    assert backbone_parameters(config) == sum(p.numel() for p in backbone.parameters())
    active = {m: attention_way + 2 * 32 + expert + 32 * n for m, n in POOLS.items()}  # pre-FFN LN, 1 expert, router
    flops = {m: 8 * 32 * 32 + 2 * 32 * n + 4 * 32 * 64 for m, n in POOLS.items()}
    for modality, n in POOLS.items():
        assert layer["by_modality"][modality] == {
            "experts": n, "active_parameters_per_token": active[modality], "flops_per_token": flops[modality]
        }  # fmt: skip
    assert (layer["active_parameters_per_token"], layer["max_active_parameters_per_token"]) == (
        active["vision"],
        active["language"],
    )
    assert (layer["flops_per_token"], layer["max_flops_per_token"]) == (flops["vision"], flops["language"])
    totals = backbone_cost(config, sequence_length=10)["by_modality"]
    assert totals["language"]["flops_per_token"] == 2 * flops["language"]
    assert totals["vision"]["active_parameters_per_token"] == 2 * active["vision"] + 2 * 32  # + its final LayerNorm
    assert variant_name(config) == "Switch, 4 vision / 8 language experts, expert choice c=1"


@pytest.mark.parametrize("capacity", [1.0, 2.0])
def test_each_pool_routes_only_its_modality_as_a_per_token_expert_choice_loop(capacity):
    torch.manual_seed(0)
    config = MultiwayConfig.preset("test", moe=moma_plan(capacity_factor=capacity))
    backbone = MultiwayTransformer(config).double()
    realistic_(backbone)
    block = backbone.layers[0]
    generator = torch.Generator().manual_seed(1)
    image = torch.randn(2, 5, 32, generator=generator, dtype=torch.double)
    text = torch.randn(2, 6, 32, generator=generator, dtype=torch.double)
    padding = torch.zeros(2, 6, dtype=torch.bool)
    padding[1, 4:] = True

    inputs = [image.clone().requires_grad_(True), text.clone().requires_grad_(True)]
    image_out, text_out, records = block(*inputs, padding, None)
    inputs_ref = [image.clone().requires_grad_(True), text.clone().requires_grad_(True)]
    outputs_ref, counts_ref = reference_block(block, inputs_ref, padding)

    assert [(record.modality, record.expert_counts.numel()) for record in records] == [("vision", 4), ("language", 8)]
    for record, counts, tokens in zip(records, counts_ref, (10, 12), strict=True):
        assert torch.equal(record.expert_counts, counts)  # each pool's experts took their top-C of its tokens only
        assert record.expert_counts.tolist() == [math.ceil(capacity * tokens / record.expert_counts.numel())] * len(
            counts
        )
    real = ~padding
    torch.testing.assert_close(image_out, outputs_ref[0])
    torch.testing.assert_close(text_out[real], outputs_ref[1][real])

    grads = [torch.randn_like(image), torch.randn_like(text)]
    params = list(block.parameters())
    loss = (image_out * grads[0]).sum() + (text_out * grads[1])[real].sum()
    loss_ref = (outputs_ref[0] * grads[0]).sum() + (outputs_ref[1] * grads[1])[real].sum()
    got = torch.autograd.grad(loss, [*inputs, *params], allow_unused=True)
    want = torch.autograd.grad(loss_ref, [*inputs_ref, *params], allow_unused=True)
    names = ["image", "text"] + [name for name, _ in block.named_parameters()]
    checked = 0
    for name, g, w in zip(names, got, want, strict=True):
        assert (g is None) == (w is None), name
        if g is not None:
            torch.testing.assert_close(g, w, msg=lambda m, name=name: f"gradient of {name}: {m}")
            checked += 1
    assert checked == len(names)  # every router, expert and projection of both pools is trained


def reference_block(block, inputs: list[torch.Tensor], padding: torch.Tensor):
    """The block's attention, then each modality's FFN input through its own pool by the per-token loop of
    :func:`tests.moe.reference.reference_forward` (each expert picks its top-C tokens of that modality):
    (outputs, each pool's expert loads)."""
    attended = block.attention(list(enumerate(inputs)), None)
    outputs, loads = [], []
    for modality, (x, update) in enumerate(zip(inputs, attended, strict=True)):
        hidden = x + update
        mask = padding if modality == 1 else None
        y, _, load, _ = reference_forward(block.ffn[modality], block.ffn_norm[modality](hidden), mask)
        outputs.append(hidden + y)
        loads.append(load)
    return outputs, loads


@pytest.mark.parametrize("pools", ["{vision: 1000000, language: 8}", "{vision: 4, language: 3000000}"])
def test_a_pool_beyond_host_memory_is_refused_in_one_line_by_mmoe_fit(tmp_path, pools):
    """``mmoe fit`` with a MoMa pool whose experts cannot fit in this host's memory ends in one line naming the
    parameter count and the memory (exit 2) before any is allocated, not in the allocator's error after tracebacks.
    A subprocess, so that the allocation, if it were tried, could not take this process's memory."""
    variant = tmp_path / "pools.yaml"
    variant.write_text(f"model:\n  init_args:\n    backbone:\n      moe:\n        experts_by_modality: {pools}\n")
    configs = ["configs/pretrain/tiny.yaml", "configs/pretrain/tiny/moma.yaml", str(variant)]
    command = [sys.executable, "-m", "mmoe.cli", "fit", *(f"--config={c}" for c in configs)]
    command.append(f"--trainer.default_root_dir={tmp_path / 'run'}")
    environment = os.environ | {"OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    result = subprocess.run(command, cwd=ROOT, env=environment, capture_output=True, text=True, timeout=300)
    assert result.returncode == 2, result.stderr[-2000:]
    assert "Traceback" not in result.stderr, result.stderr[-2000:]
    line = result.stderr.strip().splitlines()[-1]
    assert line.startswith("mmoe fit: error: MultiwayConfig: ") and "parameters need" in line, line
    assert "GiB of memory" in line and "moe.experts_by_modality" in line
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_on_the_meta_device_a_backbone_beyond_host_memory_is_still_built():
    """Shapes only: nothing is allocated, so nothing is refused."""
    plan = MoEPlan(num_experts=4, top_k=1, every=1, experts_by_modality={"vision": 1_000_000, "language": 4})
    config = MultiwayConfig.preset("tiny", moe=plan)
    with torch.device("meta"):
        backbone = MultiwayTransformer(config)
    assert sum(p.numel() for p in backbone.parameters()) == backbone_parameters(config)
