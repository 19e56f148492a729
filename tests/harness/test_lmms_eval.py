"""VQA and captioning tasks behind lmms-eval's model interface, fed lmms-eval's own request objects: the answers and
captions equal `mmoe infer`'s on the same images, requests go to the head their task names, `until` cuts the output,
log-likelihood requests and requests without one image are refused in one line, and the entry point's manifest
resolves to the class. Skipped without lmms-eval."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("lmms_eval.api.model", reason="lmms-eval is not installed (pip install 'mmoe[lmms-eval]')")

from lmms_eval.api.instance import Instance  # noqa: E402
from lmms_eval.models.registry_v2 import ModelRegistryV2  # noqa: E402

from mmoe.data.synth.language import questions  # noqa: E402
from mmoe.data.synth.scenes import render, sample_scene  # noqa: E402
from mmoe.harness.lmms_eval import MODEL_ID, MMoELMMs, manifest  # noqa: E402
from mmoe.model import MoEPlan, MultiwayConfig  # noqa: E402
from mmoe.tasks.captioning import CaptioningFineTuning  # noqa: E402
from mmoe.tasks.catalog import class_path  # noqa: E402
from mmoe.tasks.vqa import VQAFineTuning  # noqa: E402
from tests.cli_fixtures import run_mmoe  # noqa: E402

ANSWERS = ["yes", "no", "red", "blue", "green", "circle", "square", "triangle", "one", "two", "three"]


def save_task(path: Path, task_class: type, **arguments) -> Path:
    """A task saved as `mmoe fit` saves it, its matrices drawn at std 0.2 (far from the init's uniform outputs)."""
    torch.manual_seed(0)
    task = task_class(backbone=MultiwayConfig.preset("test", moe=MoEPlan(num_experts=4, every=1)), **arguments)
    with torch.no_grad():
        for parameter in task.parameters():
            if parameter.dim() > 1:
                parameter.normal_(0, 0.2)
    hyper_parameters = dict(task.hparams) | {"_class_path": class_path(task_class)}
    torch.save({"hyper_parameters": hyper_parameters, "state_dict": task.state_dict()}, path)
    return path


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("lmms")
    (root / "answers.json").write_text(json.dumps(ANSWERS))
    rng = np.random.default_rng(0)
    documents = []
    for index in range(4):
        scene = sample_scene(rng)
        image = render(scene, 48)
        image.save(root / f"{index}.png")
        documents.append({"image": image, "question": questions(scene, rng, 1)[0].text, "file": root / f"{index}.png"})
    return {
        "vqa": save_task(root / "vqa.ckpt", VQAFineTuning, answer_vocab=str(root / "answers.json")),
        "captioning": save_task(root / "captioning.ckpt", CaptioningFineTuning, max_length=6, num_beams=2),
        "documents": documents,
    }


def requests(documents: list[dict], task: str, until: list[str] | None = None) -> list[Instance]:
    """lmms-eval's generation requests over ``documents`` as its simple models receive them."""
    return [
        Instance(
            request_type="generate_until",
            arguments=(
                f"<image>{document['question']}\nAnswer the question using a single word or phrase.",
                {"until": until or ["ASSISTANT:"]},
                lambda doc: [doc["image"]],
                doc_id,
                task,
                "val",
            ),
            idx=0,
            metadata={"task": task, "doc_id": doc_id, "repeats": 1},
        )  # fmt: skip
        for doc_id, document in enumerate(documents)
    ]


def model(saved: dict, tasks: dict, **arguments) -> MMoELMMs:
    built = MMoELMMs(**{name: str(saved[name]) for name in arguments.pop("heads", ("vqa", "captioning"))}, **arguments)
    built.task_dict = tasks
    return built


def infer(argv: list[str], capsys) -> dict:
    code, out, err = run_mmoe(["infer", *argv, "--json"], capsys)
    assert code == 0, err
    return json.loads(out)


def test_questions_get_the_vqa_heads_answer_and_captioning_tasks_a_caption(saved, capsys):
    documents = saved["documents"]
    tasks = {"vqav2_val": {"val": documents}, "coco2017_cap_val": {"val": documents}}
    answers = model(saved, tasks).generate_until(requests(documents, "vqav2_val"))
    captions = model(saved, tasks).generate_until(requests(documents, "coco2017_cap_val"))
    for document, answer, caption in zip(documents, answers, captions, strict=True):
        vqa = infer(["vqa", "--ckpt", str(saved["vqa"]), "--image", str(document["file"]),
                     "--question", document["question"], "--top-k", "1"], capsys)  # fmt: skip
        assert answer == vqa["answers"][0]["answer"]
        described = infer(["caption", "--ckpt", str(saved["captioning"]), "--image", str(document["file"])], capsys)
        assert caption == described["caption"] and caption
    assert len(set(answers)) > 1 or len(set(captions)) > 1  # the heads tell the images apart


def test_one_loaded_task_takes_every_request_and_until_cuts_the_output(saved):
    documents = saved["documents"][:2]
    tasks = {"anything": {"val": documents}}
    captions = model(saved, tasks, heads=("captioning",)).generate_until(requests(documents, "anything"))
    word = captions[0].split()[-1] if captions[0].split() else captions[0]
    cut = model(saved, tasks, heads=("captioning",)).generate_until(requests(documents[:1], "anything", [word]))
    assert cut == [captions[0][: captions[0].find(word)]]
    answers = model(saved, tasks, heads=("vqa",)).generate_until(requests(documents, "anything"))
    assert all(answer in ANSWERS for answer in answers)


def test_likelihoods_dialogues_and_requests_without_one_image_are_refused_in_one_line(saved):
    documents = saved["documents"][:1]
    built = model(saved, {"vqav2_val": {"val": documents}})
    for method in (built.loglikelihood, built.generate_until_multi_round):
        with pytest.raises(NotImplementedError) as raised:
            method(requests(documents, "vqav2_val"))
        assert "\n" not in str(raised.value)
    two_images = requests(documents, "vqav2_val")[0]
    two_images.arguments = (*two_images.arguments[:2], lambda doc: [doc["image"], doc["image"]], 0, "vqav2_val", "val")
    with pytest.raises(ValueError, match="vqav2_val document 0: the mmoe model takes one image, got 2"):
        built.generate_until([two_images])
    with pytest.raises(ValueError, match="needs --model_args"):
        MMoELMMs()


def test_the_entry_point_names_the_manifest_which_resolves_to_the_class():
    project = Path(__file__).parents[2] / "pyproject.toml"
    group = project.read_text().split('[project.entry-points."lmms_eval.models"]\n', 1)[1].split("\n\n", 1)[0]
    assert group.strip() == f'{MODEL_ID} = "mmoe.harness.lmms_eval:manifest"'
    registry = ModelRegistryV2()
    registry.register_manifest(manifest())
    assert registry.get_model_class(MODEL_ID) is MMoELMMs
