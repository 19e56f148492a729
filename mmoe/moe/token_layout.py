"""Where each routed (sub-)token comes from: its sequence and its segment (modality) of the sequence.

A layer flattens (B, L, D) tokens into S = B*L*h (sub-)tokens, sample-major, then position, then head (MH-MoE Eq. 4).
DeepSeek-V3's sequence-wise balance loss needs each (sub-)token's sample; LIMoE's per-modality entropy losses need
each one's modality, which a shared FFN sees as consecutive segments of the joint sequence (image tokens, then text).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TokenLayout:
    """The (B, L, h) layout of a layer's S = B*L*h (sub-)tokens.

    Attributes:
        batch: B sequences.
        length: L tokens per sequence.
        heads: h sub-tokens per token (1 without MH-MoE).
        segment_lengths: the lengths of the consecutive segments (modalities) each sequence is made of, summing to L;
            None = one segment.
    """

    batch: int
    length: int
    heads: int = 1
    segment_lengths: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.segment_lengths is not None:
            lengths = tuple(int(n) for n in self.segment_lengths)
            if any(n < 0 for n in lengths) or sum(lengths) != self.length:
                raise ValueError(
                    f"segment_lengths={list(lengths)} must be non-negative and sum to the sequence length {self.length}"
                )
            object.__setattr__(self, "segment_lengths", lengths)  # frozen: a list given becomes a tuple

    @property
    def num_segments(self) -> int:
        return 1 if self.segment_lengths is None else len(self.segment_lengths)

    def sequence_S(self, device: torch.device) -> torch.Tensor:
        """(S,) long: the sequence (sample) of each (sub-)token."""
        return torch.arange(self.batch, device=device).repeat_interleave(self.length * self.heads)

    def segment_S(self, device: torch.device) -> torch.Tensor:
        """(S,) long: the segment (modality) of each (sub-)token."""
        if self.segment_lengths is None:
            return torch.zeros(self.batch * self.length * self.heads, dtype=torch.long, device=device)
        lengths = torch.tensor(self.segment_lengths, device=device)
        segment_L = torch.arange(len(self.segment_lengths), device=device).repeat_interleave(lengths)
        return segment_L.repeat_interleave(self.heads).repeat(self.batch)
