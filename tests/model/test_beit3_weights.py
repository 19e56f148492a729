"""Released BEiT-3 weights in mmoe's backbone: parity with torchscale's BEiT3 (the reference implementation) on the
same weights and inputs, the file forms users hold, the reverse export, and one-line errors for other files."""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch
import yaml

from mmoe.model import MoEPlan, MultiwayConfig, MultiwayTransformer
from mmoe.model.beit3 import BEiT3Weights, beit3_config, from_beit3, load_beit3, read_beit3, to_beit3
from mmoe.model.layers import LANGUAGE, VISION
from mmoe.runtime.checkpoint import export_backbone, load_backbone
from mmoe.vocabulary import VOCAB_SIZE
from tests.cli_fixtures import run_mmoe

with warnings.catch_warnings():  # the reference implementation: scripts/setup.sh installs it beside mmoe
    warnings.simplefilter("ignore")
    pytest.importorskip("torchscale", reason="the reference BEiT-3 implementation is not installed")
    from torchscale.architecture.config import EncoderConfig
    from torchscale.model.BEiT3 import BEiT3

SMALL = dict(dim=128, heads=2, ffn=256, layers=2, image=32, patch=16, vocab=120, text_rows=40)


def torchscale_shape(config: MultiwayConfig) -> dict:
    """A backbone's shape in the keys :func:`torchscale_beit3` reads."""
    return dict(dim=config.dim, heads=config.num_heads, ffn=config.ffn_dim, layers=config.depth,
                image=config.image_size, patch=config.patch_size, vocab=config.vocab_size,
                text_rows=config.max_text_positions)  # fmt: skip


#: BEiT-3 base as released: the preset ``from_beit3`` reads.
BASE = torchscale_shape(MultiwayConfig.preset("beit3_base"))


def torchscale_beit3(shape: dict, normalize_output: bool = True, seed: int = 0) -> BEiT3:
    """torchscale's BEiT3 as the unilm code builds it, every weight (LayerNorms too) drawn at random."""
    args = EncoderConfig(
        vocab_size=shape["vocab"], multiway=True, layernorm_embedding=False, normalize_output=normalize_output,
        no_output_layer=True, encoder_embed_dim=shape["dim"], encoder_attention_heads=shape["heads"],
        encoder_ffn_embed_dim=shape["ffn"], encoder_layers=shape["layers"], img_size=shape["image"],
        patch_size=shape["patch"], max_source_positions=shape["text_rows"], subln=True,
    )  # fmt: skip
    torch.manual_seed(seed)
    model = BEiT3(args).eval()
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.copy_(torch.randn_like(parameter) * 0.05 + (1.0 if parameter.dim() == 1 else 0.0) * 0.1)
    return model


def inputs(shape: dict, batch: int = 2, length: int = 7) -> dict:
    generator = torch.Generator().manual_seed(1)
    image = torch.randn(batch, 3, shape["image"], shape["image"], generator=generator)
    text = torch.randint(0, shape["vocab"], (batch, length), generator=generator)
    padding = torch.zeros(batch, length, dtype=torch.bool)
    padding[0, length - 3 :] = True
    return {"image": image, "text": text, "padding": padding}


def compare(reference: BEiT3, shape: dict, atol: float = 1e-5) -> None:
    backbone = from_beit3(reference.state_dict()).eval()
    given = inputs(shape)
    with torch.no_grad():
        cases = {
            "image": (reference(visual_tokens=given["image"]), backbone(image=given["image"])),
            "text": (
                reference(textual_tokens=given["text"], text_padding_position=given["padding"]),
                backbone(text=given["text"], text_padding_mask=given["padding"]),
            ),
            "image+text": (
                reference(visual_tokens=given["image"], textual_tokens=given["text"],
                          text_padding_position=given["padding"]),
                backbone(image=given["image"], text=given["text"], text_padding_mask=given["padding"]),
            ),
        }  # fmt: skip
    image_rows = torch.zeros(
        given["padding"].shape[0], reference.vision_embed.num_position_embeddings(), dtype=torch.bool
    )
    padding = {"image": None, "text": given["padding"], "image+text": torch.cat([image_rows, given["padding"]], 1)}
    for name, (theirs, ours) in cases.items():
        expected = theirs["encoder_out"]
        assert ours.hidden.shape == expected.shape, name
        if padding[name] is not None:  # torchscale zeroes padding rows' embeddings, mmoe does not; no token reads them
            keep = ~padding[name]
            ours_hidden, expected = ours.hidden[keep], expected[keep]
        else:
            ours_hidden = ours.hidden
        torch.testing.assert_close(ours_hidden, expected, atol=atol, rtol=0, msg=name)


def test_hidden_states_equal_torchscale_beit3_on_the_same_weights():
    compare(torchscale_beit3(SMALL), SMALL)


