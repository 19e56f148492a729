"""The task head builders of :mod:`mmoe.model.heads`: layers and initialisation as BEiT-3's fine-tuning heads."""

from __future__ import annotations

import torch
from torch import nn

from mmoe.model.heads import init_head, nlvr2_head, vqa_pooler_and_head


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
