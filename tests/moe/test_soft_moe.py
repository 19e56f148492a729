"""Soft MoE (Puigcerver et al., 2024, §2) against a per-slot / per-token loop written from the paper's equations:
outputs and every gradient, with padding; the comparison fails when the dispatch softmax runs over the wrong axis;
padding is never dispatched; a multiway backbone trains with per-modality and shared slot pools; the cost formulas
count the layer's own parameters; the combinations it has no use for are refused in one line."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mmoe.commands.info import variant_name
from mmoe.metrics.routing_collect import RouterInputs
from mmoe.model import MoEPlan, MultiwayConfig, MultiwayTransformer
from mmoe.model.cost import attention_way_parameters, backbone_parameters, layer_cost
from mmoe.moe import MoEConfig, SoftMoELayer, build_moe_layer
from mmoe.moe import soft_moe as soft_moe_module
from mmoe.moe.cost import active_parameters_per_token, flops_per_token, moe_parameter_count
from mmoe.tasks.captioning import CaptioningFineTuning
from tests.moe.reference import reference_expert

EPS = 1e-6  # the authors' normalize: x * rsqrt(sum(x**2) + 1e-6)


def make_soft_layer(seed: int = 0, **fields) -> SoftMoELayer:
    """A float64 layer (D 8, 3 experts of 2 slots) whose logits are of order 1-4: the learned scale at 4 (the
    cosines are in [-1, 1]), so neither softmax is flat."""
    torch.manual_seed(seed)
    config = MoEConfig(
        **{"dim": 8, "ffn_dim": 12, "num_experts": 3, "routing": "soft", "slots_per_expert": 2, **fields}
    )
    layer = build_moe_layer(config).double()
    with torch.no_grad():
        layer.scale.fill_(4.0)
    return layer


def unit(vector: torch.Tensor) -> torch.Tensor:
    return vector / torch.sqrt((vector * vector).sum() + EPS)


def reference_soft_moe(layer: SoftMoELayer, x_LD: torch.Tensor, padded: list[bool]) -> torch.Tensor:
    """One sequence, by the paper's equations in plain loops: logits l_ts = <x_t / |x_t|, scale Phi_s / |Phi_s|>;
    slot s's input sum_t D_ts x_t with D_ts = exp l_ts / sum_t' exp l_t's over the real tokens; slot s's output
    expert s // p on it; token t's output sum_s C_ts y~_s with C_ts = exp l_ts / sum_s' exp l_ts'; 0 at padding."""
    slots, per_expert = layer.num_slots, layer.config.slots_per_expert
    length = x_LD.shape[0]
    phis = [layer.scale * unit(layer.slot_embeddings[:, s]) for s in range(slots)]
    logits = [[(unit(x_LD[t]) * phis[s]).sum() for s in range(slots)] for t in range(length)]
    real = [t for t in range(length) if not padded[t]]
    slot_outputs = []
    for s in range(slots):
        if real:
            norm = sum(torch.exp(logits[t][s]) for t in real)
            slot_input = sum(torch.exp(logits[t][s]) / norm * x_LD[t] for t in real)
        else:
            slot_input = torch.zeros_like(x_LD[0])
        slot_outputs.append(reference_expert(layer.experts, s // per_expert, slot_input))
    outputs = []
    for t in range(length):
        if padded[t]:
            outputs.append(torch.zeros_like(x_LD[t]))
            continue
        norm = sum(torch.exp(logits[t][s]) for s in range(slots))
        outputs.append(sum(torch.exp(logits[t][s]) / norm * slot_outputs[s] for s in range(slots)))
    return torch.stack(outputs)


def padding_mask() -> torch.Tensor:
    """Three sequences of 5: one full, one with two padded tokens, one of padding only."""
    mask = torch.zeros(3, 5, dtype=torch.bool)
    mask[1, 3:] = True
    mask[2] = True
    return mask


def compare_with_reference(layer: SoftMoELayer, padded: bool = True) -> None:
    """Outputs and the gradients of every parameter and of the input, with :func:`padding_mask` or none."""
    layer.zero_grad()
    torch.manual_seed(1)
    mask = padding_mask()
    x = torch.randn(3, 5, 8, dtype=torch.double, requires_grad=True)
    target = torch.randn(3, 5, 8, dtype=torch.double)
    y, _ = layer(x, mask if padded else None)
    mask = mask if padded else torch.zeros_like(mask)
    (y * target).sum().backward()
    got = {name: p.grad.clone() for name, p in layer.named_parameters()} | {"x": x.grad.clone()}
    layer.zero_grad()
    x_ref = x.detach().clone().requires_grad_(True)
    expected_y = torch.stack([reference_soft_moe(layer, x_ref[b], mask[b].tolist()) for b in range(3)])
    (expected_y * target).sum().backward()
    expected = {name: p.grad for name, p in layer.named_parameters()} | {"x": x_ref.grad}
    torch.testing.assert_close(y, expected_y)
    for name, grad in expected.items():
        torch.testing.assert_close(got[name], grad, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("subln", [False, True], ids=["plain", "subln"])
def test_soft_moe_matches_the_per_slot_reference_outputs_and_every_gradient(subln):
    layer = make_soft_layer(subln=subln)
    with torch.no_grad():  # the combine and dispatch weights are far from uniform
        logits = layer.logits(torch.randn(4, 5, 8, dtype=torch.double))
    assert logits.abs().max() > 1.0
    compare_with_reference(layer)
    compare_with_reference(layer, padded=False)


def test_the_reference_comparison_fails_when_the_dispatch_softmax_runs_over_slots(monkeypatch):
    layer = make_soft_layer()
    compare_with_reference(layer)  # as built, equal

    def over_slots(logits_BLS, valid_BL):
        return torch.softmax(logits_BLS, dim=-1) * (1.0 if valid_BL is None else valid_BL[..., None])

    monkeypatch.setattr(soft_moe_module, "dispatch_weights", over_slots)
    with pytest.raises(AssertionError):
        compare_with_reference(layer)


def test_the_reference_comparison_fails_without_the_normalisation(monkeypatch):
    layer = make_soft_layer()
    monkeypatch.setattr(soft_moe_module, "inverse_norm", lambda x, dim: torch.ones_like(x.sum(dim, keepdim=True)))
    with pytest.raises(AssertionError):
        compare_with_reference(layer)


def test_padding_is_never_dispatched_and_gets_zero():
    layer = make_soft_layer()
    mask = padding_mask()
    x = torch.randn(3, 5, 8, dtype=torch.double)
    changed = x.clone()
    changed[mask] = 100 * torch.randn(int(mask.sum()), 8, dtype=torch.double)
    y, routing = layer(x, mask)
    y_changed, _ = layer(changed, mask)
    assert torch.equal(y, y_changed)  # padding values change nothing, not even by rounding
    assert not y.isnan().any() and (y[mask] == 0).all()
    dispatch = soft_moe_module.dispatch_weights(layer.logits(x), ~mask)
    assert (dispatch[mask] == 0).all()
    torch.testing.assert_close(dispatch[:2].sum(1), torch.ones(2, layer.num_slots, dtype=torch.double))
    # Two sequences with a real token feed each expert's 2 slots; the padding-only one feeds none.
    assert routing.expert_counts.tolist() == [4, 4, 4]
    assert (routing.expert_index[mask] == -1).all() and (routing.expert_index[~mask] >= 0).all()
    assert routing.balance_loss == 0 and routing.z_loss == 0 and routing.token_mask.equal(~mask)
    assert 0 < routing.router_entropy < math.log(layer.num_slots)


def test_each_sample_is_mixed_alone():
    """Soft MoE's groups are sequences: a sample's outputs do not depend on the samples beside it."""
    layer = make_soft_layer()
    x = torch.randn(4, 6, 8, dtype=torch.double)
    together, _ = layer(x)
    alone, _ = layer(x[2:3])
    torch.testing.assert_close(together[2:3], alone)


@pytest.mark.parametrize("mode", ["per_modality", "shared"])
def test_a_multiway_backbone_trains_with_soft_moe_slot_pools(mode):
    """per_modality: each modality's Soft MoE mixes only its own tokens (image slots, text slots); shared: one pool
    mixes the image and text tokens of each sequence."""
    torch.manual_seed(0)
    plan = MoEPlan(num_experts=4, routing="soft", slots_per_expert=2, every=1, mode=mode)
    config = MultiwayConfig.preset("test", moe=plan)
    model = MultiwayTransformer(config)
    assert sum(p.numel() for p in model.parameters()) == backbone_parameters(config)
    seen: dict[str, int] = {}
    for slot in model.moe_layers():
        assert isinstance(slot.layer, SoftMoELayer)
        slot.layer.register_forward_pre_hook(lambda m, args, key=slot.modality: seen.update({key: args[0].shape[1]}))
    image, text = torch.randn(2, 3, 32, 32), torch.randint(0, 100, (2, 6))
    text_padding = torch.zeros(2, 6, dtype=torch.bool)
    text_padding[1, 4:] = True
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    before = {name: p.detach().clone() for name, p in model.named_parameters() if "slot_embeddings" in name}
    out = model(image=image, text=text, text_padding_mask=text_padding)
    (out.hidden * torch.randn_like(out.hidden)).pow(2).mean().backward()
    optimizer.step()
    image_tokens = config.num_patches + 1
    expected = {"vision": image_tokens, "language": 6} if mode == "per_modality" else {"shared": image_tokens + 6}
    assert seen == expected
    assert {record.modality for record in out.routing} == set(expected)
    assert all(not torch.equal(before[name], p) for name, p in model.named_parameters() if name in before)
    assert RouterInputs(model).layers == {}  # no router to capture: Soft MoE layers are left out


def test_cost_counts_the_layer_and_scales_with_the_sequence():
    config = MoEConfig(dim=8, ffn_dim=12, num_experts=3, routing="soft", slots_per_expert=2, subln=True)
    layer = build_moe_layer(config)
    assert moe_parameter_count(config) == sum(p.numel() for p in layer.parameters())
    assert active_parameters_per_token(config) == moe_parameter_count(config)
    slots, expert = 6, 2 * 2 * 8 * 12
    # Logits, dispatch and combine (2 d n p each), the experts' n p slots over m tokens.
    assert flops_per_token(config, tokens=6) == 3 * 2 * 8 * slots + expert
    assert flops_per_token(config, tokens=12) == 3 * 2 * 8 * slots + expert // 2
    with pytest.raises(ValueError, match="give tokens"):
        flops_per_token(config)


@pytest.mark.parametrize("mode", ["per_modality", "shared"])
def test_mmoe_info_counts_each_pool_at_the_tokens_it_mixes(mode):
    """A vision Soft MoE FFN mixes the image's tokens, a language one the text's, a shared one both."""
    plan = MoEPlan(num_experts=4, routing="soft", slots_per_expert=2, every=1, mode=mode)
    config = MultiwayConfig.preset("test", moe=plan)
    image, text = config.num_patches + 1, 11
    layer = layer_cost(config, 0, sequence_length=image + text)
    moe = plan.layer_config(config.dim, config.ffn_dim, config.subln)
    attention, norm = 2 * 4 * config.dim**2, 2 * config.dim
    tokens = [image, text] if mode == "per_modality" else [image + text]
    flops = [attention + flops_per_token(moe, tokens=m) for m in tokens]
    assert (layer["flops_per_token"], layer["max_flops_per_token"]) == (min(flops), max(flops))
    assert layer["active_parameters_per_token"] == attention_way_parameters(config) + moe_parameter_count(moe) + norm
    assert variant_name(config) == "Soft MoE, 4 experts x 2 slots per sequence"


@pytest.mark.parametrize(
    "fields,named",
    [
        (dict(top_k=2), "top_k=2 with routing='soft'"),
        (dict(capacity_factor=1.0), "capacity_factor=1.0 with routing='soft'"),
        (dict(strata=[2, 2], top_k=2), "strata"),
        (dict(heads=2), "heads=2 with routing='soft'"),
        (dict(shared_experts=1), "shared_experts=1 with routing='soft'"),
        (dict(bias_update_rate=0.01), "bias_update_rate=0.01 with routing='soft'"),
        (dict(balance_batch="global"), "balance_batch='global' with routing='soft'"),
        (dict(expert_groups=2), "expert_groups=2"),
        (dict(slots_per_expert=0), "slots_per_expert must be a positive integer"),
        (dict(routing="token_choice", slots_per_expert=2), "slots_per_expert=2: needs routing: soft"),
    ],
)
def test_combinations_soft_moe_has_no_use_for_are_one_line(fields, named):
    message = refusal({"routing": "soft"} | fields)
    assert named in message and "\n" not in message


def refusal(fields: dict) -> str:
    """The one-line error of a Soft MoE layer config with ``fields``."""
    try:
        MoEConfig(dim=16, ffn_dim=32, num_experts=4, **fields)
    except ValueError as error:
        return str(error)
    raise AssertionError(f"{fields} was accepted")


def test_expert_parallel_and_captioning_refuse_soft_moe():
    with pytest.raises(ValueError, match="expert_parallel=2 with routing='soft'"):
        MoEPlan(num_experts=4, routing="soft", expert_parallel=2)
    backbone = MultiwayConfig.preset("test", moe=MoEPlan(num_experts=4, every=1, routing="soft"))
    with pytest.raises(ValueError, match="routing='soft' is refused for captioning: its text is causal") as error:
        CaptioningFineTuning(backbone=backbone, max_length=8)
    assert "\n" not in str(error.value)


def test_mmoe_fit_refuses_soft_moe_captioning_in_one_line(tmp_path):
    """The real command in a subprocess, on the shipped captioning config with a crafted part that turns on Soft
    MoE: exit 2, one line naming the field, nothing written."""
    root = Path(__file__).resolve().parents[2]
    part = tmp_path / "soft.yaml"
    part.write_text("model:\n  init_args:\n    backbone:\n      moe:\n        routing: soft\n")
    captioning = root / "configs" / "finetune" / "captioning_tiny.yaml"
    environment = {**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "mmoe.cli", "fit", "--config", str(captioning), "--config", str(part)],
        capture_output=True,
        text=True,
        env=environment,
        cwd=tmp_path,
        timeout=300,
    )
    assert done.returncode == 2, done.stderr[-2000:]
    assert "Traceback" not in done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("mmoe fit: error: model.backbone.moe.routing='soft' is refused for captioning")
    assert list(tmp_path.iterdir()) == [part]


def test_pretraining_with_soft_moe_fits_and_logs_its_routing(tmp_path):
    """A few masked pre-training steps (image, text and image-text batches, text padding) with the routing
    statistics callback on: finite losses, statistics written for every Soft MoE layer."""
    import lightning as L
    from torch.utils.data import DataLoader

    from mmoe.runtime.routing_callback import RoutingStatsCallback
    from mmoe.tasks.pretraining import MaskedPretraining
    from mmoe.tasks.visual_codebook import fit_codebook
    from tests.tasks.test_pretraining import BACKBONE, images, make_batches

    torch.manual_seed(0)
    codebook = tmp_path / "codebook.pt"
    fit_codebook([images(64)], size=16, patch_size=16, pool=2, iterations=5).save(codebook)
    plan = MoEPlan(num_experts=4, routing="soft", slots_per_expert=2, every=1)
    task = MaskedPretraining(MultiwayConfig(**BACKBONE, moe=plan), str(codebook))
    batches = make_batches(3)
    quiet = {"logger": False, "enable_checkpointing": False, "enable_progress_bar": False}
    callbacks = [RoutingStatsCallback(every_n_steps=3, save_dir=tmp_path)]
    trainer = L.Trainer(max_steps=6, accelerator="cpu", default_root_dir=tmp_path, callbacks=callbacks, **quiet)
    trainer.fit(task, DataLoader(batches * 2, batch_size=None, shuffle=False))
    for batch in batches:
        losses, routing = task.masked_losses(batch)
        assert all(torch.isfinite(loss) for loss in losses.values()) and routing
    assert (tmp_path / "routing_stats.json").is_file()
