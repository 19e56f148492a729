"""What ``mmoe infer`` prints besides a task's own result (:mod:`mmoe.tasks.inference`): a result with its routing, a
folder's and a split's results files, a search's matches. Each formats itself: :meth:`formatted` lines, or the JSON
object of :meth:`record` (``--json``)."""

from __future__ import annotations

import dataclasses
from typing import Any

from mmoe.tasks.inference import FieldsRecord, InferResult


@dataclasses.dataclass(frozen=True)
class Routed:
    """A single input's result with ``--routing``: the experts each text token went to in every MoE layer
    (``{"token", "experts": {layer: experts}}`` per token) and the image's expert map."""

    result: InferResult
    text_tokens: list[dict]
    routing_map: str

    def formatted(self) -> str:
        lines = [self.result.formatted()]
        for token in self.text_tokens:
            layers = "  ".join(f"{key}: {experts}" for key, experts in token["experts"].items())
            lines.append(f"{token['token']!r}\t{layers}")
        lines.append(f"routing map: {self.routing_map}")
        return "\n".join(lines)

    def record(self) -> dict[str, Any]:
        return {**self.result.record(), "text_tokens": self.text_tokens, "routing_map": self.routing_map}


@dataclasses.dataclass(frozen=True)
class FolderResults(FieldsRecord):
    """A folder of images given to ``--image``: its results file and counts."""

    results_file: str
    images: int
    unreadable_skipped: int

    def formatted(self) -> str:
        return f"{self.images} images -> {self.results_file} ({self.unreadable_skipped} unreadable)"


@dataclasses.dataclass(frozen=True)
class ShardResults(FieldsRecord):
    """A split given to ``--shards``: its results file, counts, and ``shortfall``, what says how many samples of the
    split's manifests have no entry (None when none is missing or the manifests give no count)."""

    results_file: str
    samples: int
    corrupt_skipped: int
    shortfall: str | None

    def formatted(self) -> str:
        return f"{self.samples} samples -> {self.results_file} ({self.corrupt_skipped} corrupt skipped)"


def match_lines(matches: list[dict], named_by: str) -> list[str]:
    return [f"{match['score']:.4f}\t{match[named_by]}" for match in matches]


@dataclasses.dataclass(frozen=True)
class ImageMatches(FieldsRecord):
    """``--images DIR --text``: the folder's best images for the text (``{"file", "score"}``, best first), and how
    many images the folder has, were embedded now, were cached and could not be read."""

    query: str
    matches: list[dict]
    images: int
    embedded: int
    cached: int
    unreadable_skipped: int

    def formatted(self) -> str:
        counts = (
            f"{self.images} images ({self.embedded} embedded, {self.cached} cached, "
            f"{self.unreadable_skipped} unreadable)"
        )
        return "\n".join([*match_lines(self.matches, "file"), counts])


@dataclasses.dataclass(frozen=True)
class TextMatches(FieldsRecord):
    """``--image X --texts FILE``: the file's best lines for the image (``{"text", "score"}``, best first), of
    ``texts``."""

    query: str
    matches: list[dict]
    texts: int

    def formatted(self) -> str:
        return "\n".join(match_lines(self.matches, "text"))
