"""Captioning stays causal through its MoE layers: with token-choice routing no caption position changes when a later
token does; expert-choice routing, whose experts pick tokens over the whole batch, is refused in one line, from Python
and from ``mmoe fit``."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from mmoe.model import MoEPlan, MultiwayConfig, MultiwayTransformer
from mmoe.runtime.checkpoint import export_backbone
from mmoe.tasks.captioning import CaptioningFineTuning
from tests.cli_fixtures import run_mmoe

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

CAPTIONING = Path(__file__).resolve().parents[2] / "configs" / "finetune" / "captioning_tiny.yaml"
REFUSED = "model.backbone.moe.routing='expert_choice' is refused for captioning: its text is causal"


def captioner(**plan) -> CaptioningFineTuning:
    torch.manual_seed(0)
    backbone = MultiwayConfig.preset("test", moe=MoEPlan(num_experts=4, every=1, **plan))
    return CaptioningFineTuning(backbone=backbone, max_length=8).eval()


@pytest.mark.parametrize("plan", [dict(), dict(top_k=2), dict(heads=2, top_k=2)], ids=["top1", "top2", "mhmoe"])
def test_token_choice_keeps_every_caption_position_blind_to_later_tokens(plan):
    """Two batches of two captions that differ only in the last token of the first caption."""
    task = captioner(**plan)
    generator = torch.Generator().manual_seed(0)
    image = torch.randn(2, 3, 32, 32, generator=generator)
    text = torch.randint(0, 1000, (2, 8), generator=generator)
    changed = text.clone()
    changed[0, -1] = (text[0, -1] + 1) % 1000
    with torch.no_grad():
        logits, _ = task(image, text)
        other, _ = task(image, changed)
    torch.testing.assert_close(other[0, :-1], logits[0, :-1])  # every earlier position of the changed caption
    torch.testing.assert_close(other[1], logits[1])  # and the other caption
    assert (other[0, -1] - logits[0, -1]).abs().max() > 1e-3  # the changed token itself does change


def test_expert_choice_is_refused_for_captioning():
    with pytest.raises(ValueError) as error:
        captioner(routing="expert_choice", capacity_factor=1.0)
    assert str(error.value).startswith(REFUSED) and "\n" not in str(error.value)


@pytest.mark.parametrize(
    ("moe", "refused"),
    [
        ("routing: expert_choice\n        capacity_factor: 1.0", REFUSED),
        ("top_k: 2\n        capacity_factor: 1.0", "model.backbone.moe.capacity_factor=1.0 with top_k=2 is refused"),
    ],
    ids=["expert_choice", "top2_capacity"],
)
def test_mmoe_fit_refuses_batch_dependent_captioning_in_one_line(tmp_path, capsys, monkeypatch, moe, refused):
    monkeypatch.chdir(tmp_path)
    edited = tmp_path / "routing.yaml"
    edited.write_text(f"model:\n  init_args:\n    backbone:\n      moe:\n        {moe}\n")
    code, _, err = run_mmoe(["fit", "--config", str(CAPTIONING), "--config", str(edited)], capsys)
    assert code == 2, err
    assert "Traceback" not in err
    assert err.strip().splitlines()[-1].startswith(f"mmoe fit: error: {refused}")
    assert list(tmp_path.iterdir()) == [edited]  # nothing trained, nothing written


def test_an_expert_choice_backbone_fine_tunes_captioning_only_under_token_choice(tmp_path):
    """The way out the error names: the same backbone's weights under dropless token choice."""
    plan = MoEPlan(num_experts=4, every=1, routing="expert_choice", capacity_factor=1.0)
    pretrained = tmp_path / "backbone.pt"
    export_backbone(MultiwayTransformer(MultiwayConfig.preset("test", moe=plan)), pretrained)
    with pytest.raises(ValueError, match=REFUSED):
        CaptioningFineTuning(pretrained=str(pretrained), max_length=8)
    token_choice = dataclasses.replace(plan, routing="token_choice", capacity_factor=None)
    task = CaptioningFineTuning(
        backbone=MultiwayConfig.preset("test", moe=token_choice), pretrained=str(pretrained), max_length=8
    )
    assert task.backbone.config.moe.routing == "token_choice"


BATCH_PRIORITY_REFUSED = "model.backbone.moe.capacity_priority='batch_priority' is refused for captioning"


def test_batch_priority_is_refused_for_captioning_and_position_priority_is_not():
    """Batch priority drops the least confident choices of the whole batch first: a later caption token's confidence
    would decide whether an earlier one keeps its expert."""
    with pytest.raises(ValueError) as error:
        captioner(capacity_factor=1.0, capacity_priority="batch_priority")
    assert str(error.value).startswith(BATCH_PRIORITY_REFUSED) and "\n" not in str(error.value)
    assert captioner(capacity_factor=1.0).backbone.config.moe.capacity_priority == "position"


