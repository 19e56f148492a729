"""The retrieval task: BEiT-3's dual-encoder heads over image-only and text-only passes of one MoE backbone, the
symmetric contrastive loss against a per-row reference, both passes' balance losses and routing records, and the
in-batch negatives gathered over 2 gloo processes (loss and gradients equal one process on the global batch)."""

from __future__ import annotations

import copy
import dataclasses
import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from mmoe.model import MoEPlan, MultiwayConfig
from mmoe.tasks.retrieval import RetrievalFineTuning, contrastive_loss, gather_with_grad
from tests.gloo import spawn_gloo

WORLD = 2


def config() -> MultiwayConfig:
    return MultiwayConfig.preset("test", vocab_size=120, moe=MoEPlan(num_experts=4, every=1))


def task(**overrides) -> RetrievalFineTuning:
    torch.manual_seed(0)
    return RetrievalFineTuning(backbone=config(), **overrides)


def batch(count: int, seed: int = 0) -> dict:
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 110, (count, 7), generator=generator)
    padding = torch.zeros(count, 7, dtype=torch.bool)
    padding[0, 4:] = True
    return {
        "image": torch.randn(count, 3, 32, 32, generator=generator),
        "text_ids": ids,
        "text_padding_mask": padding,
        "image_id": torch.arange(count),
    }


def reference_contrastive_loss(image: torch.Tensor, text: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """CLIP's loss written row by row: each image against every text, each text against every image."""
    terms = []
    for i in range(len(image)):
        logits = torch.stack([scale * image[i] @ text[j] for j in range(len(text))])
        terms.append(-torch.log_softmax(logits, 0)[i])
    for j in range(len(text)):
        logits = torch.stack([scale * text[j] @ image[i] for i in range(len(image))])
        terms.append(-torch.log_softmax(logits, 0)[j])
    return torch.stack(terms[: len(image)]).mean() / 2 + torch.stack(terms[len(image) :]).mean() / 2


def test_heads_are_bias_free_projections_and_the_scale_starts_at_log_1_over_0_07():
    model = task()
    for head in (model.vision_head, model.language_head):
        assert head.bias is None and head.weight.shape == (32, 32)
    assert model.logit_scale.item() == pytest.approx(math.log(1 / 0.07))
    assert model.scale().item() == pytest.approx(1 / 0.07, rel=1e-5)
    assert task(max_logit_scale=5.0).scale().item() == 5.0
    counts = RetrievalFineTuning.head_parameters(config(), {})
    assert counts == {"vision_head": 32 * 32, "language_head": 32 * 32, "logit_scale": 1}


def test_embeddings_are_unit_vectors_of_the_cls_of_single_modality_passes():
    model = task().eval()
    data = batch(3)
    with torch.no_grad():
        image, text, routing = model(data["image"], data["text_ids"], data["text_padding_mask"])
        image_pass = model.backbone(image=data["image"])
        text_pass = model.backbone(text=data["text_ids"], text_padding_mask=data["text_padding_mask"])
    torch.testing.assert_close(image.norm(dim=-1), torch.ones(3))
    torch.testing.assert_close(image, F.normalize(model.vision_head(image_pass.hidden[:, 0]), dim=-1))
    torch.testing.assert_close(text, F.normalize(model.language_head(text_pass.hidden[:, 0]), dim=-1))
    # both passes' records, vision (image pass) then language (text pass), one per MoE layer each
    assert [r.modality for r in routing] == ["vision", "vision", "language", "language"]


def test_contrastive_loss_equals_the_per_row_reference():
    generator = torch.Generator().manual_seed(1)
    image = F.normalize(torch.randn(5, 8, generator=generator), dim=-1)
    text = F.normalize(image + 0.5 * torch.randn(5, 8, generator=generator), dim=-1)
    scale = torch.tensor(1 / 0.07)
    torch.testing.assert_close(contrastive_loss(image, text, scale), reference_contrastive_loss(image, text, scale))
    # matched pairs lower the loss below shuffled ones
    assert contrastive_loss(image, text, scale) < contrastive_loss(image, text.roll(1, 0), scale)


def test_the_objective_holds_both_passes_balance_losses():
    model = task(balance_coefficient=0.5)
    model.log_dict = model.log = lambda *args, **kwargs: None
    data = batch(4)
    loss, routing, _ = model.shared_step(data, "train")
    assert len(routing) == 4
    step = model.step_losses(data)
    balance = torch.stack([record.balance_loss for record in step.routing]).sum()
    assert balance > 0
    torch.testing.assert_close(loss, step.task_loss + 0.5 * balance)
    image, text, _ = model(data["image"], data["text_ids"], data["text_padding_mask"])
    torch.testing.assert_close(step.task_loss, reference_contrastive_loss(image, text, model.scale()))
    loss.backward()
    assert model.logit_scale.grad is not None and model.logit_scale.grad.abs() > 0
    for slot in model.backbone.moe_layers():  # every expert pool learns: vision from images, language from texts
        assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in slot.layer.parameters()), slot


