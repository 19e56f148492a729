"""A MoE layer's LayerNorm epsilon is the backbone's ``MultiwayConfig.layernorm_eps``, the dense FFN's: a backbone's MoE
layers against a per-token reference written with that epsilon, every expert path, and an upcycled backbone against
its dense one. (The fused Triton path: the "Sub-LN with a backbone's epsilon" case of triton_interpreter_checks.py.)"""

from __future__ import annotations

import pytest
import torch

from mmoe.model import MoEPlan, MultiwayConfig, MultiwayTransformer
from mmoe.model.upcycle import upcycle
from mmoe.moe import MoEConfig, MoELayer
from mmoe.moe.experts import GroupedExperts
from tests.moe.reference import reference_expert

# 1e-6 as a backbone might set it; 0.5 so large that any path left at 1e-5 is far off.
EPSILONS = [1e-6, 0.5]


def backbone(eps: float, plan: MoEPlan | None) -> MultiwayTransformer:
    torch.manual_seed(0)
    config = MultiwayConfig.preset("test", vocab_size=50, layernorm_eps=eps, moe=plan)
    return MultiwayTransformer(config).double().eval()


@pytest.mark.parametrize("eps", EPSILONS)
def test_a_backbones_moe_layers_use_its_layernorm_eps_against_a_per_token_reference(eps):
    model = backbone(eps, MoEPlan(num_experts=4, top_k=2, every=1, shared_experts=1))
    layers = [module for module in model.modules() if isinstance(module, MoELayer)]
    assert layers and all(layer.experts.ln_weight is not None for layer in layers)  # the test preset has Sub-LN
    x = 0.1 * torch.randn(2, 5, model.config.dim, dtype=torch.double)  # small activations: eps matters
    x_SD = x.view(-1, x.shape[-1])
    for layer in layers:
        y_SD = layer(x)[0].view_as(x_SD)
        chosen = layer.router(x_SD, None)  # the choices and gate weights; the experts' part is what is checked
        for s, x_D in enumerate(x_SD):
            pairs = zip(chosen.expert_SK[s], chosen.weight_SK[s], strict=True)
            want = sum(w * reference_expert(layer.experts, int(e), x_D, eps) for e, w in pairs)
            want = want + reference_expert(layer.shared_experts, 0, x_D, eps)
            torch.testing.assert_close(y_SD[s], want)


@pytest.mark.parametrize("eps", EPSILONS)
@pytest.mark.parametrize("path", ["loop", "grouped", "padded"])
def test_every_expert_path_uses_the_configured_epsilon(eps, path):
    torch.manual_seed(1)
    experts = GroupedExperts(3, 8, 12, subln=True, subln_eps=eps)  # float32: the grouped GEMM takes no float64
    x = 0.1 * torch.randn(7, 8)
    expert = torch.tensor([0, 0, 1, 1, 1, 2, 2])
    offsets = torch.tensor([2, 5, 7], dtype=torch.int32)
    if path == "grouped" and not hasattr(torch, "_grouped_mm"):
        pytest.skip("this torch has no grouped GEMM")
    run = {
        "loop": lambda: experts.forward_loop(x, offsets),
        "grouped": lambda: experts.forward_grouped(x, expert, offsets),
        "padded": lambda: experts.forward_padded(x, [2, 3, 2]),
    }[path]
    want = torch.stack([reference_expert(experts, int(e), x_D, eps) for e, x_D in zip(expert, x, strict=True)])
    torch.testing.assert_close(run(), want)


@pytest.mark.parametrize("eps", EPSILONS)
@pytest.mark.parametrize("strata", [None, [4]], ids=["experts", "stratified"])
def test_an_upcycled_backbone_equals_its_dense_one_at_any_layernorm_eps(eps, strata):
    """Experts copied from the dense FFNs (top-2 renormalised, dropless; a Stratified layer's LayerNorm copied from
    the pre-FFN one) give the dense model's hidden states only if their LayerNorms have the dense ones' epsilon."""
    dense = backbone(eps, None)
    moe = upcycle(dense, MoEPlan(num_experts=4, top_k=2, every=1, strata=strata)).double().eval()
    image = torch.randn(2, 3, 32, 32, dtype=torch.double)
    text = torch.randint(0, 50, (2, 6))
    with torch.no_grad():
        want = dense(image=image, text=text).hidden
        got = moe(image=image, text=text).hidden
    torch.testing.assert_close(got, want)


def test_the_layernorm_epsilon_must_be_a_finite_number_at_least_zero():
    with pytest.raises(ValueError, match=r"MoEConfig.layernorm_eps must be a finite number >= 0, got -1.0"):
        MoEConfig(dim=16, ffn_dim=32, subln=True, layernorm_eps=-1.0)
