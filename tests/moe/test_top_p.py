"""Top-p dynamic routing (Huang et al., 2024) against a per-token loop written from the paper's §3: outputs, chosen
experts, the balance and dynamic losses, and every gradient, with padding; its controller of the mean number of
experts; its refusals, also from the real ``mmoe`` command."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import mmoe.moe.top_p as top_p_module
from mmoe.moe import MoEConfig, MoELayer
from mmoe.moe.top_p import TopPThreshold, controlled_p, top_p_choices
from tests.moe.reference import reference_expert, reference_scores

ROOT = Path(__file__).resolve().parents[2]
NUM_EXPERTS = 6


def make_layer(seed: int = 0, **fields) -> MoELayer:
    """float64, 6 experts, linear router logits of order 1-4 (X-MoE's cosine scores over its temperature are of
    that order already)."""
    torch.manual_seed(seed)
    config = {"dim": 16, "ffn_dim": 12, "num_experts": NUM_EXPERTS, "router": "linear", "renormalize": False}
    layer = MoELayer(MoEConfig(**{**config, "top_p": 0.6, "dynamic_loss_weight": 1e-2, **fields})).double()
    if layer.config.router == "linear":
        torch.nn.init.normal_(layer.router.scorer.weight, std=0.7)
    return layer


def reference_top_p(probs: torch.Tensor, p: float) -> list[int]:
    """Huang et al. §3.1: experts in descending probability, up to and including the one whose probability makes
    the running sum reach p."""
    chosen, total = [], 0.0
    for expert in sorted(range(probs.numel()), key=lambda e: -float(probs[e].detach())):
        chosen.append(expert)
        total += float(probs[expert].detach())
        if total >= p:
            break
    return chosen


def reference_forward(layer: MoELayer, x: torch.Tensor, padding: torch.Tensor):
    """Per token: y = sum over the chosen experts of P_e FFN_e(x) (renormalised if the config says so); the Switch
    balance loss N sum_i f_i P_i over first choices; the dynamic loss, the mean entropy of P, times its weight."""
    config, router = layer.config, layer.router
    p = float(router.top_p.p)
    y = torch.zeros_like(x)
    choices, rows = {}, []
    for b in range(x.shape[0]):
        for t in range(x.shape[1]):
            if padding[b, t]:
                continue
            gate_logits, balance_logits = reference_scores(router, config, x[b, t])
            probs = gate_logits.softmax(-1)
            chosen = reference_top_p(probs, p)
            total = sum(probs[e] for e in chosen) if config.renormalize else 1.0
            for e in chosen:
                y[b, t] = y[b, t] + probs[e] / total * reference_expert(layer.experts, e, x[b, t])
            choices[(b, t)] = chosen
            rows.append((chosen[0], balance_logits.softmax(-1), probs))
    n = len(rows)
    share = [sum(first == e for first, _, _ in rows) / n for e in range(NUM_EXPERTS)]
    mean_prob = sum(balance for _, balance, _ in rows) / n
    balance = NUM_EXPERTS * sum(share[e] * mean_prob[e] for e in range(NUM_EXPERTS))
    entropy = sum(-(probs * probs.log()).sum() for _, _, probs in rows) / n
    return y, choices, balance, config.dynamic_loss_weight * entropy


def assert_matches_reference(layer: MoELayer) -> None:
    torch.manual_seed(5)
    x = torch.randn(2, 7, 16, dtype=torch.double, requires_grad=True)
    padding = torch.zeros(2, 7, dtype=torch.bool)
    padding[1, 4:] = True
    y, record = layer(x, padding)
    want_y, want_choices, want_balance, want_dynamic = reference_forward(layer, x, padding)
    torch.testing.assert_close(y[~padding], want_y[~padding])
    got_choices = {key: [e for e in record.expert_index[key][0].tolist() if e >= 0] for key in want_choices}
    assert got_choices == want_choices
    counts = {len(chosen) for chosen in want_choices.values()}
    assert len(counts) > 1, f"want tokens with different numbers of experts, got {counts}"
    assert (record.expert_index[padding] == -1).all()
    torch.testing.assert_close(record.balance_loss, want_balance)
    torch.testing.assert_close(record.auxiliary_losses["dynamic_loss"], want_dynamic)

    weights = torch.randn_like(y)
    objective = (y * weights).sum() + record.balance_loss + record.auxiliary_losses["dynamic_loss"]
    want_objective = (want_y * weights).sum() + want_balance + want_dynamic
    inputs = [x, *layer.parameters()]
    grads, want_grads = torch.autograd.grad(objective, inputs), torch.autograd.grad(want_objective, inputs)
    for got, want in zip(grads, want_grads, strict=True):
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize(
    "fields",
    [{}, {"router": "xmoe", "top_p": 0.5}, {"renormalize": True}, {"subln": True, "top_p": 0.8}],
    ids=["linear", "xmoe", "renormalised", "subln"],
)
def test_top_p_matches_the_per_token_reference(fields) -> None:
    assert_matches_reference(make_layer(**fields))


def test_the_reference_fails_when_the_expert_reaching_p_is_left_out(monkeypatch) -> None:
    """The broken selection stops before the expert whose probability reaches p."""

    def without_the_crossing_expert(probs_SE, p):
        expert_SE, weight_SE = original(probs_SE, p)
        sorted_SE = probs_SE.sort(dim=-1, descending=True).values
        crossed_SE = (sorted_SE.cumsum(dim=-1) >= p)[:, : expert_SE.shape[1]]
        crossed_SE[:, 0] = False
        expert_SE = torch.where(crossed_SE, torch.full_like(expert_SE, probs_SE.shape[-1]), expert_SE)
        return expert_SE, torch.where(crossed_SE, torch.zeros_like(weight_SE), weight_SE)

    original = top_p_module.top_p_choices
    monkeypatch.setattr(top_p_module, "top_p_choices", without_the_crossing_expert)
    with pytest.raises(AssertionError):
        assert_matches_reference(make_layer())


def test_choices_include_the_expert_reaching_p_and_keep_the_columns_used() -> None:
    probs = torch.tensor([[0.125, 0.75, 0.125, 0.0], [0.25, 0.125, 0.5, 0.125], [0.0625, 0.0625, 0.125, 0.75]])
    expert, weight = top_p_choices(probs, 0.625)
    # 0.75 reaches 0.625 alone; 0.5 does not, 0.5 + 0.25 does; K = 2, the most used, not E = 4.
    assert expert.tolist() == [[1, 4], [2, 0], [3, 4]]
    assert weight.tolist() == [[0.75, 0.0], [0.5, 0.25], [0.75, 0.0]]
    assert top_p_choices(probs, 0.75)[0].tolist() == [[1, 4], [2, 0], [3, 4]]  # a sum equal to p reaches it


def _stream(steps: int, seed: int = 0):
    """Batches of softmax distributions over 8 experts whose logits grow sharper over the stream, as a router's do
    in training, so that a fixed p would drift off the target."""
    generator = torch.Generator().manual_seed(seed)
    for step in range(steps):
        sharpness = 1.0 + 2.0 * step / steps
        logits = sharpness * torch.randn(256, 8, generator=generator, dtype=torch.double)
        yield logits.softmax(-1).requires_grad_()


@pytest.mark.parametrize("target", [1.5, 3.0])
def test_controller_moves_p_the_right_way_and_holds_the_target(target: float) -> None:
    threshold = TopPThreshold(0.4, target, rate=0.5).train()
    means, ps = [], []
    for probs in _stream(300):
        expert, weight = threshold(probs, None)
        weight.sum().backward()  # closes the measurement: p moves at the next forward
        means.append(float((expert < 8).sum(-1).double().mean()))
        ps.append(float(threshold.p))
    first_direction = math.copysign(1.0, ps[3] - 0.4)
    assert first_direction == math.copysign(1.0, target - means[0]), (means[0], ps[:4])
    last = sum(means[-50:]) / 50
    assert abs(last - target) <= 0.05 * target, (last, ps[-1])


def test_p_moves_in_training_only_and_after_a_backward() -> None:
    threshold = TopPThreshold(0.4, 3.0, rate=0.5).train()
    probs = next(_stream(1))
    threshold(probs, None)
    threshold(probs, None)  # a second forward before any backward (a recomputation) routes with the same p
    assert float(threshold.p) == pytest.approx(0.4)
    threshold(probs, None)[1].sum().backward()
    threshold(probs, None)
    moved = float(threshold.p)
    assert moved > 0.4
    threshold.eval()
    threshold(probs, None)[1].sum().backward()
    threshold(probs, None)
    assert float(threshold.p) == moved  # evaluation routes with the frozen p


@pytest.mark.parametrize("frozen", [False, True])
def test_frozen_routing_keeps_p(frozen: bool) -> None:
    """X-MoE's frozen routing (fine-tuning) freezes p with the router; otherwise three steps move it."""
    layer = make_layer(target_active_experts=4.0, frozen=frozen).train()
    x = torch.randn(2, 7, 16, dtype=torch.double, requires_grad=True)
    for _ in range(3):
        layer(x, None)[0].sum().backward()
    assert (float(layer.router.top_p.p) == 0.6) == frozen


