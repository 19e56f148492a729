"""Fine-tuning end to end on a small synthetic corpus through the DataModules: a tiny VQA model beats a random answer
after a few dozen steps, a tiny NLVR2 model beats a constant answer after a few hundred, a tiny retrieval model beats
chance recall, and the predict writers of all four tasks produce files ``mmoe eval`` scores."""

from __future__ import annotations

import contextlib
import io
import json

import lightning as L
import pytest
import torch

from mmoe.data.datamodules import CaptioningDataModule, NLVR2DataModule, RetrievalDataModule, VQADataModule
from mmoe.data.synth.convert import convert_layout
from mmoe.data.synth.corpus import SynthSizes, build_corpus
from mmoe.metrics.cli import eval_command
from mmoe.model import MoEPlan, MultiwayConfig
from mmoe.model.config import PRESETS
from mmoe.runtime.optimizer import OptimizerConfig
from mmoe.tasks.captioning import CaptioningFineTuning
from mmoe.tasks.nlvr2 import NLVR2FineTuning
from mmoe.tasks.retrieval import RetrievalFineTuning
from mmoe.tasks.vqa import VQAFineTuning

pytestmark = pytest.mark.slow

BACKBONE = PRESETS["test"] | {"dim": 64, "ffn_dim": 128}
LOADER = dict(image_size=32, max_text_length=32, num_workers=0, shuffle_buffer=200)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("synthetic")
    sizes = SynthSizes(
        train_images=200, val_images=60, test_images=6, questions_per_image=5, nlvr2_train_sets=150,
        nlvr2_eval_sets=50, texts=10, image_size=64,
    )  # fmt: skip
    build_corpus(root, seed=0, sizes=sizes)
    convert_layout(root, root / "shards")
    return root


def trainer(steps: int, root) -> L.Trainer:
    return L.Trainer(
        max_steps=steps,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0 if steps else None,
        default_root_dir=root,
    )


def score(argv: list[str]) -> dict:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = eval_command(argv)
    assert code == 0
    return json.loads(out.getvalue())


def random_answer_accuracy(datamodule: VQADataModule) -> float:
    """Expected accuracy (percent) of an answer drawn uniformly from the vocabulary, on the validation split."""
    totals, count = 0.0, 0
    for batch in datamodule.val_dataloader():
        totals += float(batch["targets"].sum())
        count += len(batch["targets"])
    return 100 * totals / count / datamodule.num_answers


def test_vqa_beats_a_random_answer_and_writes_a_scorable_submission(corpus, tmp_path):
    shards = corpus / "shards"
    vocab = str(shards / "vqav2-train2014" / "answers.json")
    data = VQADataModule(
        vocab, train_shards=shards / "vqav2-train2014", val_shards=shards / "vqav2-val2014",
        test_shards=shards / "vqav2-val2014", batch_size=32, eval_batch_size=100, **LOADER,
    )  # fmt: skip
    torch.manual_seed(0)
    model = VQAFineTuning(
        answer_vocab=vocab,
        backbone=MultiwayConfig(**BACKBONE, moe=MoEPlan(num_experts=4, every=2)),
        optimizer=OptimizerConfig(learning_rate=2e-3, warmup_steps=5),
        predictions_file=str(tmp_path / "vqa_results.json"),
    )
    fit = trainer(40, tmp_path)
    fit.fit(model, data)
    validated = trainer(0, tmp_path).validate(model, data, verbose=False)[0]
    chance = random_answer_accuracy(data)
    # Measured on this corpus: 24.4 after 40 steps against a random answer's 5.9. Beating the answer-type prior
    # (39.4 on the default corpus) takes longer training (tasks/vqav2/README.md).
    assert validated["val/vqa_accuracy"] > chance + 10
    trainer(0, tmp_path).predict(model, data, return_predictions=False)
    report = score(
        [
            "vqa",
            "--questions", str(corpus / "vqav2" / "v2_OpenEnded_mscoco_val2014_questions.json"),
            "--annotations", str(corpus / "vqav2" / "v2_mscoco_val2014_annotations.json"),
            "--results", str(tmp_path / "vqa_results.json"),
        ]
    )  # fmt: skip
    assert report["overall"] == pytest.approx(validated["val/vqa_accuracy"], abs=1e-6)


