"""BEiT v2's VQ-KD tokenizer from a file in the released layout: codes against a per-patch reference, the file's
wrappers and names, errors for other layouts and missing files, the cost it reports."""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from mmoe.model.vqkd import load_vqkd, resample_positions, unused_summary, vqkd_cost
from tests.model.vqkd_reference import reference_codes, released_state, save_released

UNUSED_PARTS = {"decoder", "decode_task_layer", "quantize", "teacher_model", "scaling_layer"}


@pytest.fixture(scope="module")
def state() -> dict:
    return released_state()


@pytest.mark.parametrize(("wrapper", "name"), [("model", "vqkd.pth"), ("state_dict", "vqkd.zip"), (None, "vqkd.pt")])
def test_released_file_gives_the_reference_codes(state, tmp_path, wrapper, name):
    loaded = load_vqkd(save_released(tmp_path / name, state, wrapper))
    tokenizer = loaded.tokenizer
    assert (tokenizer.num_codes, tokenizer.grid, tokenizer.image_size) == (512, 4, 64)
    assert {key.split(".")[0] for key in loaded.unused} == UNUSED_PARTS
    assert not any(key.startswith(("encoder.", "encode_task_layer.")) for key in loaded.unused)
    assert "quantize.embedding.weight" not in loaded.unused
    images = torch.rand(3, 3, 64, 64, generator=torch.Generator().manual_seed(1))
    codes = tokenizer.encode(images)
    expected = reference_codes(state, images)
    assert codes.shape == (3, 16) and codes.dtype == torch.long
    assert torch.equal(codes, expected)
    assert len(expected.unique()) > 8  # the codes vary from patch to patch: the check is not between constants


def test_unused_summary_counts_by_part(state):
    loaded_keys = [key for key in state if key.startswith(("decoder.", "quantize.cluster", "teacher_model."))]
    decoder = sum(key.startswith("decoder.") for key in state)
    assert unused_summary(loaded_keys) == f"decoder {decoder}, quantize 1, teacher_model 1"


def test_missing_key_is_named(state, tmp_path):
    broken = {key: value for key, value in state.items() if key != "encoder.blocks.1.attn.v_bias"}
    with pytest.raises(ValueError, match=r"has no key encoder\.blocks\.1\.attn\.v_bias") as error:
        load_vqkd(save_released(tmp_path / "broken.pth", broken), what="model.vqkd_tokenizer")
    assert str(tmp_path / "broken.pth") in str(error.value) and "model.vqkd_tokenizer" in str(error.value)
    assert "\n" not in str(error.value)


def test_another_layout_names_its_first_missing_key(tmp_path):
    beit3_like = {"encoder.layers.0.self_attn.q_proj.A.weight": torch.zeros(4, 4)}
    with pytest.raises(ValueError, match=r"not a VQ-KD tokenizer: it has no key encoder\.patch_embed\.proj\.weight"):
        load_vqkd(save_released(tmp_path / "beit3.pth", beit3_like))


def test_mis_shaped_key_names_both_shapes(state, tmp_path):
    broken = dict(state)
    broken["encoder.blocks.1.mlp.fc2.weight"] = torch.zeros(128, 256)
    with pytest.raises(ValueError) as error:
        load_vqkd(save_released(tmp_path / "broken.pth", broken))
    message = str(error.value)
    assert "encoder.blocks.1.mlp.fc2.weight has shape (128, 256)" in message and "needs (128, 512)" in message


def test_missing_file_names_path_and_option(tmp_path):
    missing = tmp_path / "vqkd_encoder_base_decoder_3x768x12_clip.pth"
    with pytest.raises(FileNotFoundError, match=f"model.vqkd_tokenizer {missing} does not exist"):
        load_vqkd(missing, what="model.vqkd_tokenizer")


def test_codes_fall_on_the_backbone_grid(state, tmp_path):
    path = save_released(tmp_path / "vqkd.pth", state)
    coarse = load_vqkd(path, grid=2).tokenizer
    assert coarse.image_size == 32 and coarse.encoder.pos_embed.shape == (1, 5, 128)
    codes = coarse.encode(torch.rand(2, 3, 48, 48))  # resized to the tokenizer's 2 x 16 px
    assert codes.shape == (2, 4) and int(codes.max()) < 512
    table = state["encoder.pos_embed"]
    assert resample_positions(table, 4) is table
    resampled = resample_positions(table, 2)
    assert torch.equal(resampled[:, 0], table[:, 0]) and resampled.shape == (1, 5, 128)


def test_cost_counts_the_tokenizer_parameters_and_flops(state, tmp_path):
    tokenizer = load_vqkd(save_released(tmp_path / "vqkd.pth", state)).tokenizer
    cost = vqkd_cost(tokenizer.shape)
    assert cost["parameters"] == sum(value.numel() for value in tokenizer.state_dict().values())
    for block in tokenizer.encoder.blocks:  # the explicit attention, whose matrix products the counter sees
        block.attn.fused_attn = False
    with FlopCounterMode(display=False) as counter:
        tokenizer.encode(torch.rand(1, 3, 64, 64))
    assert cost["flops_per_image"] == counter.get_total_flops()


def test_non_finite_weights_are_refused(state, tmp_path):
    broken = dict(state)
    broken["encode_task_layer.2.bias"] = torch.full((32,), float("nan"))
    with pytest.raises(ValueError, match="holds non-finite weights: 1 of its .* the first encode_task_layer.2.bias"):
        load_vqkd(save_released(tmp_path / "nan.pth", broken), what="model.vqkd_tokenizer")
