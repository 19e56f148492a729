"""mmoe backbones as timm models (``mmoe.timm``), driven through timm's own functions: ``timm.create_model`` on an
``mmoe export`` folder, ``features_only=True``, ``forward_intermediates``, ``reset_classifier``, timm's data config.
The reference is mmoe's own image-only forward of the folder's backbone (``from_pretrained``); equal bit for bit."""

from __future__ import annotations

import copy
import dataclasses
import json

import pytest
import timm
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from timm.data import resolve_model_data_config
from torch import nn

import mmoe.timm  # noqa: F401  (registers the mmoe_<size>_<router> names)
from mmoe.data.transforms import IMAGE_MEAN, IMAGE_STD
from mmoe.model import MultiwayConfig, MultiwayTransformer
from mmoe.model.pretrained import PretrainedFolderError, from_pretrained, save_pretrained, write_folder
from mmoe.timm import named_difference, shipped_config

NAME = "mmoe_tiny_xmoe"
BATCH = 3


def realistic_backbone(config, generator: torch.Generator) -> MultiwayTransformer:
    """A backbone whose every weight is drawn at a trained model's scale rather than the init's: matrices
    N(0, 1/fan_in), LayerNorm gains 1 + N(0, 0.1^2), biases and other vectors (X-MoE's log temperature) N(0, 0.1^2),
    scalars 0.3, buffers 0. Built on the meta device: the init it skips would cost seconds, and the values of the
    buffers a folder does not hold are the reader's own."""
    with torch.device("meta"):
        backbone = MultiwayTransformer(config)
    backbone.to_empty(device="cpu")
    gains = {id(module.weight) for module in backbone.modules() if isinstance(module, nn.LayerNorm)}
    with torch.no_grad():
        for parameter in backbone.parameters():
            noise = torch.randn(parameter.shape, generator=generator)
            if parameter.dim() >= 2:
                parameter.copy_(noise * parameter.shape[-1] ** -0.5)
            elif parameter.dim() == 1:
                parameter.copy_(noise * 0.1 + (1.0 if id(parameter) in gains else 0.0))
            else:
                parameter.fill_(0.3)
        for buffer in backbone.buffers():
            buffer.zero_()
    return backbone


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """An ``mmoe export`` folder of the tiny X-MoE backbone (MoE in layers 1 and 3) with realistic weights; its text
    vocabulary and positions cut down (fields the model's name leaves to the folder) to keep the file small."""
    config = dataclasses.replace(shipped_config("tiny", "xmoe"), vocab_size=64, max_text_positions=8)
    backbone = realistic_backbone(config, torch.Generator().manual_seed(0))
    return save_pretrained(backbone, tmp_path_factory.mktemp("timm") / "export")


@pytest.fixture(scope="module")
def images():
    side = shipped_config("tiny", "xmoe").image_size
    return torch.randn(BATCH, 3, side, side, generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="module")
def reference(folder, images):
    """mmoe's image-only forward of the folder's backbone: the output and each layer's image tokens."""
    backbone = from_pretrained(folder).eval()
    layer_outputs = []
    hooks = [layer.register_forward_hook(lambda _, __, out: layer_outputs.append(out[0])) for layer in backbone.layers]
    with torch.no_grad():
        output = backbone(image=images)
    for hook in hooks:
        hook.remove()
    return output, layer_outputs


def create(folder, **kwargs):
    return timm.create_model(NAME, pretrained=True, pretrained_cfg_overlay=dict(file=str(folder)), **kwargs).eval()


@pytest.fixture(scope="module")
def model(folder):
    """The folder's model through ``timm.create_model`` (each test that changes it changes a copy)."""
    return create(folder)


def test_forward_features_equal_mmoe_s_image_only_forward(model, images, reference):
    output, layer_outputs = reference
    with torch.no_grad():
        features = model.forward_features(images)
        final, intermediates = model.forward_intermediates(images, output_fmt="NLC")
    assert torch.equal(features, output.hidden)
    assert torch.equal(final, output.hidden)
    assert len(intermediates) == len(layer_outputs) == 4
    for ours, theirs in zip(intermediates, layer_outputs, strict=True):
        assert torch.equal(ours, theirs[:, 1:])  # patch tokens, the CLS token left out
    # the routing records of the last forward, those of mmoe's forward
    assert [(r.layer, r.modality) for r in model.routing] == [(1, "vision"), (3, "vision")]
    for ours, theirs in zip(model.routing, output.routing, strict=True):
        assert torch.equal(ours.expert_index, theirs.expert_index)
        assert ours.expert_index.unique().numel() > 1  # the tokens spread over several experts
    assert len(list(model.backbone.moe_layers())) == 4  # vision and language MoE FFNs of layers 1 and 3