def test_controlled_p_stays_a_probability_and_the_buffer_is_saved() -> None:
    p = torch.tensor(0.5, dtype=torch.double)
    assert 0 < float(controlled_p(p, torch.tensor(1.0), 8.0, 1e3)) < 1
    assert 0 < float(controlled_p(p, torch.tensor(8.0), 1.0, 1e3)) < 1
    layer = make_layer(target_active_experts=2.0)
    layer.router.top_p.p.fill_(0.73)
    layer.to(torch.bfloat16)  # a cast leaves p float64: bf16 would round the controller's steps away
    assert layer.router.top_p.p.dtype == torch.float64 and float(layer.router.top_p.p) == 0.73
    restored = make_layer(target_active_experts=2.0)
    restored.load_state_dict(layer.state_dict())
    assert float(restored.router.top_p.p) == 0.73


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"top_p": 1.5}, "MoEConfig.top_p=1.5: expected None or a probability"),
        ({"target_active_experts": 6.0}, "MoEConfig.target_active_experts=6.0: expected None or a mean"),
        ({"top_p": None, "target_active_experts": 2.0}, "the controller moves top_p"),
        ({"top_p": None}, "MoEConfig.dynamic_loss_weight=0.01: Huang et al.'s dynamic loss goes with top-p"),
        ({"gate": "sigmoid"}, "set gate: softmax"),
        ({"capacity_factor": 1.25}, "top-p routing is dropless"),
        ({"top_k": 2}, "leave top_k at 1"),
        ({"strata": [2, 4]}, "not defined for strata"),
        ({"bias_update_rate": 1e-3}, "loss-free bias"),
        ({"routing": "expert_choice", "capacity_factor": 2.0}, "MoEConfig.top_p=0.6"),
        ({"top_p_rate": 0.0}, "MoEConfig.top_p_rate=0.0"),
    ],
)
def test_refusals(fields, message) -> None:
    with pytest.raises(ValueError, match="^" + r".*" + message.replace(".", r"\.").replace("(", r"\(")):
        make_layer(**fields)


