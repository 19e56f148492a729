"""Fine-tuned mmoe VQA and captioning tasks as an lmms-eval model (``lmms-eval`` on PyPI), registered through its
entry-point group ``lmms_eval.models`` (``pyproject.toml``: ``mmoe = "mmoe.harness.lmms_eval:manifest"``), so
``lmms-eval --model mmoe --model_args vqa=VQA,captioning=CAPTIONING --tasks ...`` finds it once mmoe is installed.

* ``generate_until``: a request of a captioning task (its name matched by ``caption_tasks``) gets the captioning
  head's caption of its image (beam search, the checkpoint's length settings); any other request the VQA head's best
  answer to its question, the first non-empty line of the request's context (lmms-eval's VQA prompts put their
  instruction on a line after the question; ``<image>`` marks are dropped). With one of the two tasks loaded, every
  request goes to it. The output is cut at the request's first ``until`` string.
* ``loglikelihood`` and multi-round generation are refused in one line: a classifier over an answer list and a
  caption decoder give no likelihood of an arbitrary continuation.

Each request needs exactly one image. Requests are answered one at a time, in float32, without gradients.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch
from lmms_eval.api.instance import Instance
from lmms_eval.api.model import lmms
from lmms_eval.models.registry_v2 import ModelManifest
from PIL import Image

from mmoe.data.transforms import eval_transform, to_rgb
from mmoe.infer.load import FineTuned, load_fine_tuned
from mmoe.tasks.captioning import CaptioningFineTuning
from mmoe.tasks.vqa import VQAFineTuning

#: The name lmms-eval's ``--model`` takes.
MODEL_ID = "mmoe"
#: lmms-eval's captioning tasks by name (COCO 2014 / 2017 captions, COCO Karpathy, NoCaps, Flickr30K, TextCaps).
DEFAULT_CAPTION_TASKS = r"^(coco\d*_cap|coco_karpathy|nocaps|flickr30k|textcaps)"


def manifest() -> ModelManifest:
    """The entry point's payload: the model id ``mmoe`` and its class."""
    return ModelManifest(model_id=MODEL_ID, simple_class_path=f"{__name__}.{MMoELMMs.__name__}")


class MMoELMMs(lmms):
    """An lmms-eval model over a VQA and / or a captioning task of mmoe (each a Lightning checkpoint of ``mmoe fit``
    or an ``mmoe export`` folder).

    Args:
        vqa: the VQA task answering questions; None = none.
        captioning: the captioning task writing captions; None = none.
        caption_tasks: a regular expression over lmms-eval task names: the requests it matches go to ``captioning``.
        device: where both run (lmms-eval's ``--device``).
        batch_size, max_batch_size: lmms-eval's options, accepted; requests are answered one at a time.

    Raises:
        ValueError: neither task given, or a file that is not such a task (one line naming it).
    """

    def __init__(
        self,
        vqa: str | None = None,
        captioning: str | None = None,
        caption_tasks: str = DEFAULT_CAPTION_TASKS,
        device: str | None = "cpu",
        batch_size: int | str | None = 1,
        max_batch_size: int | None = None,
    ) -> None:
        super().__init__()
        if vqa is None and captioning is None:
            raise ValueError("the mmoe model needs --model_args vqa=CHECKPOINT and / or captioning=CHECKPOINT")
        device = device or "cpu"
        self.vqa = load_fine_tuned(Path(vqa), VQAFineTuning, device) if vqa else None
        self.captioning = load_fine_tuned(Path(captioning), CaptioningFineTuning, device) if captioning else None
        self.caption_tasks = re.compile(caption_tasks)

    def loglikelihood(self, requests: list[Instance]) -> list[tuple[float, bool]]:
        raise NotImplementedError(
            "the mmoe model gives no log-likelihoods (a VQA classifier and a caption decoder): run generation tasks"
        )

    def generate_until_multi_round(self, requests: list[Instance]) -> list[str]:
        raise NotImplementedError("the mmoe model answers one question or writes one caption per image, not a dialogue")

    def generate_until(self, requests: list[Instance]) -> list[str]:
        """One answer or caption per request (see the module docstring)."""
        return [self.respond(request) for request in requests]

    def respond(self, request: Instance) -> str:
        """The answer or caption of one request, cut at its first ``until`` string."""
        context, generation, doc_to_visual, doc_id, task, split = request.args
        visuals = doc_to_visual(self.task_dict[task][split][doc_id])
        images = [visual for visual in visuals or [] if isinstance(visual, Image.Image)]
        if len(images) != 1 or len(visuals) != 1:
            raise ValueError(
                f"{task} document {doc_id}: the mmoe model takes one image, got {len(visuals or [])} visuals"
            )
        with torch.no_grad():
            if self.wants_caption(task):
                text = self.caption(images[0])
            else:
                text = self.answer(images[0], question_of(context), task, doc_id)
        return cut_at(text, (generation or {}).get("until"))

    def wants_caption(self, task: str) -> bool:
        """Whether a request of ``task`` goes to the captioning task."""
        if self.vqa is None or self.captioning is None:
            return self.vqa is None
        return self.caption_tasks.search(task) is not None

    def caption(self, image: Image.Image) -> str:
        loaded = self.captioning
        return loaded.task.captions(pixels(loaded, image))[0]

    def answer(self, image: Image.Image, question: str, task: str, doc_id: int) -> str:
        if not question:
            raise ValueError(f"{task} document {doc_id}: the request's context holds no question")
        loaded = self.vqa
        logits, _ = loaded.task(pixels(loaded, image), *loaded.text(question))
        return loaded.task.answers[int(logits[0].argmax())]


def pixels(loaded: FineTuned, image: Image.Image) -> torch.Tensor:
    """(1, 3, S, S): ``image`` as the task's evaluation data gives it, on its device."""
    return eval_transform(loaded.image_size)(to_rgb(image))[None].to(loaded.device)


def question_of(context: str) -> str:
    """The question of a request's context: its first non-empty line, ``<image>`` marks dropped."""
    lines = [line.strip() for line in context.replace("<image>", "").splitlines()]
    return next((line for line in lines if line), "")


def cut_at(text: str, until: str | list[str] | None) -> str:
    """``text`` up to the first of the ``until`` strings it holds (all of it when none)."""
    stops = [until] if isinstance(until, str) else list(until or [])
    ends = [text.find(stop) for stop in stops if stop and stop in text]
    return text[: min(ends)] if ends else text
