"""MoELayer against a per-token reference, a dense FFN, and the contract of DESIGN.md "MoE core"."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F

from mmoe.moe import MoEConfig, MoELayer, restore_expert_embedding_norm
from tests.moe.reference import assert_matches_reference, reference_forward

COMBINATIONS = list(itertools.product(("linear", "xmoe"), ("softmax", "sigmoid"), (1, 2), (1, 4), (None, 1.0)))
# top-k beyond 2 (fine-grained MoE routes many experts per token), up to every expert (E = 4).
COMBINATIONS += [
    ("linear", "softmax", 3, 1, None),
    ("xmoe", "sigmoid", 3, 2, 1.0),
    ("xmoe", "softmax", 4, 1, 0.75),
    ("linear", "sigmoid", 4, 4, None),
]


def make_layer(seed: int = 0, **overrides) -> MoELayer:
    torch.manual_seed(seed)
    fields = dict(dim=16, ffn_dim=12, num_experts=4)
    fields.update(overrides)
    layer = MoELayer(MoEConfig(**fields)).double()
    if layer.config.router == "linear":
        # Larger logits than the default init so the top-k choices are well separated from ties.
        torch.nn.init.normal_(layer.router.scorer.weight, std=1.0)
    return layer


def padded_input(seed: int = 1, batch: int = 2, length: int = 7, dim: int = 16):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, length, dim, generator=generator, dtype=torch.double)
    padding = torch.zeros(batch, length, dtype=torch.bool)
    padding[1, 4:] = True
    return x, padding


@pytest.mark.parametrize("router,gate,top_k,heads,capacity", COMBINATIONS)
def test_dispatch_matches_per_token_reference(router, gate, top_k, heads, capacity):
    layer = make_layer(router=router, gate=gate, top_k=top_k, heads=heads, capacity_factor=capacity)
    x, padding = padded_input()
    routing = assert_matches_reference(layer, x, padding)
    if capacity is None:
        assert routing.dropped_fraction.item() == 0.0


def test_capacity_drops_are_reported_and_left_out():
    layer = make_layer(router="linear", top_k=1, capacity_factor=0.5)
    x, _ = padded_input(length=16)
    y, routing = layer(x)
    capacity = 8  # ceil(0.5 * 1 * 32 / 4)
    assert routing.expert_counts.max().item() <= capacity
    dropped = (routing.expert_index == -1).sum().item()
    assert dropped > 0
    assert routing.dropped_fraction.item() == pytest.approx(dropped / 32)
    assert routing.expert_counts.sum().item() == 32 - dropped
    # A dropped token gets nothing from the experts.
    dropped_tokens = (routing.expert_index == -1).view(2, 16)
    assert torch.all(y[dropped_tokens] == 0)


def test_eval_capacity_factor_applies_in_eval_mode():
    layer = make_layer(router="linear", capacity_factor=None, eval_capacity_factor=0.25)
    x, _ = padded_input(length=16)
    _, routing_train = layer.train()(x)
    _, routing_eval = layer.eval()(x)
    assert routing_train.dropped_fraction.item() == 0.0
    assert routing_eval.dropped_fraction.item() > 0.0
    assert routing_eval.expert_counts.max().item() <= 2  # ceil(0.25 * 32 / 4)


@pytest.mark.parametrize("router", ["linear", "xmoe"])
def test_one_expert_equals_dense_ffn(router):
    layer = make_layer(router=router, num_experts=1)
    dense_fc1, dense_fc2 = torch.nn.Linear(16, 12).double(), torch.nn.Linear(12, 16).double()
    with torch.no_grad():
        dense_fc1.weight.copy_(layer.experts.fc1_weight[0].t())
        dense_fc1.bias.copy_(layer.experts.fc1_bias[0])
        dense_fc2.weight.copy_(layer.experts.fc2_weight[0].t())
        dense_fc2.bias.copy_(layer.experts.fc2_bias[0])
    x = torch.randn(3, 5, 16, dtype=torch.double)
    x_moe, x_dense = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    y, routing = layer(x_moe)
    y_dense = dense_fc2(F.gelu(dense_fc1(x_dense)))
    torch.testing.assert_close(y, y_dense)
    assert routing.balance_loss.item() == pytest.approx(1.0)
    grad = torch.randn_like(y)
    (y * grad).sum().backward()
    (y_dense * grad).sum().backward()
    torch.testing.assert_close(x_moe.grad, x_dense.grad)
    torch.testing.assert_close(layer.experts.fc1_weight.grad[0], dense_fc1.weight.grad.t())
    torch.testing.assert_close(layer.experts.fc2_weight.grad[0], dense_fc2.weight.grad.t())
    torch.testing.assert_close(layer.experts.fc1_bias.grad[0], dense_fc1.bias.grad)


@pytest.mark.parametrize("heads,top_k,capacity", [(1, 1, None), (4, 2, None), (1, 2, 1.0), (4, 1, 1.0)])
def test_padding_changes_nothing_else(heads, top_k, capacity):
    layer = make_layer(heads=heads, top_k=top_k, capacity_factor=capacity)
    x, padding = padded_input()
    y, routing = layer(x, padding)
    garbage = x.clone()
    garbage[padding] = 1e3 * torch.randn_like(garbage[padding])
    y_garbage, routing_garbage = layer(garbage, padding)
    valid = ~padding
    torch.testing.assert_close(y[valid], y_garbage[valid])
    torch.testing.assert_close(routing.balance_loss, routing_garbage.balance_loss)
    assert torch.equal(routing.expert_counts, routing_garbage.expert_counts)
    assert torch.all(routing.expert_index[padding] == -1)
    if capacity is None:
        # Same as batches holding only the real tokens (with a capacity, the capacity itself depends on the batch).
        y_short, routing_short = layer(x[1:, :4])
        torch.testing.assert_close(y[1, :4], y_short[0])
        _, routing_first = layer(x[:1])
        assert torch.equal(routing.expert_counts, routing_short.expert_counts + routing_first.expert_counts)


def test_balance_loss_by_hand():
    layer = make_layer(router="linear", num_experts=2, dim=2, ffn_dim=4)
    with torch.no_grad():
        layer.router.scorer.weight.copy_(torch.tensor([[1.0, 0.0], [0.0, 1.0]]))
    # Logits (2, 0), (0, 1), (3, 0): first choices 0, 1, 0.
    x = torch.tensor([[[2.0, 0.0], [0.0, 1.0], [3.0, 0.0]]], dtype=torch.double)
    _, routing = layer(x)
    p = [torch.tensor(v, dtype=torch.double).softmax(0) for v in ([2.0, 0.0], [0.0, 1.0], [3.0, 0.0])]
    mean_p = sum(p) / 3
    expected = 2 * (2 / 3 * mean_p[0] + 1 / 3 * mean_p[1])
    assert routing.balance_loss.item() == pytest.approx(expected.item())
    assert routing.expert_counts.tolist() == [2, 1]


def test_xmoe_balance_loss_uses_fixed_softmax_temperature_with_sigmoid_gate():
    layer = make_layer(router="xmoe", gate="sigmoid")
    with torch.no_grad():
        layer.router.scorer.log_temperature.fill_(0.0)  # learned tau moved away from tau_0
    x, _ = padded_input()
    _, routing = layer(x)
    scorer = layer.router.scorer
    x_SD = x.reshape(-1, 16)
    cosine = (
        F.normalize(x_SD @ scorer.projection.weight.t(), dim=-1) @ F.normalize(scorer.expert_embeddings, dim=-1).t()
    )
    probs = (cosine / 0.07).softmax(-1)
    first = cosine.argmax(-1)
    fraction = torch.bincount(first, minlength=4).double() / first.numel()
    torch.testing.assert_close(routing.balance_loss.double(), 4 * (fraction * probs.mean(0)).sum())


def test_no_token_gives_zero_loss_not_nan():
    layer = make_layer(top_k=2, heads=4)
    x = torch.randn(2, 3, 16, dtype=torch.double, requires_grad=True)
    y, routing = layer(x, torch.ones(2, 3, dtype=torch.bool))
    assert routing.balance_loss.item() == 0.0
    assert routing.expert_counts.sum().item() == 0
    assert routing.dropped_fraction.item() == 0.0
    routing.balance_loss.backward()
    assert torch.isfinite(x.grad).all()
    y_empty, routing_empty = layer(torch.randn(0, 5, 16, dtype=torch.double))
    assert y_empty.shape == (0, 5, 16) and routing_empty.balance_loss.item() == 0.0


@pytest.mark.parametrize("heads,top_k", [(1, 1), (1, 2), (4, 1), (4, 2)])
def test_counts_cover_every_real_sub_token_choice(heads, top_k):
    layer = make_layer(heads=heads, top_k=top_k)
    x, padding = padded_input()
    _, routing = layer(x, padding)
    assert routing.expert_counts.sum().item() == int((~padding).sum()) * heads * top_k
    assert routing.expert_index.shape == (2, 7, heads, top_k)
    assert routing.requested_capacity.item() == 1.0
    assert routing.expert_counts.dtype == torch.long


def test_frozen_routing_keeps_balance_loss_but_trains_nothing_inside():
    layer = make_layer(frozen=True, heads=4)
    x = torch.randn(2, 5, 16, dtype=torch.double, requires_grad=True)
    y, routing = layer(x)
    assert routing.balance_loss.requires_grad
    (y.sum() + routing.balance_loss).backward()
    for name, parameter in list(layer.router.named_parameters()) + list(layer.experts.named_parameters()):
        assert not parameter.requires_grad and parameter.grad is None, name
    assert layer.merge.weight.grad is not None  # MH-MoE split/merge layers stay trainable
    # The balance loss alone still reaches the input (it trains the layers below the router).
    x.grad = None
    _, routing = layer(x)
    routing.balance_loss.backward()
    assert x.grad.abs().sum() > 0


def test_restore_expert_embedding_norm_after_an_optimiser_step():
    layer = make_layer(router="xmoe")
    norms = layer.router.scorer.expert_embeddings.norm(dim=-1)
    torch.testing.assert_close(norms, torch.full_like(norms, 0.1))
    optimiser = torch.optim.SGD(layer.parameters(), lr=10.0)
    x, _ = padded_input()
    y, routing = layer(x)
    (y.square().mean() + routing.balance_loss).backward()
    assert layer.router.scorer.log_temperature.grad is not None  # tau is learnable (Eq. 8)
    optimiser.step()
    assert not torch.allclose(layer.router.scorer.expert_embeddings.norm(dim=-1), norms)
    restore_expert_embedding_norm(layer)
    torch.testing.assert_close(layer.router.scorer.expert_embeddings.norm(dim=-1), norms)


def test_xmoe_defaults_follow_the_papers():
    layer = MoELayer(MoEConfig(dim=64, ffn_dim=128, num_experts=8))
    scorer = layer.router.scorer
    assert scorer.projection.weight.shape == (16, 64) and scorer.projection.bias is None
    assert scorer.temperature.item() == pytest.approx(0.3)
    sigmoid = MoELayer(MoEConfig(64, 128, num_experts=8, gate="sigmoid"))
    assert sigmoid.router.scorer.temperature.item() == pytest.approx(0.07)
    multi = MoELayer(MoEConfig(64, 128, num_experts=8, heads=4))
    assert multi.router.scorer.projection.weight.shape == (4, 16)  # d_e = 16 / h on D/h sub-tokens
    assert multi.experts.fc1_weight.shape == (8, 16, 128)  # beta = 1: hidden ffn_dim on D/h
    assert MoELayer(MoEConfig(64, 128, num_experts=8, heads=4, beta=4.0)).experts.fc1_weight.shape == (8, 16, 512)
    assert torch.all(multi.merge.bias == 0)
    single = MoELayer(MoEConfig(64, 128, num_experts=8, heads=1))
    assert single.multi_head is None and single.merge is None


@pytest.mark.parametrize(
    "fields,message",
    [
        (dict(dim=30, heads=4), "dim=30"),
        (dict(top_k=5), "top_k=5"),
        (dict(top_k=0), "top_k"),
        (dict(num_experts=1, top_k=2), "top_k=2"),
        (dict(router="hash"), "router"),
        (dict(gate="relu"), "gate"),
        (dict(dim=0), "dim"),
        (dict(ffn_dim=-4), "ffn_dim"),
        (dict(num_experts=0), "num_experts"),
        (dict(heads=0), "heads"),
        (dict(capacity_factor=0.0), "capacity_factor"),
        (dict(eval_capacity_factor=-1.0), "eval_capacity_factor"),
        (dict(beta=0.0), "beta"),
        (dict(routing_dim=0), "routing_dim"),
        (dict(strata=[2, 3], top_k=2), "strata"),
        (dict(strata=[2, 2], top_k=1), "top_k"),
        (dict(strata=[2, 2], top_k=2, heads=2), "heads"),
        (dict(strata=[2, 0, 2], num_experts=4, top_k=2), "strata"),
    ],
)
def test_bad_config_names_field_and_value(fields, message):
    base = dict(dim=32, ffn_dim=64, num_experts=4)
    base.update(fields)
    with pytest.raises(ValueError, match=message):
        MoEConfig(**base)


def test_bf16_autocast_on_cpu():
    layer = MoELayer(MoEConfig(32, 64, num_experts=4, top_k=2, heads=2))
    x = torch.randn(2, 6, 32, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y, routing = layer(x)
    assert y.dtype == torch.bfloat16
    assert routing.balance_loss.dtype == torch.float32
    (y.float().sum() + routing.balance_loss).backward()
    assert torch.isfinite(x.grad).all()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("heads,top_k,capacity", [(1, 1, None), (1, 2, 1.0), (4, 2, None)])
def test_cuda_bf16_matches_fp32_cpu(heads, top_k, capacity):
    torch.manual_seed(0)
    layer = MoELayer(MoEConfig(64, 128, num_experts=8, top_k=top_k, heads=heads, capacity_factor=capacity))
    x = torch.randn(4, 33, 64)
    padding = torch.zeros(4, 33, dtype=torch.bool)
    padding[2, 20:] = True
    y_cpu, routing_cpu = layer(x, padding)
    layer_cuda = layer.to("cuda")
    x_cuda = x.cuda().requires_grad_(True)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        y_cuda, routing_cuda = layer_cuda(x_cuda, padding.cuda())
    assert y_cuda.dtype == torch.bfloat16
    same_choice = (routing_cuda.expert_index.cpu() == routing_cpu.expert_index).all(-1).all(-1)
    assert same_choice.float().mean() > 0.95
    valid = ~padding & same_choice
    torch.testing.assert_close(y_cuda.float().cpu()[valid], y_cpu[valid], atol=5e-2, rtol=5e-2)
    (y_cuda.float().square().mean() + routing_cuda.balance_loss).backward()
    assert torch.isfinite(x_cuda.grad).all()


@pytest.mark.parametrize(
    "router,gate,top_k,heads,capacity", [("xmoe", "softmax", 2, 4, 1.0), ("linear", "sigmoid", 1, 1, None)]
)
def test_float32_grouped_gemm_path_matches_reference(router, gate, top_k, heads, capacity):
    layer = make_layer(router=router, gate=gate, top_k=top_k, heads=heads, capacity_factor=capacity).float()
    x, padding = padded_input()
    x = x.float().requires_grad_(True)
    y, routing = layer(x, padding)  # few rows per expert on a CPU: the grouped GEMM path
    with torch.no_grad():
        y_ref, balance_ref, counts_ref, _ = reference_forward(layer.double(), x.double(), padding)
    valid = ~padding
    torch.testing.assert_close(y[valid].double(), y_ref[valid], atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(routing.balance_loss.double(), balance_ref, atol=1e-6, rtol=1e-5)
    assert torch.equal(routing.expert_counts, counts_ref)


@pytest.mark.parametrize("router,heads", [("linear", 1), ("xmoe", 2)])
def test_raw_top2_gate_values_match_the_reference(router, heads):
    """MH-MoE Eq. 2 / 6: the two experts' outputs are mixed with the raw gate values (``renormalize=False``)."""
    layer = make_layer(router=router, top_k=2, heads=heads, renormalize=False)
    x, padding = padded_input()
    y, routing = layer(x, padding)
    y_ref, balance_ref, counts_ref, index_ref = reference_forward(layer, x, padding)
    valid = ~padding
    torch.testing.assert_close(y[valid], y_ref[valid])
    assert torch.equal(routing.expert_index, index_ref)
    renormalised = make_layer(router=router, top_k=2, heads=heads)
    renormalised.load_state_dict(layer.state_dict())
    assert not torch.allclose(renormalised(x, padding)[0][valid], y[valid])  # raw weights sum to less than one