def test_mmoe_fit_refuses_a_bad_top_p_in_one_line(tmp_path) -> None:
    """The tiny top-p recipe with a target beyond its 8 experts: exit 2 and one line naming the field and value."""
    variant = tmp_path / "bad.yaml"
    variant.write_text("model:\n  init_args:\n    backbone:\n      moe:\n        target_active_experts: 9.0\n")
    parts = ("configs/pretrain/tiny.yaml", "configs/pretrain/tiny/top_p.yaml", variant)
    result = subprocess.run(
        [sys.executable, "-m", "mmoe.cli", "fit", *(f"--config={part}" for part in parts)],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    lines = result.stderr.strip().splitlines()
    assert (result.returncode, "Traceback" in result.stderr) == (2, False), result.stderr[-2000:]
    assert "MoEPlan.target_active_experts=9.0" in lines[-1] and "num_experts=8" in lines[-1], lines[-1]


def test_cost_counts_the_expected_experts_at_the_target_and_every_expert_at_most() -> None:
    from mmoe.model import MoEPlan, MultiwayConfig
    from mmoe.model.cost import layer_cost
    from mmoe.moe.cost import active_parameters_per_token, flops_per_token

    top_2 = MoEConfig(dim=64, ffn_dim=256, num_experts=8, top_k=2, router="linear")
    every = MoEConfig(dim=64, ffn_dim=256, num_experts=8, top_k=8, router="linear")
    top_p = MoEConfig(dim=64, ffn_dim=256, num_experts=8, router="linear", top_p=0.4, target_active_experts=2.0)
    assert flops_per_token(top_p) == flops_per_token(top_2)
    assert active_parameters_per_token(top_p) == active_parameters_per_token(top_2)
    fixed = MoEConfig(dim=64, ffn_dim=256, num_experts=8, router="linear", top_p=0.4)  # no target: the most
    assert flops_per_token(fixed) == flops_per_token(every)

    def moe_layer_cost(**fields):
        plan = MoEPlan(num_experts=8, every=2, router="linear", **fields)
        return layer_cost(MultiwayConfig.preset("tiny", moe=plan), 1)

    controlled, reference = moe_layer_cost(top_p=0.4, target_active_experts=2.0), moe_layer_cost(top_k=2)
    assert controlled["flops_per_token"] == reference["flops_per_token"]
    assert (
        controlled["max_flops_per_token"] == moe_layer_cost(top_k=8)["flops_per_token"] > reference["flops_per_token"]
    )


def test_active_experts_window_script_reads_the_last_window(tmp_path, capsys) -> None:
    import importlib.util
    import json

    spec = importlib.util.spec_from_file_location("active_experts_window", ROOT / "scripts/active_experts_window.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    windows = [
        {"step": 50, "active_experts": {"layer1/vision": [0, 10, 0]}},
        {"step": 100, "active_experts": {"layer1/vision": [0, 1, 3], "layer1/language": [0, 2, 2]}},
    ]
    (tmp_path / "routing_stats.json").write_text(json.dumps({"windows": windows}))
    assert script.main([str(tmp_path), "--target", "1.625", "--tolerance", "0.01"]) == 0  # (1 + 6 + 2 + 4) / 8
    assert "layer1/vision: 1.7500" in capsys.readouterr().out
    assert script.main([str(tmp_path), "--target", "1.0", "--tolerance", "0.05"]) == 1
