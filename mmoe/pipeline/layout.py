"""Where a pipeline run keeps its files: the corpus under ``DIR/data`` (:class:`mmoe.data.synth.layout.CorpusLayout`),
each variant's runs and exported backbones under ``DIR/<variant>``, the stage markers under ``DIR/stages``."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from mmoe.data.synth.layout import CorpusLayout
from mmoe.io import read_json
from mmoe.pipeline.settings import TrainingSettings
from mmoe.runtime.layout import RunLayout

#: The folder (under a variant's) and stage-name part of the fine-tunings from random init.
RANDOM_INIT = "random-init"
#: The exported backbone files of a variant's folder: pre-trained, randomly initialised, fine-tuned on a task.
PRETRAINED_BACKBONE = "backbone_pretrained.pt"
RANDOM_BACKBONE = "backbone_random.pt"


def finetuned_backbone_name(task: str) -> str:
    """The file name of the backbone exported from a fine-tuning of ``task``."""
    return f"backbone_{task}.pt"


@dataclass(frozen=True)
class PipelineRun:
    """One pipeline output directory and its settings."""

    out: Path
    settings: TrainingSettings

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

    def variant_folder(self, name: str) -> Path:
        """The folder of one variant's runs and files."""
        return self.out / name

    def pretraining(self, variant: str) -> RunLayout:
        return RunLayout(self.variant_folder(variant) / "pretrain")

    def backbone(self, variant: str) -> Path:
        """The variant's pre-trained backbone, exported for the fine-tunings."""
        return self.variant_folder(variant) / PRETRAINED_BACKBONE

    def finetuned_backbone(self, variant: str, task: str) -> Path:
        """The backbone of the variant's fine-tuning of ``task``, exported."""
        return self.variant_folder(variant) / finetuned_backbone_name(task)

    def finetuning(self, variant: str, task: str) -> RunLayout:
        return RunLayout(self.variant_folder(variant) / task)

    def random_backbone(self, variant: str) -> Path:
        """A randomly initialised backbone of the variant's architecture (the start that shows what pre-training
        adds)."""
        return self.variant_folder(variant) / RANDOM_INIT / RANDOM_BACKBONE

    def finetuning_from_random(self, variant: str, task: str) -> RunLayout:
        return RunLayout(self.variant_folder(variant) / RANDOM_INIT / task)

    def chance(self) -> dict:
        """The chance levels of the corpus summary."""
        return read_json(self.corpus.summary, "corpus summary")["chance"]
