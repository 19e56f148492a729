"""Decoding with the image's keys and values computed once (``MultiwayTransformer.image_context`` and
``forward_text``) gives the text what the whole sequence under captioning's mask gives it, for every layer layout a
captioner can have; a capacity factor in force turns the shortcut off, and captioning's beam search decodes the same
captions either way."""

from __future__ import annotations

import pytest
import torch

from mmoe.model import MoEPlan, MultiwayConfig, MultiwayTransformer
from mmoe.tasks.captioning import CaptioningFineTuning, caption_attention_mask

LAYOUTS = {
    "dense": dict(),
    "xmoe_top1": dict(moe=MoEPlan(num_experts=4, every=1)),
    "mhmoe_top2": dict(moe=MoEPlan(num_experts=4, every=1, heads=2, top_k=2)),
    "shared_ffn_vl_layer": dict(moe=MoEPlan(num_experts=4, every=1, mode="shared", top_k=2), vl_layers=1),
    "vl_layers_shared_attention": dict(moe=MoEPlan(num_experts=4, every=2), vl_layers=2, attention="shared"),
    "stratified": dict(moe=MoEPlan(num_experts=4, strata=[2, 2], top_k=2, every=1)),
    # MoE++'s gating residual: each token's logits carried from layer 0's modality FFN into layer 1's VL-FFN.
    "moe_plus_plus_gating_residual": dict(
        moe=MoEPlan(
            num_experts=4,
            every=1,
            top_k=2,
            router="linear",
            null_experts=1,
            copy_experts=1,
            constant_experts=1,
            gating_residual=True,
        ),
        vl_layers=1,
    ),
    # LIMoE's entropy losses read the modalities' lengths of a shared FFN's sequence; a text-only step gives one.
    "limoe_shared_ffn": dict(
        moe=MoEPlan(num_experts=4, every=1, mode="shared", local_entropy_weight=0.1, global_entropy_weight=0.1)
    ),
}


def sharpened(backbone: MultiwayTransformer) -> MultiwayTransformer:
    """``backbone`` with its matrices drawn at std 0.2: peaked attention and routing, where a key, a query or a
    route taken from the wrong token shows (BEiT-3's std 0.02 leaves attention nearly uniform at this width)."""
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for parameter in backbone.parameters():
            if parameter.dim() >= 2:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.2)
    return backbone.eval()


def inputs(config: MultiwayConfig, batch: int = 3, text_len: int = 7) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    image = torch.randn(batch, 3, config.image_size, config.image_size, generator=generator)
    return image, torch.randint(0, 1000, (batch, text_len), generator=generator)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_the_text_after_a_cached_image_equals_the_whole_sequence(layout):
    torch.manual_seed(0)
    config = MultiwayConfig.preset("test", **LAYOUTS[layout])
    backbone = sharpened(MultiwayTransformer(config))
    image, text = inputs(config)
    image_len = 1 + config.num_patches
    mask = caption_attention_mask(image_len, text.shape[1])
    assert backbone.routes_each_token_alone()
    with torch.no_grad():
        whole = backbone(image=image, text=text, attn_mask=mask)
        context = backbone.image_context(image)
        alone = backbone.forward_text(text, context, mask[:, image_len:])
        # Another image's keys and values: the test sees a context that is not the right one.
        other = backbone.forward_text(text, backbone.image_context(image.roll(1, dims=0)), mask[:, image_len:])
    assert alone.image_len == 0 and alone.text_len == text.shape[1]
    torch.testing.assert_close(alone.hidden, whole.text_hidden, rtol=1e-4, atol=1e-4)
    assert (other.hidden - whole.text_hidden).abs().max() > 0.1
    assert [(r.layer, r.modality) for r in alone.routing] == [
        (r.layer, r.modality) for r in whole.routing if r.modality != "vision"
    ]


def test_a_capacity_factor_in_force_turns_the_shortcut_off():
    """Drops under a capacity factor depend on the other tokens of the batch, the image's among them."""
    in_eval = MultiwayTransformer(MultiwayConfig.preset("test", moe=MoEPlan(num_experts=4, eval_capacity_factor=1.0)))
    assert in_eval.train().routes_each_token_alone() and not in_eval.eval().routes_each_token_alone()
    always = MultiwayTransformer(MultiwayConfig.preset("test", moe=MoEPlan(num_experts=4, capacity_factor=1.0)))
    assert not always.eval().routes_each_token_alone()  # eval falls back on the training factor


@pytest.mark.parametrize("beams", [1, 3])
def test_captions_decoded_with_the_cached_image_are_those_of_the_whole_sequence(beams, monkeypatch):
    torch.manual_seed(0)
    task = CaptioningFineTuning(backbone=MultiwayConfig.preset("test", moe=MoEPlan(num_experts=4, every=1)),
                                max_length=10, min_length=2)  # fmt: skip
    sharpened(task.backbone)
    task.eval()
    image, _ = inputs(task.backbone.config, batch=4)
    cached = task.generate(image, num_beams=beams)
    calls = []
    monkeypatch.setattr(task.backbone, "image_context", lambda image: calls.append(image) or [])
    monkeypatch.setattr(task.backbone, "routes_each_token_alone", lambda: False)
    whole = task.generate(image, num_beams=beams)
    assert calls == []  # the whole sequence ran at every step
    assert torch.equal(cached.tokens, whole.tokens) and len({tuple(t.tolist()) for t in whole.tokens}) > 1
    torch.testing.assert_close(cached.scores, whole.scores, rtol=1e-4, atol=1e-4)
