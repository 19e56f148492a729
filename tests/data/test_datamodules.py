"""DataModules over shards converted from the synthetic corpus: documented keys, shapes and dtypes, 0-2 workers."""

from __future__ import annotations

import functools
import json
import multiprocessing
from pathlib import Path

import lightning as L
import pytest
import torch

from mmoe.data import tokenizer
from mmoe.data.datamodules import (
    CaptioningDataModule,
    NLVR2DataModule,
    PretrainDataModule,
    RetrievalDataModule,
    VQADataModule,
)
from mmoe.data.masking import MaskingConfig
from mmoe.data.synth.convert import convert_layout
from mmoe.data.synth.corpus import SIZES, build_corpus
from mmoe.data.tokenizer import MASK_ID, PAD_ID, SOT_ID
from mmoe.tasks.visual_codebook import eval_image_batches


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("corpus")
    build_corpus(root, seed=0, sizes=SIZES["tiny"])
    convert_layout(root, root / "shards", shard_size=8)
    return root / "shards"


def check_text(batch):
    ids, padding = batch["text_ids"], batch["text_padding_mask"]
    assert ids.dtype == torch.long and padding.dtype == torch.bool and ids.shape == padding.shape
    assert (ids[:, 0] == SOT_ID).all() and ((ids == PAD_ID) == padding).all()


@pytest.mark.parametrize("num_workers", [0, 2])
def test_pretraining_batches(shards, num_workers):
    module = PretrainDataModule(
        image_shards=str(shards / "pretrain-images"),
        text_shards=str(shards / "pretrain-text"),
        pair_shards=str(shards / "pretrain-pairs"),
        val_pair_shards=str(shards / "coco-karpathy-val"),
        batch_size=4,
        image_size=64,
        patch_size=16,
        max_text_length=32,
        batches_per_epoch=12,
        num_workers=num_workers,
        shuffle_buffer=16,
    )
    batches = list(module.train_dataloader())
    assert len(batches) == 12
    kinds = {batch["kind"] for batch in batches}
    assert kinds <= {"image", "text", "pair"} and len(kinds) >= 2
    for batch in batches:
        if batch["kind"] in ("image", "pair"):
            assert batch["image"].shape == (4, 3, 64, 64) and batch["image"].dtype == torch.float32
            assert batch["image_mask"].shape == (4, 16) and batch["image_mask"].dtype == torch.bool
            expected = 6 if batch["kind"] == "image" else 0  # round(0.4 * 16); pair images unmasked by default
            assert (batch["image_mask"].sum(1) == expected).all()
        if batch["kind"] in ("text", "pair"):
            check_text(batch)
            assert batch["text_mask"].any(1).all() and not batch["text_mask"][batch["text_padding_mask"]].any()
            assert (batch["text_ids"] == MASK_ID).any()
            assert torch.equal(batch["text_ids"][~batch["text_mask"]], batch["text_targets"][~batch["text_mask"]])
        assert len(batch["key"]) == 4
    val = list(module.val_dataloader())
    assert val and all(batch["kind"] == "pair" for batch in val)
    assert (
        sum(len(batch["key"]) for batch in val)
        == json.loads((shards / "coco-karpathy-val/manifest.json").read_text())["samples"]
    )
    assert module.skipped_samples()["train/image"] == 0


def test_pretraining_joint_steps_and_masked_pair_images(shards):
    module = PretrainDataModule(
        image_shards=str(shards / "pretrain-images"),
        pair_shards=str(shards / "pretrain-pairs"),
        joint=True,
        masking=MaskingConfig(mask_pair_images=True, pair_text_ratio=0.5),
        batch_size=2,
        image_size=64,
        batches_per_epoch=3,
        num_workers=0,
    )
    steps = list(module.train_dataloader())
    assert len(steps) == 3 and all(set(step) == {"image", "pair"} for step in steps)
    assert all(step["pair"]["image_mask"].sum(1).eq(6).all() for step in steps)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_vqa_batches(shards, num_workers):
    answers = json.loads((shards / "vqav2-train2014/answers.json").read_text())
    module = VQADataModule(
        answer_vocab=str(shards / "vqav2-train2014/answers.json"),
        train_shards=str(shards / "vqav2-train2014"),
        val_shards=str(shards / "vqav2-val2014"),
        test_shards=str(shards / "vqav2-test-dev2015"),
        image_size=64,
        batch_size=4,
        eval_batch_size=5,
        num_workers=num_workers,
    )
    assert module.num_answers == len(answers) > 0
    train = list(module.train_dataloader())
    assert train and all(batch["image"].shape == (4, 3, 64, 64) for batch in train)
    for batch in train:
        check_text(batch)
        assert batch["targets"].shape == (4, len(answers)) and (batch["targets"].amax(1) > 0).all()
    val = list(module.val_dataloader())
    total = json.loads((shards / "vqav2-val2014/manifest.json").read_text())["samples"]
    assert sum(batch["question_id"].numel() for batch in val) == total  # every question once
    question_ids = torch.cat([batch["question_id"] for batch in val])
    assert question_ids.unique().numel() == total
    first = val[0]
    assert first["question_id"].dtype == torch.long and first["image_id"].dtype == torch.long
    assert all(len(answers_) == 10 for answers_ in first["answers"]) and "targets" in first
    assert {"question", "answer_type", "question_type"} <= first.keys()
    # soft scores: the target of the majority answer is the official accuracy of its annotator count
    for row, humans in enumerate(first["answers"]):
        for label, answer in enumerate(answers):
            count = sum(h.rstrip(".") == answer for h in humans)
            expected = [0.0, 0.3, 0.6, 0.9][count] if count < 4 else 1.0
            assert first["targets"][row, label].item() == pytest.approx(expected)
    test = list(module.test_dataloader())
    assert test and "targets" not in test[0] and test[0]["answers"] == [[]] * len(test[0]["answers"])


