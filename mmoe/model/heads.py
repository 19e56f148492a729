"""Task heads over the multiway backbone, BEiT-3 style (Wang et al., 2023, §3.1; unilm ``beit3/modeling_finetune.py``):
the pooler, the VQAv2 classifier, the NLVR2 pair classifier, the captioning token head, the retrieval projections and
the ImageNet classifier, with BEiT-3's head initialisation. Pure torch; the Lightning tasks in :mod:`mmoe.tasks` own
them as attributes, so the parameter names (``pooler.*``, ``head.*``) are the tasks'.

Each builder constructs its modules and then initialises them, in that order: the default initialisers and
:func:`init_head` draw from torch's generator, so the order fixes the initial weights under a seed.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from mmoe.model.initialization import init_beit3_

#: Scale of the NLVR2 MLP's initial linear weights and biases (BEiT-3 ``TwoLayerMLP`` init for NLVR2).
BEIT3_HEAD_INIT_SCALE = 1e-3
#: Initial value of the retrieval task's learnable log logit scale: log(1 / 0.07), a temperature of 0.07 (CLIP,
#: BEiT-3 ``BEiT3ForRetrieval``).
LOG_LOGIT_SCALE_INIT = math.log(1 / 0.07)


class Pooler(nn.Module):
    """BEiT-3's pooler over one token: LayerNorm -> Linear(D, D) -> tanh."""

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim, eps=eps)
        self.dense = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.dense(self.norm(x)))


def init_head(module: nn.Module) -> None:
    """BEiT-3's head init (unilm ``beit3/modeling_utils.py`` ``_init_weights``): linear weights from a normal of std
    0.02 truncated at ±std (:func:`mmoe.model.initialization.init_beit3_`), zero biases, LayerNorm 1 / 0."""
    for layer in module.modules():
        if isinstance(layer, nn.Linear):
            init_beit3_(layer.weight)
            if layer.bias is not None:
                nn.init.zeros_(layer.bias)
        elif isinstance(layer, nn.LayerNorm):
            nn.init.ones_(layer.weight)
            nn.init.zeros_(layer.bias)


def vqa_pooler_and_head(dim: int, num_answers: int, eps: float = 1e-5) -> tuple[Pooler, nn.Sequential]:
    """BEiT-3's VQAv2 classifier: the pooler over the vision CLS, then Linear(D, 2D) -> LayerNorm(2D) -> GELU ->
    Linear(2D, num_answers); both initialised with :func:`init_head` (after both are built)."""
    pooler = Pooler(dim, eps)
    head = nn.Sequential(
        nn.Linear(dim, 2 * dim),
        nn.LayerNorm(2 * dim, eps=eps),
        nn.GELU(),
        nn.Linear(2 * dim, num_answers),
    )
    init_head(pooler)
    init_head(head)
    return pooler, head


def nlvr2_head(dim: int, eps: float = 1e-5, init_scale: float = BEIT3_HEAD_INIT_SCALE) -> nn.Sequential:
    """BEiT-3's NLVR2 classifier over the two passes' ``[vision CLS, language CLS]`` (4D): LayerNorm(4D) ->
    Linear(4D, 2D) -> LayerNorm(2D) -> GELU -> Linear(2D, 2), :func:`init_head` then the linear weights and biases
    multiplied by ``init_scale``."""
    head = nn.Sequential(
        nn.LayerNorm(4 * dim, eps=eps),
        nn.Linear(4 * dim, 2 * dim),
        nn.LayerNorm(2 * dim, eps=eps),
        nn.GELU(),
        nn.Linear(2 * dim, 2),
    )
    init_head(head)
    with torch.no_grad():
        for layer in head:
            if isinstance(layer, nn.Linear):
                layer.weight.mul_(init_scale)
                layer.bias.mul_(init_scale)
    return head


def token_head(dim: int, num_classes: int) -> nn.Linear:
    """The captioning head: Linear(D, num_classes) over the text tokens, :func:`init_head` initialised."""
    head = nn.Linear(dim, num_classes)
    init_head(head)
    return head


def retrieval_heads(dim: int) -> tuple[nn.Linear, nn.Linear]:
    """BEiT-3's retrieval projections (``BEiT3ForRetrieval``): ``vision_head`` over the image-only pass's vision CLS
    and ``language_head`` over the text-only pass's first token, each Linear(D, D) without bias, :func:`init_head`
    initialised (vision first); the task L2-normalises their outputs."""
    vision_head, language_head = nn.Linear(dim, dim, bias=False), nn.Linear(dim, dim, bias=False)
    init_head(vision_head)
    init_head(language_head)
    return vision_head, language_head


def classification_head(
    dim: int, num_classes: int, eps: float = 1e-5, init_scale: float = BEIT3_HEAD_INIT_SCALE
) -> tuple[nn.LayerNorm, nn.Linear]:
    """BEiT-3's ImageNet classifier (``BEiT3ForImageClassification``) over the mean of the image-only pass's patch
    tokens (no CLS): ``fc_norm`` = LayerNorm(D), then ``head`` = Linear(D, num_classes); both :func:`init_head`
    initialised, then the linear weight and bias multiplied by ``init_scale`` (BEiT-3: 1e-3)."""
    fc_norm, head = nn.LayerNorm(dim, eps=eps), nn.Linear(dim, num_classes)
    init_head(fc_norm)
    init_head(head)
    with torch.no_grad():
        head.weight.mul_(init_scale)
        head.bias.mul_(init_scale)
    return fc_norm, head
