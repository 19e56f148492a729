"""BEiT v2's VQ-KD tokenizer from a file in the released layout: codes against a per-patch reference (with and
without layer scale), the file's wrappers, names and training arguments, errors for other layouts, codebooks too small
to be targets and missing files, the cost it reports."""

from __future__ import annotations

import argparse
import os

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from mmoe.model.vqkd import load_vqkd, read_vqkd_shape, resample_positions, unused_summary, vqkd_cost
from mmoe.safe_load import load_checkpoint_file
from tests.model.vqkd_reference import reference_codes, released_state, save_released

UNUSED_PARTS = {"decoder", "decode_task_layer", "quantize", "teacher_model", "scaling_layer"}


@pytest.fixture(scope="module")
def state() -> dict:
    return released_state()


@pytest.fixture(scope="module")
def layer_scale_state() -> dict:
    """A tokenizer built with ``init_values`` > 0: every block has ``gamma_1`` / ``gamma_2``, spread around 0.1."""
    return released_state(layer_scale=True)


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


def test_layer_scale_file_gives_the_reference_codes(layer_scale_state, tmp_path):
    """Each block's residual branches are scaled by the file's gammas, as the release's ``Block`` scales them."""
    loaded = load_vqkd(save_released(tmp_path / "vqkd.pth", layer_scale_state))
    assert loaded.tokenizer.shape.layer_scale
    assert not any(key.startswith("encoder.") for key in loaded.unused)
    images = torch.rand(3, 3, 64, 64, generator=torch.Generator().manual_seed(1))
    expected = reference_codes(layer_scale_state, images)
    assert torch.equal(loaded.tokenizer.encode(images), expected)
    without_gammas = {key: value for key, value in layer_scale_state.items() if "gamma" not in key}
    assert (reference_codes(without_gammas, images) != expected).float().mean() > 0.5  # a missed gamma shows
    assert len(expected.unique()) > 8


def test_a_block_without_its_layer_scale_is_named(layer_scale_state, tmp_path):
    broken = {key: value for key, value in layer_scale_state.items() if key != "encoder.blocks.1.gamma_2"}
    with pytest.raises(ValueError, match=r"has no key encoder\.blocks\.1\.gamma_2"):
        load_vqkd(save_released(tmp_path / "broken.pth", broken))


def test_an_encoder_weight_the_tokenizer_does_not_apply_is_refused(state, tmp_path):
    """A relative position bias (a release ``VisionTransformer`` with ``use_rel_pos_bias``) would change the codes:
    it is refused, not left unused."""
    extra = state | {"encoder.blocks.0.attn.relative_position_bias_table": torch.randn(52, 2)}
    with pytest.raises(ValueError) as error:
        load_vqkd(save_released(tmp_path / "rel.pth", extra), what="model.vqkd_tokenizer")
    message = str(error.value)
    assert "model.vqkd_tokenizer" in message and str(tmp_path / "rel.pth") in message and "\n" not in message
    assert "encoder.blocks.0.attn.relative_position_bias_table" in message and "does not apply" in message


def test_training_arguments_beside_the_weights_load(state, tmp_path):
    """A file saved with its ``args`` (an ``argparse.Namespace``) loads under ``weights_only``; the Namespace is
    allowed for this load only."""
    path = tmp_path / "vqkd.pth"
    torch.save({"model": state, "args": argparse.Namespace(codebook_n_emd=512, model="vqkd_encoder")}, path)
    tokenizer = load_vqkd(path).tokenizer
    images = torch.rand(1, 3, 64, 64, generator=torch.Generator().manual_seed(2))
    assert torch.equal(tokenizer.encode(images), reference_codes(state, images))
    assert read_vqkd_shape(path).num_codes == 512
    assert argparse.Namespace not in torch.serialization.get_safe_globals()
    with pytest.raises(ValueError, match="asks to import argparse.Namespace"):
        load_checkpoint_file(path)