@pytest.mark.parametrize("num_workers", [0, 1])
def test_nlvr2_batches(shards, num_workers):
    module = NLVR2DataModule(
        train_shards=str(shards / "nlvr2-train"),
        val_shards=str(shards / "nlvr2-dev"),
        image_size=64,
        batch_size=4,
        num_workers=num_workers,
    )
    batch = next(iter(module.train_dataloader()))
    assert batch["image_left"].shape == batch["image_right"].shape == (4, 3, 64, 64)
    check_text(batch)
    assert batch["label"].dtype == torch.long and set(batch["label"].tolist()) <= {0, 1}
    val = list(module.val_dataloader())
    identifiers = [i for b in val for i in b["identifier"]]
    assert len(identifiers) == len(set(identifiers)) == 4 * SIZES["tiny"].nlvr2_eval_sets
    labels = torch.cat([b["label"] for b in val])
    assert labels.float().mean().item() == 0.5
    assert module.test_dataloader() == []


@pytest.mark.parametrize("num_workers", [0, 1])
def test_the_tokenizer_is_read_before_workers_start_so_that_they_inherit_it(shards, num_workers, monkeypatch):
    """A loader with workers reads the BPE tables in this process first (workers forked after it reuse them); one
    without workers reads them at its first text, as before."""
    monkeypatch.setattr(
        tokenizer, "_open_clip_bpe", functools.lru_cache(maxsize=1)(tokenizer._open_clip_bpe.__wrapped__)
    )
    module = NLVR2DataModule(
        train_shards=str(shards / "nlvr2-train"), image_size=64, batch_size=4, num_workers=num_workers
    )
    loader = module.train_dataloader()
    assert tokenizer._open_clip_bpe.cache_info().currsize == num_workers
    check_text(next(iter(loader)))
    # Read once in this process: before the worker started, or at the first text without one.
    assert tokenizer._open_clip_bpe.cache_info()[1:] == (1, 1, 1)  # misses, maxsize, currsize


def karpathy_module(module_class, shards):
    """A caption-shard DataModule (captioning or retrieval) over the Karpathy train + restval and val splits."""
    return module_class(
        train_shards=str(shards / "coco-karpathy-train-restval"),
        val_shards=str(shards / "coco-karpathy-val"),
        image_size=64,
        batch_size=6,
        num_workers=0,
    )


def test_captioning_batches(shards):
    module = karpathy_module(CaptioningDataModule, shards)
    train = next(iter(module.train_dataloader()))
    check_text(train)
    assert train["image"].shape == (6, 3, 64, 64) and train["image_id"].shape == (6,)
    assert train["text_mask"].any(1).all() and not train["text_mask"][:, 0].any()
    val = list(module.val_dataloader())
    assert all(len(captions) == 5 for batch in val for captions in batch["captions"])
    assert "text_ids" not in val[0] and val[0]["image_id"].dtype == torch.long


def test_retrieval_batches_pair_each_image_with_one_caption_in_training_and_all_of_them_in_evaluation(shards):
    module = karpathy_module(RetrievalDataModule, shards)
    train = next(iter(module.train_dataloader()))
    check_text(train)
    assert train["image"].shape == (6, 3, 64, 64) and train["text_ids"].shape[0] == 6
    assert len(set(train["image_id"].tolist())) == 6 and "caption_image" not in train
    val = list(module.val_dataloader())
    for batch in val:
        counts = [len(captions) for captions in batch["captions"]]
        assert batch["text_ids"].shape[0] == sum(counts) == len(batch["caption_image"])
        assert batch["caption_image"].tolist() == [row for row, count in enumerate(counts) for _ in range(count)]
        tokenizer = module.tokenizer
        first = batch["text_ids"][0][~batch["text_padding_mask"][0]].tolist()
        assert first == tokenizer.encode(batch["captions"][0][0])
    assert sum(len(batch["image_id"]) for batch in val) == SIZES["tiny"].val_images // 3


