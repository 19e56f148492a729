"""The demo's settings (:data:`FULL`, :data:`FAST`), its variants and the run directory it works in."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from mmoe.data.converters.coco import CAPTION_TOKENS_FILE
from mmoe.data.synth.convert import CAPTION_TRAIN_SPLIT
from mmoe.data.synth.corpus import SUMMARY_FILE
from mmoe.io import read_json
from mmoe.tasks.layout import RunLayout

#: The configs shipped with the package (``configs/`` at the repo root links here).
CONFIGS = Path(__file__).resolve().parents[1] / "configs"


#: The pre-training parts ``configs/pretrain/tiny/<variant>.yaml`` the demo runs (``dense``: none). Not
#: ``global_balance``: the demo trains on one device, where the global-batch balance loss is Switch's own.
VARIANTS = (
    "dense", "switch", "xmoe", "mhmoe", "stratified", "fine_grained", "shared_experts", "loss_free", "expert_choice"
)  # fmt: skip

#: The folder (under a variant's) and stage-name part of the fine-tunings from random init (``--random-init``).
RANDOM_INIT = "random-init"


#: The token ids of the training captions, under the corpus root: captioning's and pre-training's MLM output vocabulary.
CAPTION_TOKENS = f"shards/{CAPTION_TRAIN_SPLIT}/{CAPTION_TOKENS_FILE}"


class DemoError(RuntimeError):
    """A stage failed; the message names the stage and the command."""


@dataclass(frozen=True)
class DemoSettings:
    """Sizes and step counts of one demo run.

    Attributes:
        synth: extra options of ``mmoe data synth`` (corpus size).
        codebook_size: visual tokens K of the codebook.
        backbone: overrides of the tiny configs' backbone (``model.init_args.backbone``), e.g. a smaller width.
        image_size: image side in pixels (the backbone's and the DataModules').
        pretrain_steps: pre-training optimiser steps.
        pretrain_learning_rate: the pre-training's peak learning rate; None = the tiny config's (1e-3).
        contrastive_coefficient: weight of the image-text contrastive loss added to the pre-training
            (``MaskedPretraining(contrastive_coefficient=)``, VLMo's ITC); 0 = BEiT-3's masked data modelling alone.
        pretrain_output_vocab: whether the pre-training's MLM head predicts only the tokens of the corpus' training
            captions (``MaskedPretraining(output_vocab=)``) instead of the tokenizer's 49,408.
        finetune_steps: optimiser steps per fine-tuning task; a benchmark without steps is not fine-tuned.
        finetune_learning_rates: learning rates that replace the tiny configs' for these tasks (a shorter schedule
            learns more with a larger one).
        finetune_head_lr_multipliers: head learning-rate multipliers (``optimizer.head_lr_multiplier``, BEiT-3's
            ``--task_head_lr_weight``) that replace the tiny configs' for these tasks.
        finetune_layer_decays: BEiT-3's layer-wise learning-rate decays (``optimizer.layer_decay``) that replace the
            tiny configs' (1.0, off) for these tasks.
        batch_size: training batch size of every stage.
        num_beams: beams of caption decoding.
        checkpoint_every: steps between checkpoints (where an interrupted training resumes).
        figure_images: images in the sub-token maps.
        precision: Lightning's ``trainer.precision`` of every training and prediction stage (``bf16-mixed`` on a GPU).
    """

    synth: tuple[str, ...]
    codebook_size: int
    backbone: Mapping[str, int]
    image_size: int
    pretrain_steps: int
    pretrain_learning_rate: float | None
    contrastive_coefficient: float
    pretrain_output_vocab: bool
    finetune_steps: Mapping[str, int]
    finetune_learning_rates: Mapping[str, float]
    finetune_head_lr_multipliers: Mapping[str, float]
    finetune_layer_decays: Mapping[str, float]
    batch_size: int
    num_beams: int
    checkpoint_every: int
    figure_images: int
    precision: str = "32-true"

    def steps(self, task: str) -> int:
        return self.finetune_steps[task]

    def to_json(self) -> dict:
        return json.loads(json.dumps(dataclasses.asdict(self)))

    def replace(self, **changes) -> DemoSettings:
        """These settings with ``changes`` (field name -> value)."""
        return dataclasses.replace(self, **changes)


#: The fields of :class:`DemoSettings` that override a fine-tuning's optimiser for some tasks, and the option of
#: ``model.init_args.optimizer`` each one sets.
OPTIMIZER_OVERRIDES = {
    "finetune_learning_rates": "learning_rate",
    "finetune_head_lr_multipliers": "head_lr_multiplier",
    "finetune_layer_decays": "layer_decay",
}

#: The fields of :class:`DemoSettings` that map a name to a value.
MAPPING_FIELDS = ("backbone", "finetune_steps", *OPTIMIZER_OVERRIDES)


FULL = DemoSettings(
    # 1,600 NLVR2 dev pairs instead of 400: the standard error of an accuracy near 0.6 is 0.012, not 0.024.
    synth=("--size", "small", "--nlvr2-eval-sets", "400"),
    codebook_size=256,
    # The tiny configs' backbone as it is (width 192, 3 heads, FFN 768). Width 128 steps 1.66x faster, but
    # from random init 700 captioning steps named colours that are there 37.7% of the time against 54.1% at 192, and
    # from the pre-trained backbone 43.8% against 92.3% (tasks/coco_captioning/README.md).
    backbone={},
    image_size=64,
    pretrain_steps=80,
    # With the contrastive loss: at 1e-3 it stays at ln(32) for all 80 steps, at 3e-4 it falls to 2.2
    pretrain_learning_rate=3e-4,
    contrastive_coefficient=1.0,
    pretrain_output_vocab=True,
    # Captioning's 500 steps fill one of the two fine-tuning lanes (about 220 s with its evaluation) while VQA, NLVR2
    # and retrieval fill the other (mmoe demo --jobs 2); their colour words are right 70.4% / 79.3% / 92.3% of the time
    # after 450 / 500 / 700 steps (tasks/coco_captioning/README.md). NLVR2 scored 0.632 after 150 steps (0.652 after
    # 200): its 50 steps went to VQA, which needs them more (tasks/vqav2/README.md, "Layer-wise decay").
    finetune_steps={"vqav2": 300, "nlvr2": 150, "captioning": 500, "retrieval": 100},
    # VQA: BEiT-3's split of a slow backbone and a fast head (head at 6e-4) with BEiT-3's layer-wise decay, steeper
    # than its 0.65 for NLVR2: the top layer learns at 3e-4 x 0.4 = 1.2e-4, the embeddings at 3e-4 x 0.4^5 = 3e-6. At
    # width 192 and 200 steps: 52.75 against 50.97 for the backbone at a flat 1e-5 (tasks/vqav2/README.md).
    finetune_learning_rates={"vqav2": 3e-4},
    finetune_head_lr_multipliers={"vqav2": 2.0},
    finetune_layer_decays={"vqav2": 0.4},
    batch_size=32,
    num_beams=3,
    checkpoint_every=50,
    figure_images=4,
)


FAST = FULL.replace(codebook_size=64, figure_images=2)


@dataclass(frozen=True)
class DemoRun:
    """One demo output directory and its settings."""

    out: Path
    settings: DemoSettings

    @property
    def data(self) -> Path:
        return self.out / "data"

    @property
    def shards(self) -> Path:
        return self.data / "shards"

    @property
    def codebook(self) -> Path:
        return self.data / "codebook.pt"

    @property
    def caption_tokens(self) -> Path:
        return self.data / CAPTION_TOKENS

    @property
    def corpus_summary(self) -> Path:
        return self.data / SUMMARY_FILE

    def variant(self, name: str) -> Path:
        """The folder of one variant's runs and files."""
        return self.out / name

    def pretraining(self, variant: str) -> RunLayout:
        return RunLayout(self.variant(variant) / "pretrain")

    def backbone(self, variant: str) -> Path:
        """The variant's pre-trained backbone, exported for the fine-tunings."""
        return self.variant(variant) / "backbone_pretrained.pt"

    def finetuning(self, variant: str, task: str) -> RunLayout:
        return RunLayout(self.variant(variant) / task)

    def random_backbone(self, variant: str) -> Path:
        """A randomly initialised backbone of the variant's architecture (``mmoe demo --random-init``)."""
        return self.variant(variant) / RANDOM_INIT / "backbone_random.pt"

    def finetuning_from_random(self, variant: str, task: str) -> RunLayout:
        return RunLayout(self.variant(variant) / RANDOM_INIT / task)

    def chance(self) -> dict:
        """The chance levels of the corpus summary."""
        return read_json(self.corpus_summary, "corpus summary")["chance"]
