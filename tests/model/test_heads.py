"""The task head builders of :mod:`mmoe.model.heads`: layers and initialisation as BEiT-3's fine-tuning heads."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from mmoe.model.heads import init_head, nlvr2_head, token_head, vqa_pooler_and_head
from mmoe.model.initialization import init_beit3_


def test_head_builders_match_beit3_initialisation():
    torch.manual_seed(0)
    pooler, head = vqa_pooler_and_head(8, 5, eps=1e-6)
    assert [type(m) for m in head] == [nn.Linear, nn.LayerNorm, nn.GELU, nn.Linear] and head[3].out_features == 5
    assert all(bool((m.bias == 0).all()) for m in (pooler.dense, head[0], head[3]))
    torch.manual_seed(1)
    scaled = nlvr2_head(8, init_scale=1e-3)
    torch.manual_seed(1)
    reference = nlvr2_head(8, init_scale=1.0)
    assert torch.allclose(scaled[1].weight, reference[1].weight * 1e-3) and bool((scaled[0].weight == 1).all())
    layer = nn.LayerNorm(4)
    nn.init.constant_(layer.weight, 3.0)
    init_head(layer)
    assert bool((layer.weight == 1).all())


@pytest.mark.parametrize(
    ("shape", "dtype"),
    [((2000, 192), torch.float32), ((300,), torch.float32), ((7, 5, 3), torch.float64), ((1000, 96), torch.bfloat16),
     ((0, 4), torch.float32)],
)  # fmt: skip
def test_init_beit3_draws_torch_s_trunc_normal_values_and_leaves_the_generator_as_it_does(shape, dtype):
    """The rejection rounds touch only the values still outside the cut, yet give bit for bit the values of
    ``nn.init.trunc_normal_(std, a=-std, b=std)`` and the same generator state after (a later draw equal)."""
    torch.manual_seed(3)
    expected = nn.init.trunc_normal_(torch.empty(shape, dtype=dtype), std=0.02, a=-0.02, b=0.02)
    after = torch.rand(4)
    torch.manual_seed(3)
    drawn = init_beit3_(torch.empty(shape, dtype=dtype))
    assert torch.equal(drawn, expected) and torch.equal(torch.rand(4), after)
    assert bool((drawn.abs() <= 0.02).all())
    if len(shape) == 2:  # a non-contiguous tensor goes through torch's own
        torch.manual_seed(3)
        expected = nn.init.trunc_normal_(torch.empty(shape[::-1], dtype=dtype).t(), std=0.02, a=-0.02, b=0.02)
        torch.manual_seed(3)
        assert torch.equal(init_beit3_(torch.empty(shape[::-1], dtype=dtype).t()), expected)


def test_init_beit3_cuts_at_one_std_and_every_task_head_draws_with_it():
    """BEiT-3 (unilm beit3/modeling_utils.py) truncates its std-0.02 normal at ±std: every weight within ±0.02 and the
    std that of N(0, 0.02²) cut at ±1 std, 0.02 * sqrt(1 - 2 φ(1) / (Φ(1) - Φ(-1))) ≈ 0.0108. The VQA pooler and
    classifier, the NLVR2 MLP (before its init scale) and the captioning head draw their linear weights the same way
    (torch's default cut at ±2 would leave std 0.02 and weights past 0.06 in a matrix this size)."""
    torch.manual_seed(0)
    phi, mass = math.exp(-0.5) / math.sqrt(2 * math.pi), math.erf(1 / math.sqrt(2))
    cut_std = 0.02 * math.sqrt(1 - 2 * phi / mass)
    drawn = init_beit3_(torch.empty(1000, 1000))
    assert float(drawn.abs().max()) <= 0.02
    assert float(drawn.std()) == pytest.approx(cut_std, rel=0.02)
    pooler, head = vqa_pooler_and_head(256, 3129)
    weights = [pooler.dense.weight, head[0].weight, head[3].weight]  # head[3]: (3129, 512)
    weights += [layer.weight for layer in nlvr2_head(256, init_scale=1.0) if isinstance(layer, nn.Linear)]
    weights.append(token_head(256, 2000).weight)
    for weight in weights:
        assert float(weight.abs().max()) <= 0.02
        assert float(weight.std()) == pytest.approx(cut_std, rel=0.05)