def test_eval_image_batches_for_codebooks(shards):
    batches = list(eval_image_batches(str(shards / "pretrain-images"), image_size=32, batch_size=10))
    assert sum(b.shape[0] for b in batches) == SIZES["tiny"].train_images and batches[0].shape[1:] == (3, 32, 32)


class _Probe(L.LightningModule):
    """Counts what a Trainer feeds it."""

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1))
        self.seen: list[str] = []

    def training_step(self, batch, index):
        self.seen.append(batch["kind"])
        return self.weight.sum() * 0 + self.weight.square().sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_datamodule_runs_under_a_trainer(shards, tmp_path):
    module = PretrainDataModule(
        pair_shards=str(shards / "pretrain-pairs"), text_shards=str(shards / "pretrain-text"), batch_size=2,
        image_size=64, batches_per_epoch=4, num_workers=1,
    )  # fmt: skip
    probe = _Probe()
    trainer = L.Trainer(
        max_epochs=2, accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=tmp_path,
    )  # fmt: skip
    trainer.fit(probe, datamodule=module)
    assert len(probe.seen) == 8 and set(probe.seen) <= {"pair", "text"}


@pytest.mark.parametrize(
    "cls", [PretrainDataModule, VQADataModule, NLVR2DataModule, CaptioningDataModule, RetrievalDataModule]
)
def test_constructor_arguments_are_typed_and_documented_for_lightning_cli(cls):
    from jsonargparse import ArgumentParser

    parser = ArgumentParser()
    parser.add_class_arguments(cls, "data")
    help_text = parser.format_help()
    assert "--data.num_workers" in help_text and "DataLoader workers" in help_text
    if cls is PretrainDataModule:
        args = parser.parse_args(["--data.pair_shards", "x", "--data.masking.image_ratio", "0.3"])
        assert args.data.masking.image_ratio == 0.3


def train_module(kind: str, shards: Path):
    """A DataModule of ``kind`` over the tiny corpus with one worker."""
    if kind == "pretrain":
        return PretrainDataModule(
            image_shards=str(shards / "pretrain-images"),
            text_shards=str(shards / "pretrain-text"),
            pair_shards=str(shards / "pretrain-pairs"),
            batch_size=4,
            image_size=64,
            patch_size=16,
            batches_per_epoch=6,
            num_workers=1,
            shuffle_buffer=16,
        )
    if kind == "vqa":
        answers = str(shards / "vqav2-train2014/answers.json")
        train = str(shards / "vqav2-train2014")
        return VQADataModule(answer_vocab=answers, train_shards=train, image_size=64, batch_size=4, num_workers=1)
    if kind == "nlvr2":
        return NLVR2DataModule(train_shards=str(shards / "nlvr2-train"), image_size=64, batch_size=4, num_workers=1)
    module_class = CaptioningDataModule if kind == "captioning" else RetrievalDataModule
    train = str(shards / "coco-karpathy-train-restval")
    return module_class(train_shards=train, image_size=64, batch_size=6, num_workers=1)


def same_batches(first, second) -> bool:
    if isinstance(first, torch.Tensor):
        return isinstance(second, torch.Tensor) and first.dtype == second.dtype and torch.equal(first, second)
    if isinstance(first, dict):
        return first.keys() == second.keys() and all(same_batches(first[key], second[key]) for key in first)
    if isinstance(first, list | tuple):
        return len(first) == len(second) and all(map(same_batches, first, second))
    return first == second


@pytest.mark.parametrize("kind", ["pretrain", "vqa", "nlvr2", "captioning", "retrieval"])
def test_workers_forked_from_a_fork_server_give_the_batches_of_workers_forked_from_this_process(shards, kind):
    """The pool's processes fork their DataLoader workers from a fork server (mmoe.pipeline.pool), which unpickle
    the dataset instead of inheriting it: two epochs of training batches are the same either way."""
    from mmoe.pipeline.pool import start_data_workers_from_a_server

    before = multiprocessing.get_start_method()

    def two_epochs(method: str) -> list:
        multiprocessing.set_start_method(method, force=True)
        torch.manual_seed(0)
        loader = train_module(kind, shards).train_dataloader()
        return [list(loader) for _ in range(2)]

    try:
        start_data_workers_from_a_server(before)
        served = two_epochs("forkserver")
        forked = two_epochs("fork")
    finally:
        multiprocessing.set_start_method(before, force=True)
    assert len(forked[0]) > 1 and not same_batches(forked[0], forked[1])  # each epoch draws anew
    assert same_batches(served, forked)
