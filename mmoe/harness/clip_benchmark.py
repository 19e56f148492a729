"""A fine-tuned mmoe retrieval task as a CLIP_benchmark model (``clip-benchmark`` on PyPI, LAION's zero-shot
retrieval and classification suite).

CLIP_benchmark asks a loader for ``(model, transform, tokenizer)``: a model with ``encode_image`` / ``encode_text``,
the image transform its datasets apply to each PIL image, and a tokenizer from a list of strings to one tensor of ids.
:func:`load_mmoe_clip` gives these for a Lightning checkpoint of ``mmoe fit`` or a folder of ``mmoe export``:

* ``encode_image``: the task's image-only pass (:meth:`RetrievalFineTuning.embed_images`), L2-normalised.
* ``encode_text``: the text-only pass (:meth:`RetrievalFineTuning.embed_texts`). CLIP_benchmark hands over ids alone,
  so the padding mask is read back from them: the pad id never occurs inside an encoded text.
* the transform: the checkpoint's evaluation transform (shorter side resized, centre crop, normalised) after a
  conversion to 8-bit RGB; the tokenizer: the task's own, at the text length it was trained with.

CLIP_benchmark has no plug-in mechanism: :func:`register` adds the model type ``mmoe`` to its loader table, and
``python -m mmoe.harness.clip_benchmark eval --model_type mmoe --pretrained CKPT ...`` runs its command with it.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torchvision.transforms as T
from torch import nn

from mmoe.data.tokenizer import TextTokenizer
from mmoe.data.transforms import eval_transform, to_rgb
from mmoe.infer.load import load_fine_tuned
from mmoe.tasks.retrieval import RetrievalFineTuning

#: The model type :func:`register` adds to CLIP_benchmark (its ``--model_type``).
MODEL_TYPE = "mmoe"


class MMoEClipModel(nn.Module):
    """A retrieval task with CLIP's encoder interface: ``encode_image`` (B, 3, S, S) -> (B, D) and ``encode_text``
    (B, T) ids -> (B, D), each L2-normalised as the task embeds them.

    Args:
        task: the fine-tuned dual encoder.
        pad_id: the id that pads the texts of ``encode_text`` (its tokenizer's ``ids.pad``).
    """

    def __init__(self, task: RetrievalFineTuning, pad_id: int) -> None:
        super().__init__()
        self.task = task
        self.pad_id = pad_id

    def encode_image(self, image: torch.Tensor) -> torch.Tensor:
        """(B, D) unit image embeddings of (B, 3, S, S) normalised pixels."""
        return self.task.embed_images(image)[0]

    def encode_text(self, text: torch.Tensor) -> torch.Tensor:
        """(B, D) unit text embeddings of (B, T) ids padded with :attr:`pad_id`."""
        return self.task.embed_texts(text, text == self.pad_id)[0]


class ClipTokenizer:
    """Texts to one (B, T) long tensor of ids, right-padded to the longest (CLIP_benchmark's tokenizer interface);
    picklable, as DataLoader workers need."""

    def __init__(self, tokenizer: TextTokenizer) -> None:
        self.tokenizer = tokenizer

    @property
    def pad_id(self) -> int:
        return self.tokenizer.ids.pad

    def __call__(self, texts: str | list[str]) -> torch.Tensor:
        return self.tokenizer(texts)[0]


def image_transform(image_size: int) -> T.Compose:
    """A PIL image of any mode to the (3, S, S) tensor the checkpoint's evaluation data gives."""
    return T.Compose([to_rgb, eval_transform(image_size)])


def load_mmoe_clip(
    model_name: str = "retrieval",
    pretrained: str | Path | None = None,
    cache_dir: str | None = None,
    device: str | torch.device = "cpu",
) -> tuple[MMoEClipModel, T.Compose, ClipTokenizer]:
    """CLIP_benchmark's loader signature over a retrieval task: ``pretrained`` is a Lightning checkpoint of
    ``mmoe fit`` or a folder of ``mmoe export``; its config fixes the architecture, so ``model_name`` and
    ``cache_dir`` are not read. Returns ``(model, transform, tokenizer)``, the model in eval mode, float32, on
    ``device``.

    Raises:
        ValueError: no ``pretrained``, or it is not a retrieval task (one line naming the file,
            :class:`mmoe.infer.load.InferError`).
    """
    if pretrained is None:
        raise ValueError(
            "an mmoe model needs --pretrained: a retrieval checkpoint of `mmoe fit` or an `mmoe export` folder"
        )
    loaded = load_fine_tuned(pretrained, RetrievalFineTuning, device=str(device))
    tokenizer = ClipTokenizer(loaded.tokenizer)
    model = MMoEClipModel(loaded.task, tokenizer.pad_id).eval()
    return model, image_transform(loaded.image_size), tokenizer


def register() -> None:
    """Adds the model type ``mmoe`` (:func:`load_mmoe_clip`) to CLIP_benchmark's loader table, once; its command
    reads the same table, so a later ``--model_type mmoe`` is accepted. Raises ImportError without clip_benchmark."""
    from clip_benchmark import models

    models.TYPE2FUNC.setdefault(MODEL_TYPE, load_mmoe_clip)
    if MODEL_TYPE not in models.MODEL_TYPES:
        models.MODEL_TYPES.append(MODEL_TYPE)  # the command's --model_type choices are this very list


def main() -> int:
    """``python -m mmoe.harness.clip_benchmark ...``: CLIP_benchmark's command with the model type ``mmoe``."""
    try:
        register()
        from clip_benchmark.cli import main as clip_benchmark_main
    except ImportError as error:
        print(
            f"mmoe harness: error: CLIP_benchmark is not installed ({error}): pip install 'mmoe[eval]'", file=sys.stderr
        )
        return 2
    clip_benchmark_main()
    return 0


if __name__ == "__main__":
    sys.exit(main())
