"""ReMoE's ReLU gates (Wang et al., 2025): the layer equals a per-token loop written from the paper's equations
(outputs, the experts each (sub-)token used, the adaptive L1 penalty, every gradient), a token whose gates are all zero
gets a zero update, the comparison fails when the gates are renormalised on purpose, the coefficient's update moves
the right way and holds a toy stream at its target, and bad combinations are refused in one line."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import mmoe.moe.router as router_module
from mmoe.moe import MoEConfig, MoELayer
from mmoe.moe.relu_routing import next_coefficient, relu_choices, target_sparsity
from tests.moe.reference import reference_expert

DIM, EXPERTS, TOP_K = 12, 6, 2
LAMBDA = 0.3  # a coefficient of order 1, so the penalty's gradient shows in the comparison


def relu_layer(balanced: bool = True, heads: int = 1, seed: int = 0) -> MoELayer:
    torch.manual_seed(seed)
    config = MoEConfig(
        dim=DIM, ffn_dim=20, num_experts=EXPERTS, top_k=TOP_K, renormalize=False, router="linear", gate="relu",
        relu_l1_balanced=balanced, heads=heads, relu_l1_initial=LAMBDA,
    )  # fmt: skip
    layer = MoELayer(config).double()
    with torch.no_grad():
        layer.router.scorer.weight.normal_(0.0, 1.0)  # logits of order 1-4, about half of them positive
    return layer


def reference_relu(layer: MoELayer, x: torch.Tensor, padding: torch.Tensor):
    """Per (sub-)token: g = ReLU(W_r x), y = sum over g_e > 0 of g_e FFN_e(x) (no renormalisation), the experts used
    best first, and lambda * L_reg: the mean L1 norm of g, or each mean gate times its load E/(k T) #{g_e > 0}."""
    config, router = layer.config, layer.router
    batch, length, _ = x.shape
    sub_x = (x if layer.multi_head is None else layer.multi_head(x)).reshape(batch, length, config.heads, -1)
    outputs = torch.zeros_like(sub_x)
    used, gates = {}, []
    for b in range(batch):
        for t in range(length):
            for h in range(config.heads):
                if padding[b, t]:
                    continue
                logits, _ = router.scorer.reference_scores(sub_x[b, t, h])
                g = torch.relu(logits)
                gates.append(g)
                used[b, t, h] = sorted((e for e in range(EXPERTS) if g[e] > 0), key=lambda e: -float(g[e].detach()))
                for e in used[b, t, h]:
                    outputs[b, t, h] = outputs[b, t, h] + g[e] * reference_expert(layer.experts, e, sub_x[b, t, h])
    y = outputs.reshape(batch, length, -1)
    y = y if layer.merge is None else layer.merge(y)
    tokens = len(gates)
    mean_gate = [sum(g[e] for g in gates) / tokens for e in range(EXPERTS)]
    if config.relu_l1_balanced:
        load = [sum(float(g[e] > 0) for g in gates) * EXPERTS / (TOP_K * tokens) for e in range(EXPERTS)]
        penalty = sum(load[e] * mean_gate[e] for e in range(EXPERTS))
    else:
        penalty = sum(mean_gate)
    return y, used, float(router.relu_l1_coefficient) * penalty


def assert_relu_matches_reference(layer: MoELayer, x: torch.Tensor, padding: torch.Tensor) -> None:
    y, routing = layer(x, padding)
    want_y, want_used, want_loss = reference_relu(layer, x, padding)
    loss = routing.auxiliary_losses["relu_l1_loss"]
    torch.testing.assert_close(y, want_y)
    torch.testing.assert_close(loss, want_loss)
    for (b, t, h), experts in want_used.items():
        index = routing.expert_index[b, t, h].tolist()
        assert index == experts + [-1] * (EXPERTS - len(experts)), (b, t, h)
    assert (routing.expert_index[padding] == -1).all()
    assert int(routing.expert_counts.sum()) == sum(len(experts) for experts in want_used.values())
    weights = torch.randn_like(y)
    inputs = [x, *layer.parameters()]
    grads = torch.autograd.grad((y * weights).sum() + 5 * loss, inputs, allow_unused=True)
    want = torch.autograd.grad((want_y * weights).sum() + 5 * want_loss, inputs, allow_unused=True)
    for got, expected in zip(grads, want, strict=True):
        torch.testing.assert_close(got, expected)


@pytest.mark.parametrize(("balanced", "heads"), [(True, 1), (False, 1), (True, 2)])
def test_relu_layer_matches_the_per_token_reference(balanced, heads):
    layer = relu_layer(balanced, heads)
    x = torch.randn(2, 5, DIM, dtype=torch.double, requires_grad=True)
    padding = torch.zeros(2, 5, dtype=torch.bool)
    padding[1, 3:] = True
    with torch.no_grad():
        _, routing = layer(x, padding)
    used = (routing.expert_index >= 0).sum(-1)[~padding]
    assert used.min() < used.max(), "want (sub-)tokens using different numbers of experts"
    assert_relu_matches_reference(layer, x, padding)


def test_a_token_with_every_gate_zero_gets_a_zero_update():
    layer = relu_layer()
    weight = layer.router.scorer.weight.detach()  # (E, D), rank E < D: a token whose logits are all -3
    silent = -3 * weight.t() @ torch.linalg.solve(weight @ weight.t(), torch.ones(EXPERTS, dtype=torch.double))
    x = torch.randn(1, 4, DIM, dtype=torch.double)
    x[0, 2] = silent
    x.requires_grad_(True)
    y, routing = layer(x)
    assert (routing.expert_index[0, 2] == -1).all() and (routing.expert_index[0, [0, 1, 3]] >= 0).any()
    assert torch.equal(y[0, 2], torch.zeros(DIM, dtype=torch.double))
    (grad,) = torch.autograd.grad(y.sum(), x)
    assert torch.equal(grad[0, 2], torch.zeros(DIM, dtype=torch.double))  # no gate open: no gradient either
    assert_relu_matches_reference(layer, x, torch.zeros(1, 4, dtype=torch.bool))