def test_head_is_beit3_s_mean_of_patches_layer_norm_linear(model, images, reference):
    output, _ = reference
    model = copy.deepcopy(model)
    model.reset_classifier(7)
    pooled = F.layer_norm(
        output.hidden[:, 1:].mean(dim=1), (model.embed_dim,), model.fc_norm.weight, model.fc_norm.bias, 1e-5
    )
    with torch.no_grad():
        logits = model(images)
        assert torch.equal(logits, F.linear(pooled, model.head.weight, model.head.bias))
        assert logits.shape == (BATCH, 7) and model.num_classes == 7
        # BEiT-3's head init: std 0.02 truncated at ±0.02, then x 0.001
        assert model.head.weight.abs().max() <= 0.02 * 1e-3
        model.reset_classifier(0)
        assert model.num_classes == 0
        assert torch.equal(model(images), pooled)  # no head: the pre-logits
        assert torch.equal(model.forward_head(model.forward_features(images), pre_logits=True), pooled)
        model.reset_classifier(5, global_pool="token")
        cls_logits = model(images)
    cls_pooled = F.layer_norm(output.hidden[:, 0], (model.embed_dim,), model.fc_norm.weight, model.fc_norm.bias, 1e-5)
    assert torch.equal(cls_logits, F.linear(cls_pooled, model.head.weight, model.head.bias))


