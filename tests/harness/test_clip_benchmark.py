"""A retrieval checkpoint behind CLIP_benchmark's interface: the wrapper's embeddings equal the task's own (files read
as `mmoe infer` reads them, one text at a time), for a checkpoint of `mmoe fit` and a folder of `mmoe export`; and,
where clip_benchmark is installed, its own zero-shot retrieval gives the recalls `mmoe eval retrieval` gives on the
same embeddings, its zero-shot classification the accuracy of a direct reference, and its loader table the model."""

from __future__ import annotations

import importlib
import io
import json
import shutil
import sys
import tarfile

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image

from mmoe.commands.export import export_checkpoint
from mmoe.data.synth.language import captions
from mmoe.data.synth.scenes import COLORS, render, sample_scene
from mmoe.harness.clip_benchmark import load_mmoe_clip
from mmoe.infer.load import InferError, load_fine_tuned
from mmoe.metrics.retrieval import evaluate_retrieval_file
from mmoe.model import MoEPlan, MultiwayConfig
from mmoe.tasks.catalog import class_path
from mmoe.tasks.pretraining import MaskedPretraining
from mmoe.tasks.retrieval import RetrievalFineTuning

IMAGES = 12


@pytest.fixture(scope="module")
def scenes() -> list[tuple[Image.Image, list[str], str]]:
    """(image, its captions, the colour of its one object) per synthetic scene, drawn at 48 px so that the transform
    resizes them."""
    rng = np.random.default_rng(0)
    drawn = []
    for _ in range(IMAGES):
        scene = sample_scene(rng, max_objects=1)
        drawn.append((render(scene, 48), captions(scene, rng, count=1 + len(drawn) % 3), scene.shapes[0].color))
    return drawn


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict:
    """A retrieval task saved as `mmoe fit` saves it and exported as `mmoe export` does. Its matrices are drawn at
    std 0.2, not the init's 0.02, so that attention, routing and the embeddings are far from uniform."""
    root = tmp_path_factory.mktemp("retrieval")
    torch.manual_seed(0)
    task = RetrievalFineTuning(backbone=MultiwayConfig.preset("test", moe=MoEPlan(num_experts=4, every=1)))
    with torch.no_grad():
        for parameter in task.parameters():
            if parameter.dim() > 1:
                parameter.normal_(0, 0.2)
    hyper_parameters = dict(task.hparams) | {"_class_path": class_path(RetrievalFineTuning)}
    checkpoint = root / "retrieval.ckpt"
    torch.save({"hyper_parameters": hyper_parameters, "state_dict": task.state_dict()}, checkpoint)
    export_checkpoint(checkpoint, root / "exported", backbone_only=False)
    return {"checkpoint": checkpoint, "folder": root / "exported", "root": root}


@pytest.mark.parametrize("kind", ["checkpoint", "folder"])
def test_the_wrapper_embeds_as_the_task_does(saved, scenes, kind):
    model, transform, tokenizer = load_mmoe_clip(pretrained=saved[kind])
    reference = load_fine_tuned(saved[kind], RetrievalFineTuning)
    paths = []
    for index, (image, _, _) in enumerate(scenes[:4]):
        paths.append(saved["root"] / f"{kind}-{index}.png")
        image.save(paths[-1])
    texts = [text for _, written, _ in scenes[:4] for text in written]
    with torch.no_grad():
        image_BD = model.encode_image(torch.stack([transform(image) for image, _, _ in scenes[:4]]))
        text_BD = model.encode_text(tokenizer(texts))  # one batch, the shorter texts padded
        want_image = torch.cat([reference.task.embed_images(reference.image(path)[None])[0] for path in paths])
        want_text = torch.cat([reference.task.embed_texts(*reference.text(text))[0] for text in texts])
    assert image_BD.shape == (4, 32) and text_BD.shape == (len(texts), 32)
    assert bool((tokenizer(texts) == tokenizer.pad_id).any()), "no text was padded: the mask goes untested"
    torch.testing.assert_close(image_BD.norm(dim=-1), torch.ones(4))
    torch.testing.assert_close(text_BD.norm(dim=-1), torch.ones(len(texts)))
    torch.testing.assert_close(image_BD, want_image, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(text_BD, want_text, atol=1e-5, rtol=1e-5)
    assert (image_BD[0] - image_BD[1]).abs().max() > 1e-2  # distinct images embed apart


def test_the_transform_takes_any_image_mode(saved, scenes):
    _, transform, _ = load_mmoe_clip(pretrained=saved["folder"])
    image = scenes[0][0]
    for mode in ("L", "RGBA", "P"):
        assert transform(image.convert(mode)).shape == (3, 32, 32)
    torch.testing.assert_close(transform(image.convert("RGBA")), transform(image))


def test_a_missing_or_wrong_model_is_one_line(saved, tmp_path):
    with pytest.raises(ValueError, match="needs --pretrained"):
        load_mmoe_clip(pretrained=None)
    not_a_checkpoint = tmp_path / "notes.ckpt"
    not_a_checkpoint.write_bytes(b"plain text")
    with pytest.raises(ValueError) as raised:
        load_mmoe_clip(pretrained=not_a_checkpoint)
    assert str(not_a_checkpoint) in str(raised.value) and "\n" not in str(raised.value)
    pretraining = tmp_path / "pretraining.ckpt"
    hyper_parameters = {"backbone": {}, "_class_path": class_path(MaskedPretraining)}
    torch.save({"hyper_parameters": hyper_parameters, "state_dict": {}}, pretraining)
    with pytest.raises(InferError, match="pre-training checkpoint"):
        load_mmoe_clip(pretrained=pretraining)


def test_a_folder_of_another_task_is_named_as_such(saved, tmp_path):
    """An export's config.json naming another task's class is refused as that task, whose arguments a retrieval
    folder's config does not fit, not as a folder of another mmoe version."""
    folder = tmp_path / "exported"
    shutil.copytree(saved["folder"], folder)
    config = json.loads((folder / "config.json").read_text())
    config["task"]["class_path"] = "mmoe.tasks.vqa.VQAFineTuning"
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError) as raised:
        load_mmoe_clip(pretrained=folder)
    message = str(raised.value)
    assert "another mmoe version" not in message and "\n" not in message and str(folder / "config.json") in message
    assert "'mmoe.tasks.vqa.VQAFineTuning' is a vqav2 task, not a retrieval task" in message
    assert repr(class_path(RetrievalFineTuning)) in message


