"""``mmoe infer`` on tiny fine-tuned checkpoints: well-formed output for each task, the same answers as ``mmoe predict``
on the same images, the routing map, a folder of images, and one-line errors."""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from PIL import Image

from mmoe.cli import main
from mmoe.model import MoEPlan, MultiwayConfig, MultiwayTransformer
from mmoe.runtime.checkpoint import config_to_dict, export_backbone
from tests.cli_fixtures import run_mmoe, small_shards

BACKBONE = MultiwayConfig.preset("test", moe=MoEPlan(num_experts=4, every=2, heads=2))
#: task -> (LightningModule, DataModule, train split, prediction split, extra model arguments)
TASKS = {
    "vqa": ("mmoe.tasks.vqa.VQAFineTuning", "mmoe.data.datamodules.VQADataModule", "vqav2-train2014",
            "vqav2-val2014"),
    "caption": ("mmoe.tasks.captioning.CaptioningFineTuning", "mmoe.data.datamodules.CaptioningDataModule",
                "coco-karpathy-train-restval", "coco-karpathy-test"),
    "nlvr2": ("mmoe.tasks.nlvr2.NLVR2FineTuning", "mmoe.data.datamodules.NLVR2DataModule", "nlvr2-train",
              "nlvr2-dev"),
}  # fmt: skip


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """task -> (checkpoint, config, prediction split folder, predictions file of `mmoe predict`)."""
    root = tmp_path_factory.mktemp("infer")
    shards = small_shards(root, train_images=60, val_images=4, test_images=3, questions_per_image=5)
    made = {}
    for name, (model, data, train, test) in TASKS.items():
        model_args = {"backbone": config_to_dict(BACKBONE), "optimizer": {"warmup_steps": 1}}
        data_args = {"train_shards": str(shards / train), "val_shards": str(shards / test),
                     "test_shards": str(shards / test), "image_size": 32, "batch_size": 4, "eval_batch_size": 8,
                     "max_text_length": 24, "num_workers": 0}  # fmt: skip
        if name == "vqa":
            model_args["answer_vocab"] = data_args["answer_vocab"] = str(shards / train / "answers.json")
        if name == "caption":
            model_args |= {"max_length": 8, "num_beams": 2}
        config = {
            "seed_everything": 0,
            "trainer": {"max_steps": 2, "accelerator": "cpu", "logger": False, "enable_progress_bar": False,
                        "limit_val_batches": 0, "default_root_dir": str(root / name)},
            "model": {"class_path": model, "init_args": model_args},
            "data": {"class_path": data, "init_args": data_args},
        }  # fmt: skip
        path = root / f"{name}.yaml"
        path.write_text(yaml.safe_dump(config))
        assert main(["fit", "--config", str(path)]) == 0
        checkpoint = next((root / name / "checkpoints").glob("*.ckpt"))
        predictions = root / f"{name}-predictions"
        argv = ["predict", "--config", str(path), "--ckpt_path", str(checkpoint)]
        assert main([*argv, "--model.init_args.predictions_file", str(predictions)]) == 0
        made[name] = (checkpoint, path, shards / test, predictions)
    return made


def shard_samples(split: Path) -> list[dict[str, bytes]]:
    """Every sample of a split's shards: member extension -> bytes."""
    samples: dict[str, dict[str, bytes]] = {}
    for shard in sorted(split.glob("*.tar")):
        with tarfile.open(shard) as archive:
            for member in archive.getmembers():
                key, extension = member.name.split(".", 1)
                samples.setdefault(key, {})[extension] = archive.extractfile(member).read()
    return list(samples.values())


def infer(argv: list[str], capsys) -> tuple[int, dict | None, str]:
    code, out, err = run_mmoe(["infer", *argv, "--json"], capsys)
    return code, (json.loads(out) if code == 0 else None), err


def image_file(sample: dict[str, bytes], extension: str, path: Path) -> str:
    path.write_bytes(sample[extension])
    return str(path)


def test_vqa_answers_as_predict_does(runs, tmp_path, capsys):
    checkpoint, _, split, predictions = runs["vqa"]
    predicted = {entry["question_id"]: entry["answer"] for entry in json.loads(predictions.read_text())}
    for index, sample in enumerate(shard_samples(split)[:4]):
        meta = json.loads(sample["json"])
        image = image_file(sample, "jpg" if "jpg" in sample else "png", tmp_path / f"q{index}.img")
        code, result, err = infer(["vqa", "--ckpt", str(checkpoint), "--image", image, "--question",
                                   meta["question"], "--top-k", "3"], capsys)  # fmt: skip
        assert code == 0, err
        answers = result["answers"]
        assert len(answers) == 3 and all(0 <= a["score"] <= 1 and isinstance(a["answer"], str) for a in answers)
        assert [a["score"] for a in answers] == sorted((a["score"] for a in answers), reverse=True)
        assert answers[0]["answer"] == predicted[meta["question_id"]]