class ShellCommand:
    """Unpickled, it runs ``touch marker`` through ``os.system``: what a crafted file could run."""

    def __init__(self, marker) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


@pytest.mark.parametrize("where", ["beside the weights", "inside the arguments"])
def test_a_file_that_would_run_a_command_is_refused(state, tmp_path, where):
    marker = tmp_path / "ran"
    payload = ShellCommand(marker)
    extra = {"note": payload} if where == "beside the weights" else {"args": argparse.Namespace(note=payload)}
    path = tmp_path / "crafted.pth"
    torch.save({"model": state, **extra}, path)
    with pytest.raises(ValueError) as error:
        load_vqkd(path, what="model.vqkd_tokenizer")
    message = str(error.value)
    assert f"model.vqkd_tokenizer {path} was refused: it asks to import {os.system.__module__}.system" in message
    assert "\n" not in message and not marker.exists()
    torch.load(path, weights_only=False)
    assert marker.exists()  # the payload is real


@pytest.mark.parametrize("codes", [0, 1])
def test_a_codebook_of_fewer_than_two_codes_is_refused(state, tmp_path, codes):
    """0 codes leave nothing to pick; 1 code makes every target code 0 (a MIM task with nothing to learn)."""
    path = save_released(tmp_path / "small.pth", state | {"quantize.embedding.weight": torch.ones(codes, 32)})
    for read in (load_vqkd, read_vqkd_shape):
        with pytest.raises(ValueError) as error:
            read(path, what="model.vqkd_tokenizer")
        assert str(error.value) == (
            f"model.vqkd_tokenizer {path}: quantize.embedding.weight has shape ({codes}, 32), expected at least 2 "
            "codebook rows (one per code) of the code dimension"
        )


MALFORMED = {
    "a codebook of one dimension": (
        {"quantize.embedding.weight": torch.ones(32)},
        "quantize.embedding.weight has shape (32,), expected 2 dimensions, each at least 1",
    ),
    "codes of no dimension": (
        {"quantize.embedding.weight": torch.ones(8, 0)},
        "quantize.embedding.weight has shape (8, 0), expected 2 dimensions, each at least 1",
    ),
    "a flat patch embedding": (
        {"encoder.patch_embed.proj.weight": torch.ones(128, 768)},
        "encoder.patch_embed.proj.weight has shape (128, 768), expected 4 dimensions, each at least 1",
    ),
    "a position table of CLS only": (
        {"encoder.pos_embed": torch.ones(1, 1, 128)},
        "encoder.pos_embed has 1 rows, not 1 + a square",
    ),
    "a block number far past the others": (
        {"encoder.blocks.100000000.norm1.weight": torch.ones(128)},
        "it has encoder blocks up to 100000000 but none numbered 2",
    ),
    "a block key without a number": (
        {"encoder.blocks.last.norm1.weight": torch.ones(128)},
        "encoder.blocks.last.norm1.weight does not number its encoder block",
    ),
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_a_malformed_shape_is_named_in_one_line(state, tmp_path, case):
    """The tensors the tokenizer's shapes are read from, and the block numbers, are checked before anything is built:
    one line naming the key, never an IndexError, and never a tokenizer of as many blocks as a key's number says."""
    replaced, expected = MALFORMED[case]
    path = save_released(tmp_path / "malformed.pth", state | replaced)
    with pytest.raises(ValueError) as error:
        load_vqkd(path, what="model.vqkd_tokenizer")
    message = str(error.value)
    assert message.startswith(f"model.vqkd_tokenizer {path}") and expected in message and "\n" not in message


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


@pytest.mark.parametrize("layer_scale", [False, True])
def test_cost_counts_the_tokenizer_parameters_and_flops(state, layer_scale_state, tmp_path, layer_scale):
    weights = layer_scale_state if layer_scale else state
    tokenizer = load_vqkd(save_released(tmp_path / "vqkd.pth", weights)).tokenizer
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
