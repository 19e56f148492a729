"""Mixture-of-Depths over the image patches (``MultiwayConfig.depth_routing``, :mod:`mmoe.model.depth_router`):
a routed block against a per-token float64 reference written from Raposo et al. §3 (outputs and every gradient, with a
dense or a MoE FFN), the reference catching deliberate breaks, skipped patches unchanged, the text always processed,
C = 1, decoding from a cached image, a training step, the cost of ``mmoe info`` against a counted run, and the
refusals."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from mmoe.model import MoEPlan, MultiwayConfig, MultiwayTransformer, from_pretrained, save_pretrained
from mmoe.model.config import config_from_dict, config_to_dict
from mmoe.model.cost import backbone_cost
from mmoe.model.depth_router import DepthRoute, DepthRouting
from mmoe.tasks.captioning import caption_attention_mask
from tests.model.test_modality_pools import realistic_ as trained_scale_
from tests.moe.reference import reference_forward

ROOT = Path(__file__).resolve().parents[2]
PATCHES = 16  # the test preset at 64 px


def routed_config(capacity: float = 0.25, weight: str = "sigmoid", moe: MoEPlan | None = None, **overrides):
    routing = DepthRouting(capacity=capacity, weight=weight, layers=[0])
    return MultiwayConfig.preset("test", image_size=64, depth_routing=routing, moe=moe, **overrides)


def realistic_(backbone: MultiwayTransformer, seed: int = 0) -> None:
    """Weights of a trained layer's scale (:func:`tests.model.test_modality_pools.realistic_`), and depth routers whose
    scores are of order 1-4 and separate the patches (BEiT-3's from-scratch 0.02 would give near-equal scores and
    weights near 0.5)."""
    trained_scale_(backbone, seed)
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for layer in backbone.layers:
            if layer.depth_router is not None:
                weight = layer.depth_router.score.weight
                noise = torch.randn(weight.shape, generator=generator, dtype=weight.dtype)
                weight.copy_(2 * noise / math.sqrt(weight.shape[-1]))


def block_inputs(batch: int = 3, text_len: int = 6, seed: int = 1):
    generator = torch.Generator().manual_seed(seed)
    image = torch.randn(batch, 1 + PATCHES, 32, generator=generator, dtype=torch.double)
    text = torch.randn(batch, text_len, 32, generator=generator, dtype=torch.double)
    padding = torch.zeros(batch, text_len, dtype=torch.bool)
    padding[1, 4:] = True
    return image, text, padding


def key_mask(image: torch.Tensor, padding: torch.Tensor) -> torch.Tensor:
    """(B, 1, 1, L): every image token and the real text tokens are keys."""
    return torch.cat([padding.new_ones(image.shape[:2]), ~padding], dim=1)[:, None, None, :]


def reference_attention(attention, tokens: list[tuple[int, torch.Tensor]], keys: list[bool]) -> list[torch.Tensor]:
    """Each token's attention update, token by token and head by head: softmax(q·k / sqrt(d)) over the tokens that
    are keys, each token through its modality's LayerNorms and projections."""
    projected = [attention.qkv[m](attention.norm[m](x)) for m, x in tokens]
    dim = tokens[0][1].shape[-1]
    heads, head_dim = attention.num_heads, dim // attention.num_heads
    updates = []
    for (m, _), qkv in zip(tokens, projected, strict=True):
        attended = []
        for head in range(heads):
            part = slice(head * head_dim, (head + 1) * head_dim)
            q = qkv[part]
            pairs = [(other[dim : 2 * dim][part], other[2 * dim :][part]) for other in projected]
            logits = [q @ k / math.sqrt(head_dim) for (k, _), key in zip(pairs, keys, strict=True) if key]
            values = [v for (_, v), key in zip(pairs, keys, strict=True) if key]
            attended.append(sum(w * v for w, v in zip(torch.stack(logits).softmax(0), values, strict=True)))
        updates.append(attention.out[m](attention.inner_norm[m](torch.cat(attended))))
    return updates