def test_caption_as_predict_does_and_a_folder_writes_coco_results(runs, tmp_path, capsys):
    checkpoint, _, split, predictions = runs["caption"]
    predicted = {entry["image_id"]: entry["caption"] for entry in json.loads(predictions.read_text())}
    folder = tmp_path / "images"
    folder.mkdir()
    for sample in shard_samples(split):
        image_id = json.loads(sample["json"])["image_id"]
        image = image_file(sample, "jpg", folder / f"{image_id}.jpg")
        code, result, err = infer(["caption", "--ckpt", str(checkpoint), "--image", image], capsys)
        assert code == 0, err
        assert result["caption"] == predicted[image_id]
    out = tmp_path / "captions.json"
    code, result, err = infer(["caption", "--ckpt", str(checkpoint), "--image", str(folder), "--out", str(out)], capsys)
    assert code == 0, err
    assert result["images"] == len(predicted) and "mmoe infer" in err  # the progress bar
    assert {entry["image_id"]: entry["caption"] for entry in json.loads(out.read_text())} == predicted


def test_nlvr2_judges_as_predict_does_with_routing(runs, tmp_path, capsys):
    checkpoint, _, split, predictions = runs["nlvr2"]
    predicted = dict(line.split(",") for line in predictions.read_text().split())
    sample = shard_samples(split)[0]
    meta = json.loads(sample["json"])
    left = image_file(sample, "left.png", tmp_path / "left.png")
    right = image_file(sample, "right.png", tmp_path / "right.png")
    sentence = sample["txt"].decode() if "txt" in sample else meta["sentence"]
    code, result, err = infer(["nlvr2", "--ckpt", str(checkpoint), "--left", left, "--right", right, "--sentence",
                               sentence, "--routing", str(tmp_path / "map.png")], capsys)  # fmt: skip
    assert code == 0, err
    assert str(result["answer"]) == predicted[meta["identifier"]]
    assert 0 <= result["probability_true"] <= 1
    assert (tmp_path / "map.png").stat().st_size > 0
    tokens = result["text_tokens"]
    assert tokens[0]["token"] and set(tokens[0]["experts"]) == {"layer1/language"}
    assert all(0 <= e < 4 for token in tokens for heads in token["experts"].values() for k in heads for e in k)


def test_any_image_size_and_mode_and_plain_output(runs, tmp_path, capsys):
    checkpoint = runs["vqa"][0]
    wide = tmp_path / "wide16.png"
    Image.fromarray((np.arange(90 * 200).reshape(90, 200) * 3).astype(np.uint16)).save(wide)
    argv = ["vqa", "--ckpt", str(checkpoint), "--image", str(wide), "--question", "how many circles?"]
    code, out, err = run_mmoe(["infer", *argv, "--top-k", "2", "--routing", str(tmp_path / "r.png")], capsys)
    assert code == 0, err
    lines = out.splitlines()
    assert len(lines[0].split("\t")) == 2 and float(lines[1].split("\t")[1]) <= float(lines[0].split("\t")[1])
    assert lines[-1] == f"routing map: {tmp_path / 'r.png'}"


def test_bad_input_is_one_line_and_exit_2(runs, tmp_path, capsys):
    vqa, caption = runs["vqa"][0], runs["caption"][0]
    (tmp_path / "broken.jpg").write_bytes(b"\xff\xd8 not a jpeg")
    pretrain = tmp_path / "pretrain.ckpt"
    hyper = {"_class_path": "mmoe.tasks.pretraining.MaskedPretraining", "backbone": config_to_dict(BACKBONE)}
    torch.save({"hyper_parameters": hyper, "state_dict": {}}, pretrain)
    export_backbone(MultiwayTransformer(BACKBONE), tmp_path / "backbone.pt")
    good = ["--image", str(tmp_path / "broken.jpg")]
    cases = [
        (["vqa", "--ckpt", str(vqa), *good, "--question", "q"], "broken.jpg is not an image"),
        (["vqa", "--ckpt", str(vqa), "--image", str(tmp_path / "none.png"), "--question", "q"], "none.png does not"),
        (["vqa", "--ckpt", str(tmp_path / "missing.ckpt"), *good, "--question", "q"], "missing.ckpt"),
        (["vqa", "--ckpt", str(caption), *good, "--question", "q"], "is a captioning checkpoint, not a vqav2 one"),
        (["caption", "--ckpt", str(pretrain), *good], "is a pre-training checkpoint"),
        (["caption", "--ckpt", str(tmp_path / "backbone.pt"), *good], "holds no fine-tuned task"),
        (["caption", "--ckpt", str(caption), "--image", str(tmp_path)], "give --out"),
        (["caption", "--ckpt", str(caption), *good, "--device", "nowhere"], "--device nowhere"),
        (["caption", "--ckpt", str(caption), "--image", str(tmp_path), "--routing", "m.png"], "single input"),
        (["caption", "--ckpt", str(caption), "--shards", str(tmp_path / "nowhere")], "give --out"),
        (["vqa", "--ckpt", str(vqa), "--shards", str(tmp_path / "nowhere"), "--out", "r.json"], "--shards:"),
        (["vqa", "--ckpt", str(vqa), *good], "--question needed"),
        (["nlvr2", "--ckpt", str(vqa), "--left", "a.png", "--sentence", "s"], "--right needed"),
        (["vqa", "--ckpt", str(vqa), *good, "--question", "q", "--answer-vocab", str(tmp_path / "a.json")],
         "a.json"),
    ]  # fmt: skip
    for argv, message in cases:
        code, _, err = run_mmoe(["infer", *argv], capsys)
        assert code == 2, (argv, err)
        assert len(err.strip().splitlines()) == 1 and message in err and err.startswith("mmoe infer:"), err


