"""What a pipeline run trains: :class:`TrainingSettings` (corpus size, step counts, the options laid over the shipped
configs), the demo's two presets (:data:`DEMO`, :data:`DEMO_FAST`; the claims study derives its own from them), and
the settings file that keeps a run folder from mixing two settings."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from mmoe.io import read_json, write_json
from mmoe.pipeline.stages import PipelineError
from mmoe.runtime.optimizer import check_optimizer_fields


@dataclass(frozen=True)
class TrainingSettings:
    """Sizes and step counts of one pipeline run; each default keeps the shipped tiny configs as they are.

    Attributes:
        corpus_size: the synthetic corpus's size preset (``mmoe data synth --size``).
        nlvr2_eval_sets: NLVR2 evaluation sets of the corpus (``--nlvr2-eval-sets``; None = the preset's).
        codebook_size: visual tokens K of the codebook.
        image_size: image side in pixels (the backbone's and the DataModules').
        pretrain_steps: pre-training optimiser steps.
        finetune_steps: optimiser steps per fine-tuning task; a benchmark without steps is not fine-tuned.
        batch_size: training batch size of every stage.
        num_beams: beams of caption decoding.
        checkpoint_every: steps between checkpoints (where an interrupted training resumes).
        figure_images: images in the sub-token maps.
        backbone: overrides of the tiny configs' backbone (``model.init_args.backbone``), e.g. a smaller width.
        pretrain_learning_rate: the pre-training's peak learning rate; None = the tiny config's.
        contrastive_coefficient: weight of the image-text contrastive loss added to the pre-training
            (``MaskedPretraining(contrastive_coefficient=)``, VLMo's ITC); 0 = BEiT-3's masked data modelling alone.
        pretrain_output_vocab: whether the pre-training's MLM head predicts only the tokens of the corpus' training
            captions (``MaskedPretraining(output_vocab=)``) instead of the tokenizer's 49,408.
        finetune_optimizer: per task, :class:`~mmoe.runtime.optimizer.OptimizerConfig` fields that replace the tiny
            config's (e.g. ``{"vqav2": {"learning_rate": 3e-4, "layer_decay": 0.4}}``).
        precision: Lightning's ``trainer.precision`` of every training and prediction stage (``bf16-mixed`` on a GPU).
    """

    corpus_size: str
    codebook_size: int
    image_size: int
    pretrain_steps: int
    finetune_steps: Mapping[str, int]
    batch_size: int
    num_beams: int
    checkpoint_every: int
    figure_images: int
    nlvr2_eval_sets: int | None = None
    backbone: Mapping[str, int] = field(default_factory=dict)
    pretrain_learning_rate: float | None = None
    contrastive_coefficient: float = 0.0
    pretrain_output_vocab: bool = False
    finetune_optimizer: Mapping[str, Mapping[str, float]] = field(default_factory=dict)
    precision: str = "32-true"

    def __post_init__(self) -> None:
        for task, options in self.finetune_optimizer.items():
            check_optimizer_fields(options, f"finetune_optimizer[{task!r}]")

    def steps(self, task: str) -> int:
        return self.finetune_steps[task]

    def to_json(self) -> dict:
        return json.loads(json.dumps(dataclasses.asdict(self)))

    def replace(self, **changes) -> TrainingSettings:
        """These settings with ``changes`` (field name -> value)."""
        return dataclasses.replace(self, **changes)


#: ``mmoe demo``'s settings; the measurements behind each choice are in docs/tutorials/demo_details.md and the
#: tasks' pages.
DEMO = TrainingSettings(
    # 1,600 NLVR2 dev pairs instead of 400: a tighter accuracy estimate.
    corpus_size="small",
    nlvr2_eval_sets=400,
    codebook_size=256,
    image_size=64,
    pretrain_steps=80,
    # Captioning's steps fill one of the two fine-tuning processes while VQA, NLVR2 and retrieval fill the other.
    finetune_steps={"vqav2": 300, "nlvr2": 150, "captioning": 500, "retrieval": 100},
    batch_size=32,
    num_beams=3,
    checkpoint_every=50,
    figure_images=4,
    # The tiny configs' backbone as it is (width 192, 3 heads, FFN 768).
    backbone={},
    # With the contrastive loss, the tiny config's 1e-3 leaves it at ln(batch size).
    pretrain_learning_rate=3e-4,
    contrastive_coefficient=1.0,
    pretrain_output_vocab=True,
    # VQA: BEiT-3's split of a slow backbone and a fast head with BEiT-3's layer-wise decay, steeper than its 0.65 for
    # NLVR2: the top layer learns at 3e-4 x 0.4, the embeddings at 3e-4 x 0.4^5, the head at 3e-4 x 2.
    finetune_optimizer={"vqav2": {"learning_rate": 3e-4, "head_lr_multiplier": 2.0, "layer_decay": 0.4}},
)

#: ``mmoe demo --fast``: a smaller codebook and fewer figure images.
DEMO_FAST = DEMO.replace(codebook_size=64, figure_images=2)

#: The settings file of a demo run folder.
DEMO_SETTINGS_FILE = "demo.json"


def record_demo_settings(out: Path, settings: TrainingSettings) -> None:
    """Records ``settings`` in a demo run folder ``out``; a folder made with other settings is refused (PipelineError),
    not mixed."""
    hint = "use another --out, or that run's --fast and --precision choices with the version that made it"
    refuse_other_settings(out / DEMO_SETTINGS_FILE, settings.to_json(), "a demo run", hint)


#: Per optimiser option, the per-task field older settings files kept it in.
_OLD_OPTIMIZER_FIELDS = {
    "finetune_learning_rates": "learning_rate",
    "finetune_head_lr_multipliers": "head_lr_multiplier",
    "finetune_layer_decays": "layer_decay",
}


def upgraded_settings(stored: dict) -> dict:
    """Training settings as an older settings file stored them, in today's form:

    - ``synth``, the options of ``mmoe data synth`` as text (``["--size", "small", "--nlvr2-eval-sets", "400"]``),
      became ``corpus_size`` and ``nlvr2_eval_sets``;
    - three per-task optimiser fields became ``finetune_optimizer``; a file from before them trained with the configs'
      optimisers, as one without them does today;
    - one from before the precision option trained in 32-true;
    - the per-name fields were lists of ``[name, value]`` pairs.
    """
    stored = {"precision": "32-true"} | {
        key: dict(value) if isinstance(value, list) and key != "synth" else value for key, value in stored.items()
    }
    if "synth" in stored:
        options = dict(zip(stored["synth"][::2], stored["synth"][1::2], strict=False))
        stored = {key: value for key, value in stored.items() if key != "synth"}
        stored |= {"corpus_size": options.get("--size", "small"), "nlvr2_eval_sets": None}
        if "--nlvr2-eval-sets" in options:
            stored["nlvr2_eval_sets"] = int(options["--nlvr2-eval-sets"])
    if "finetune_optimizer" not in stored:
        optimizer: dict[str, dict[str, float]] = {}
        for old, option in _OLD_OPTIMIZER_FIELDS.items():
            for task, value in dict(stored.get(old) or {}).items():
                optimizer.setdefault(task, {})[option] = value
        stored = {key: value for key, value in stored.items() if key not in _OLD_OPTIMIZER_FIELDS}
        stored["finetune_optimizer"] = optimizer
    return stored


def refuse_other_settings(
    path: Path, settings: dict, what: str, hint: str, upgrade: Callable[[dict], dict] = upgraded_settings
) -> None:
    """Records ``settings`` in ``path`` (JSON, ``{"settings": ...}``); PipelineError listing what differs when
    ``path`` holds other settings, so a run directory is never mixed. ``upgrade``: an older file's settings in
    today's form."""
    if path.is_file():
        stored = read_json(path, "run settings", PipelineError).get("settings")
        stored = upgrade(stored) if isinstance(stored, dict) else {}
        if stored != settings:
            keys = dict.fromkeys([*settings, *stored])
            changed = "; ".join(
                f"{key}: {stored.get(key)!r} there, {settings.get(key)!r} now"
                for key in keys
                if stored.get(key) != settings.get(key)
            )
            raise PipelineError(f"{path.parent} holds {what} made with other settings ({changed}; see {path}): {hint}")
        return
    write_json(path, {"settings": settings})
