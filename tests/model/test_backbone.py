"""MultiwayTransformer: BEiT-3 parameter counts, shapes, padding, the multiway split, MoE placement and records."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F

from mmoe.model import MoEPlan, MultiwayConfig, MultiwayTransformer
from mmoe.model.config import PRESETS
from mmoe.model.cost import backbone_parameters, layer_parameters
from mmoe.model.layers import FeedForward
from mmoe.moe import MoELayer
from mmoe.moe.cost import moe_parameter_count


def tiny(**overrides) -> MultiwayConfig:
    return MultiwayConfig.preset("test", **({"vocab_size": 100} | overrides))


def inputs(batch: int = 2, text_len: int = 6, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    image = torch.randn(batch, 3, 32, 32, generator=generator)
    text = torch.randint(0, 100, (batch, text_len), generator=generator)
    padding = torch.zeros(batch, text_len, dtype=torch.bool)
    padding[1, 4:] = True
    return image, text, padding


def count(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def test_beit3_base_parameter_counts():
    config = MultiwayConfig.preset("beit3_base")
    with torch.device("meta"):
        backbone = MultiwayTransformer(config)
    assert count(backbone.layers) == pytest.approx(170.29e6, rel=1e-3)
    assert count(backbone) == pytest.approx(220.99e6, rel=1e-3)
    assert config.position_offset + config.num_patches + 1 == 199


PLANS = [
    None,
    MoEPlan(num_experts=4, router="linear"),
    MoEPlan(num_experts=4, heads=4, top_k=2),
    MoEPlan(num_experts=4, heads=2, beta=2.0, mode="shared", every=1),
    MoEPlan(num_experts=3, layers=[0]),
]


@pytest.mark.parametrize("plan,attention,vl_layers", list(itertools.product(PLANS, ("multiway", "shared"), (0, 1))))
def test_closed_form_count_matches_module(plan, attention, vl_layers):
    config = tiny(moe=plan, attention=attention, vl_layers=vl_layers, position_offset=2)
    backbone = MultiwayTransformer(config)
    assert backbone_parameters(config) == count(backbone)
    for index, layer in enumerate(backbone.layers):
        assert layer_parameters(config, index) == count(layer)


def test_moe_layers_follow_mhmoe_appendix_d():
    d, n, h, beta = 64, 8, 4, 1.0
    config = tiny(dim=d, ffn_dim=4 * d, num_heads=4, moe=MoEPlan(num_experts=n, heads=h, router="linear", every=1))
    layer = MultiwayTransformer(config).layers[0].ffn[0]
    gamma = 2 * d * d + d * n // h + round(8 * beta * d * d * n / h)  # MH-MoE Gamma (Eq. 21-24), weights only
    biases = 2 * d + n * (4 * d + d // h)  # split/merge biases, expert biases (hidden 4d and d/h)
    subln = n * 2 * 4 * d  # Sub-LN in each expert
    assert count(layer) == gamma + biases + subln == moe_parameter_count(layer.config)


def test_moe_every_rule_and_explicit_layers():
    assert tiny(depth=6, moe=MoEPlan(every=2)).moe_layer_indices() == [1, 3, 5]
    assert tiny(depth=6, moe=MoEPlan(every=3)).moe_layer_indices() == [2, 5]
    assert tiny(depth=6, moe=MoEPlan(layers=[0, 4])).moe_layer_indices() == [0, 4]
    backbone = MultiwayTransformer(tiny(depth=4, moe=MoEPlan(every=2, num_experts=2)))
    kinds = [type(layer.ffn[0]) for layer in backbone.layers]
    assert kinds == [FeedForward, MoELayer, FeedForward, MoELayer]


def test_moe_layers_name_each_moe_ffn_as_its_records_do():
    backbone = MultiwayTransformer(tiny(depth=4, vl_layers=1, moe=MoEPlan(every=2, num_experts=2)))
    slots = [(slot.index, slot.modality) for slot in backbone.moe_layers()]
    assert slots == [(1, "vision"), (1, "language"), (3, "vision"), (3, "language"), (3, "shared")]
    assert [slot.layer for slot in backbone.moe_layers()][-1] is backbone.layers[3].vl_ffn
    image, text, padding = inputs()
    records = backbone(image=image, text=text, text_padding_mask=padding).routing
    assert {(r.layer, r.modality) for r in records} <= set(slots)
    shared = MultiwayTransformer(tiny(depth=2, moe=MoEPlan(every=1, num_experts=2, mode="shared")))
    assert [(slot.index, slot.modality) for slot in shared.moe_layers()] == [(0, "shared"), (1, "shared")]


@pytest.mark.parametrize("plan", PLANS[:3])
def test_forward_shapes_for_each_input_kind(plan):
    backbone = MultiwayTransformer(tiny(moe=plan))
    image, text, padding = inputs()
    pair = backbone(image=image, text=text, text_padding_mask=padding)
    assert pair.hidden.shape == (2, 5 + 6, 32) and (pair.image_len, pair.text_len) == (5, 6)
    image_only = backbone(image=image)
    assert image_only.hidden.shape == (2, 5, 32) and image_only.text_len == 0
    text_only = backbone(text=text, text_padding_mask=padding)
    assert text_only.hidden.shape == (2, 6, 32) and text_only.image_len == 0
    if plan is not None:
        assert [r.modality for r in pair.routing] == ["vision", "language"]
        assert [r.modality for r in image_only.routing] == ["vision"]
        assert [r.modality for r in text_only.routing] == ["language"]
    with pytest.raises(ValueError, match="needs an image, a text"):
        backbone()


def test_text_padding_does_not_change_real_positions():
    backbone = MultiwayTransformer(tiny(moe=MoEPlan(num_experts=4, heads=2, top_k=2, every=1))).eval()
    image, text, padding = inputs()
    out = backbone(image=image, text=text, text_padding_mask=padding)
    other = text.clone()
    other[padding] = (other[padding] + 7) % 100
    out_other = backbone(image=image, text=other, text_padding_mask=padding)
    keep = torch.cat([torch.ones(2, 5, dtype=torch.bool), ~padding], dim=1)
    torch.testing.assert_close(out.hidden[keep], out_other.hidden[keep])
    short = backbone(image=image[1:], text=text[1:, :4])
    torch.testing.assert_close(out.hidden[1, : 5 + 4], short.hidden[0], atol=1e-5, rtol=1e-5)
    for record, record_other in zip(out.routing, out_other.routing, strict=True):
        assert torch.equal(record.expert_counts, record_other.expert_counts)
        torch.testing.assert_close(record.balance_loss, record_other.balance_loss)


def reference_plain_layer(block, x: torch.Tensor, way: int, num_heads: int) -> torch.Tensor:
    """A plain pre-LN Sub-LN Transformer layer written out, using one way's weights for every token."""
    attention = block.attention
    h = attention.norm[way](x)
    q, k, v = (h @ attention.qkv[way].weight.t() + attention.qkv[way].bias).chunk(3, dim=-1)
    batch, length, dim = x.shape

    def heads(t):
        return t.view(batch, length, num_heads, -1).transpose(1, 2)

    scores = heads(q) @ heads(k).transpose(-1, -2) / (dim // num_heads) ** 0.5
    attended = (scores.softmax(-1) @ heads(v)).transpose(1, 2).reshape(batch, length, dim)
    x = x + attention.out[way](attention.inner_norm[way](attended))
    ffn = block.ffn[way]
    return x + ffn.fc2(ffn.norm(F.gelu(ffn.fc1(block.ffn_norm[way](x)))))


def test_multiway_layer_with_tied_weights_equals_plain_layer():
    torch.manual_seed(0)
    backbone = MultiwayTransformer(tiny(depth=1))
    block = backbone.layers[0]
    with torch.no_grad():
        for pair in (
            block.attention.norm,
            block.attention.qkv,
            block.attention.inner_norm,
            block.attention.out,
            block.ffn_norm,
            block.ffn,
        ):
            for vision_param, language_param in zip(pair[0].parameters(), pair[1].parameters(), strict=True):
                vision_param.normal_(std=0.2)
                language_param.copy_(vision_param)
    image_x, text_x = torch.randn(2, 5, 32), torch.randn(2, 6, 32)
    out_image, out_text, records = block(image_x, text_x, None, None)
    expected = reference_plain_layer(block, torch.cat([image_x, text_x], dim=1), 0, 4)
    torch.testing.assert_close(torch.cat([out_image, out_text], dim=1), expected, atol=1e-5, rtol=1e-5)
    assert records == []
    # Untied, the modalities really do use different weights.
    with torch.no_grad():
        block.ffn[1].fc2.bias.add_(1.0)
    _, out_text_untied, _ = block(image_x, text_x, None, None)
    assert not torch.allclose(out_text_untied, out_text)


def test_per_modality_moe_sees_only_its_modality():
    heads, top_k = 2, 2
    backbone = MultiwayTransformer(tiny(moe=MoEPlan(num_experts=4, heads=heads, top_k=top_k, every=1)))
    image, text, padding = inputs()
    out = backbone(image=image, text=text, text_padding_mask=padding)
    assert [(r.layer, r.modality) for r in out.routing] == [
        (0, "vision"),
        (0, "language"),
        (1, "vision"),
        (1, "language"),
    ]
    for record in out.routing:
        if record.modality == "vision":
            assert record.expert_index.shape[:2] == (2, 5)
            assert record.expert_counts.sum().item() == 2 * 5 * heads * top_k
        else:
            assert record.expert_index.shape[:2] == (2, 6)
            assert record.expert_counts.sum().item() == int((~padding).sum()) * heads * top_k
            assert torch.all(record.expert_index[padding] == -1)
    # The vision MoE's experts get no gradient from a loss on text positions only.
    out.text_hidden.sum().backward()
    vision_moe = backbone.layers[1].ffn[0]
    assert vision_moe.experts.fc1_weight.grad is None or vision_moe.experts.fc1_weight.grad.abs().sum() == 0


def test_shared_moe_routes_all_tokens_through_one_layer():
    backbone = MultiwayTransformer(tiny(moe=MoEPlan(num_experts=4, mode="shared", every=2)))
    image, text, padding = inputs()
    out = backbone(image=image, text=text, text_padding_mask=padding)
    assert len(backbone.layers[1].ffn) == 1
    (record,) = out.routing
    assert record.modality == "shared" and record.layer == 1
    assert record.expert_index.shape[:2] == (2, 11)
    assert record.expert_counts.sum().item() == 2 * 5 + int((~padding).sum())


def test_balance_losses_are_differentiable():
    backbone = MultiwayTransformer(tiny(moe=MoEPlan(num_experts=4, every=1)))
    image, text, padding = inputs()
    out = backbone(image=image, text=text, text_padding_mask=padding)
    assert len(out.routing) == 4
    total = sum(record.balance_loss for record in out.routing)
    total.backward()
    router = backbone.layers[0].ffn[1].router.scorer
    assert router.expert_embeddings.grad is not None and router.expert_embeddings.grad.abs().sum() > 0
    assert backbone.patch_embed.weight.grad.abs().sum() > 0  # reaches the layers below


def test_image_mask_replaces_patches_with_mask_token():
    backbone = MultiwayTransformer(tiny())
    with torch.no_grad():
        backbone.mask_token.normal_()
    image = torch.randn(1, 3, 32, 32)
    mask = torch.tensor([[True, False, False, True]])
    embedded = backbone.embed_image(image, mask)
    positions = backbone.vision_positions[:5]
    torch.testing.assert_close(embedded[0, 1] - positions[1], backbone.mask_token[0, 0])
    torch.testing.assert_close(embedded[0, 4] - positions[4], backbone.mask_token[0, 0])
    assert not torch.allclose(embedded[0, 2] - positions[2], backbone.mask_token[0, 0])


def test_vision_language_ffn_serves_fused_input_only():
    backbone = MultiwayTransformer(tiny(vl_layers=1)).eval()
    image, text, padding = inputs()
    top = backbone.layers[1]
    assert top.vl_ffn is not None and backbone.layers[0].vl_ffn is None
    calls = []
    handle = top.vl_ffn.register_forward_hook(lambda *args: calls.append(1))
    backbone(image=image, text=text, text_padding_mask=padding)
    assert calls == [1]
    backbone(image=image)
    backbone(text=text)
    assert calls == [1]
    handle.remove()


def test_activation_checkpointing_gives_the_same_gradients():
    torch.manual_seed(0)
    plain = MultiwayTransformer(tiny(moe=MoEPlan(num_experts=4, every=1), drop_path=0.0))
    checkpointed = MultiwayTransformer(tiny(moe=MoEPlan(num_experts=4, every=1), checkpoint_activations=True))
    checkpointed.load_state_dict(plain.state_dict())
    image, text, padding = inputs()
    grads = []
    for model in (plain, checkpointed):
        out = model(image=image, text=text, text_padding_mask=padding)
        (out.hidden.square().mean() + sum(r.balance_loss for r in out.routing)).backward()
        grads.append({name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys()
    for name in grads[0]:
        torch.testing.assert_close(grads[0][name], grads[1][name], msg=name)


def test_bf16_autocast_on_cpu():
    backbone = MultiwayTransformer(tiny(moe=MoEPlan(num_experts=4, heads=2, every=1)))
    image, text, padding = inputs()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = backbone(image=image, text=text, text_padding_mask=padding)
    assert out.hidden.dtype in (torch.bfloat16, torch.float32)
    (out.hidden.float().mean() + sum(r.balance_loss for r in out.routing)).backward()
    assert torch.isfinite(backbone.patch_embed.weight.grad).all()


def test_initialisation_follows_beit3():
    backbone = MultiwayTransformer(MultiwayConfig.preset("tiny", moe=MoEPlan(num_experts=4, heads=2)))
    assert torch.all(backbone.cls_token == 0) and torch.all(backbone.mask_token == 0)
    fc1 = backbone.layers[0].ffn[0].fc1
    assert fc1.weight.abs().max() <= 0.02 and torch.all(fc1.bias == 0)
    assert 0.005 < fc1.weight.std() < 0.02
    experts = backbone.layers[1].ffn[0].experts
    assert experts.fc1_weight.abs().max() <= 0.02 and torch.all(experts.fc2_bias == 0)
    router = backbone.layers[1].ffn[0].router.scorer
    torch.testing.assert_close(router.expert_embeddings.norm(dim=-1), torch.full((4,), 0.1))
    assert torch.all(backbone.layers[1].ffn[0].merge.bias == 0)


def test_presets():
    tiny_config = MultiwayConfig.preset("tiny")
    assert (tiny_config.depth, tiny_config.dim, tiny_config.image_size) == (4, 192, 64)
    base = MultiwayConfig.preset("base", drop_path=0.1)
    assert (base.depth, base.dim, base.num_heads, base.ffn_dim, base.image_size, base.patch_size) == (
        12,
        768,
        12,
        3072,
        224,
        16,
    )
    assert base.drop_path == 0.1 and base.vocab_size == 49410
    with pytest.raises(ValueError, match="preset 'huge'"):
        MultiwayConfig.preset("huge")


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_preset_builds_a_backbone_of_its_closed_form_size(name):
    config = MultiwayConfig.preset(name)
    with torch.device("meta"):
        backbone = MultiwayTransformer(config)
    assert count(backbone) == backbone_parameters(config)


def test_the_test_preset_is_the_tests_backbone():
    config = MultiwayConfig.preset("test")
    assert (config.depth, config.dim, config.num_heads, config.ffn_dim, config.num_patches) == (2, 32, 4, 64, 4)
    image, text, padding = inputs()
    out = MultiwayTransformer(config)(image=image, text=text, text_padding_mask=padding)
    assert out.hidden.shape == (2, 1 + 4 + 6, 32)


@pytest.mark.parametrize(
    "fields,message",
    [
        (dict(dim=30), "num_heads"),
        (dict(image_size=40), "patch_size"),
        (dict(attention="cross"), "attention"),
        (dict(vl_layers=5), "vl_layers"),
        (dict(moe=MoEPlan(layers=[7])), "outside"),
        (dict(moe=MoEPlan(heads=3)), "heads=3"),
        (dict(depth=0), "depth"),
    ],
)
def test_bad_config_names_field_and_value(fields, message):
    with pytest.raises(ValueError, match=message):
        tiny(**fields)


def test_bad_moe_plan_names_field():
    with pytest.raises(ValueError, match="MoEPlan.every"):
        MoEPlan(every=0)
    with pytest.raises(ValueError, match="MoEPlan.mode"):
        MoEPlan(mode="mixed")


def test_bad_inputs_name_the_value():
    backbone = MultiwayTransformer(tiny())
    with pytest.raises(ValueError, match="image_size=32"):
        backbone(image=torch.randn(1, 3, 48, 48))
    rows = backbone.config.max_text_positions
    with pytest.raises(ValueError, match=f"max_text_positions={rows}"):
        backbone(text=torch.zeros(1, rows + 4, dtype=torch.long))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_bf16_forward_backward():
    backbone = MultiwayTransformer(MultiwayConfig.preset("tiny", moe=MoEPlan(num_experts=8, heads=4))).cuda()
    image = torch.randn(4, 3, 64, 64, device="cuda")
    text = torch.randint(0, 1000, (4, 16), device="cuda")
    padding = torch.zeros(4, 16, dtype=torch.bool, device="cuda")
    padding[0, 10:] = True
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out = backbone(image=image, text=text, text_padding_mask=padding)
    (out.hidden.float().square().mean() + sum(r.balance_loss for r in out.routing)).backward()
    assert torch.isfinite(backbone.patch_embed.weight.grad).all()


def test_transformer_dropout_acts_in_training_only():
    """MultiwayConfig.dropout (MH-MoE App. C: 0.1): random in training, the identity in evaluation."""
    image, text, padding = inputs()
    torch.manual_seed(0)
    backbone = MultiwayTransformer(tiny(dropout=0.1))
    plain = MultiwayTransformer(tiny())
    plain.load_state_dict(backbone.state_dict())
    backbone.eval(), plain.eval()
    with torch.no_grad():
        torch.testing.assert_close(backbone(image, text, padding).hidden, plain(image, text, padding).hidden)
    backbone.train()
    first, second = backbone(image, text, padding).hidden, backbone(image, text, padding).hidden
    assert not torch.allclose(first, second)
    with pytest.raises(ValueError, match="dropout must lie in"):
        tiny(dropout=1.0)