def read_results(path: Path, task: str):
    if task == "nlvr2":
        return sorted(path.read_text().split())
    return sorted(json.loads(path.read_text()), key=lambda entry: json.dumps(entry, sort_keys=True))


@pytest.mark.parametrize("task", list(TASKS))
def test_a_shard_split_gives_predicts_results_file(runs, task, tmp_path, capsys):
    checkpoint, _, split, predictions = runs[task]
    out = tmp_path / "results"
    code, result, err = infer([task, "--ckpt", str(checkpoint), "--shards", str(split), "--out", str(out)], capsys)
    assert code == 0, err
    assert read_results(out, task) == read_results(predictions, task)
    assert result["corrupt_skipped"] == 0 and result["samples"] == len(read_results(out, task))


def test_corrupt_shard_samples_are_skipped_and_counted(runs, tmp_path, capsys):
    checkpoint, _, split, predictions = runs["vqa"]
    folder = tmp_path / "split"
    folder.mkdir()
    for shard in split.glob("*.tar"):
        (folder / shard.name).write_bytes(shard.read_bytes())
    sample = shard_samples(split)[0]
    with tarfile.open(folder / "broken.tar", "w") as archive:
        for extension, data in {"json": sample["json"], "jpg": b"\xff\xd8 not a jpeg"}.items():
            info = tarfile.TarInfo(f"broken.{extension}")
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
    out = tmp_path / "results.json"
    code, result, err = infer(["vqa", "--ckpt", str(checkpoint), "--shards", str(folder), "--out", str(out)], capsys)
    assert code == 0, err
    assert result["corrupt_skipped"] == 1 and "broken" in err
    assert read_results(out, "vqa") == read_results(predictions, "vqa")


def test_a_folder_skips_unreadable_images_and_caption_routing_reads_the_caption_pass(runs, tmp_path, capsys):
    checkpoint, _, split, _ = runs["caption"]
    folder = tmp_path / "images"
    folder.mkdir()
    sample = shard_samples(split)[0]
    image_file(sample, "jpg", folder / "1.jpg")
    (folder / "2.jpg").write_bytes(b"not an image")
    out = tmp_path / "captions.json"
    code, result, err = infer(["caption", "--ckpt", str(checkpoint), "--image", str(folder), "--out", str(out)], capsys)
    assert code == 0, err
    assert (result["images"], result["unreadable_skipped"]) == (1, 1) and "2.jpg is not an image" in err
    argv = [
        "caption",
        "--ckpt",
        str(checkpoint),
        "--image",
        str(folder / "1.jpg"),
        "--routing",
        str(tmp_path / "m.png"),
    ]
    code, result, err = infer(argv, capsys)
    assert code == 0, err
    assert result["text_tokens"] and (tmp_path / "m.png").stat().st_size > 0


def test_routing_map_of_a_one_head_moe_shows_the_chosen_experts(tmp_path, capsys):
    from mmoe.tasks.nlvr2 import NLVR2FineTuning

    config = MultiwayConfig.preset("test", moe=MoEPlan(num_experts=4, every=1))
    task = NLVR2FineTuning(backbone=config)
    hyper = {**task.hparams, "_class_path": "mmoe.tasks.nlvr2.NLVR2FineTuning"}
    torch.save({"hyper_parameters": hyper, "state_dict": task.state_dict()}, tmp_path / "nlvr2.ckpt")
    for side in ("left", "right"):
        Image.fromarray(np.full((40, 50, 3), 90 if side == "left" else 200, dtype=np.uint8)).save(
            tmp_path / f"{side}.png"
        )
    pair = ["--left", str(tmp_path / "left.png"), "--right", str(tmp_path / "right.png")]
    argv = ["nlvr2", "--ckpt", str(tmp_path / "nlvr2.ckpt"), *pair, "--sentence", "two circles", "--routing",
            str(tmp_path / "map.png")]  # fmt: skip
    code, result, err = infer(argv, capsys)
    assert code == 0, err
    assert (tmp_path / "map.png").stat().st_size > 0
    assert set(result["text_tokens"][0]["experts"]) == {"layer0/language", "layer1/language"}