def gathered_worker(rank: int, out: str) -> None:
    torch.set_num_threads(1)
    model = task()
    reference = copy.deepcopy(model)
    data = batch(5, seed=3)
    rows = slice(0, 3) if rank == 0 else slice(3, 5)  # uneven: 3 and 2 rows
    local = {name: value[rows] for name, value in data.items()}
    loss = model.step_losses(local).task_loss
    loss.backward()
    for parameter in model.parameters():  # what DDP does: average the gradients over the processes
        if parameter.grad is not None:
            dist.all_reduce(parameter.grad)
            parameter.grad /= WORLD
    image, text, _ = reference(data["image"], data["text_ids"], data["text_padding_mask"])
    expected = contrastive_loss(image, text, reference.scale())
    expected.backward()
    torch.testing.assert_close(loss, expected)
    checked = 0
    for (name, got), want in zip(model.named_parameters(), reference.parameters(), strict=True):
        if want.grad is None:
            assert got.grad is None or not got.grad.any(), name
            continue
        # Equal up to float32 rounding: two half-batches sum their terms in another order than one whole batch, which
        # moves an entry by about 1e-6 of the tensor's largest (up to 9e-7 measured), so an entry near 0 can miss a
        # bound relative to itself. The bound is 1e-5 of the largest entry; a missing gather or average is off by
        # tenths of it.
        bound = 1e-5 * float(want.grad.abs().max())
        torch.testing.assert_close(got.grad, want.grad, rtol=1e-4, atol=max(bound, 1e-6), msg=name)
        checked += int(want.grad.abs().sum() > 0)
    assert checked > 10
    gathered = gather_with_grad(torch.full((3 - rank, 2), float(rank)))
    assert gathered.tolist() == [[0.0, 0.0]] * 3 + [[1.0, 1.0]] * 2
    if rank == 0:
        with open(out, "w") as done:
            done.write(str(checked))


def test_two_processes_give_the_loss_and_gradients_of_one_process_on_the_global_batch(tmp_path):
    out = tmp_path / "checked"
    spawn_gloo(gathered_worker, WORLD, tmp_path, str(out))
    assert int(out.read_text()) > 10


def test_a_released_224_px_retrieval_file_loads_its_heads_into_a_384_px_task(tmp_path, capsys):
    """The layout of ``beit3_base_itc_patch16_224.pth`` (backbone under ``beit3.``, ``vision_head``,
    ``language_head`` and ``logit_scale`` beside it) at the tests' scale: 32 px in the file, 64 px in the task (the
    vision position table resized bicubically, its offset and CLS rows kept)."""
    from mmoe.model import MultiwayTransformer
    from mmoe.model.beit3 import to_beit3

    small = MultiwayConfig.preset("test", vocab_size=120, position_offset=2)
    torch.manual_seed(1)
    source = MultiwayTransformer(small)
    generator = torch.Generator().manual_seed(2)
    heads = {
        "vision_head.weight": torch.randn(32, 32, generator=generator),
        "language_head.weight": torch.randn(32, 32, generator=generator),
        "logit_scale": torch.tensor(4.2),
    }
    path = tmp_path / "beit3_base_itc_patch16_224.pth"
    torch.save({"model": {f"beit3.{key}": value for key, value in to_beit3(source).items()} | heads}, path)
    model = RetrievalFineTuning(pretrained=str(path), backbone=dataclasses.replace(small, image_size=64))
    assert "BEiT-3 retrieval head: 3 tensors loaded" in capsys.readouterr().err
    for key, value in heads.items():
        assert torch.equal(model.state_dict()[key], value), key
    table = model.backbone.vision_positions
    assert table.shape == (2 + 1 + 16, 32)
    torch.testing.assert_close(table[:3], source.vision_positions[:3])
    grid = source.vision_positions[3:].reshape(1, 2, 2, 32).permute(0, 3, 1, 2)
    resized = F.interpolate(grid, size=(4, 4), mode="bicubic", align_corners=False).permute(0, 2, 3, 1)
    torch.testing.assert_close(table[3:], resized.reshape(16, 32))
    torch.testing.assert_close(model.backbone.text_embed.weight, source.text_embed.weight)
    text = batch(2)
    with torch.no_grad():
        embedded, _ = model.embed_texts(text["text_ids"], text["text_padding_mask"])
        hidden = source(text=text["text_ids"], text_padding_mask=text["text_padding_mask"]).hidden[:, 0]
    torch.testing.assert_close(embedded, F.normalize(hidden @ heads["language_head.weight"].T, dim=-1))
    images, _ = model.embed_images(torch.randn(2, 3, 64, 64))
    assert images.shape == (2, 32)