def reference_routed_block(block, image, text, padding, routing: DepthRouting):
    """Raposo et al. §3 for one block, image by image: r_j = w·x_j + b per patch; the top ceil(C n) patches and the
    CLS run the block with the whole text (a skipped patch is no key); x + g(r) (block(x̃) - x̃) for a kept patch,
    x for a skipped one, the block's output for the CLS and the text. Returns (image out, text out, kept positions,
    the FFNs' reference loads (None for a dense FFN))."""
    router = block.depth_router.score
    batch, image_len, _ = image.shape
    kept, hidden_image, hidden_text = [], [], []
    for b in range(batch):
        scores = {j: router.weight[0] @ image[b, j] + router.bias[0] for j in range(1, image_len)}
        top = sorted(scores, key=lambda j: -float(scores[j].detach()))[: math.ceil(routing.capacity * (image_len - 1))]
        kept.append([0, *sorted(top)])
        tokens = [(0, image[b, j]) for j in kept[b]] + [(1, text[b, t]) for t in range(text.shape[1])]
        keys = [True] * len(kept[b]) + [not bool(p) for p in padding[b]]
        updates = reference_attention(block.attention, tokens, keys)
        hidden = [x + u for (_, x), u in zip(tokens, updates, strict=True)]
        hidden_image.append(torch.stack(hidden[: len(kept[b])]))
        hidden_text.append(torch.stack(hidden[len(kept[b]) :]))
    hidden_image, hidden_text = torch.stack(hidden_image), torch.stack(hidden_text)
    updates, loads = [], []
    for m, hidden, mask in ((0, hidden_image, None), (1, hidden_text, padding)):
        normed = block.ffn_norm[m](hidden)
        if hasattr(block.ffn[m], "fc1"):  # dense: token by token
            updates.append(torch.stack([torch.stack([block.ffn[m](t)[0] for t in row]) for row in normed]))
        else:
            update, _, load, _ = reference_forward(block.ffn[m], normed, mask)
            updates.append(update)
            loads.append(load)
    out_image = image.clone()
    for b in range(batch):
        for slot, j in enumerate(kept[b]):
            block_update = hidden_image[b, slot] + updates[0][b, slot] - image[b, j]
            gate = 1.0 if j == 0 else scores_weight(router, image[b, j], routing.weight)
            out_image[b, j] = image[b, j] + gate * block_update
    return out_image, hidden_text + updates[1], kept, loads or None


def scores_weight(router: nn.Linear, x: torch.Tensor, weight: str) -> torch.Tensor:
    score = router.weight[0] @ x + router.bias[0]
    return score.sigmoid() if weight == "sigmoid" else score


def assert_block_matches_reference(block, routing: DepthRouting) -> None:
    """The block's outputs, kept patches, FFN loads and every gradient (parameters, image, text) against
    :func:`reference_routed_block`."""
    image, text, padding = block_inputs()
    inputs = [image.clone().requires_grad_(True), text.clone().requires_grad_(True)]
    image_out, text_out, records = block(*inputs, padding, key_mask(image, padding))
    inputs_ref = [image.clone().requires_grad_(True), text.clone().requires_grad_(True)]
    image_ref, text_ref, kept, loads = reference_routed_block(block, *inputs_ref, padding, routing)

    depth = records[-1]
    assert depth.processed.tolist() == [[j in row for j in range(1 + PATCHES)] for row in kept]
    if loads is not None:
        for record, load in zip(records[:-1], loads, strict=True):  # the MoE FFNs saw the kept tokens only
            assert torch.equal(record.expert_counts, load)
    real = ~padding
    torch.testing.assert_close(image_out, image_ref)
    torch.testing.assert_close(text_out[real], text_ref[real])
    generator = torch.Generator().manual_seed(5)
    grads = [torch.randn(image.shape, generator=generator, dtype=image.dtype), torch.randn_like(text)]
    params = list(block.parameters())
    loss = (image_out * grads[0]).sum() + (text_out * grads[1])[real].sum()
    loss_ref = (image_ref * grads[0]).sum() + (text_ref * grads[1])[real].sum()
    got = torch.autograd.grad(loss, [*inputs, *params], allow_unused=True)
    want = torch.autograd.grad(loss_ref, [*inputs_ref, *params], allow_unused=True)
    names = ["image", "text"] + [name for name, _ in block.named_parameters()]
    for name, g, w in zip(names, got, want, strict=True):
        assert g is not None and w is not None, name
        torch.testing.assert_close(g, w, msg=lambda m, name=name: f"gradient of {name}: {m}")
    assert got[names.index("depth_router.score.weight")].abs().max() > 1e-3  # the router learns