def test_nlvr2_beats_a_constant_answer_and_its_predictions_are_scored_by_mmoe_eval(corpus, tmp_path):
    shards = corpus / "shards"
    data = NLVR2DataModule(
        train_shards=shards / "nlvr2-train", val_shards=shards / "nlvr2-dev", test_shards=shards / "nlvr2-dev",
        batch_size=32, **LOADER,
    )  # fmt: skip
    torch.manual_seed(0)
    model = NLVR2FineTuning(
        backbone=MultiwayConfig(**BACKBONE),
        head_init_scale=1.86,  # configs/finetune/nlvr2_tiny.yaml's: the head's std 0.02 under BEiT-3's ±std cut
        optimizer=OptimizerConfig(layer_decay=0.65, learning_rate=2e-4, warmup_steps=10),
        predictions_file=str(tmp_path / "nlvr2.csv"),
    )
    trainer(200, tmp_path).fit(model, data)
    validated = trainer(0, tmp_path).validate(model, data, verbose=False)[0]
    # Measured on these 200 dev pairs (every set 2 true, 2 false: a constant answer scores 0.500): 0.595 / 0.610 /
    # 0.555 / 0.595 with seeds 0-3 (with the heads' earlier uncut std-0.02 init at scale 1.0: 0.590 / 0.585 / 0.590 /
    # 0.575); 0.500 with BEiT-3's head init scale 1e-3, and at learning rate 5e-4 or 1e-3 (300 steps).
    assert validated["val/accuracy"] > 0.55
    trainer(0, tmp_path).predict(model, data, return_predictions=False)
    lines = (tmp_path / "nlvr2.csv").read_text().splitlines()
    assert len(lines) == 200 and all(line.split(",")[1] in ("True", "False") for line in lines)
    report = score(
        ["nlvr2", "--data", str(corpus / "nlvr2" / "dev.json"), "--predictions", str(tmp_path / "nlvr2.csv")]
    )
    assert report["accuracy"] == pytest.approx(validated["val/accuracy"])
    assert report["consistency"] == pytest.approx(validated["val/consistency"])


def test_caption_results_are_scored_by_mmoe_eval(corpus, tmp_path):
    shards = corpus / "shards"
    data = CaptioningDataModule(
        train_shards=shards / "coco-karpathy-train-restval", val_shards=shards / "coco-karpathy-test",
        test_shards=shards / "coco-karpathy-test", batch_size=16, **LOADER,
    )  # fmt: skip
    model = CaptioningFineTuning(
        backbone=MultiwayConfig(**BACKBONE),
        num_beams=2,
        max_length=6,
        optimizer=OptimizerConfig(warmup_steps=2),
        results_dir=str(tmp_path / "val"),
        predictions_file=str(tmp_path / "captions.json"),
    )
    trainer(4, tmp_path).fit(model, data)
    trainer(0, tmp_path).predict(model, data, return_predictions=False)
    results = json.loads((tmp_path / "captions.json").read_text())
    assert len(results) == 20 and all(set(entry) == {"image_id", "caption"} for entry in results)
    karpathy = str(corpus / "coco" / "karpathy" / "dataset_coco.json")
    report = score(["caption", "--karpathy", karpathy, "--split", "test", "--results", str(tmp_path / "captions.json"),
                    "--no-spice"])  # fmt: skip
    assert 0.0 <= report["CIDEr"] and report["SPICE"] is None


def test_retrieval_beats_chance_recall_and_its_embeddings_are_scored_by_mmoe_eval(corpus, tmp_path):
    shards = corpus / "shards"
    data = RetrievalDataModule(
        train_shards=shards / "coco-karpathy-train-restval", val_shards=shards / "coco-karpathy-test",
        test_shards=shards / "coco-karpathy-test", batch_size=32, eval_batch_size=8, hflip=False, **LOADER,
    )  # fmt: skip
    torch.manual_seed(0)
    model = RetrievalFineTuning(
        backbone=MultiwayConfig(**BACKBONE, moe=MoEPlan(num_experts=4, every=2)),
        optimizer=OptimizerConfig(learning_rate=1e-4, warmup_steps=5),  # 1e-3 and 3e-4 stall at log(batch)
        predictions_file=str(tmp_path / "embeddings.pt"),
    )
    trainer(150, tmp_path).fit(model, data)
    validated = trainer(0, tmp_path).validate(model, data, verbose=False)[0]
    images = 20  # the Karpathy test third of the 60 val2014 images, 5 captions each
    # Chance: R@1 = 1 / 20 text -> image, a little more image -> text (5 positives among 100 captions). Measured after
    # 150 steps: t2i R@1 0.30, i2t R@1 0.20, mean recall 0.487.
    assert validated["val/t2i_r1"] > 3 / images and validated["val/i2t_r1"] > 2 / images
    assert validated["val/mean_recall"] > validated["val/t2i_r1"]
    trainer(0, tmp_path).predict(model, data, return_predictions=False)
    report = score(
        ["retrieval", "--embeddings", str(tmp_path / "embeddings.pt"), "--results", str(tmp_path / "r.json")]
    )
    for name, value in report.items():
        assert value == pytest.approx(validated[f"val/{name}"], abs=1e-6), name
    ranks = json.loads((tmp_path / "r.json").read_text())
    assert len(ranks["images"]) == images and len(ranks["captions"]) == 5 * images
