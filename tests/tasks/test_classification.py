"""Image classification (BEiT-3's ImageNet task): the head's shape and initial scale, an image-only pass that leaves
the text weights without gradient, top-1 / top-5 against a hand count, timm's augmentations and losses, and a short
``mmoe fit`` / ``mmoe predict`` / ``mmoe eval`` / ``mmoe infer classify`` run with Mixup, CutMix and EMA."""

from __future__ import annotations

import dataclasses
import io
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from PIL import Image
from timm.utils import accuracy

from mmoe.cli import main
from mmoe.config.launch import read_config
from mmoe.data.classification import ClassificationDecoder, eval_transform
from mmoe.data.samples import CorruptSampleError
from mmoe.metrics.classification import top_k_accuracy
from mmoe.model import MultiwayTransformer
from mmoe.model.heads import classification_head, init_head
from mmoe.runtime.checkpoint import export_backbone
from mmoe.safe_load import load_checkpoint_file
from mmoe.tasks.classification import ImageClassificationFineTuning
from mmoe.tasks.classification_ema import EMA_KEY
from tests.cli_fixtures import run_mmoe
from tests.tasks.classification_fixtures import BACKBONE, CLASSES, fit_config, png, write_split

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def splits(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("classification")
    return write_split(root / "train", "cls-train", 6), write_split(root / "val", "cls-val", 2, seed=100)


@pytest.fixture(scope="module")
def run(tmp_path_factory, splits):
    """A 4-step fit with Mixup + CutMix and an EMA, then ``mmoe predict`` on the val split: (config, checkpoint,
    predictions)."""
    root = tmp_path_factory.mktemp("classification-run")
    config = root / "fit.yaml"
    model = {"mixup": {"mixup_alpha": 0.8, "cutmix_alpha": 1.0}, "ema_decay": 0.5}
    config.write_text(yaml.safe_dump(fit_config(root / "run", *splits, steps=4, **model)))
    assert main(["fit", "--config", str(config)]) == 0
    checkpoint = next((root / "run" / "checkpoints").glob("*.ckpt"))
    predictions = root / "predictions.json"
    argv = ["predict", "--config", str(config), "--ckpt_path", str(checkpoint)]
    assert main([*argv, "--model.init_args.predictions_file", str(predictions)]) == 0
    return config, checkpoint, json.loads(predictions.read_text())


def test_the_head_is_beit3s_and_starts_a_thousand_times_smaller():
    torch.manual_seed(0)
    fc_norm, head = classification_head(32, 7, init_scale=1e-3)
    assert (head.in_features, head.out_features) == (32, 7)
    assert torch.equal(fc_norm.weight, torch.ones(32)) and torch.equal(fc_norm.bias, torch.zeros(32))
    torch.manual_seed(0)
    reference = torch.nn.Linear(32, 7)
    init_head(reference)  # what the head is before the scaling: the same draws
    assert torch.equal(head.weight, reference.weight * 1e-3)
    assert 0 < head.weight.abs().max() <= 0.02 * 1e-3


def test_logits_are_the_head_over_the_mean_of_the_patch_tokens(splits):
    task = ImageClassificationFineTuning(classes=str(splits[0] / "classes.json"), backbone=BACKBONE).eval()
    assert task.backbone.final_norm is None  # BEiT-3's normalize_output=False
    counted = task.head_parameters(BACKBONE, {"classes": str(splits[0] / "classes.json")})  # mmoe info's count
    assert counted == {"head": sum(p.numel() for p in [*task.fc_norm.parameters(), *task.head.parameters()])}
    image = torch.randn(2, 3, 32, 32)
    logits, _ = task(image)
    hidden = task.backbone(image=image).hidden
    assert logits.shape == (2, len(CLASSES))
    assert torch.allclose(logits, task.head(task.fc_norm(hidden[:, 1:].mean(dim=1))))
    assert not torch.allclose(logits, task.head(task.fc_norm(hidden.mean(dim=1))))  # the CLS is left out


def test_an_image_only_pass_gives_the_text_weights_no_gradient(splits):
    task = ImageClassificationFineTuning(classes=str(splits[0] / "classes.json"), backbone=BACKBONE)
    logits, routing = task(torch.randn(2, 3, 32, 32))
    (logits.sum() + task.balance_loss(routing)).backward()
    grads = {name: p.grad for name, p in task.backbone.named_parameters()}
    # Multiway modules index their ways 0 = vision, 1 = language.
    way = r"(^|\.)(norm|qkv|inner_norm|out|ffn|ffn_norm|final_norm)\.{}\."
    text = [n for n in grads if n.startswith(("text_embed", "text_positions")) or re.search(way.format(1), n)]
    vision = [n for n in grads if n.startswith("patch_embed") or re.search(way.format(0), n)]
    assert text and vision
    assert all(grads[name] is None for name in text), [name for name in text if grads[name] is not None]
    assert all(grads[name] is not None for name in vision if "mask_token" not in name)
    assert {record.modality for record in routing} == {"vision"}


def test_top_k_accuracy_equals_a_count_by_hand():
    generator = torch.Generator().manual_seed(0)
    logits, labels = torch.randn(50, 10, generator=generator), torch.randint(10, (50,), generator=generator)
    ranked = logits.argsort(dim=-1, descending=True).tolist()
    scores = top_k_accuracy([row[:5] for row in ranked], labels.tolist())
    for k in (1, 5):
        hits = 0
        for i in range(50):
            better = sum(1 for j in range(10) if logits[i, j] > logits[i, labels[i]])
            hits += better < k
        assert scores[f"top{k}"] == hits / 50
    top1, top5 = accuracy(logits, labels, topk=(1, 5))  # timm's, BEiT-3's Acc@1 / Acc@5 (percent)
    assert (scores["top1"] * 100, scores["top5"] * 100) == pytest.approx((float(top1), float(top5)))


def test_mixup_cutmix_and_randaugment_are_timms():
    """The augmentations, the soft-target loss and the EMA are timm's; mmoe defines none of them, only the config that
    hands timm its arguments. (mmoe's other RandAugment, BEiT-3's vision-language one, never reaches this task.)"""
    text = "\n".join(path.read_text() for path in (ROOT / "mmoe").rglob("*.py"))
    assert "from timm.data import Mixup" in text and "from timm.loss import LabelSmoothingCrossEntropy, Soft" in text
    assert "from timm.utils import ModelEmaV3" in text and "from timm.data import create_transform" in text
    names = r"^\s*(?:class|def) (\w*(?:mixup|cutmix|softtarget|erasing|modelema|labelsmoothing)\w*)"
    assert set(re.findall(names, text, re.M | re.I)) <= {"MixupConfig", "timm_mixup"}
    assert not re.search(r"np\.random\.beta|rand_bbox|lam \* ", text)  # Mixup's lambda and CutMix's box
    classification = (ROOT / "mmoe" / "data" / "classification.py").read_text()
    assert "mmoe.data.transforms" not in classification  # not mmoe's vision-language RandAugment
    assert 'auto_augment: str | None = "rand-m9-mstd0.5-inc1"' in classification  # timm's policy string


def test_a_fit_with_mixup_and_ema_predicts_every_image_with_its_top_classes(run, splits):
    _, checkpoint, predictions = run
    assert sorted(entry["key"] for entry in predictions) == [f"cls-val_{i:04d}" for i in range(6)]
    for entry in predictions:
        assert len(entry["labels"]) == len(CLASSES) and sorted(entry["labels"]) == [0, 1, 2]  # top_k 5 > 3 classes
        assert entry["wnids"] == [CLASSES[i][0] for i in entry["labels"]]
        assert entry["names"] == [CLASSES[i][1] for i in entry["labels"]]
        assert entry["probabilities"] == sorted(entry["probabilities"], reverse=True)
        assert sum(entry["probabilities"]) == pytest.approx(1, abs=1e-5)
    state = load_checkpoint_file(checkpoint, "checkpoint")
    assert set(state[EMA_KEY]) == {key for key in state["state_dict"] if not key.startswith("train_loss")}
    averaged = state[EMA_KEY]["head.weight"]
    assert not torch.equal(averaged, state["state_dict"]["head.weight"])  # the EMA, not the trained weights


def test_predictions_use_the_ema_weights(run, splits):
    _, checkpoint, predictions = run
    state = load_checkpoint_file(checkpoint, "checkpoint")
    task = ImageClassificationFineTuning(classes=str(splits[0] / "classes.json"), backbone=BACKBONE, ema_decay=0.5)
    task.load_state_dict(state["state_dict"])
    task.on_load_checkpoint({EMA_KEY: state[EMA_KEY]})
    task.eval()

    image = eval_transform(32)(Image.open(io.BytesIO(png(CLASSES[0][2], 100)))).unsqueeze(0)
    logits, _ = task(image, task.evaluated_parts())
    expected = [e for e in predictions if e["key"] == "cls-val_0000"][0]
    assert logits.softmax(-1)[0].max().item() == pytest.approx(expected["probabilities"][0], abs=1e-5)
    trained, _ = task(image)  # the trained weights themselves predict otherwise
    assert trained.softmax(-1)[0].max().item() != pytest.approx(expected["probabilities"][0], abs=1e-5)


def test_mmoe_eval_scores_the_predictions_against_a_solution_file(run, capsys, tmp_path):
    _, _, predictions = run
    solution = tmp_path / "LOC_val_solution.csv"
    truth = {f"cls-val_{i:04d}": CLASSES[i % 3][0] for i in range(6)}
    solution.write_text("ImageId,PredictionString\n" + "".join(f"{k},{w} 1 2 3 4 \n" for k, w in truth.items()))
    path = tmp_path / "p.json"
    path.write_text(json.dumps(predictions))
    code, out, err = run_mmoe(
        ["eval", "classification", "--predictions", str(path), "--solution", str(solution)], capsys
    )
    assert code == 0, err
    scores = json.loads(out)
    by_key = {entry["key"]: entry["wnids"] for entry in predictions}
    assert scores["top1"] == sum(by_key[k][0] == w for k, w in truth.items()) / 6
    assert scores["top5"] == 1.0 and scores["images"] == 6


def test_mmoe_infer_classify_answers_as_predict_did_from_the_checkpoint_and_its_export(run, capsys, tmp_path):
    """``mmoe infer classify`` and an ``mmoe export`` folder use the EMA weights, as ``mmoe predict`` did."""
    _, checkpoint, predictions = run
    image = tmp_path / "red.png"
    image.write_bytes(png(CLASSES[0][2], 100))  # the bytes of cls-val_0000
    expected = next(entry for entry in predictions if entry["key"] == "cls-val_0000")
    code, _, err = run_mmoe(["export", "--ckpt", str(checkpoint), "--out", str(tmp_path / "exported")], capsys)
    assert code == 0, err
    for source in (checkpoint, tmp_path / "exported"):
        argv = ["infer", "classify", "--ckpt", str(source), "--image", str(image), "--top-k", "2", "--json"]
        code, out, err = run_mmoe(argv, capsys)
        assert code == 0, err
        result = json.loads(out)
        assert result["labels"] == expected["labels"][:2] and result["names"] == expected["names"][:2]
        assert result["probabilities"] == pytest.approx(expected["probabilities"][:2], abs=1e-5)


def test_a_bad_classes_file_is_one_line_and_exit_2(splits, tmp_path):
    bad = tmp_path / "classes.json"
    bad.write_text(
        json.dumps({"classes": [{"index": 0, "wnid": "n1", "name": "a"}, {"index": 2, "wnid": "n2", "name": "b"}]})
    )
    config = fit_config(tmp_path / "run", *splits, classes=str(bad))
    path = tmp_path / "fit.yaml"
    path.write_text(yaml.safe_dump(config))
    done = subprocess.run(
        [sys.executable, "-m", "mmoe.cli", "fit", "--config", str(path)], capture_output=True, text=True, cwd=ROOT
    )
    assert done.returncode == 2
    lines = [line for line in done.stderr.splitlines() if "error" in line]
    assert len(lines) == 1 and str(bad) in lines[0] and "index 2" in lines[0], done.stderr


def test_the_decoder_names_an_image_by_its_file_and_refuses_a_class_out_of_range():
    sample = {"__key__": "000000007", "__url__": "s.tar", "png": png(CLASSES[0][2], 0), "cls": b"2",
              "json": json.dumps({"path": "ILSVRC2012_val_00000007.JPEG", "wnid": "n0"}).encode()}  # fmt: skip
    decode = ClassificationDecoder(eval_transform(32), num_classes=3)
    item = decode(sample)
    assert (item["label"], item["key"], item["name"]) == (2, "000000007", "ILSVRC2012_val_00000007")
    assert item["image"].shape == (3, 32, 32)
    assert decode({k: v for k, v in sample.items() if k != "json"})["name"] == "000000007"
    for bad, reason in ((b"3", "outside the classes 0..2"), (b"-1", "outside"), (b"x", "not an integer")):
        with pytest.raises(CorruptSampleError, match=reason):
            decode(sample | {"cls": bad})


def test_a_pretrained_backbone_loads_without_its_final_layernorm(splits, tmp_path):
    """BEiT-3 fine-tunes ImageNet with ``normalize_output=False``: the pre-trained final LayerNorm is left out."""
    pretrained = MultiwayTransformer(BACKBONE)
    assert pretrained.final_norm is not None
    export_backbone(pretrained, tmp_path / "backbone.pt")
    # The checkpoint's own architecture, and one given as the configs give it (output_norm: false).
    for backbone in (None, dataclasses.replace(BACKBONE, output_norm=False)):
        task = ImageClassificationFineTuning(
            classes=str(splits[0] / "classes.json"), pretrained=str(tmp_path / "backbone.pt"), backbone=backbone
        )
        assert task.backbone.final_norm is None and not task.backbone.config.output_norm
        loaded = task.backbone.state_dict()
        assert loaded.keys() == {key for key in pretrained.state_dict() if not key.startswith("final_norm.")}
        assert all(torch.equal(loaded[key], pretrained.state_dict()[key]) for key in loaded)


def test_the_shipped_tiny_config_runs_on_the_synthetic_split_and_scores_against_its_solution(
    synthetic_corpus, tmp_path, capsys
):
    """configs/finetune/imagenet_tiny.yaml, a few steps, on the synthetic corpus's classification split; ``mmoe eval``
    then scores every val image against the corpus's ``LOC_val_solution.csv`` as validation did."""
    shards = synthetic_corpus / "shards"
    config = ["--config", str(ROOT / "configs" / "finetune" / "imagenet_tiny.yaml")]
    options = ["--data.init_args.data_root", str(synthetic_corpus), "--trainer.default_root_dir", str(tmp_path / "run"),
               "--model.init_args.classes", str(shards / "classification-train" / "classes.json"),
               "--data.init_args.num_workers", "0", "--trainer.enable_progress_bar", "false"]  # fmt: skip
    steps = ["--trainer.max_steps", "3", "--trainer.val_check_interval", "3", "--data.init_args.batch_size", "8"]
    small = [f"--model.init_args.backbone.{name}" for name in ("dim", "depth", "num_heads", "ffn_dim", "image_size")]
    options += [word for pair in zip(small, ["32", "2", "2", "64", "32"], strict=True) for word in pair]
    assert main(["fit", *config, *options, *steps]) == 0
    predictions = tmp_path / "predictions.json"
    predict = ["--ckpt_path", str(tmp_path / "run" / "checkpoints" / "last.ckpt")]
    assert main(["predict", *config, *options, *predict, "--model.init_args.predictions_file", str(predictions)]) == 0
    solution = synthetic_corpus / "imagenet" / "LOC_val_solution.csv"
    capsys.readouterr()
    code, out, err = run_mmoe(
        ["eval", "classification", "--predictions", str(predictions), "--solution", str(solution)], capsys
    )
    assert code == 0, err
    scores = json.loads(out)
    assert scores["images"] == len(json.loads(predictions.read_text())) == len(solution.read_text().splitlines()) - 1
    state = load_checkpoint_file(tmp_path / "run" / "checkpoints" / "last.ckpt", "checkpoint")
    assert 0.0 <= scores["top1"] <= scores["top5"] <= 1.0 and "val/top1_accuracy" in str(state["callbacks"])


def test_the_ema_continues_across_a_resume_as_in_one_run(splits, tmp_path):
    """2 steps, then a resume to 4, ends with the EMA of one 4-step run (and the same trained weights)."""
    model = {"mixup": {"mixup_alpha": 0.8, "cutmix_alpha": 1.0}, "ema_decay": 0.5}
    model["optimizer"] = {"warmup_steps": 1, "learning_rate": 1e-3, "total_steps": 4}

    def fit(name: str, steps: int, *resume: str) -> dict:
        config = tmp_path / f"{name}.yaml"
        config.write_text(yaml.safe_dump(fit_config(tmp_path / name, *splits, steps=steps, **model)))
        assert main(["fit", "--config", str(config), *resume]) == 0
        return load_checkpoint_file(
            max((tmp_path / name / "checkpoints").glob("*.ckpt"), key=lambda p: p.stat().st_mtime), "checkpoint"
        )

    whole = fit("whole", 4)
    first = fit("halves", 2)
    resumed = fit("halves", 4, "--ckpt_path", str(next((tmp_path / "halves" / "checkpoints").glob("*step=2.ckpt"))))
    assert first["global_step"] == 2 and resumed["global_step"] == whole["global_step"] == 4
    for kind in ("state_dict", EMA_KEY):
        assert whole[kind].keys() == resumed[kind].keys()
        assert all(torch.equal(whole[kind][key], resumed[kind][key]) for key in whole[kind]), kind
    assert not torch.equal(first[EMA_KEY]["head.weight"], resumed[EMA_KEY]["head.weight"])


def test_the_base_config_is_the_guides_recipe():
    """beit3/get_started/get_started_for_image_classification.md (base): 8 GPUs x batch 128, lr 7e-4, layer decay
    0.65, 50 epochs with 5 of warm-up, drop path 0.15, weight decay 0.05, mixup 0.8, CutMix 1.0; the rest from
    run_beit3_finetuning.py's defaults. 1,281,167 ImageNet-1K training images."""
    config = read_config([ROOT / "configs" / "finetune" / "imagenet_base.yaml"]).fit
    model, data, trainer = config.model.init_args, config.data.init_args, config.trainer
    batch = data.batch_size * trainer.accumulate_grad_batches * trainer.devices
    steps_per_epoch = 1_281_167 // batch
    assert batch == 8 * 128 and model.backbone.image_size == 224 and model.backbone.drop_path == 0.15
    assert (trainer.max_steps, model.optimizer.warmup_steps) == (50 * steps_per_epoch, 5 * steps_per_epoch)
    optimizer = model.optimizer
    assert (optimizer.learning_rate, optimizer.layer_decay, optimizer.weight_decay) == (7e-4, 0.65, 0.05)
    assert optimizer.learning_rate * optimizer.min_lr_ratio == pytest.approx(1e-6, rel=1e-3)  # --min_lr
    assert (model.mixup.mixup_alpha, model.mixup.cutmix_alpha, model.label_smoothing) == (0.8, 1.0, 0.1)
    assert (data.augmentation.auto_augment, data.augmentation.re_prob) == ("rand-m9-mstd0.5-inc1", 0.25)
    assert model.head_init_scale == 1e-3 and model.ema_decay is None and not model.backbone.output_norm


@pytest.mark.parametrize(
    ("solution", "expected"),
    [
        ("Image,Labels\nx_0,n00000001 1 2 3 4\n", "expected the header ImageId,PredictionString"),
        ("ImageId,PredictionString\nunseen,n00000001 1 2 3 4\n", "no prediction for 1 labelled images, e.g. 'unseen'"),
        ("ImageId,PredictionString\nx_0,\n", "line 2: no class for image 'x_0'"),
    ],
)
def test_mmoe_eval_classification_refuses_a_bad_solution_in_one_line(tmp_path, solution, expected):
    predictions = tmp_path / "p.json"
    predictions.write_text(json.dumps([{"key": "0", "image": "x_0", "labels": [0], "wnids": ["n00000001"]}]))
    (tmp_path / "solution.csv").write_text(solution)
    argv = ["eval", "classification", "--predictions", str(predictions), "--solution", str(tmp_path / "solution.csv")]
    done = subprocess.run([sys.executable, "-m", "mmoe.cli", *argv], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.count("\n") == 1 and expected in done.stderr, done.stderr