def test_renormalised_gates_break_the_comparison(monkeypatch):
    """The reference catches a ReLU router that renormalises its gates (a top-k habit ReMoE drops)."""

    def renormalised(logits_SE):
        gates_SE, expert_SK, weight_SK = relu_choices(logits_SE)
        return gates_SE, expert_SK, weight_SK / weight_SK.sum(-1, keepdim=True).clamp_min(1e-12)

    monkeypatch.setattr(router_module, "relu_choices", renormalised)
    layer = relu_layer()
    x = torch.randn(2, 5, DIM, dtype=torch.double, requires_grad=True)
    with pytest.raises(AssertionError):
        assert_relu_matches_reference(layer, x, torch.zeros(2, 5, dtype=torch.bool))


def test_coefficient_rises_while_dense_falls_while_sparse():
    target = target_sparsity(2, 8)
    assert target == 0.75
    assert next_coefficient(1e-3, 0.5, target, 1.2) == pytest.approx(1.2e-3)
    assert next_coefficient(1e-3, 0.9, target, 1.2) == pytest.approx(1e-3 / 1.2)
    assert next_coefficient(1e-3, target, target, 1.2) == 1e-3


def test_coefficient_holds_a_toy_stream_at_its_target():
    """A stream whose task loss rewards open gates; the penalty, its coefficient moved after every step, brings the
    mean number of experts used per token from about E/2 to k and keeps it there."""
    torch.manual_seed(0)
    config = MoEConfig(
        dim=16, ffn_dim=16, num_experts=8, top_k=2, renormalize=False, router="linear", gate="relu",
        relu_l1_initial=1e-3, relu_l1_multiplier=1.2,
    )  # fmt: skip
    router = MoELayer(config).router
    optimizer = torch.optim.SGD(router.parameters(), lr=0.5)
    coefficient, used_per_step, coefficients = config.relu_l1_initial, [], []
    for _ in range(200):
        x = torch.randn(128, 16) + 0.5
        routed = router(x, None)
        gates = routed.scores_SE
        loss = -0.05 * gates.sum(-1).mean() + routed.auxiliary_losses["relu_l1_loss"]
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        used = float((gates > 0).sum(-1).double().mean())
        coefficient = next_coefficient(coefficient, 1 - used / 8, target_sparsity(2, 8), 1.2)
        router.relu_l1_coefficient.fill_(coefficient)
        used_per_step.append(used)
        coefficients.append(coefficient)
    assert used_per_step[0] > 3  # about half of the gates open at the start
    assert coefficients[20] > coefficients[0]  # dense: the coefficient rises
    late = sum(used_per_step[-80:]) / 80
    assert abs(late - 2) < 0.1, late


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({"router": "xmoe"}, "router"),
        ({"renormalize": True}, "renormalize"),
        ({"capacity_factor": 1.0}, "capacity_factor"),
        ({"bias_update_rate": 0.01}, "bias_update_rate"),
        ({"strata": [2, 4]}, "strata"),
        ({"routing": "expert_choice", "capacity_factor": None}, "routing"),
    ],
)
def test_relu_gates_refuse_what_they_cannot_mean(fields, field):
    settings = {"renormalize": False, "router": "linear", "gate": "relu", **fields}
    with pytest.raises(ValueError, match=rf"^MoEConfig\.{field}=.* with gate='relu': ") as error:
        MoEConfig(dim=DIM, ffn_dim=20, num_experts=EXPERTS, top_k=TOP_K, **settings)
    assert "\n" not in str(error.value)


@pytest.mark.parametrize(("field", "value"), [("relu_l1_initial", 0.0), ("relu_l1_multiplier", 1.0)])
def test_bad_controller_settings_are_refused(field, value):
    with pytest.raises(ValueError, match=rf"^MoEConfig\.{field} must be a finite number"):
        MoEConfig(
            dim=DIM, ffn_dim=20, num_experts=EXPERTS, renormalize=False, router="linear", gate="relu", **{field: value}
        )


def test_coefficient_is_a_buffer_saved_only_with_relu_gates():
    layer = relu_layer()
    assert "router.relu_l1_coefficient" in layer.state_dict()
    assert not any(p is layer.router.relu_l1_coefficient for p in layer.parameters())
    plain = MoELayer(MoEConfig(dim=DIM, ffn_dim=20, num_experts=EXPERTS, router="linear"))
    assert "router.relu_l1_coefficient" not in plain.state_dict()
    assert not plain.config.may_choose_no_expert and layer.config.may_choose_no_expert


def test_the_command_refuses_relu_gates_on_the_xmoe_scorer_in_one_line():
    """The real ``mmoe`` command, in a subprocess: exit 2 and one line naming the field, its value and why."""
    argv = ["moe-info", "--moe.dim", "64", "--moe.ffn_dim", "256", "--moe.num_experts", "8", "--moe.gate", "relu"]
    argv += ["--moe.renormalize", "false"]  # the scorer stays X-MoE's default: refused
    done = subprocess.run([sys.executable, "-m", "mmoe.cli", *argv], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "router='xmoe' with gate='relu'" in lines[0] and "linear scorer" in lines[0], lines