class Recording(torch.nn.Module):
    """The wrapper, keeping every embedding it hands to CLIP_benchmark."""

    def __init__(self, model) -> None:
        super().__init__()
        self.model, self.images, self.texts = model, [], []

    def encode_image(self, image):
        self.images.append(self.model.encode_image(image))
        return self.images[-1]

    def encode_text(self, text):
        self.texts.append(self.model.encode_text(text))
        return self.texts[-1]


def retrieval_loader(scenes, transform) -> torch.utils.data.DataLoader:
    """CLIP_benchmark's retrieval batches: (images (B, 3, S, S), each image's captions)."""
    items = [(transform(image), written) for image, written, _ in scenes]
    return torch.utils.data.DataLoader(
        items, batch_size=5, collate_fn=lambda batch: (torch.stack([i for i, _ in batch]), [t for _, t in batch])
    )


def test_clip_benchmark_retrieval_recalls_equal_mmoe_eval_retrieval(saved, scenes, tmp_path):
    zeroshot_retrieval = pytest.importorskip(
        "clip_benchmark.metrics.zeroshot_retrieval", reason="clip_benchmark is not installed (pip install mmoe[eval])"
    )
    model, transform, tokenizer = load_mmoe_clip(pretrained=saved["checkpoint"])
    recording = Recording(model)
    theirs = zeroshot_retrieval.evaluate(
        recording, retrieval_loader(scenes, transform), tokenizer, "cpu", amp=False, recall_k_list=[1, 5, 10]
    )
    written = [text for _, texts, _ in scenes for text in texts]
    embeddings = {
        "image_ids": torch.arange(IMAGES),
        "image_embeddings": torch.cat(recording.images),
        "caption_image_ids": torch.tensor([i for i, (_, texts, _) in enumerate(scenes) for _ in texts]),
        "caption_embeddings": torch.cat(recording.texts),
        "captions": written,
    }
    torch.save(embeddings, tmp_path / "embeddings.pt")
    ours = evaluate_retrieval_file(tmp_path / "embeddings.pt", chunk=4)
    for k in (1, 5, 10):
        # CLIP_benchmark's "image retrieval" is text -> image; its "text retrieval" image -> text
        assert theirs[f"image_retrieval_recall@{k}"] == pytest.approx(ours[f"t2i_r{k}"], abs=1e-6), k
        assert theirs[f"text_retrieval_recall@{k}"] == pytest.approx(ours[f"i2t_r{k}"], abs=1e-6), k
    assert 0 < ours["t2i_r1"] < ours["t2i_r5"] < 1  # the recalls are not all chance, none or every query


class Colours(torch.utils.data.Dataset):
    """Each scene labelled with its object's colour (CLIP_benchmark reads ``classes``)."""

    classes = list(COLORS)

    def __init__(self, scenes, transform) -> None:
        self.items = [(transform(image), self.classes.index(colour)) for image, _, colour in scenes]

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int):
        return self.items[index]