def routed_block(**config):
    torch.manual_seed(0)
    backbone = MultiwayTransformer(routed_config(**config)).double()
    realistic_(backbone)
    return backbone.layers[0]


@pytest.mark.parametrize("weight", ["sigmoid", "raw"])
@pytest.mark.parametrize("capacity", [0.25, 0.6])
def test_a_routed_block_equals_the_per_token_reference(capacity, weight):
    block = routed_block(capacity=capacity, weight=weight)
    assert_block_matches_reference(block, DepthRouting(capacity=capacity, weight=weight, layers=[0]))


def test_with_a_moe_ffn_the_routed_block_equals_the_reference_and_the_experts_see_only_kept_tokens():
    block = routed_block(moe=MoEPlan(num_experts=4, top_k=2, router="linear", every=1))
    assert_block_matches_reference(block, DepthRouting(capacity=0.25, layers=[0]))


def test_the_reference_catches_the_lowest_scores_kept(monkeypatch):
    block = routed_block()
    top_k = torch.Tensor.topk
    monkeypatch.setattr(torch.Tensor, "topk", lambda self, k, dim=-1: top_k(self, k, dim=dim, largest=False))
    with pytest.raises(AssertionError):
        assert_block_matches_reference(block, DepthRouting(capacity=0.25, layers=[0]))


def test_the_reference_catches_the_router_weight_dropped(monkeypatch):
    block = routed_block()

    def merge_unweighted(route, image_x, kept, kept_out):
        return image_x.scatter(1, route.indices[..., None].expand_as(kept), kept_out)

    monkeypatch.setattr(DepthRoute, "merge", merge_unweighted)
    with pytest.raises(AssertionError):
        assert_block_matches_reference(block, DepthRouting(capacity=0.25, layers=[0]))


def test_skipped_patches_are_unchanged_exactly_and_the_text_is_always_processed():
    block = routed_block()
    image, text, padding = block_inputs()
    image_out, text_out, records = block(image, text, padding, key_mask(image, padding))
    processed = records[-1].processed
    assert processed[:, 0].all() and processed.sum(1).tolist() == [1 + 4] * 3  # CLS + ceil(0.25 * 16)
    assert torch.equal(image_out[~processed], image[~processed])
    assert (image_out[processed] - image[processed]).abs().amin() > 0
    assert (text_out - text)[~padding].abs().amin() > 0
    plain = routed_block()
    plain.depth_router = None
    _, text_alone, _ = block(None, text, padding, None)  # text only: nothing to route, the plain block
    torch.testing.assert_close(text_alone, plain(None, text, padding, None)[1], rtol=0, atol=0)


def test_at_capacity_one_every_patch_takes_the_plain_block_update_times_its_router_weight():
    """C = 1 keeps every token, so attention and the FFN see what the plain block sees; the patches' updates are
    scaled by sigmoid(r), which is not 1: the CLS and the text equal the plain block, the patches do not."""
    block = routed_block(capacity=1.0)
    plain = routed_block(capacity=1.0)
    plain.depth_router = None
    image, text, padding = block_inputs()
    mask = key_mask(image, padding)
    image_out, text_out, _ = block(image, text, padding, mask)
    plain_image, plain_text, _ = plain(image, text, padding, mask)
    router = block.depth_router.score
    weights = (image[:, 1:] @ router.weight[0] + router.bias[0]).sigmoid()[..., None]
    torch.testing.assert_close(image_out[:, 1:], image[:, 1:] + weights * (plain_image[:, 1:] - image[:, 1:]))
    torch.testing.assert_close(image_out[:, 0], plain_image[:, 0])
    torch.testing.assert_close(text_out, plain_text)
    assert (image_out[:, 1:] - plain_image[:, 1:]).abs().max() > 1e-2