def test_features_only_gives_the_feature_info_s_maps(folder, images, reference):
    _, layer_outputs = reference
    extractor = create(folder / "model.safetensors", features_only=True, out_indices=(0, 2))  # the file: its folder
    with torch.no_grad():
        maps = extractor(images)
    info = extractor.feature_info
    side = images.shape[-1]
    assert [tuple(m.shape) for m in maps] == [
        (BATCH, channels, side // reduction, side // reduction)
        for channels, reduction in zip(info.channels(), info.reduction(), strict=True)
    ]
    assert info.channels() == [192, 192] and info.reduction() == [16, 16]
    assert len(extractor.model.backbone.layers) == 3  # pruned after the last layer asked for
    for feature_map, index in zip(maps, (0, 2), strict=True):
        grid = layer_outputs[index][:, 1:].reshape(BATCH, 4, 4, -1).permute(0, 3, 1, 2)
        assert torch.equal(feature_map, grid)


def test_intermediates_normed_and_with_their_cls_token(model, images, reference):
    output, layer_outputs = reference
    with torch.no_grad():
        pairs = model.forward_intermediates(images, indices=[-1], norm=True, return_prefix_tokens=True)[1]
        early = model.forward_intermediates(images, indices=[1], stop_early=True, intermediates_only=True)
    assert [(r.layer, r.modality) for r in model.routing] == [(1, "vision")]  # layers 2 and 3 not run
    ((grid, cls_token),) = pairs
    assert torch.equal(cls_token, output.hidden[:, :1])
    assert torch.equal(grid, output.hidden[:, 1:].reshape(BATCH, 4, 4, -1).permute(0, 3, 1, 2))
    assert torch.equal(early[0], layer_outputs[1][:, 1:].reshape(BATCH, 4, 4, -1).permute(0, 3, 1, 2))


def test_grad_checkpointing_recomputes_the_same_layers(model, images):
    """timm's ``set_grad_checkpointing`` is the backbone's ``checkpoint_activations``: in training, the same tokens
    and gradients as without it (the tiny config has no dropout or drop path, X-MoE routing no jitter)."""
    results = []
    for checkpointing in (False, True):
        trained = copy.deepcopy(model).train()
        trained.set_grad_checkpointing(checkpointing)
        calls, layer = [], trained.backbone.layers[0]
        layer.forward = lambda *args, calls=calls, run=layer.forward: calls.append(1) or run(*args)
        final, _ = trained.forward_intermediates(images)
        final.square().mean().backward()
        assert len(calls) == (2 if checkpointing else 1)  # run again in the backward pass where checkpointed
        results.append((final.detach(), trained.backbone.patch_embed.weight.grad))
    (plain, plain_grad), (recomputed, recomputed_grad) = results
    assert torch.equal(plain, recomputed) and torch.equal(plain_grad, recomputed_grad)


def test_pretrained_cfg_is_the_folder_s_input_and_mmoe_s_normalisation(model, folder, tmp_path):
    data = resolve_model_data_config(model)
    assert data["mean"] == IMAGE_MEAN and data["std"] == IMAGE_STD and data["interpolation"] == "bicubic"
    assert data["input_size"] == model.pretrained_cfg["input_size"] == (3, 64, 64)  # the folder's side
    # A task model's folder (its backbone under "backbone.", a head beside it) at another side: the same backbone
    # weights, the position table's patch rows resized (as BEiT-3 fine-tunes at other resolutions).
    config = json.loads((folder / "config.json").read_text()) | {"task": {"name": "a task"}}
    weights = {f"backbone.{name}": value for name, value in load_file(folder / "model.safetensors").items()}
    task_folder = write_folder(tmp_path / "task", config, weights | {"head.weight": torch.ones(2, 192)})
    larger = create(task_folder, img_size=96)
    ours, theirs = model.backbone.state_dict(), larger.backbone.state_dict()
    assert [name for name in ours if not torch.equal(ours[name], theirs[name])] == ["vision_positions"]
    assert torch.equal(ours["vision_positions"][:1], theirs["vision_positions"][:1])  # the CLS row kept
    with torch.no_grad():
        assert larger.forward_features(torch.zeros(1, 3, 96, 96)).shape == (1, 1 + 36, 192)


def test_a_folder_of_another_architecture_is_refused_in_one_line(folder, tmp_path):
    config = json.loads((folder / "config.json").read_text())
    config["backbone"]["moe"]["num_experts"] = 16
    other = tmp_path / "other"
    other.mkdir()
    (other / "config.json").write_text(json.dumps(config))
    with pytest.raises(PretrainedFolderError) as refused:
        create(other)
    message = str(refused.value)
    assert "\n" not in message
    assert f"{other / 'config.json'}: backbone.moe.num_experts is 16, {NAME} has 8" in message
    with pytest.raises(PretrainedFolderError, match="backbone.moe sets MoE layers, mmoe_tiny_dense is dense"):
        timm.create_model("mmoe_tiny_dense", pretrained=True, pretrained_cfg_overlay=dict(file=str(folder)))
    with pytest.raises(PretrainedFolderError, match=f"{tmp_path / 'absent'} does not exist"):
        create(tmp_path / "absent")
    with pytest.raises(PretrainedFolderError, match="pretrained=True needs an mmoe export folder") as unnamed:
        timm.create_model(NAME, pretrained=True)
    assert "\n" not in str(unnamed.value)


def test_every_shipped_config_is_a_model_of_its_own_shape():
    names = timm.list_models("mmoe_*")
    assert {"mmoe_tiny_xmoe", "mmoe_tiny_dense", "mmoe_base_mhmoe", "mmoe_base_dense"} <= set(names)
    assert shipped_config("tiny", "mhmoe").moe.heads == 4 and shipped_config("base", "mhmoe").dim == 768
    extractor = timm.create_model("mmoe_tiny_dense", features_only=True)  # not pretrained: the shipped config's
    assert extractor.model.backbone.config == shipped_config("tiny", "dense") and not extractor.model.routing
    assert extractor.feature_info.module_name() == [f"backbone.layers.{i}" for i in (1, 2, 3)]  # the last three
    assert timm.get_pretrained_cfg("mmoe_base_xmoe").input_size == (3, 224, 224)
    # BEiT-3 base as released (its text ids, position offset 2) is mmoe_base_dense: those fields are the folder's
    assert named_difference(shipped_config("base", "dense"), MultiwayConfig.preset("beit3_base"), "m") is None
    assert named_difference(shipped_config("base", "dense"), MultiwayConfig.preset("tiny"), "m") == (
        "backbone.dim is 192, m has 768"
    )
