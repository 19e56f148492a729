"""Where a pipeline run keeps its files, one layout for the demo and the claims study (:class:`WorkLayout`): the corpus
and codebook under ``DIR/data`` (:class:`mmoe.data.synth.layout.CorpusLayout`), each pre-training's run folder
``DIR/pretrain/<name>`` with its exported backbone ``backbone.pt`` in it, each fine-tuning's run folder
``DIR/finetune/<name>/<task>`` (``<task>-seed<s>`` where the fine-tuning is seeded), the stage markers under
``DIR/stages``."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from mmoe.data.synth.layout import CorpusLayout
from mmoe.io import read_json
from mmoe.pipeline.settings import TrainingSettings
from mmoe.runtime.layout import RunLayout

#: The name part of a start from random init: ``<name>-random-init`` beside the pre-training ``<name>``.
RANDOM_INIT = "random-init"
#: The exported backbone in a run folder: a pre-training's (or a random init's), or a fine-tuning's.
BACKBONE = "backbone.pt"


def random_init_name(name: str) -> str:
    """The name of the randomly initialised start beside the pre-training ``name``."""
    return f"{name}-{RANDOM_INIT}"


@dataclass(frozen=True)
class WorkLayout:
    """The folders and files of one work folder ``out`` (the demo's ``--out``, the study's ``--out``)."""

    out: Path

    @property
    def data(self) -> Path:
        return self.out / "data"

    @property
    def corpus(self) -> CorpusLayout:
        """The synthetic corpus's files under :attr:`data`."""
        return CorpusLayout(self.data)

    @property
    def shards(self) -> Path:
        return self.corpus.shards

    @property
    def codebook(self) -> Path:
        return self.data / "codebook.pt"

    def pretraining(self, name: str) -> RunLayout:
        """The run folder of the pre-training ``name`` (a demo variant, a study run)."""
        return RunLayout(self.out / "pretrain" / name)

    def backbone(self, name: str) -> Path:
        """The backbone exported from the pre-training ``name`` (or initialised for it), for its fine-tunings."""
        return self.pretraining(name).root / BACKBONE

    def finetuning(self, name: str, task: str, seed: int | None = None) -> RunLayout:
        """The run folder of ``task``'s fine-tuning from the backbone of ``name`` (at ``seed`` where given)."""
        return RunLayout(self.out / "finetune" / name / (task if seed is None else f"{task}-seed{seed}"))

    def chance(self) -> dict:
        """The chance levels of the corpus summary."""
        return read_json(self.corpus.summary, "corpus summary")["chance"]


@dataclass(frozen=True)
class PipelineRun(WorkLayout):
    """One pipeline work folder and the settings its stages train with."""

    settings: TrainingSettings
