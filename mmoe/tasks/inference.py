"""What ``mmoe infer <task>`` needs of a fine-tuning task, kept beside the task rather than on it: its options, how its
inputs are read, how its outputs become a result, and the results, each of which formats itself.

One :class:`InferSpec` per task (:mod:`mmoe.tasks.infer_specs`, held by :data:`mmoe.tasks.catalog.INFER_SPECS`). A
result (:class:`InferResult`) is printed as :meth:`~InferResult.formatted` lines, or as the JSON object of
:meth:`~InferResult.record` with ``--json``.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any, Generic, Protocol, TypeVar

import torch

from mmoe.data.samples import Decoder
from mmoe.data.tokenizer import TextTokenizer
from mmoe.tasks.finetuning import FineTuningTask

TaskT = TypeVar("TaskT", bound=FineTuningTask)
#: Text -> (ids, padding mask), each (1, T), on the task's device.
Tokenize = Callable[[str], tuple[torch.Tensor, torch.Tensor]]


class InferResult(Protocol):
    """A result ``mmoe infer`` prints."""

    def formatted(self) -> str:
        """The plain-text form: one or more lines."""
        ...

    def record(self) -> dict[str, Any]:
        """The JSON object of ``--json``."""
        ...


class FieldsRecord:
    """A result dataclass whose ``--json`` record is its fields, nested dataclasses as objects."""

    def record(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class InferOption:
    """One of a task's own ``mmoe infer`` options besides its inputs: ``--<flag>``, read as ``type`` (a string when
    None)."""

    flag: str
    help: str
    type: Callable[[str], Any] | None = None
    default: Any = None

    def add_to(self, parser: argparse.ArgumentParser) -> None:
        kind = {} if self.type is None else {"type": self.type}
        parser.add_argument(f"--{self.flag}", default=self.default, help=self.help, **kind)


def no_arguments(options: dict[str, Any]) -> dict[str, Any]:
    return {}


@dataclasses.dataclass(frozen=True)
class InferSpec(Generic[TaskT]):
    """What ``mmoe infer <task.name>`` needs of ``task``.

    Args:
        task: the fine-tuning task class whose checkpoints are read.
        run: one input -> (the result, the text whose routing ``--routing`` lists): ``run(task, images, text,
            tokenize, options)`` with ``images`` (N, 3, S, S), one per option of ``images``, on the task's device,
            ``text`` the value of the option ``text`` (or None) and ``options`` the parsed options (dest -> value).
        shard_decoder: ``(image_size, tokenizer)`` -> the decoder of the task's shard samples for ``--shards``
            (evaluation transform at ``image_size``).
        aliases: other names the subcommand answers to.
        images: the options that each give one image of a single input (one image: a folder may be given instead).
        alternatives: options that stand in for the first of ``images`` (retrieval's ``images``: a folder to search).
        text: the option giving the text of a single input (a question, a statement); None = no text.
        options: the task's own options besides its inputs.
        arguments: the task arguments its options replace in a checkpoint's, besides the files of
            :attr:`FineTuningTask.file_arguments` (captioning's ``--beam``: ``num_beams``).
        folder_entry: ``(image, result, text)`` -> the results-file entry of one image of a folder given to ``--image``;
            None = the task reads no folder.
    """

    task: type[TaskT]
    run: Callable[[TaskT, torch.Tensor, str | None, Tokenize, dict[str, Any]], tuple[InferResult, str | None]]
    shard_decoder: Callable[[int, TextTokenizer], Decoder]
    aliases: tuple[str, ...] = ()
    images: tuple[str, ...] = ("image",)
    alternatives: tuple[str, ...] = ()
    text: str | None = None
    options: tuple[InferOption, ...] = ()
    arguments: Callable[[dict[str, Any]], dict[str, Any]] = no_arguments
    folder_entry: Callable[[Path, Any, str | None], dict] | None = None

    def task_arguments(self, options: dict[str, Any]) -> dict[str, Any]:
        """Task arguments that the options (dest -> value) replace in a checkpoint's: the files of
        :attr:`FineTuningTask.file_arguments` that were given, and :attr:`arguments`'."""
        files = {name: options[name] for name in self.task.file_arguments if options.get(name) is not None}
        return files | self.arguments(options)


@dataclasses.dataclass(frozen=True)
class Answer:
    """One VQA answer and its sigmoid score."""

    answer: str
    score: float


@dataclasses.dataclass(frozen=True)
class Answers(FieldsRecord):
    """VQA's best answers, best first."""

    answers: list[Answer]

    def formatted(self) -> str:
        return "\n".join(f"{entry.answer}\t{entry.score:.4f}" for entry in self.answers)


@dataclasses.dataclass(frozen=True)
class Verdict(FieldsRecord):
    """NLVR2's answer for a pair: true or false, and the probability of true."""

    answer: bool
    probability_true: float

    def formatted(self) -> str:
        return f"{self.answer}\tP(true) = {self.probability_true:.4f}"


@dataclasses.dataclass(frozen=True)
class Caption(FieldsRecord):
    """An image's caption."""

    caption: str

    def formatted(self) -> str:
        return self.caption


@dataclasses.dataclass(frozen=True)
class Similarity(FieldsRecord):
    """The cosine similarity of an image's and a text's retrieval embeddings."""

    similarity: float

    def formatted(self) -> str:
        return f"cosine similarity {self.similarity:.4f}"


@dataclasses.dataclass(frozen=True)
class Classes(FieldsRecord):
    """An image's most probable classes, best first: their indices, WordNet ids, names and softmax probabilities (as
    a classification predictions entry holds them)."""

    labels: list[int]
    wnids: list[str]
    names: list[str]
    probabilities: list[float]

    def formatted(self) -> str:
        rows = zip(self.names, self.wnids, self.probabilities, strict=True)
        return "\n".join(f"{name}\t{wnid}\t{probability:.4f}" for name, wnid, probability in rows)
