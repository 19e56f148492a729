"""Tokenizer (open_clip BPE + pad / mask) and BEiT-3 masks."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mmoe.data.masking import MaskingConfig, block_mask, image_masks, mask_caption, mask_text
from mmoe.data.tokenizer import EOT_ID, MASK_ID, NUM_BPE_TOKENS, PAD_ID, SOT_ID, VOCAB_SIZE, TextTokenizer
from mmoe.model.config import MultiwayConfig


def test_special_ids_follow_open_clip_vocabulary():
    from open_clip.tokenizer import SimpleTokenizer

    bpe = SimpleTokenizer()
    assert (bpe.sot_token_id, bpe.eot_token_id, len(bpe.encoder)) == (SOT_ID, EOT_ID, 49408)
    assert (PAD_ID, MASK_ID, VOCAB_SIZE) == (49408, 49409, MultiwayConfig().vocab_size)


def test_encode_pad_and_decode_round_trip():
    tokenizer = TextTokenizer(max_length=16)
    ids, padding = tokenizer(["a red circle", "two blue squares at the top"])
    assert ids.dtype == torch.long and padding.dtype == torch.bool and ids.shape == padding.shape
    assert ids[0, 0] == SOT_ID and ids[0, 4] == EOT_ID and padding[0].tolist() == [False] * 5 + [True] * 3
    assert (ids[padding] == PAD_ID).all() and not padding[1].any()
    assert tokenizer.decode(ids[0]) == "a red circle"
    assert tokenizer.decode(ids[1]) == "two blue squares at the top"


def test_truncation_keeps_the_end_token():
    tokenizer = TextTokenizer(max_length=5)
    ids = tokenizer.encode("one two three four five six")
    assert len(ids) == 5 and ids[0] == SOT_ID and ids[-1] == EOT_ID
    assert tokenizer.decode(ids) == "one two three"
    with pytest.raises(ValueError, match="max_length"):
        TextTokenizer(max_length=1)


@pytest.mark.parametrize("grid, ratio", [((14, 14), 0.4), ((4, 4), 0.4), ((8, 8), 0.4), ((6, 10), 0.25)])
def test_block_masks_have_the_exact_count(grid, ratio):
    config = MaskingConfig(image_ratio=ratio)
    masks = image_masks(64, grid, config, np.random.default_rng(0))
    expected = int(np.floor(ratio * grid[0] * grid[1] + 0.5))
    assert masks.shape == (64, grid[0] * grid[1]) and masks.dtype == torch.bool
    assert (masks.sum(1) == expected).all()


def _components(mask: np.ndarray) -> list[int]:
    """Sizes of the 4-connected masked regions."""
    seen = np.zeros_like(mask)
    sizes = []
    for start in zip(*np.nonzero(mask), strict=True):
        if seen[start]:
            continue
        stack, size = [start], 0
        seen[start] = True
        while stack:
            r, c = stack.pop()
            size += 1
            for nr, nc in ((r + 1, c), (r - 1, c), (r, c + 1), (r, c - 1)):
                if 0 <= nr < mask.shape[0] and 0 <= nc < mask.shape[1] and mask[nr, nc] and not seen[nr, nc]:
                    seen[nr, nc] = True
                    stack.append((nr, nc))
        sizes.append(size)
    return sizes


def test_block_masks_are_blocks_not_scattered_patches():
    rng = np.random.default_rng(1)
    masks = [block_mask((14, 14), 78, rng) for _ in range(50)]
    # A random 40% patch set on 14x14 has dozens of regions; BEiT blocks give a handful of large ones.
    regions = [len(_components(m)) for m in masks]
    largest = [max(_components(m)) for m in masks]
    assert np.mean(regions) < 8 and np.mean(largest) >= 16
    scattered = np.zeros(196, bool)
    scattered[rng.choice(196, 78, replace=False)] = True
    assert len(_components(scattered.reshape(14, 14))) > 2 * np.mean(regions)


def test_block_masks_are_reproducible_from_the_seed():
    config = MaskingConfig()
    a = image_masks(8, (14, 14), config, np.random.default_rng(7))
    b = image_masks(8, (14, 14), config, np.random.default_rng(7))
    c = image_masks(8, (14, 14), config, np.random.default_rng(8))
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_mlm_masks_the_ratio_of_real_tokens_and_never_specials():
    tokenizer = TextTokenizer(max_length=64)
    texts = ["word " * n for n in (1, 7, 20, 40, 60)]
    ids, padding = tokenizer(texts)
    out = mask_text(ids, 0.15, np.random.default_rng(0))
    real = (~padding & (ids != SOT_ID) & (ids != EOT_ID)).sum(1)
    expected = torch.clamp(torch.floor(0.15 * real + 0.5), min=1)
    assert torch.equal(out.mask.sum(1), expected.long())
    assert not out.mask[padding].any() and not out.mask[ids == SOT_ID].any() and not out.mask[ids == EOT_ID].any()
    assert torch.equal(out.targets, ids)
    assert torch.equal(out.input_ids[~out.mask], ids[~out.mask])  # only chosen positions change
    assert torch.equal(out.input_ids[padding], ids[padding])


def test_mvlm_ratio_and_bert_replacement_fractions():
    ids = torch.cat(
        [torch.full((4000, 1), SOT_ID), torch.randint(0, 1000, (4000, 20)), torch.full((4000, 1), EOT_ID)], dim=1
    )
    out = mask_text(ids, 0.5, np.random.default_rng(3))
    assert (out.mask.sum(1) == 10).all()
    chosen_inputs, chosen_targets = out.input_ids[out.mask], out.targets[out.mask]
    as_mask = (chosen_inputs == MASK_ID).float().mean().item()
    unchanged = (chosen_inputs == chosen_targets).float().mean().item()
    assert abs(as_mask - 0.8) < 0.01 and abs(unchanged - 0.1) < 0.01
    randoms = chosen_inputs[(chosen_inputs != MASK_ID) & (chosen_inputs != chosen_targets)]
    assert randoms.numel() > 0 and randoms.max() < NUM_BPE_TOKENS
    none_replaced = mask_text(
        ids[:10], 0.5, np.random.default_rng(0), MaskingConfig(mask_token_fraction=0.0, random_token_fraction=0)
    )
    assert torch.equal(none_replaced.input_ids, ids[:10]) and none_replaced.mask.any()


def test_caption_masks_follow_beit3_count_rule():
    tokenizer = TextTokenizer(max_length=32)
    ids, _ = tokenizer(["a red circle at the top", "circle"])
    out = mask_caption(ids, 0.6, np.random.default_rng(0))
    # n = tokens after the start (end included): 7 and 2 -> max(1, min(round(0.6 n), n - 1)) = 4 and 1
    assert out.mask.sum(1).tolist() == [4, 1]
    assert not out.mask[:, 0].any()


def test_masking_config_rejects_bad_values():
    with pytest.raises(ValueError, match="image_ratio"):
        MaskingConfig(image_ratio=1.5)
    with pytest.raises(ValueError, match="mask_token_fraction"):
        MaskingConfig(mask_token_fraction=0.95, random_token_fraction=0.1)


def test_token_strings_are_readable():
    tokenizer = TextTokenizer(16)
    ids = tokenizer.encode("a red cube")
    assert [tokenizer.token_string(i) for i in ids] == ["<start>", "a", "red", "cube", "<end>"]
    assert [tokenizer.token_string(i) for i in (PAD_ID, MASK_ID)] == ["<pad>", "<mask>"]
