"""The masked-modeling pre-training task on hand-made batches: losses, balance term, optimiser, norm restore."""

from __future__ import annotations

import dataclasses
import json
import math

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from mmoe.data.transforms import denormalize
from mmoe.model import MoEPlan, MultiwayConfig
from mmoe.model.config import PRESETS
from mmoe.model.vqkd import load_vqkd
from mmoe.runtime.optimizer import PRETRAINING_OPTIMIZER, warmup_cosine
from mmoe.tasks.pretraining import MaskedPretraining, vqkd_codes
from mmoe.tasks.visual_codebook import PatchCodebook, fit_codebook
from tests.model.vqkd_reference import released_state, save_released

BACKBONE = PRESETS["test"] | {"vocab_size": 120}


def images(count: int, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    base = torch.rand(count, 3, 1, 1, generator=generator) * 2 - 1
    return (base + 0.3 * torch.randn(count, 3, 32, 32, generator=generator)).clamp(-1, 1)


@pytest.fixture()
def codebook_path(tmp_path):
    codebook = fit_codebook([images(64)], size=16, patch_size=16, pool=2, iterations=5)
    path = tmp_path / "codebook.pt"
    codebook.save(path)
    return str(path)


def make_batches(count: int, seed: int = 0) -> list[dict]:
    generator = torch.Generator().manual_seed(seed)
    batches = []
    for index in range(count):
        kind = ("image", "text", "pair")[index % 3]
        batch: dict = {"kind": kind}
        if kind != "text":
            batch["image"] = images(4, seed + index)
            batch["image_mask"] = torch.rand(4, 4, generator=generator) < (0.4 if kind == "image" else 0.0)
            batch["image_mask"][:, 0] = kind == "image"
        if kind != "image":
            # Learnable text: each position holds a fixed token, so masked tokens are predictable from positions.
            targets = (3 + (torch.arange(10) * 11) % 110).repeat(4, 1)
            text_mask = torch.rand(4, 10, generator=generator) < 0.3
            text_mask[:, 1] = True
            padding = torch.zeros(4, 10, dtype=torch.bool)
            padding[0, 7:] = True
            text_mask &= ~padding
            batch |= {
                "text_ids": torch.where(text_mask, 119, targets),
                "text_targets": targets,
                "text_mask": text_mask,
                "text_padding_mask": padding,
            }
        batches.append(batch)
    return batches


def test_codebook_round_trip_and_encoding(tmp_path, codebook_path):
    codebook = PatchCodebook.load(codebook_path)
    ids = codebook.encode(images(3))
    assert ids.shape == (3, 4) and ids.dtype == torch.long and 0 <= ids.min() and ids.max() < 16
    # A patch equal to a centroid (after pooling) maps to that centroid.
    flat = codebook.centroids[5].view(3, 2, 2)
    patch = flat.repeat_interleave(8, 1).repeat_interleave(8, 2)
    image = patch.repeat(1, 2, 2)[None]
    assert codebook.encode(image)[0].tolist() == [5, 5, 5, 5]
    with pytest.raises(FileNotFoundError, match="mmoe tokenizer fit"):
        PatchCodebook.load(tmp_path / "none.pt")


def test_losses_per_kind_and_balance_term(codebook_path):
    task = MaskedPretraining(MultiwayConfig(**BACKBONE, moe=MoEPlan(num_experts=4, every=1)), codebook_path)
    image_batch, text_batch, pair_batch = make_batches(3)
    losses, routing = task.masked_losses(image_batch)
    assert set(losses) == {"image"} and [r.modality for r in routing] == ["vision", "vision"]
    losses, routing = task.masked_losses(text_batch)
    assert set(losses) == {"text"} and [r.modality for r in routing] == ["language", "language"]
    losses, routing = task.masked_losses(pair_batch)
    assert set(losses) == {"pair"} and len(routing) == 4
    # At initialisation the cross-entropy is about log(classes).
    assert abs(losses["pair"].item() - math.log(120)) < 1.0
    balance = task.balance_loss(routing)
    torch.testing.assert_close(balance, torch.stack([r.balance_loss for r in routing]).sum())


def test_training_reduces_loss_and_keeps_expert_norms(codebook_path, tmp_path):
    torch.manual_seed(0)
    config = MultiwayConfig(**BACKBONE, moe=MoEPlan(num_experts=4, heads=2, every=1))
    optimizer = dataclasses.replace(PRETRAINING_OPTIMIZER, learning_rate=3e-3, warmup_steps=5)
    task = MaskedPretraining(config, codebook_path, optimizer=optimizer)
    batches = make_batches(6)
    loader = DataLoader(batches * 10, batch_size=None, shuffle=False)
    first = {}
    for batch in batches[:3]:
        losses, _ = task.masked_losses(batch)
        first |= {k: v.item() for k, v in losses.items()}
    trainer = L.Trainer(
        max_steps=60,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        accelerator="cpu",
        default_root_dir=tmp_path,
    )
    trainer.fit(task, loader)
    last = {}
    for batch in batches[:3]:
        losses, _ = task.masked_losses(batch)
        last |= {k: v.item() for k, v in losses.items()}
    for kind in ("image", "text", "pair"):
        assert last[kind] < 0.8 * first[kind], (kind, first[kind], last[kind])
    for layer in task.backbone.layers:
        for ffn in layer.ffn:
            norms = ffn.router.scorer.expert_embeddings.norm(dim=-1)
            torch.testing.assert_close(norms, torch.full_like(norms, 0.1))


def test_no_weight_decay_on_biases_norms_and_router_embeddings(codebook_path):
    task = MaskedPretraining(MultiwayConfig(**BACKBONE, moe=MoEPlan(num_experts=4, every=1)), codebook_path)
    task.trainer = L.Trainer(max_steps=10, logger=False)
    optimizer = task.configure_optimizers()["optimizer"]
    decayed = {id(p) for p in optimizer.param_groups[0]["params"]}
    names = {id(p): n for n, p in task.named_parameters()}
    assert all(not names[i].endswith(".bias") and "norm" not in names[i] for i in decayed)
    assert not any(names[i].endswith(("expert_embeddings", "log_temperature", "cls_token")) for i in decayed)
    assert optimizer.defaults["betas"] == (0.9, 0.98) and optimizer.defaults["eps"] == 1e-6


def test_warmup_cosine_schedule():
    schedule = warmup_cosine(10, 110, 0.1)
    assert schedule(0) == pytest.approx(0.1) and schedule(9) == pytest.approx(1.0)
    assert schedule(60) == pytest.approx(0.1 + 0.9 * 0.5)
    assert schedule(110) == pytest.approx(0.1) and schedule(500) == pytest.approx(0.1)


def test_codebook_patch_size_must_match(codebook_path):
    with pytest.raises(ValueError, match="backbone.patch_size=8"):
        MaskedPretraining(MultiwayConfig(**(BACKBONE | {"patch_size": 8})), codebook_path)


@pytest.mark.slow
def test_teacher_feature_target_from_open_clip_weights_on_disk(tmp_path):
    import open_clip

    weights = tmp_path / "teacher.pt"
    torch.save(open_clip.create_model("ViT-S-32").state_dict(), weights)  # stands in for weights a user has
    task = MaskedPretraining(MultiwayConfig(**BACKBONE), teacher_checkpoint=str(weights), teacher_model="ViT-S-32")
    assert not any(name.startswith("_teacher") for name in task.state_dict())
    assert task.mim_head.out_features == 384
    losses, _ = task.masked_losses(make_batches(1)[0])
    assert set(losses) == {"image_cosine"} and 0.0 < losses["image_cosine"].item() < 2.0
    losses["image_cosine"].backward()
    assert task.mim_head.weight.grad.abs().sum() > 0


def test_exactly_one_image_target(codebook_path, tmp_path):
    message = "exactly one of model.visual_codebook, model.teacher_checkpoint and model.vqkd_tokenizer"
    with pytest.raises(ValueError, match=message):
        MaskedPretraining(MultiwayConfig(**BACKBONE))
    with pytest.raises(ValueError, match=message):
        MaskedPretraining(MultiwayConfig(**BACKBONE), codebook_path, vqkd_tokenizer=codebook_path)
    with pytest.raises(FileNotFoundError, match=f"model.vqkd_tokenizer {tmp_path / 'vqkd.pth'} does not exist"):
        MaskedPretraining(MultiwayConfig(**BACKBONE), vqkd_tokenizer=str(tmp_path / "vqkd.pth"))
    with pytest.raises(FileNotFoundError, match="teacher_checkpoint"):
        MaskedPretraining(MultiwayConfig(**BACKBONE), teacher_checkpoint=str(tmp_path / "missing.pt"))


def test_training_step_records_are_detached_copies():
    """training_step hands callbacks detached copies of the routing records; the step's own records (and their
    graph) stay as the backbone returned them."""
    from mmoe.moe import MoEConfig, build_moe_layer
    from mmoe.tasks.base import detached

    layer = build_moe_layer(MoEConfig(dim=16, ffn_dim=32, num_experts=4, top_k=2))
    _, record = layer(torch.randn(2, 3, 16))
    copy = detached(record)
    assert copy is not record and record.balance_loss.requires_grad and record.z_loss.requires_grad
    assert not copy.balance_loss.requires_grad and not copy.z_loss.requires_grad
    assert torch.equal(copy.balance_loss, record.balance_loss) and copy.expert_index is record.expert_index


def test_vqkd_targets_are_the_tokenizer_codes_of_the_pixels(tmp_path, capsys):
    """MIM with VQ-KD targets: the codes of the images in [0, 1] (the data's normalisation undone), computed in fp32
    even under a bf16 autocast on the CPU; the tokenizer stays out of the checkpoint and the optimiser."""
    path = save_released(tmp_path / "vqkd.pth", released_state(dim=64, depth=1, mlp=128, grid=2, codes=64))
    task = MaskedPretraining(MultiwayConfig(**BACKBONE), vqkd_tokenizer=str(path))
    report = capsys.readouterr().err.strip().splitlines()
    assert len(report) == 1 and "model.vqkd_tokenizer" in report[0] and "decoder" in report[0]
    assert task.mim_head.out_features == 64
    assert not any("encoder" in name or "codebook" in name for name in task.state_dict())
    assert all(not name.startswith("_vqkd") for name, _ in task.named_parameters())
    batch = make_batches(1)[0]
    tokenizer = load_vqkd(path).tokenizer
    expected = tokenizer.encode(denormalize(batch["image"]).clamp(0, 1))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        codes = vqkd_codes(task._vqkd[0], batch["image"])
    assert torch.equal(codes, expected) and len(expected.unique()) > 1
    losses, _ = task.masked_losses(batch)
    mask = batch["image_mask"]
    logits = task.mim_head(task.backbone(image=batch["image"], image_mask=mask).image_hidden[:, 1:][mask])
    torch.testing.assert_close(losses["image"], F.cross_entropy(logits, expected[mask]))
    given = (expected + 1) % 64  # codes the loader computed come with the batch and are used as they are
    with_targets, _ = task.masked_losses(batch | {"image_targets": given})
    torch.testing.assert_close(with_targets["image"], F.cross_entropy(logits, given[mask]))
    losses["image"].backward()
    assert task.mim_head.weight.grad.abs().sum() > 0


def test_output_vocab_head_is_the_full_heads_softmax_over_its_ids(codebook_path, tmp_path):
    """With ``output_vocab`` the MLM head predicts only the listed ids: its loss is the whole-vocabulary head's
    cross-entropy with the logits of the other ids left out, and a masked id outside the list is named."""
    config = MultiwayConfig(**BACKBONE)
    _, text_batch, pair_batch = make_batches(3)
    ids = sorted(set(text_batch["text_targets"].flatten().tolist()))
    path = tmp_path / "text_tokens.json"
    path.write_text(json.dumps(ids[::-1]))
    torch.manual_seed(0)
    full = MaskedPretraining(config, codebook_path)
    part = MaskedPretraining(config, codebook_path, output_vocab=str(path))
    assert part.mlm_head.weight.shape == (len(ids), config.dim)
    part.load_state_dict(full.state_dict() | {"mlm_head.weight": full.mlm_head.weight[ids] * 40,
                                              "mlm_head.bias": full.mlm_head.bias[ids] + 0.5})  # fmt: skip
    with torch.no_grad():
        full.mlm_head.weight.mul_(40)
        full.mlm_head.bias.add_(0.5)
    for batch in (text_batch, pair_batch):
        out = full.backbone(image=batch.get("image"), text=batch["text_ids"],
                            text_padding_mask=batch["text_padding_mask"])  # fmt: skip
        logits = full.mlm_head(out.text_hidden[batch["text_mask"]])[:, ids]
        targets = [ids.index(i) for i in batch["text_targets"][batch["text_mask"]].tolist()]
        expected = F.cross_entropy(logits, torch.tensor(targets))
        losses, _ = part.masked_losses(batch)
        torch.testing.assert_close(losses[batch["kind"]], expected)
    assert losses["pair"].item() < math.log(len(ids)) + 2.0
    path.write_text(json.dumps(ids[1:]))
    with pytest.raises(ValueError, match=rf"token ids \[{ids[0]}\].*not in model.output_vocab"):
        MaskedPretraining(config, codebook_path, output_vocab=str(path)).masked_losses(text_batch)


def test_contrastive_loss_on_pairs_is_a_per_pair_infonce_over_cls_tokens(codebook_path):
    """``contrastive_coefficient`` adds, for the pair batch only, the symmetric InfoNCE of an image-only pass's vision
    CLS and an unmasked text-only pass's first token (per-row loop below), weighted in the step loss."""
    config = MultiwayConfig(**BACKBONE, moe=MoEPlan(num_experts=4, every=1))
    torch.manual_seed(0)
    task = MaskedPretraining(config, codebook_path, contrastive_coefficient=0.5)
    with torch.no_grad():
        task.vision_head.weight.mul_(30)  # embeddings that differ between rows (BEiT-3's init makes them near equal)
        task.language_head.weight.mul_(30)
    image_batch, text_batch, pair_batch = make_batches(3)
    losses, routing = task.masked_losses(pair_batch)
    assert set(losses) == {"pair", "pair_contrastive"} and len(routing) == 4 + 2 + 2  # joint (2 ways), image, text
    image = F.normalize(task.vision_head(task.backbone(image=pair_batch["image"]).hidden[:, 0]), dim=-1)
    text_out = task.backbone(text=pair_batch["text_targets"], text_padding_mask=pair_batch["text_padding_mask"])
    text = F.normalize(task.language_head(text_out.hidden[:, 0]), dim=-1)
    scale = math.exp(math.log(1 / 0.07))
    rows = []
    for i in range(len(image)):
        image_to_text = torch.stack([scale * image[i] @ text[j] for j in range(len(text))])
        text_to_image = torch.stack([scale * text[i] @ image[j] for j in range(len(image))])
        rows.append(-(image_to_text.log_softmax(0)[i] + text_to_image.log_softmax(0)[i]) / 2)
    torch.testing.assert_close(losses["pair_contrastive"], torch.stack(rows).mean(), rtol=1e-4, atol=1e-5)
    assert losses["pair_contrastive"].item() > 0.05  # not a trivially solved batch
    assert set(task.masked_losses(image_batch)[0]) == {"image"}  # image and text batches have no pairs
    step = task.step_losses({"image": image_batch, "text": text_batch, "pair": pair_batch})
    expected = step.logged["image_loss"] + step.logged["text_loss"] + step.logged["pair_loss"]
    torch.testing.assert_close(step.task_loss, expected + 0.5 * step.logged["pair_contrastive_loss"])
    assert "pair_contrastive_ppl" not in step.logged and step.logged["logit_scale"].item() == pytest.approx(1 / 0.07)
    step.task_loss.backward()
    assert task.logit_scale.grad is not None and task.vision_head.weight.grad.abs().sum() > 0
    with pytest.raises(ValueError, match="contrastive_coefficient must be a finite number >= 0"):
        MaskedPretraining(config, codebook_path, contrastive_coefficient=-1.0)