def test_a_model_without_the_final_norm_is_read_as_such():
    reference = torchscale_beit3(SMALL, normalize_output=False)  # BEiT-3's VQAv2 models
    assert not beit3_config(read_beit3(reference.state_dict())).output_norm
    compare(reference, SMALL)


@pytest.mark.slow
def test_base_hidden_states_equal_torchscale_beit3():
    """At base's width, heads, resolution and vocabulary; 2 of its 12 layers (every layer is read alike: the SMALL
    tests; the depth of the released files: the preset's shape test below)."""
    shape = BASE | {"layers": 2}
    compare(torchscale_beit3(shape), shape)


def test_the_beit3_base_preset_is_the_shape_of_the_released_files():
    with torch.device("meta"):  # shapes only: the released layout without drawing 221M weights
        reference = torchscale_beit3(BASE)
    assert beit3_config(read_beit3(reference.state_dict())) == MultiwayConfig.preset("beit3_base")


def test_the_architecture_is_read_from_the_shapes():
    config = beit3_config(read_beit3(torchscale_beit3(SMALL).state_dict()))
    assert (config.dim, config.depth, config.num_heads, config.ffn_dim) == (128, 2, 2, 256)
    assert (config.image_size, config.patch_size, config.vocab_size) == (32, 16, 120)
    assert (config.max_text_positions, config.position_offset, config.subln, config.moe) == (40, 2, True, None)


def test_released_file_forms_load_alike(tmp_path):
    reference = torchscale_beit3(SMALL)
    state = {f"beit3.{key}": value for key, value in reference.state_dict().items()}
    head = {"head.0.weight": torch.ones(4, 128), "mim_head.weight": torch.ones(8, 128)}
    forms = {
        "unilm.pth": {"model": state | head},
        "downloaded.zip": {"model": state | head},  # the same torch zip archive under a .zip name
        "deepspeed.pt": {"module": state | head},
        "bare.pth": reference.state_dict(),
    }
    expected = from_beit3(reference.state_dict()).state_dict()
    for name, content in forms.items():
        torch.save(content, tmp_path / name)
        loaded = load_beit3(tmp_path / name)
        for key, value in expected.items():
            torch.testing.assert_close(loaded.backbone.state_dict()[key], value, msg=f"{name}: {key}")
        assert loaded.unexpected == []
        assert set(loaded.heads) == (set() if name == "bare.pth" else set(head))


def test_export_round_trips_into_torchscale():
    reference = torchscale_beit3(SMALL)
    exported = to_beit3(from_beit3(reference.state_dict()))
    assert exported.keys() == reference.state_dict().keys()
    fresh = torchscale_beit3(SMALL, seed=5)
    fresh.load_state_dict(exported)  # strict: every key and shape
    for key, value in reference.state_dict().items():
        assert torch.equal(fresh.state_dict()[key], value), key


def test_export_refuses_a_layout_beit3_does_not_have():
    config = from_beit3(torchscale_beit3(SMALL).state_dict()).config
    with pytest.raises(ValueError, match="no BEiT-3 layout \\(moe="):
        to_beit3(MultiwayTransformer(dataclasses.replace(config, moe=MoEPlan(num_experts=2))))
    with pytest.raises(ValueError, match="position_offset=0"):
        to_beit3(MultiwayTransformer(dataclasses.replace(config, position_offset=0)))


def test_a_larger_image_resizes_the_vision_positions_and_keeps_the_offset_rows():
    state = torchscale_beit3(SMALL).state_dict()
    backbone = from_beit3(state, image_size=64)
    table = state["encoder.embed_positions.A.weight"]
    assert backbone.vision_positions.shape == (2 + 1 + 16, 128)
    torch.testing.assert_close(backbone.vision_positions[:3], table[:3])
    assert backbone(image=torch.randn(1, 3, 64, 64)).hidden.shape == (1, 17, 128)
    with pytest.raises(ValueError, match=r"^MultiwayConfig\.position_offset=0 differs from the checkpoint's 2$"):
        from_beit3(state, image_size=64, position_offset=0)  # the offset rows cannot be resized


def test_other_files_and_shapes_are_one_line_errors(tmp_path):
    reference = torchscale_beit3(SMALL)
    with pytest.raises(FileNotFoundError, match="missing.pth does not exist"):
        from_beit3(tmp_path / "missing.pth")
    backbone = from_beit3(reference.state_dict())
    export_backbone(backbone, tmp_path / "mmoe.pt")  # an mmoe file, not a BEiT-3 one
    with pytest.raises(ValueError, match=r"is not a BEiT-3 checkpoint: it has no key \*encoder.layers.0"):
        from_beit3(tmp_path / "mmoe.pt")
    (tmp_path / "truncated.pth").write_bytes(b"PK\x03\x04" + b"\0" * 10)
    with pytest.raises(ValueError, match="truncated.pth could not be read"):
        from_beit3(tmp_path / "truncated.pth")
    with pytest.raises(ValueError) as mismatch:
        from_beit3(reference.state_dict(), ffn_dim=512)
    message = str(mismatch.value)
    assert "encoder.layers.0.ffn.A.fc1.weight has shape (256, 128)" in message and "(512, 128)" in message
    assert "\n" not in message
    with pytest.raises(ValueError, match="mmoe upcycle"):
        from_beit3(reference.state_dict(), moe=MoEPlan(num_experts=2))


