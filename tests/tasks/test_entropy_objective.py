"""LIMoE's entropy losses in training (Mustafa et al., 2022): a step's objective is the task loss + alpha x the
balance losses + the local and global entropy losses of a per-modality reference over the routers' gate
probabilities (image tokens and text tokens apart, in a shared FFN and in the VL-FFN too), the entropy terms reach
the routers' gradients, and the losses are logged (``metrics.csv``) for pre-training and fine-tuning alike."""

from __future__ import annotations

import csv
import math
import warnings

import lightning as L
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader

from mmoe.model import MoEPlan, MultiwayConfig
from mmoe.tasks.base import BackboneTask, detached
from mmoe.tasks.pretraining import MaskedPretraining
from mmoe.tasks.vqa import VQAFineTuning
from tests.tasks.test_pretraining import BACKBONE, codebook_path, make_batches  # noqa: F401 (fixture)

IMAGE_TOKENS = 5  # the test backbone's CLS + (32 / 16)^2 patches
NUM_EXPERTS = 4


class RoutingProbe:
    """Per MoE-layer forward, in call order: the input's (B, L), its padding mask and the router's gate
    probabilities (S, E) (in the autograd graph)."""

    def __init__(self, task: BackboneTask) -> None:
        self.calls: list[dict] = []
        for slot in task.backbone.moe_layers():
            slot.layer.register_forward_pre_hook(self.layer_input, with_kwargs=True)
            slot.layer.router.register_forward_hook(self.router_output)

    def layer_input(self, module, args, kwargs) -> None:
        padding = args[1] if len(args) > 1 else kwargs.get("padding_mask")
        self.calls.append({"shape": args[0].shape[:2], "padding": padding})

    def router_output(self, module, args, output) -> None:
        self.calls[-1]["probs"] = output.scores_SE


def modality_slices(length: int, text_length: int) -> list[slice]:
    """The modalities of an FFN input of ``length`` tokens, told apart by length alone: image, text or both."""
    image, text = slice(0, IMAGE_TOKENS), slice(IMAGE_TOKENS, IMAGE_TOKENS + text_length)
    return {IMAGE_TOKENS: [image], text_length: [slice(0, text_length)], IMAGE_TOKENS + text_length: [image, text]}[
        length
    ]


def entropy(p: torch.Tensor) -> torch.Tensor:
    return -(p * p.log()).sum(-1)


def reference_entropy_losses(calls: list[dict], plan: MoEPlan, text_length: int, reduce: str) -> dict[str, float]:
    """LIMoE's losses token by token: per layer call and modality, the local loss is the mean entropy of the gate
    distributions of its non-padding (sub-)tokens, the global one minus the entropy of their mean (or the threshold
    max(0, log S - H)); summed over the modalities, weighted, then summed (or averaged) over the calls."""
    local, global_ = [], []
    for call in calls:
        batch, length = call["shape"]
        probs = call["probs"].reshape(batch, length, plan.heads, NUM_EXPERTS)
        valid = torch.ones(batch, length, dtype=torch.bool) if call["padding"] is None else ~call["padding"]
        local_sum, global_sum = 0.0, 0.0
        for part in modality_slices(length, text_length):
            tokens = [(b, t) for b in range(batch) for t in range(part.start, part.stop) if valid[b, t]]
            rows = torch.stack([probs[b, t, h] for b, t in tokens for h in range(plan.heads)])
            local_sum = local_sum + torch.stack([entropy(row) for row in rows]).mean()
            spread = entropy(rows.mean(0))
            minimum = plan.global_entropy_min_experts
            global_sum = global_sum + (-spread if minimum is None else (math.log(minimum) - spread).clamp_min(0))
        local.append(plan.local_entropy_weight * local_sum)
        global_.append(plan.global_entropy_weight * global_sum)
    total = {"local_entropy_loss": torch.stack(local), "global_entropy_loss": torch.stack(global_)}
    return {name: values.sum() if reduce == "sum" else values.mean() for name, values in total.items()}


