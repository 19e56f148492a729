"""BEiT-3's weight initialisation (unilm ``beit3/modeling_utils.py``, ``_init_weights`` and ``trunc_normal_``): a
normal of std 0.02 truncated at ±std (not torch's default cut at ±2, which leaves a std-0.02 normal in effect
untruncated). The backbone, the pre-training heads and the fine-tuning heads (:func:`mmoe.model.heads.init_head`) draw
with :func:`init_beit3_`.
"""

from __future__ import annotations

import torch
from torch import nn

#: BEiT-3's init std (``init_std`` / ``trunc_normal_(std=.02)``).
BEIT3_INIT_STD = 0.02


def init_beit3_(tensor: torch.Tensor, std: float = BEIT3_INIT_STD) -> torch.Tensor:
    """Fills ``tensor`` in place from N(0, std²) truncated to [-std, std], as BEiT-3 does; returns it."""
    return nn.init.trunc_normal_(tensor, std=std, a=-std, b=std)