def test_weights_split_keeps_heads_apart():
    state = {
        "beit3.text_embed.weight": torch.zeros(1),
        "beit3.encoder.layers.0.self_attn.q_proj.A.weight": torch.zeros(1),
    }
    weights = read_beit3(state | {"pooler.dense.weight": torch.zeros(1), "logit_scale": torch.zeros(())})
    assert isinstance(weights, BEiT3Weights) and set(weights.backbone) == {
        "text_embed.weight",
        "encoder.layers.0.self_attn.q_proj.A.weight",
    }
    assert set(weights.heads) == {"pooler.dense.weight", "logit_scale"}


def unilm_task_file(tmp_path, name: str, heads: dict[str, torch.Tensor], shape: dict = SMALL):
    """A torchscale backbone saved as unilm saves a task model: ``{"model": {"beit3.*": ..., <head keys>: ...}}``."""
    reference = torchscale_beit3(shape)
    state = {f"beit3.{key}": value for key, value in reference.state_dict().items()}
    path = tmp_path / name
    torch.save({"model": state | heads}, path)
    return path, reference


def random_heads(shapes: dict[str, tuple[int, ...]]) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(3)
    return {key: torch.randn(*shape, generator=generator) for key, shape in shapes.items()}


def test_a_vqa_model_starts_a_vqa_task_with_its_head(tmp_path, capsys):
    from mmoe.tasks.vqa import VQAFineTuning

    (tmp_path / "answers.json").write_text('["yes", "no", "2"]')
    d = SMALL["dim"]
    shapes = {"pooler.norm.weight": (d,), "pooler.norm.bias": (d,), "pooler.dense.weight": (d, d),
              "pooler.dense.bias": (d,), "head.0.weight": (2 * d, d), "head.0.bias": (2 * d,),
              "head.1.weight": (2 * d,), "head.1.bias": (2 * d,), "head.3.weight": (3, 2 * d),
              "head.3.bias": (3,)}  # fmt: skip
    heads = random_heads(shapes)
    path, reference = unilm_task_file(tmp_path, "beit3_base_patch16_480_vqa.pth", heads)
    task = VQAFineTuning(answer_vocab=str(tmp_path / "answers.json"), pretrained=str(path))
    for key, value in heads.items():
        assert torch.equal(task.state_dict()[key], value), key
    backbone = from_beit3(reference.state_dict())
    for key, value in backbone.state_dict().items():
        assert torch.equal(task.backbone.state_dict()[key], value), key
    assert "BEiT-3 vqav2 head: 10 tensors loaded" in capsys.readouterr().err
    # Another answer vocabulary: the classifier stays fresh, the rest of the head loads.
    (tmp_path / "answers.json").write_text('["yes", "no", "2", "red"]')
    task = VQAFineTuning(answer_vocab=str(tmp_path / "answers.json"), pretrained=str(path))
    assert torch.equal(task.state_dict()["head.0.weight"], heads["head.0.weight"])
    assert not torch.equal(task.state_dict()["head.3.weight"][:3], heads["head.3.weight"])
    assert "kept fresh: head.3.weight (4, 256) (file (3, 256))" in capsys.readouterr().err


def test_nlvr2_and_captioning_heads_map_to_the_mmoe_names(tmp_path, capsys):
    from mmoe.tasks.captioning import CaptioningFineTuning
    from mmoe.tasks.nlvr2 import NLVR2FineTuning

    d = SMALL["dim"]
    nlvr2 = random_heads({"head.norm1.weight": (4 * d,), "head.dense1.weight": (2 * d, 4 * d),
                          "head.norm2.bias": (2 * d,), "head.dense2.weight": (2, 2 * d)})  # fmt: skip
    path, _ = unilm_task_file(tmp_path, "nlvr2.pth", nlvr2)
    task = NLVR2FineTuning(pretrained=str(path))
    mapping = {"head.norm1.weight": "head.0.weight", "head.dense1.weight": "head.1.weight",
               "head.norm2.bias": "head.2.bias", "head.dense2.weight": "head.4.weight"}  # fmt: skip
    for theirs, ours in mapping.items():
        assert torch.equal(task.state_dict()[ours], nlvr2[theirs]), theirs
    # Captioning keeps the rows of its output vocabulary from BEiT-3's full-vocabulary MLM head.
    shape = dict(SMALL, vocab=VOCAB_SIZE)  # the captioning task's tokenizer ids must fit the embedding
    mlm = random_heads({"mlm_head.weight": (VOCAB_SIZE, d), "mlm_head.bias": (VOCAB_SIZE,)})
    path, _ = unilm_task_file(tmp_path, "captioning.pth", mlm, shape)
    (tmp_path / "caption_tokens.json").write_text("[5, 7, 11, 49407]")
    task = CaptioningFineTuning(pretrained=str(path), output_vocab=str(tmp_path / "caption_tokens.json"))
    assert len(task.output_ids) > 3 and torch.equal(task.head.weight, mlm["mlm_head.weight"][task.output_ids])
    assert torch.equal(task.head.bias, mlm["mlm_head.bias"][task.output_ids])
    assert "BEiT-3 captioning head: 2 tensors loaded" in capsys.readouterr().err


