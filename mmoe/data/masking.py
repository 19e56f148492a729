"""Masks for masked data modeling (BEiT-3 pre-training, Wang et al., 2023, §2.2; BEiT, Bao et al., 2022, §2.5).

* Images: BEiT's block-wise masking (Algorithm 1): rectangles of random area and log-uniform aspect ratio are laid on
  the patch grid until the budget (40% of the patches in BEiT-3) is met.
* Texts: 15% of the tokens of monomodal texts (MLM), 50% of the text tokens of image-text pairs (MVLM), chosen
  uniformly among the real tokens (never start / end of text or padding); each chosen token is replaced BERT-style by
  the mask token (80%), a random BPE token (10%) or kept (10%), fractions configurable. BEiT-3's paper does not state
  the replacement for pre-training (its released code applies 80/10/10 to captioning); the BERT split is mmoe's
  choice, and ``mask_token_fraction=1`` gives pure masking.
* Captions: BEiT-3's captioning recipe, ``max(1, min(round(n·p), n - 1))`` of the n tokens after the start token (the
  end token included) with the same 80/10/10 replacement.

All draws come from a ``numpy.random.Generator`` passed in by the caller, so a seed fixes every mask.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from mmoe.vocabulary import OPEN_CLIP_IDS, TextIds


@dataclass
class MaskingConfig:
    """How pre-training batches are masked.

    Args:
        image_ratio: share of image patches masked, block-wise (BEiT-3: 0.4).
        min_block_patches: smallest block area in patches (BEiT: 16 on a 14x14 grid); a smaller remaining budget
            lowers it.
        min_aspect: smallest block aspect ratio; the largest is ``1 / min_aspect`` (BEiT: 0.3).
        text_ratio: share of the tokens of monomodal texts masked (BEiT-3: 0.15).
        pair_text_ratio: share of the text tokens of image-text pairs masked (BEiT-3: 0.5).
        mask_pair_images: also block-mask the image of image-text pairs. BEiT-3 §2.2 gives the masking ratios of
            monomodal texts, pair texts and images but does not say whether a pair's image is masked too; mmoe's
            default leaves it whole, so the pair's masked words are predicted from the whole image.
        mask_token_fraction: share of the chosen text tokens replaced by the mask token.
        random_token_fraction: share of the chosen text tokens replaced by a random BPE token; the rest stay as
            they are.
    """

    image_ratio: float = 0.4
    min_block_patches: int = 16
    min_aspect: float = 0.3
    text_ratio: float = 0.15
    pair_text_ratio: float = 0.5
    mask_pair_images: bool = False
    mask_token_fraction: float = 0.8
    random_token_fraction: float = 0.1

    def __post_init__(self) -> None:
        for name in ("image_ratio", "text_ratio", "pair_text_ratio", "mask_token_fraction", "random_token_fraction"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"MaskingConfig.{name} must lie in [0, 1], got {value!r}")
        if self.mask_token_fraction + self.random_token_fraction > 1.0:
            raise ValueError(
                "MaskingConfig.mask_token_fraction + random_token_fraction must be <= 1, got "
                f"{self.mask_token_fraction!r} + {self.random_token_fraction!r}"
            )
        if self.min_block_patches < 1:
            raise ValueError(f"MaskingConfig.min_block_patches must be >= 1, got {self.min_block_patches!r}")
        if not 0.0 < self.min_aspect <= 1.0:
            raise ValueError(f"MaskingConfig.min_aspect must lie in (0, 1], got {self.min_aspect!r}")


def block_mask(
    grid: tuple[int, int],
    num_masked: int,
    rng: np.random.Generator,
    min_block_patches: int = 16,
    min_aspect: float = 0.3,
    attempts: int = 10,
) -> np.ndarray:
    """One block-wise mask with exactly ``num_masked`` patches (BEiT Algorithm 1).

    Each round draws a block area uniformly between ``min(min_block_patches, remaining)`` and the remaining budget,
    an aspect ratio log-uniformly in ``[min_aspect, 1 / min_aspect]``, and a position; the block is taken when it adds
    at least one new patch without overshooting the budget. After ``attempts`` failed draws in a row, the remaining
    budget is filled with single random patches, so the count is always exact.

    Returns:
        (height, width) bool array, True = masked.
    """
    height, width = grid
    if not 0 <= num_masked <= height * width:
        raise ValueError(f"cannot mask {num_masked} of {height * width} patches")
    mask = np.zeros((height, width), dtype=bool)
    log_low, log_high = math.log(min_aspect), math.log(1.0 / min_aspect)
    count = 0
    while count < num_masked:
        budget = num_masked - count
        added = 0
        for _ in range(attempts):
            area = rng.uniform(min(min_block_patches, budget), budget)
            aspect = math.exp(rng.uniform(log_low, log_high))
            h, w = round(math.sqrt(area * aspect)), round(math.sqrt(area / aspect))
            if not (1 <= h <= height and 1 <= w <= width):
                continue
            top, left = rng.integers(0, height - h + 1), rng.integers(0, width - w + 1)
            block = mask[top : top + h, left : left + w]
            new = h * w - int(block.sum())
            if 0 < new <= budget:
                block[...] = True
                added = new
                break
        if added == 0:
            free = np.flatnonzero(~mask)
            mask.flat[rng.choice(free, size=budget, replace=False)] = True
            added = budget
        count += added
    return mask


def image_masks(
    batch_size: int, grid: tuple[int, int], config: MaskingConfig, rng: np.random.Generator
) -> torch.Tensor:
    """Block-wise masks of a batch: (B, num_patches) bool, True = masked, ``round(image_ratio · num_patches)`` each."""
    num_masked = math.floor(config.image_ratio * grid[0] * grid[1] + 0.5)
    masks = [
        block_mask(grid, num_masked, rng, config.min_block_patches, config.min_aspect).reshape(-1)
        for _ in range(batch_size)
    ]
    return torch.from_numpy(np.stack(masks)) if masks else torch.zeros(0, grid[0] * grid[1], dtype=torch.bool)


class TextMasking(NamedTuple):
    """A masked text batch.

    Attributes:
        input_ids: (B, T) ids fed to the model: chosen tokens replaced (mask / random / kept).
        targets: (B, T) the original ids.
        mask: (B, T) bool, True where the model must predict ``targets``.
    """

    input_ids: torch.Tensor
    targets: torch.Tensor
    mask: torch.Tensor


def _choose_and_replace(
    ids: torch.Tensor,
    maskable: np.ndarray,
    counts: np.ndarray,
    rng: np.random.Generator,
    masking: MaskingConfig | None,
    text_ids: TextIds,
) -> TextMasking:
    """Chooses ``counts[b]`` positions uniformly among ``maskable[b]`` and replaces them as ``masking`` says (None:
    80/10/10, :class:`MaskingConfig`'s default)."""
    masking = masking or MaskingConfig()
    mask_token_fraction, random_token_fraction = masking.mask_token_fraction, masking.random_token_fraction
    keys = rng.random(maskable.shape)
    keys[~maskable] = 2.0  # never chosen: sorted after every maskable position
    rank = np.argsort(np.argsort(keys, axis=1, kind="stable"), axis=1, kind="stable")
    chosen = (rank < counts[:, None]) & maskable
    draw = rng.random(maskable.shape)
    to_mask = chosen & (draw < mask_token_fraction)
    to_random = chosen & (draw >= mask_token_fraction) & (draw < mask_token_fraction + random_token_fraction)
    random_ids = rng.integers(text_ids.random_low, text_ids.random_high, size=maskable.shape)
    input_ids = ids.clone()
    input_ids[torch.from_numpy(to_mask)] = text_ids.mask
    to_random_t = torch.from_numpy(to_random)
    input_ids[to_random_t] = torch.from_numpy(random_ids).to(ids.dtype)[to_random_t]
    return TextMasking(input_ids, ids.clone(), torch.from_numpy(chosen))


def mask_text(
    ids: torch.Tensor,
    ratio: float,
    rng: np.random.Generator,
    masking: MaskingConfig | None = None,
    text_ids: TextIds = OPEN_CLIP_IDS,
) -> TextMasking:
    """Masked language modeling: ``max(1, round(ratio · n))`` of the n real tokens of each text (start, end and
    padding are never chosen; a text with no real token gets no mask).

    Args:
        ids: (B, T) token ids as built by :class:`mmoe.data.tokenizer.TextTokenizer`.
        ratio: share of the real tokens to mask (0.15 MLM, 0.5 MVLM).
        rng: the generator all draws come from.
        masking: how the chosen tokens are replaced (``mask_token_fraction`` by the mask token,
            ``random_token_fraction`` by a random token, ``text_ids.random_low`` to ``random_high``); None = 80/10/10.
        text_ids: the tokenizer's special ids (``TextTokenizer.ids``).
    """
    array = ids.numpy()
    maskable = (array != text_ids.start) & (array != text_ids.end) & (array != text_ids.pad)
    real = maskable.sum(axis=1)
    counts = np.where(real > 0, np.maximum(1, np.floor(ratio * real + 0.5)), 0).astype(np.int64)
    if ratio == 0.0:
        counts[:] = 0
    return _choose_and_replace(ids, maskable, counts, rng, masking, text_ids)


def mask_caption(
    ids: torch.Tensor,
    ratio: float,
    rng: np.random.Generator,
    masking: MaskingConfig | None = None,
    text_ids: TextIds = OPEN_CLIP_IDS,
) -> TextMasking:
    """BEiT-3 captioning masks: ``max(1, min(round(n · ratio), n - 1))`` of the n tokens after the start token, the
    end token included (BEiT-3's ``--captioning_mask_prob``, 0.6 by default, 0.7 in its recipes)."""
    array = ids.numpy()
    maskable = (array != text_ids.start) & (array != text_ids.pad)
    n = maskable.sum(axis=1)
    counts = np.maximum(1, np.minimum(np.floor(n * ratio + 0.5), n - 1)).astype(np.int64)
    counts = np.where(n > 0, counts, 0)
    return _choose_and_replace(ids, maskable, counts, rng, masking, text_ids)