def plan_for(router: str, heads: int, minimum: float | None, mode: str, **fields) -> MoEPlan:
    return MoEPlan(
        num_experts=NUM_EXPERTS, top_k=2, every=1, router=router, heads=heads, mode=mode, local_entropy_weight=0.3,
        global_entropy_weight=0.7, global_entropy_min_experts=minimum, **fields,
    )  # fmt: skip


def make_task(kind: str, plan: MoEPlan, reduce: str, codebook: str, tmp_path, vl_layers: int = 0) -> BackboneTask:
    torch.manual_seed(0)
    config = MultiwayConfig(**BACKBONE, moe=plan, vl_layers=vl_layers)
    if kind == "pretraining":
        task = MaskedPretraining(config, codebook, balance_reduce=reduce)
    else:
        answers = tmp_path / "answers.json"
        answers.write_text('["yes", "no", "2", "red"]')
        task = VQAFineTuning(answer_vocab=str(answers), backbone=config, balance_reduce=reduce)
    with torch.no_grad():  # a router with confident, token-dependent choices (the default init is near uniform)
        for slot in task.backbone.moe_layers():
            scorer = slot.layer.router.scorer
            if hasattr(scorer, "weight"):
                scorer.weight.mul_(50.0)
    return task


def make_batch(kind: str) -> dict:
    if kind == "pretraining":
        return make_batches(3)[2]  # an image-text pair batch, the text of one sample partly padding
    generator = torch.Generator().manual_seed(3)
    padding = torch.zeros(3, 7, dtype=torch.bool)
    padding[1, 4:] = True
    return {
        "image": torch.randn(3, 3, 32, 32, generator=generator),
        "text_ids": torch.randint(3, 110, (3, 7), generator=generator),
        "text_padding_mask": padding,
        "targets": torch.tensor([[1.0, 0, 0, 0], [0, 0.3, 0.9, 0], [0, 0, 0, 1.0]]),
    }


def objective(task: BackboneTask, batch: dict):
    """(the step's loss, its StepLosses, the probe's calls) of one ``shared_step`` in training mode."""
    probe = RoutingProbe(task)
    steps = []
    step_losses = task.step_losses
    task.step_losses = lambda batch: steps.append(step_losses(batch)) or steps[-1]
    with warnings.catch_warnings():  # self.log without a trainer warns and logs nothing
        warnings.simplefilter("ignore")
        loss, _, _ = task.train().shared_step(batch, "train")
    return loss, steps[0], probe.calls


CASES = [  # task, router, MH-MoE heads, threshold S, mode, VL-FFN layers, layer reduction
    ("pretraining", "xmoe", 1, None, "shared", 0, "sum"),
    ("pretraining", "linear", 2, 4.0, "shared", 0, "mean"),
    ("pretraining", "linear", 1, 3.0, "per_modality", 1, "sum"),
    ("vqa", "xmoe", 2, 2.0, "shared", 0, "sum"),
    ("vqa", "linear", 1, None, "per_modality", 1, "mean"),
]