def test_a_released_file_upcycles_into_a_moe_backbone_with_the_same_outputs(tmp_path):
    from mmoe.model.upcycle import upcycle
    from mmoe.runtime.checkpoint import load_backbone

    path, reference = unilm_task_file(tmp_path, "beit3_base_patch16_224.pth", {})
    moe = upcycle(load_backbone(path), MoEPlan(num_experts=4, top_k=2, every=2))
    given = inputs(SMALL)
    with torch.no_grad():
        theirs = reference(visual_tokens=given["image"], textual_tokens=given["text"])["encoder_out"]
        ours = moe.eval()(image=given["image"], text=given["text"]).hidden
    assert [slot.index for slot in moe.moe_layers()] == [1, 1]
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=0)


def test_backbone_keys_without_a_place_are_reported():
    state = dict(torchscale_beit3(SMALL).state_dict())
    state["encoder.layers.0.self_attn.relative_bias.A.weight"] = torch.zeros(2)
    assert load_beit3(state).unexpected == ["encoder.layers.0.self_attn.relative_bias.A.weight"]
    with pytest.warns(UserWarning, match="BEiT-3 keys left unused: 1 \\(encoder.layers.0.self_attn.relative_bias"):
        from_beit3(state)


def test_drop_upcycling_a_released_file_keeps_half_of_each_expert_s_units_and_redraws_the_rest(tmp_path, capsys):
    """``mmoe upcycle --drop-rate 0.5`` on a released file: each expert keeps half of its intermediate units (one unit
    either way) equal to the dense FFN's, and the others are drawn from the dense tensors' mean and std."""
    path, _ = unilm_task_file(tmp_path, "beit3_base_patch16_224.pth", {})
    plan = {"num_experts": 4, "top_k": 1, "router": "linear", "every": 2}
    config = {"model": {"class_path": "mmoe.tasks.nlvr2.NLVR2FineTuning", "init_args": {"backbone": {"moe": plan}}}}
    (tmp_path / "moe.yaml").write_text(yaml.safe_dump(config))
    argv = ["upcycle", "--ckpt", str(path), "--config", str(tmp_path / "moe.yaml"), "--drop-rate", "0.5"]
    code, _, err = run_mmoe([*argv, "--out", str(tmp_path / "init.pt")], capsys)
    assert code == 0, err
    moe, dense = load_backbone(tmp_path / "init.pt"), load_backbone(path)
    hidden = SMALL["ffn"]
    for slot in moe.moe_layers():
        ffn = dense.layers[slot.index].ffn[VISION if slot.modality == "vision" else LANGUAGE]
        experts = slot.layer.experts
        for expert in range(experts.num_experts):
            copied = {  # per unit, whether each of its tensors is the dense FFN's
                "fc1_weight": (experts.fc1_weight[expert].T == ffn.fc1.weight).all(1),
                "fc1_bias": experts.fc1_bias[expert] == ffn.fc1.bias,
                "fc2_weight": (experts.fc2_weight[expert] == ffn.fc2.weight.T).all(1),
                "ln_weight": experts.ln_weight[expert] == ffn.norm.weight,
                "ln_bias": experts.ln_bias[expert] == ffn.norm.bias,
            }
            kept = copied["fc1_weight"]
            assert all(torch.equal(flags, kept) for flags in copied.values())  # a unit is kept or redrawn whole
            assert abs(int(kept.sum()) - hidden // 2) <= 1
            redrawn = experts.fc1_weight[expert].T[~kept]
            dense_weight = ffn.fc1.weight
            assert (
                abs(float(redrawn.mean() - dense_weight.mean()))
                < 4 * float(dense_weight.std()) / redrawn.numel() ** 0.5
            )
            assert float(redrawn.std()) == pytest.approx(float(dense_weight.std()), rel=0.05)
            assert torch.equal(experts.fc2_bias[expert], ffn.fc2.bias)  # the output bias has no units: copied
