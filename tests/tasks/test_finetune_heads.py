"""VQA, NLVR2 and captioning heads on hand-made batches: shapes, losses, pairing, the captioning mask, frozen routing,
loading a pre-trained backbone and the shared optimiser."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import torch.nn.functional as F

from mmoe.data.answers import read_answer_vocab
from mmoe.data.datamodules import VQADataModule
from mmoe.data.tokenizer import EOT_ID, MASK_ID, PAD_ID, SOT_ID, VOCAB_SIZE
from mmoe.model import MoEPlan, MultiwayConfig
from mmoe.model.decoding import beam_search, greedy_search
from mmoe.model.output_vocab import load_output_vocab
from mmoe.runtime.checkpoint import export_backbone
from mmoe.runtime.optimizer import OptimizerConfig, layer_id, parameter_groups
from mmoe.tasks.captioning import (
    CaptioningFineTuning,
    caption_attention_mask,
    label_smoothed_cross_entropy,
)
from mmoe.tasks.finetuning import build_backbone
from mmoe.tasks.nlvr2 import NLVR2FineTuning
from mmoe.tasks.vqa import VQAFineTuning


def config(moe: bool = True, **overrides) -> MultiwayConfig:
    plan = MoEPlan(num_experts=4, every=1) if moe else None
    return MultiwayConfig.preset("test", **({"vocab_size": 120, "moe": plan} | overrides))


@pytest.fixture()
def answers(tmp_path):
    path = tmp_path / "answers.json"
    path.write_text('["yes", "no", "2", "red"]')
    return str(path)


def images(count: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(count, 3, 32, 32, generator=torch.Generator().manual_seed(seed))


def texts(count: int, length: int = 6, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(3, 110, (count, length), generator=torch.Generator().manual_seed(seed))
    padding = torch.zeros(count, length, dtype=torch.bool)
    padding[0, length - 2 :] = True
    return ids, padding


def test_answer_vocab_forms_and_errors(tmp_path, answers):
    assert read_answer_vocab(answers) == ["yes", "no", "2", "red"]
    (tmp_path / "map.json").write_text('{"no": 1, "yes": 0}')
    assert read_answer_vocab(tmp_path / "map.json") == ["yes", "no"]
    (tmp_path / "bad.json").write_text('{"no": 1, "yes": 1}')
    with pytest.raises(ValueError, match="labels must be"):
        read_answer_vocab(tmp_path / "bad.json")
    with pytest.raises(FileNotFoundError, match="mmoe data convert vqav2"):
        read_answer_vocab(tmp_path / "none.json")


def test_an_answers_object_gives_the_task_and_the_datamodule_one_vocabulary(tmp_path):
    path = tmp_path / "answers.json"
    path.write_text(json.dumps({"red": 2, "no": 1, "yes": 0}))  # key order is not label order
    task = VQAFineTuning(answer_vocab=str(path), backbone=config(moe=False))
    data = VQADataModule(answer_vocab=str(path), image_size=32)
    assert task.answers == data.answers == ["yes", "no", "red"]
    assert data.vocab == {"yes": 0, "no": 1, "red": 2} and data.num_answers == task.head[-1].out_features


def test_vqa_logits_and_soft_target_bce(answers):
    task = VQAFineTuning(answer_vocab=answers, backbone=config())
    ids, padding = texts(3)
    targets = torch.tensor([[1.0, 0, 0, 0], [0, 0.3, 0.9, 0], [0, 0, 0, 0]])
    batch = {"image": images(3), "text_ids": ids, "text_padding_mask": padding, "targets": targets}
    logits, routing = task.forward_batch(batch)
    assert logits.shape == (3, 4) and len(routing) == 4  # 2 MoE layers x 2 modalities
    loss = task.task_loss(logits, batch)
    # BEiT-3: mean BCE times the number of answers = sum over answers of the soft-target BCE, mean over questions.
    p = torch.sigmoid(logits.float())
    by_hand = -(targets * p.log() + (1 - targets) * (1 - p).log()).sum(dim=1).mean()
    torch.testing.assert_close(loss, by_hand, rtol=1e-5, atol=1e-5)

    output = task.training_step(batch, 0)
    balance = torch.stack([r.balance_loss for r in output["routing"]]).sum()
    torch.testing.assert_close(output["loss"], loss + 1e-2 * balance)
    assert all(not r.balance_loss.requires_grad for r in output["routing"])
    output["loss"].backward()
    assert task.head[0].weight.grad is not None and task.pooler.dense.weight.grad is not None


def test_vqa_uses_the_pooled_vision_cls(answers):
    task = VQAFineTuning(answer_vocab=answers, backbone=config(moe=False)).eval()
    ids, _ = texts(2)
    out = task.backbone(image=images(2), text=ids)
    logits, _ = task(images(2), ids)
    torch.testing.assert_close(logits, task.head(task.pooler(out.hidden[:, 0])))
    other, _ = task(images(2), texts(2, seed=1)[0])
    assert not torch.allclose(logits, other)  # the question reaches the vision CLS through attention


def test_nlvr2_pairs_each_image_with_the_sentence_in_one_pass():
    task = NLVR2FineTuning(backbone=config()).eval()
    left, right = images(3, 0), images(3, 1)
    ids, padding = texts(3)
    features, routing = task.pair_features(left, right, ids, padding)
    assert features.shape == (3, 4 * 32)
    assert all(r.expert_index.shape[0] == 6 for r in routing)  # one pass over the doubled batch
    for part, image in enumerate((left, right)):
        out = task.backbone(image=image, text=ids, text_padding_mask=padding)
        single = torch.cat([out.hidden[:, 0], out.hidden[:, out.image_len]], dim=-1)
        torch.testing.assert_close(features[:, part * 64 : (part + 1) * 64], single, atol=1e-5, rtol=1e-5)

    batch = {
        "image_left": left,
        "image_right": right,
        "text_ids": ids,
        "text_padding_mask": padding,
        "label": torch.tensor([1, 0, 1]),
    }
    logits, _ = task.forward_batch(batch)
    assert logits.shape == (3, 2)
    torch.testing.assert_close(task.task_loss(logits, batch), F.cross_entropy(logits, batch["label"]))
    # BEiT-3's 1e-3-scaled head init starts near chance.
    assert logits.abs().max() < 0.05


def test_nlvr2_refuses_to_train_or_score_an_unlabelled_pair():
    """Label -1 (a split converted without labels) is an error naming the pair, not a cross-entropy index error in
    training or a ``bool(-1)`` = True in validation."""
    task = NLVR2FineTuning(backbone=config()).eval()
    ids, padding = texts(2)
    batch = {"image_left": images(2, 0), "image_right": images(2, 1), "text_ids": ids, "text_padding_mask": padding,
             "label": torch.tensor([1, -1]), "identifier": ["dev-1-0-0", "dev-2-0-1"]}  # fmt: skip
    logits, _ = task.forward_batch(batch)
    with pytest.raises(ValueError, match=r"NLVR2 pairs without a label cannot be trained or scored on: dev-2-0-1 \("):
        task.task_loss(logits, batch)
    task.on_validation_epoch_start()
    with pytest.raises(ValueError, match="without a label.*dev-2-0-1"):
        task.validation_step(batch, 0)


def test_nlvr2_head_init_scale_multiplies_the_initial_weights():
    torch.manual_seed(0)
    beit3 = NLVR2FineTuning(backbone=config())
    torch.manual_seed(0)
    unscaled = NLVR2FineTuning(backbone=config(), head_init_scale=1.0)
    for small, full in zip(beit3.head, unscaled.head, strict=True):
        if isinstance(full, torch.nn.Linear):
            torch.testing.assert_close(small.weight, full.weight * 1e-3)
            assert 0.01 < float(full.weight.std()) < 0.03  # BEiT-3's truncated normal, std 0.02
        elif isinstance(full, torch.nn.LayerNorm):
            torch.testing.assert_close(small.weight, full.weight)


def test_caption_mask_image_never_sees_text_and_text_is_causal():
    mask = caption_attention_mask(3, 4)[0]
    assert mask.shape == (7, 7)
    assert mask[:3, :3].all() and not mask[:3, 3:].any()  # image -> image only
    assert mask[3:, :3].all()  # text -> every image token
    assert torch.equal(mask[3:, 3:], torch.ones(4, 4, dtype=torch.bool).tril())  # text -> text causal


def captioner(**overrides) -> CaptioningFineTuning:
    backbone = MultiwayConfig.preset("test", moe=MoEPlan(num_experts=4, every=2))
    return CaptioningFineTuning(backbone=backbone, max_length=8, **overrides).eval()


def test_caption_backbone_mask_in_effect():
    task = captioner()
    image = images(2)
    ids = torch.randint(0, 1000, (2, 6), generator=torch.Generator().manual_seed(0))
    changed = ids.clone()
    changed[:, 4:] = 7
    attn = caption_attention_mask(1 + task.backbone.config.num_patches, 6)
    first = task.backbone(image=image, text=ids, attn_mask=attn)
    second = task.backbone(image=image, text=changed, attn_mask=attn)
    # Image tokens never see text: identical image states; text before position 4 cannot see what follows it.
    torch.testing.assert_close(first.image_hidden, second.image_hidden)
    torch.testing.assert_close(first.text_hidden[:, :4], second.text_hidden[:, :4])
    assert not torch.allclose(first.text_hidden[:, 4:], second.text_hidden[:, 4:])


def test_caption_masked_token_loss_is_label_smoothed():
    task = captioner()
    targets = torch.tensor([[SOT_ID, 11, 12, 13, EOT_ID, PAD_ID], [SOT_ID, 21, 22, EOT_ID, PAD_ID, PAD_ID]])
    text_mask = torch.tensor([[0, 1, 0, 1, 1, 0], [0, 0, 1, 0, 0, 0]], dtype=torch.bool)
    batch = {
        "image": images(2),
        "text_ids": torch.where(text_mask, MASK_ID, targets),
        "text_padding_mask": targets == PAD_ID,
        "text_targets": targets,
        "text_mask": text_mask,
    }
    logits, _ = task.forward_batch(batch)
    assert logits.shape == (4, VOCAB_SIZE)  # logits only at the 4 masked positions
    loss = task.task_loss(logits, batch)
    logp = torch.log_softmax(logits.float(), dim=-1)
    chosen = targets[text_mask]
    eps, vocab = 0.1, VOCAB_SIZE
    smoothed = torch.full_like(logp, eps / (vocab - 1))
    smoothed[torch.arange(4), chosen] = 1 - eps
    torch.testing.assert_close(loss, -(smoothed * logp).sum(-1).mean(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(label_smoothed_cross_entropy(logits, chosen, 0.0), F.cross_entropy(logits, chosen))


def test_frozen_routing_from_an_exported_backbone_keeps_the_balance_loss(tmp_path, answers):
    pretrained = build_backbone(config(), None)
    export_backbone(pretrained, tmp_path / "backbone.pt")
    task = VQAFineTuning(answer_vocab=answers, pretrained=str(tmp_path / "backbone.pt"), frozen_routing=True)
    assert task.backbone.config.moe.frozen and task.hparams.backbone["moe"]["frozen"]
    assert task.hparams.pretrained is None  # its checkpoints are self-contained
    frozen = [name for name, p in task.backbone.named_parameters() if not p.requires_grad]
    assert frozen and all(".router." in name or ".experts." in name for name in frozen)
    for name, tensor in pretrained.state_dict().items():
        torch.testing.assert_close(task.backbone.state_dict()[name], tensor)
    ids, padding = texts(2)
    batch = {"image": images(2), "text_ids": ids, "text_padding_mask": padding, "targets": torch.zeros(2, 4)}
    output = task.training_step(batch, 0)
    balance = torch.stack([r.balance_loss for r in output["routing"]]).sum()
    assert balance > 0
    torch.testing.assert_close(output["loss"], task.task_loss(task.forward_batch(batch)[0], batch) + 1e-2 * balance)
    optimised = {id(p) for group in parameter_groups(task, OptimizerConfig(weight_decay=0.05)) for p in group["params"]}
    assert not any(id(p) in optimised for p in task.backbone.parameters() if not p.requires_grad)


def test_pretrained_at_another_image_size_resizes_vision_positions(tmp_path):
    pretrained = build_backbone(config(), None)
    export_backbone(pretrained, tmp_path / "backbone.pt")
    larger = dataclasses.replace(config(), image_size=64)
    backbone = build_backbone(larger, str(tmp_path / "backbone.pt"))
    assert backbone.vision_positions.shape == (1 + 16, 32)
    torch.testing.assert_close(backbone.vision_positions[0], pretrained.vision_positions[0])  # CLS row kept
    # A constant grid stays constant under bicubic resizing.
    assert backbone(image=torch.randn(1, 3, 64, 64)).hidden.shape == (1, 17, 32)
    with pytest.raises(ValueError, match="does not match the architecture") as mismatch:
        build_backbone(dataclasses.replace(config(), dim=64, num_heads=4), str(tmp_path / "backbone.pt"))
    message = str(mismatch.value)  # one line: the file, the first weight that differs and both shapes
    assert "backbone.pt: cls_token has shape (1, 1, 32) there, (1, 1, 64) here" in message and "\n" not in message
    with pytest.raises(ValueError, match=r"38 weights missing, 0 unexpected \(missing e.g. layers.2"):
        build_backbone(dataclasses.replace(config(), depth=3), str(tmp_path / "backbone.pt"))
    with pytest.raises(ValueError, match="model.backbone"):
        NLVR2FineTuning()


def test_layer_decay_and_head_multiplier(answers):
    optimizer = OptimizerConfig(layer_decay=0.5, head_lr_multiplier=20.0)
    task = VQAFineTuning(answer_vocab=answers, backbone=config(moe=False), optimizer=optimizer)
    assert layer_id("patch_embed.weight", 2) == 0 and layer_id("layers.1.attention.qkv.0.weight", 2) == 2
    assert layer_id("final_norm.0.weight", 2) == 3
    scales = {}
    for group in parameter_groups(task, optimizer, task.head_prefixes):
        for parameter in group["params"]:
            scales[id(parameter)] = (group["lr_scale"], group["weight_decay"])
    named = dict(task.named_parameters())
    assert scales[id(named["backbone.patch_embed.weight"])] == (0.5**3, 0.05)
    assert scales[id(named["backbone.text_positions"])] == (0.5**3, 0.0)
    assert scales[id(named["backbone.layers.1.ffn.0.fc1.weight"])] == (0.5, 0.05)
    assert scales[id(named["backbone.layers.0.ffn.0.fc1.weight"])] == (0.25, 0.05)
    assert scales[id(named["backbone.final_norm.0.weight"])] == (1.0, 0.0)
    assert scales[id(named["head.0.weight"])] == (20.0, 0.05)
    assert scales[id(named["head.0.bias"])] == (20.0, 0.0)
    assert scales[id(named["pooler.dense.weight"])] == (1.0, 0.05)  # BEiT-3 scales head* only
    assert len(scales) == len(named)  # every trainable parameter is in exactly one group


def test_caption_generation_beam_one_is_greedy_and_batched():
    task = captioner(num_beams=3)
    image = images(3, seed=4)
    with torch.no_grad():
        greedy = greedy_search(task.next_token_scorer(image), 3, **task.decoding_options())
        one_beam = beam_search(task.next_token_scorer(image, 1), 3, 1, **task.decoding_options())
    torch.testing.assert_close(one_beam.tokens, greedy.tokens)
    torch.testing.assert_close(one_beam.scores, greedy.scores)
    three = task.generate(image)
    assert three.tokens.shape[0] == 3 and three.tokens.shape[1] <= 8
    for row in range(3):  # every sample decodes as it would alone
        alone = task.generate(image[row : row + 1])
        length = alone.tokens.shape[1]
        assert torch.equal(alone.tokens[0], three.tokens[row, :length])
    assert all(isinstance(caption, str) for caption in task.captions(image))


OUTPUT_IDS = [11, 12, 13, 21, 22, 500, EOT_ID]


@pytest.fixture()
def caption_tokens(tmp_path):
    path = tmp_path / "caption_tokens.json"
    path.write_text(json.dumps(OUTPUT_IDS[::-1]))  # any order
    return str(path)


def test_caption_output_vocab_head_is_the_full_head_restricted_to_its_ids(caption_tokens):
    full = captioner()
    small = captioner(output_vocab=caption_tokens)
    assert small.head.out_features == len(OUTPUT_IDS) and small.output_ids.tolist() == OUTPUT_IDS
    # Same backbone; the small head's rows are the full head's rows of the listed ids.
    small.backbone.load_state_dict(full.backbone.state_dict())
    small.head.weight.data.copy_(full.head.weight.data[OUTPUT_IDS])
    small.head.bias.data.copy_(full.head.bias.data[OUTPUT_IDS])
    image, prefix = images(2, seed=3), torch.tensor([[SOT_ID, 11, 12], [SOT_ID, 21, 500]])
    with torch.no_grad():
        every = full.next_token_scorer(image)(prefix)
        restricted = small.next_token_scorer(image)(prefix)
    torch.testing.assert_close(restricted[:, OUTPUT_IDS], torch.log_softmax(every[:, OUTPUT_IDS], dim=-1))
    outside = torch.ones(VOCAB_SIZE, dtype=torch.bool)
    outside[OUTPUT_IDS] = False
    assert torch.isinf(restricted[:, outside]).all()
    generated = small.generate(image).tokens
    assert set(generated.flatten().tolist()) <= set(OUTPUT_IDS) | {PAD_ID}


def test_caption_output_vocab_loss_and_unknown_target(caption_tokens):
    task = captioner(output_vocab=caption_tokens)
    targets = torch.tensor([[SOT_ID, 11, 500, EOT_ID], [SOT_ID, 22, 13, EOT_ID]])
    text_mask = torch.tensor([[0, 1, 1, 1], [0, 0, 1, 0]], dtype=torch.bool)
    batch = {"image": images(2), "text_ids": torch.where(text_mask, MASK_ID, targets), "text_targets": targets,
             "text_mask": text_mask}  # fmt: skip
    logits, _ = task.forward_batch(batch)
    assert logits.shape == (4, len(OUTPUT_IDS))
    classes = torch.tensor([OUTPUT_IDS.index(token) for token in targets[text_mask].tolist()])  # per-token lookup
    eps, size = 0.1, len(OUTPUT_IDS)
    smoothed = torch.full_like(logits, eps / (size - 1))
    smoothed[torch.arange(4), classes] = 1 - eps
    expected = -(smoothed * torch.log_softmax(logits.float(), dim=-1)).sum(-1).mean()
    torch.testing.assert_close(task.task_loss(logits, batch), expected, rtol=1e-5, atol=1e-5)
    batch["text_targets"] = targets.masked_fill(targets == 13, 14)
    with pytest.raises(ValueError, match=r"token ids \[14\] .* not in model.output_vocab .*caption_tokens.json"):
        task.task_loss(logits, batch)


@pytest.mark.parametrize(
    "content, message",
    [
        ("[11, 12", "malformed JSON at line 1"),
        ('{"a": 1}', "expected a JSON list of integer token ids"),
        ("[11, 12]", f"end-of-text id {EOT_ID} is missing"),
        (f"[11, 11, {EOT_ID}]", "appears more than once"),
        (f"[11, {SOT_ID}, {EOT_ID}]", "outside \\[0, 49410\\) or the start / pad / mask ids"),
        (f"[-1, {EOT_ID}]", "outside"),
    ],
)
def test_output_vocab_file_errors_name_the_file(tmp_path, content, message):
    path = tmp_path / "caption_tokens.json"
    path.write_text(content)
    with pytest.raises(ValueError, match=message):
        load_output_vocab(path, VOCAB_SIZE)
    with pytest.raises(FileNotFoundError, match="caption_tokens.json next to the shards"):
        load_output_vocab(tmp_path / "missing.json", VOCAB_SIZE)


def test_output_paths_stay_out_of_the_checkpoint_hyperparameters(answers):
    # LightningCLI applies a checkpoint's hyper-parameters over the command line of `mmoe predict --ckpt_path`.
    task = VQAFineTuning(answer_vocab=answers, backbone=config(), predictions_file="out.json")
    assert task.predictions_file == "out.json" and "predictions_file" not in task.hparams
    assert "answer_vocab" in task.hparams and task.hparams.optimizer["learning_rate"] == 1e-4
    captions = captioner(results_dir="val", predictions_file="test.json")
    assert captions.results_dir == "val" and "results_dir" not in captions.hparams


def test_vqa_prior_bias_starts_each_sigmoid_at_one_in_k_and_beit3_starts_at_zero(answers):
    """RetinaNet's prior init (Lin et al., 2017, §4.1): b = -log((1 - π) / π) with π = 1 / K, so every answer's sigmoid
    starts at 1 / K (the share of the K answers one question's target takes) whatever the features; BEiT-3's zero
    biases start every sigmoid at 0.5 - 0.5 plus what the untrained weights add."""
    torch.manual_seed(0)
    task = VQAFineTuning(answer_vocab=answers, backbone=config(moe=False), prior_bias=True)
    bias = task.head[-1].bias
    assert torch.allclose(torch.sigmoid(bias), torch.full((4,), 1 / 4))
    weights = dict(task.head[-1].named_parameters())["weight"]
    assert float(weights.abs().max()) <= 0.02  # the weights keep BEiT-3's cut normal
    torch.manual_seed(0)
    beit3 = VQAFineTuning(answer_vocab=answers, backbone=config(moe=False))
    assert bool((beit3.head[-1].bias == 0).all())
    torch.testing.assert_close(beit3.head[-1].weight, weights)  # only the biases differ
