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
    """Fills ``tensor`` in place from N(0, std²) truncated to [-std, std], as BEiT-3 does; returns it.

    The values, and the global generator's state after, are those of ``nn.init.trunc_normal_(tensor, std=std, a=-std,
    b=std)``, which samples by rejection for a cut this wide (68% of the mass): each round draws a whole tensor of
    normals and keeps a fresh draw wherever the value so far lies outside the cut, until none does (about 14 rounds
    for 10M values). Here each round still draws the whole tensor (the generator advances the same, and those draws
    are most of the time left), but the test and the copy touch only the values still outside: about half the time
    of torch's loop for a BEiT-3 vocabulary's embedding (64,010 x 192). Tensors that are not contiguous CPU tensors
    go through torch's own.
    """
    if not tensor.is_contiguous() or tensor.is_meta or tensor.device.type != "cpu":
        return nn.init.trunc_normal_(tensor, std=std, a=-std, b=std)
    with torch.no_grad():
        # The bounds cast to the tensor's dtype, as torch compares them.
        low, high = (tensor.new_tensor(bound, device="cpu").item() for bound in (-std, std))
        values = tensor.normal_(0.0, std).view(-1)
        outside = ((values < low) | (values > high)).nonzero().squeeze(1)
        while outside.numel():
            fresh = torch.empty_like(tensor).normal_(0.0, std).view(-1)[outside]
            values[outside] = fresh
            outside = outside[(fresh < low) | (fresh > high)]
    return tensor