def test_a_batch_priority_backbone_is_fine_tuned_for_captioning_under_dropless_token_choice(tmp_path):
    """The pipeline's captioning stage (mmoe demo --variant limoe) loads a batch-priority backbone's weights into the
    same backbone routed by dropless token choice."""
    from mmoe.pipeline.launch import causal_text_backbone

    plan = MoEPlan(num_experts=4, every=1, capacity_factor=1.0, capacity_priority="batch_priority")
    pretrained = tmp_path / "backbone.pt"
    export_backbone(MultiwayTransformer(MultiwayConfig.preset("test", moe=plan)), pretrained)
    with pytest.raises(ValueError, match=BATCH_PRIORITY_REFUSED):
        CaptioningFineTuning(pretrained=str(pretrained), max_length=8)
    fields = causal_text_backbone(CaptioningFineTuning, pretrained)
    assert (fields["moe"]["capacity_factor"], fields["moe"]["capacity_priority"]) == (None, "position")
    task = CaptioningFineTuning(backbone=fields, pretrained=str(pretrained), max_length=8)
    assert task.backbone.config.moe.capacity_factor is None
    position = MoEPlan(num_experts=4, every=1, capacity_factor=1.0)
    export_backbone(MultiwayTransformer(MultiwayConfig.preset("test", moe=position)), pretrained)
    assert causal_text_backbone(CaptioningFineTuning, pretrained) is None  # left as it is


TOP2_CAPACITY = [
    (dict(top_k=2, capacity_factor=0.5), "capacity_factor=0.5"),
    (dict(top_k=2, capacity_factor=1.25), "capacity_factor=1.25"),
    (dict(top_k=2, eval_capacity_factor=1.0), "eval_capacity_factor=1.0"),
    (dict(top_k=2, heads=2, capacity_factor=1.0), "capacity_factor=1.0"),
    (dict(top_k=2, strata=[2, 2], capacity_factor=1.0), "capacity_factor=1.0"),
]


@pytest.mark.parametrize(("plan", "field"), TOP2_CAPACITY, ids=["half", "gshard", "eval_only", "mhmoe", "stratified"])
def test_top2_under_a_finite_capacity_is_refused_for_captioning(plan, field):
    """Position priority fills an expert with every first choice before any second choice: a later caption token's
    first choice could drop an earlier token's second choice of the same caption."""
    with pytest.raises(ValueError) as error:
        captioner(**plan)
    message = str(error.value)
    assert message.startswith(f"model.backbone.moe.{field} with top_k=2 is refused for captioning")
    assert "\n" not in message


@pytest.mark.parametrize(
    "plan",
    [dict(top_k=1, capacity_factor=0.25), dict(top_k=2, capacity_factor=float("inf")), dict(top_k=2)],
    ids=["top1_capacity", "top2_infinite", "top2_dropless"],
)
def test_captioning_with_a_finite_capacity_at_top1_or_dropless_top2_stays_causal(plan):
    """What stays allowed keeps every earlier position of a caption unchanged when its last token changes."""
    task = captioner(**plan)
    for seed in range(5):
        generator = torch.Generator().manual_seed(seed)
        image = torch.randn(2, 3, 32, 32, generator=generator)
        text = torch.randint(0, 1000, (2, 8), generator=generator)
        changed = text.clone()
        changed[0, -1] = (text[0, -1] + 1) % 1000
        with torch.no_grad():
            torch.testing.assert_close(task(image, changed)[0][0, :-1], task(image, text)[0][0, :-1])


def test_a_top2_capacity_backbone_is_fine_tuned_for_captioning_dropless(tmp_path):
    """The pipeline's captioning stage turns a top-2 backbone with a finite capacity into dropless top-2."""
    from mmoe.pipeline.launch import causal_text_backbone

    plan = MoEPlan(num_experts=4, every=1, top_k=2, capacity_factor=1.25)
    pretrained = tmp_path / "backbone.pt"
    export_backbone(MultiwayTransformer(MultiwayConfig.preset("test", moe=plan)), pretrained)
    fields = causal_text_backbone(CaptioningFineTuning, pretrained)
    assert (fields["moe"]["top_k"], fields["moe"]["capacity_factor"]) == (2, None)
    task = CaptioningFineTuning(backbone=fields, pretrained=str(pretrained), max_length=8)
    assert task.backbone.config.moe.top_k == 2