@pytest.mark.parametrize("case", CASES, ids=["-".join(str(v) for v in case) for case in CASES])
def test_objective_adds_the_per_modality_entropy_losses(case, codebook_path, tmp_path):  # noqa: F811
    kind, router, heads, minimum, mode, vl_layers, reduce = case
    plan = plan_for(router, heads, minimum, mode)
    task = make_task(kind, plan, reduce, codebook_path, tmp_path, vl_layers)
    batch = make_batch(kind)
    loss, step, calls = objective(task, batch)
    text_length = batch["text_ids"].shape[1]
    assert any(len(modality_slices(c["shape"][1], text_length)) == 2 for c in calls)  # a joint FFN routes both
    expected = reference_entropy_losses(calls, plan, text_length, reduce)
    balance = torch.stack([r.balance_loss for r in step.routing])
    balance = balance.sum() if reduce == "sum" else balance.mean()
    total = step.task_loss + task.hparams.balance_coefficient * balance + sum(expected.values())
    torch.testing.assert_close(loss, total, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(task.auxiliary_losses(step.routing), expected, rtol=1e-5, atol=1e-6)
    assert expected["local_entropy_loss"] > 0.01
    # With S = 2 every modality already spreads wider than two experts: the threshold leaves nothing to charge.
    assert expected["global_entropy_loss"].abs() > 1e-3 if minimum != 2.0 else expected["global_entropy_loss"] == 0
    assert all(not value.requires_grad for value in detached(step.routing[0]).auxiliary_losses.values())


def test_a_joint_ffn_computes_the_losses_per_modality_not_over_the_joint_sequence(codebook_path, tmp_path):  # noqa: F811
    """The same shared-mode step scored as if image and text were one modality gives another value: the backbone's
    modality lengths are what the layers used."""
    plan = plan_for("linear", 1, None, "shared")
    task = make_task("pretraining", plan, "sum", codebook_path, tmp_path)
    batch = make_batch("pretraining")
    _, step, calls = objective(task, batch)
    got = task.auxiliary_losses(step.routing)
    text_length = batch["text_ids"].shape[1]
    per_modality = reference_entropy_losses(calls, plan, text_length, "sum")
    as_one = reference_entropy_losses(calls, plan, IMAGE_TOKENS + text_length, "sum")  # one slice of the whole length
    torch.testing.assert_close(got, per_modality, rtol=1e-5, atol=1e-6)
    for name in got:
        assert (got[name] - as_one[name]).abs() > 1e-3, name


def test_the_entropy_terms_reach_the_router_gradients(codebook_path, tmp_path):  # noqa: F811
    """d loss / d router = d loss without the entropy losses / d router + d reference entropy losses / d router."""
    plan = plan_for("xmoe", 1, 4.0, "shared")
    task = make_task("pretraining", plan, "sum", codebook_path, tmp_path)
    plain = make_task("pretraining", MoEPlan(num_experts=NUM_EXPERTS, top_k=2, every=1, mode="shared"), "sum",
                      codebook_path, tmp_path)  # fmt: skip
    plain.load_state_dict(task.state_dict())
    batch = make_batch("pretraining")
    loss, _, calls = objective(task, batch)
    plain_loss, _, _ = objective(plain, batch)
    expected = sum(reference_entropy_losses(calls, plan, batch["text_ids"].shape[1], "sum").values())
    torch.testing.assert_close(loss, plain_loss + expected, rtol=1e-5, atol=1e-6)
    routers = [slot.layer.router for slot in task.backbone.moe_layers()]
    weights = [p for router in routers for p in router.parameters()]
    with_entropy = torch.autograd.grad(loss, weights, retain_graph=True)
    entropy_only = torch.autograd.grad(expected, weights)
    plain_weights = [p for slot in plain.backbone.moe_layers() for p in slot.layer.router.parameters()]
    without = torch.autograd.grad(plain_loss, plain_weights)
    for got, base, extra in zip(with_entropy, without, entropy_only, strict=True):
        torch.testing.assert_close(got, base + extra, rtol=1e-4, atol=1e-7)
    assert sum(extra.abs().sum() for extra in entropy_only) > 1e-3


@pytest.mark.parametrize("kind", ["pretraining", "vqa"])
def test_a_fit_logs_the_entropy_losses(kind, codebook_path, tmp_path):  # noqa: F811
    task = make_task(kind, plan_for("xmoe", 1, 3.0, "shared"), "sum", codebook_path, tmp_path)
    batch = make_batch(kind)
    logger = CSVLogger(tmp_path, name="run")
    trainer = L.Trainer(
        max_steps=3, logger=logger, log_every_n_steps=1, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, accelerator="cpu", default_root_dir=tmp_path,
    )  # fmt: skip
    trainer.fit(task, DataLoader([batch] * 3, batch_size=None, shuffle=False))
    with open(f"{logger.log_dir}/metrics.csv", newline="") as file:
        rows = list(csv.DictReader(file))
    for name in ("train/local_entropy_loss", "train/global_entropy_loss"):
        values = [float(row[name]) for row in rows if row.get(name)]
        assert len(values) == 3 and all(math.isfinite(value) for value in values), name
    assert set(task.latest_train_losses) >= {"train/local_entropy_loss", "train/global_entropy_loss"}