def test_clip_benchmark_zero_shot_classification_equals_a_direct_reference(saved, scenes):
    """CLIP_benchmark's class prompts and logits (its ``evaluate`` ends in an ``accuracy`` that NumPy 2.4 refuses:
    ``float`` of a 1-element array), against the mean of each class's unit prompt embeddings, renormalised."""
    zeroshot_classification = pytest.importorskip(
        "clip_benchmark.metrics.zeroshot_classification",
        reason="clip_benchmark is not installed (pip install mmoe[eval])",
    )
    model, transform, tokenizer = load_mmoe_clip(pretrained=saved["folder"])
    dataset = Colours(scenes, transform)
    templates = ["a {c} shape", "something {c} in the image"]
    classifier = zeroshot_classification.zero_shot_classifier(
        model, tokenizer, Colours.classes, templates, "cpu", amp=False
    )
    logits, labels = zeroshot_classification.run_classification(
        model, classifier, torch.utils.data.DataLoader(dataset, batch_size=5), "cpu", amp=False
    )
    with torch.no_grad():
        prompts = [F.normalize(model.encode_text(tokenizer([t.format(c=c) for t in templates])).mean(0), dim=0)
                   for c in Colours.classes]  # fmt: skip
        scores = model.encode_image(torch.stack([image for image, _ in dataset.items])) @ torch.stack(prompts).T
    torch.testing.assert_close(logits, 100 * scores, atol=1e-4, rtol=1e-5)
    assert labels.tolist() == [label for _, label in dataset.items]
    assert torch.equal(logits.argmax(1), scores.argmax(1))


def test_register_adds_the_model_type_to_clip_benchmarks_loader(saved):
    models = pytest.importorskip(
        "clip_benchmark.models", reason="clip_benchmark is not installed (pip install mmoe[eval])"
    )
    from mmoe.harness.clip_benchmark import MODEL_TYPE, MMoEClipModel, register

    register()
    register()  # twice: added once
    assert models.MODEL_TYPES.count(MODEL_TYPE) == 1
    model, transform, tokenizer = models.load_clip(MODEL_TYPE, "ViT-B-32-quickgelu", str(saved["folder"]), None, "cpu")
    assert isinstance(model, MMoEClipModel) and not model.training
    assert tokenizer(["a red circle"]).dtype == torch.long


def write_wds_split(root, scenes) -> None:
    """A local WebDataset retrieval split as CLIP_benchmark reads one: ``test/0.tar`` of PNG images and their
    captions a line each, ``test/nshards.txt``, ``dataset_type.txt``."""
    (root / "test").mkdir(parents=True)
    (root / "test" / "nshards.txt").write_text("1\n")
    (root / "dataset_type.txt").write_text("retrieval\n")
    with tarfile.open(root / "test" / "0.tar", "w") as tar:
        for index, (image, written, _) in enumerate(scenes):
            encoded = io.BytesIO()
            image.save(encoded, format="PNG")
            for suffix, data in (("png", encoded.getvalue()), ("txt", "\n".join(written).encode())):
                member = tarfile.TarInfo(f"{index:03d}.{suffix}")
                member.size = len(data)
                tar.addfile(member, io.BytesIO(data))


def test_the_command_runs_clip_benchmark_with_the_mmoe_model_type(saved, scenes, tmp_path, monkeypatch):
    pytest.importorskip("clip_benchmark.cli", reason="clip_benchmark is not installed (pip install mmoe[eval])")
    from mmoe.harness.clip_benchmark import main

    write_wds_split(tmp_path / "synth", scenes)
    argv = ["eval", "--model_type", "mmoe", "--pretrained", str(saved["folder"]), "--dataset", "wds/synth",
            "--dataset_root", str(tmp_path / "synth"), "--task", "zeroshot_retrieval", "--recall_k", "1", "5",
            "--no_amp", "--batch_size", "5", "--num_workers", "0",
            "--output", str(tmp_path / "result.json")]  # fmt: skip
    monkeypatch.setattr(sys, "argv", ["clip_benchmark", *argv])
    assert main() == 0
    metrics = json.loads((tmp_path / "result.json").read_text())["metrics"]
    model, transform, tokenizer = load_mmoe_clip(pretrained=saved["folder"])
    zeroshot_retrieval = importlib.import_module("clip_benchmark.metrics.zeroshot_retrieval")
    direct = zeroshot_retrieval.evaluate(
        model, retrieval_loader(scenes, transform), tokenizer, "cpu", amp=False, recall_k_list=[1, 5]
    )
    assert metrics == pytest.approx(direct, abs=1e-6) and set(metrics) == set(direct)