def test_decoding_from_the_cached_image_equals_the_whole_sequence():
    torch.manual_seed(0)
    config = routed_config(moe=MoEPlan(num_experts=4, every=1), vl_layers=1)
    backbone = MultiwayTransformer(config).eval()
    realistic_(backbone)
    generator = torch.Generator().manual_seed(0)
    image = torch.randn(3, 3, 64, 64, generator=generator)
    text = torch.randint(0, 1000, (3, 7), generator=generator)
    mask = caption_attention_mask(1 + PATCHES, text.shape[1])
    assert backbone.routes_each_token_alone()
    with torch.no_grad():
        whole = backbone(image=image, text=text, attn_mask=mask)
        context = backbone.image_context(image)
        alone = backbone.forward_text(text, context, mask[:, 1 + PATCHES :])
        beams = backbone.forward_text(
            text.repeat_interleave(2, 0), [c.repeat_interleave(2) for c in context], mask[:, 1 + PATCHES :]
        )
    assert context[0].kept is not None and context[0].keys.shape[2] == 1 + 4 and context[1].kept is None
    torch.testing.assert_close(alone.hidden, whole.text_hidden, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(beams.hidden[::2], whole.text_hidden, rtol=1e-4, atol=1e-4)
    assert whole.image_depth.tolist() == (1 + whole.depth_routing[0].processed.long()).tolist()


def test_a_training_step_with_a_moe_ffn_in_the_routed_layer_trains_the_router():
    torch.manual_seed(0)
    config = routed_config(moe=MoEPlan(num_experts=4, every=1), checkpoint_activations=True)
    backbone = MultiwayTransformer(config).train()
    optimizer = torch.optim.SGD(backbone.parameters(), lr=0.1)
    router = backbone.layers[0].depth_router.score.weight
    before = router.detach().clone()
    image, text = torch.randn(2, 3, 64, 64), torch.randint(0, 1000, (2, 5))
    out = backbone(image=image, text=text)
    loss = out.hidden.pow(2).mean() + sum(record.balance_loss for record in out.routing)
    loss.backward()
    optimizer.step()
    assert router.grad.abs().max() > 0 and not torch.equal(router, before)
    vision = [r for r in out.routing if r.modality == "vision"]
    assert [int(r.expert_counts.sum()) for r in vision] == [2 * (1 + 4), 2 * (1 + PATCHES)]  # top-1 of kept / all
    assert out.image_depth.shape == (2, 1 + PATCHES) and out.depth_routing[0].processed_fraction == 0.25


def count_weight_flops(backbone: MultiwayTransformer, image: torch.Tensor) -> int:
    """The FLOPs torch's counter counts in the matrix products of one forward of ``image`` (the weights: linear
    layers, the router among them), less the patch embedding's convolution and the attention scores."""
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        backbone(image=image)
    counts = counter.get_flop_counts()["Global"]
    return sum(count for op, count in counts.items() if "mm" in str(op) and "attention" not in str(op))


def test_info_counts_the_router_and_the_expected_flops_of_a_patch_as_a_counted_run():
    config = MultiwayConfig.preset("test", image_size=64, depth_routing=DepthRouting(capacity=0.3, every=1))
    backbone = MultiwayTransformer(config)
    cost = backbone_cost(config, sequence_length=1 + PATCHES)
    assert cost["parameters"] == sum(p.numel() for p in backbone.parameters())
    assert cost["layers"][0]["depth_routing"]["router_parameters"] == 32 + 1
    plain = backbone_cost(MultiwayConfig.preset("test", image_size=64), sequence_length=1 + PATCHES)
    kept = math.ceil(0.3 * PATCHES)
    expected = 2 * (2 * 32 + kept / PATCHES * plain["layers"][0]["flops_per_token"])  # router + C x block, 2 layers
    assert cost["by_modality"]["vision"]["flops_per_token"] == pytest.approx(expected)
    assert cost["by_modality"]["language"]["flops_per_token"] == plain["flops_per_token"]  # text unchanged
    batch = 2
    counted = count_weight_flops(backbone, torch.randn(batch, 3, 64, 64))
    cls = plain["flops_per_token"]  # the CLS runs every layer, unscored
    assert (counted - batch * cls) / (batch * PATCHES) == pytest.approx(expected)


def test_a_saved_backbone_reads_back_with_its_routers_and_routes_as_before(tmp_path):
    config = routed_config(capacity=0.125)
    assert config_from_dict(config_to_dict(config)).depth_routing == config.depth_routing
    torch.manual_seed(0)
    backbone = MultiwayTransformer(config).eval()
    realistic_(backbone)
    loaded = from_pretrained(save_pretrained(backbone, tmp_path / "mod"))
    image = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        before, after = backbone(image=image), loaded(image=image)
    assert loaded.config.depth_routing == config.depth_routing
    assert torch.equal(before.hidden, after.hidden) and torch.equal(before.image_depth, after.image_depth)


@pytest.mark.parametrize(
    "fields,message",
    [
        (dict(capacity=0.0), r"DepthRouting.capacity must be a share of the patches in \(0, 1\], got 0.0"),
        (dict(capacity=1.5), r"DepthRouting.capacity must be a share of the patches in \(0, 1\], got 1.5"),
        (dict(every=0), r"DepthRouting.every must be a positive integer, got 0"),
        (dict(layers=[]), r"DepthRouting.layers must be a non-empty list"),
        (dict(weight="tanh"), r"DepthRouting.weight must be 'sigmoid' or 'raw', got 'tanh'"),
    ],
)
def test_routings_that_make_no_sense_are_refused_in_one_line(fields, message):
    with pytest.raises(ValueError, match=message) as error:
        DepthRouting(**fields)
    assert "\n" not in str(error.value)


def test_layers_outside_the_backbone_are_refused():
    with pytest.raises(ValueError, match=r"DepthRouting.layers=\[0, 2\] has indices outside \[0, 2\): \[2\]"):
        MultiwayConfig.preset("test", depth_routing=DepthRouting(layers=[0, 2]))
    with pytest.raises(ValueError, match=r"DepthRouting.every=3 routes no layer of a backbone of depth 2"):
        MultiwayConfig.preset("test", depth_routing=DepthRouting(every=3))


@pytest.mark.parametrize("command", ["info", "fit"])
def test_mmoe_refuses_a_capacity_outside_the_unit_interval_in_one_line(tmp_path, command):
    variant = tmp_path / "mod.yaml"
    variant.write_text("model:\n  init_args:\n    backbone:\n      depth_routing:\n        capacity: 1.5\n")
    run = tmp_path / "run"
    argv = [command, "--config=configs/pretrain/tiny.yaml", "--config=configs/pretrain/tiny/mod.yaml"]
    argv += [f"--config={variant}"] + ([f"--trainer.default_root_dir={run}"] if command == "fit" else [])
    done = subprocess.run(
        [sys.executable, "-m", "mmoe.cli", *argv],
        cwd=ROOT,
        env=os.environ | {"OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert (done.returncode, "Traceback" in done.stderr) == (2, False), done.stderr[-2000:]
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith(f"mmoe {command}: error: ") and "DepthRouting.capacity" in last and "1.5" in last, last
    assert not run.exists()


def test_the_router_scores_in_float32_under_autocast():
    block = MultiwayTransformer(routed_config()).layers[0]
    image = torch.randn(2, 1 + PATCHES, 32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        route = block.depth_router(image)
    assert route.weights.dtype == torch.float32
    backbone = MultiwayTransformer(routed_config()).bfloat16()  # fp32 router weights onto a bf16 residual stream
    out = backbone(image=torch.randn(2, 3, 64, 64, dtype=torch.bfloat16))
    assert out.hidden.dtype == torch.bfloat16 and out.image_depth[:, 1:].sum(1).tolist() == [PATCHES + 4] * 2
