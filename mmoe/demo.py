"""``mmoe demo``: the whole pipeline on the embedded synthetic corpus, in minutes on a CPU.

```
mmoe demo [--out runs/demo] [--variant dense|switch|xmoe|mhmoe|stratified|all] [--fast] [--precision bf16-mixed]
```

Stages, in order (each a call of the package's own commands or Python APIs):

1. ``corpus``       ``mmoe data synth --out DIR/data --shards``: the synthetic world in the benchmarks' formats, shards;
2. ``codebook``     ``mmoe tokenizer fit``: the visual codebook, the targets of masked image modeling;

then for each variant, under ``DIR/<variant>/``:

3. ``pretrain``     ``mmoe fit`` with ``configs/pretrain/tiny_<variant>.yaml`` pointed at ``DIR``;
4. ``export``       the pre-trained backbone as ``backbone_pretrained.pt``;
5. ``vqav2``, ``nlvr2``, ``captioning``: ``mmoe fit`` with ``configs/finetune/<task>_tiny.yaml`` from that backbone,
   ``mmoe predict`` on the evaluation split, and the official scorers (:mod:`mmoe.metrics`);
6. ``figures``      ``mmoe viz subtoken-map`` (pre-trained vs VQA fine-tuned backbone) and ``mmoe viz heatmap``.

A stage is done when its output file exists and its marker ``DIR/stages/<stage>.json`` says so; a re-run reuses done
stages, and an interrupted training resumes from its last checkpoint. Every file is written atomically or under its
stage's folder, so an interruption loses nothing already finished. The run ends with a table (task, metric, value,
chance level from ``DIR/data/synth.json``) and the files written, also saved as ``DIR/results.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import lightning as L
import yaml

from mmoe.atomic import write_json_atomic

CONFIGS = Path(__file__).resolve().parent / "configs"
VARIANTS = ("dense", "switch", "xmoe", "mhmoe", "stratified")
#: Where the repository's tiny configs expect the synthetic corpus; the demo points these paths at ``DIR/data``.
CONFIG_DATA_ROOT = "data/synthetic"


class DemoError(RuntimeError):
    """A stage failed; the message names the stage and the command."""


# -- settings --------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DemoSettings:
    """Sizes and step counts of one demo run.

    Attributes:
        synth: extra options of ``mmoe data synth`` (corpus size).
        codebook_size: visual tokens K of the codebook.
        backbone: overrides of the tiny configs' backbone (``model.init_args.backbone``), e.g. a smaller width.
        image_size: image side in pixels (the backbone's and the DataModules').
        pretrain_steps: pre-training optimiser steps.
        finetune_steps: optimiser steps per fine-tuning task.
        finetune_learning_rates: learning rates that replace the tiny configs' for these tasks (a shorter schedule
            learns more with a larger one).
        batch_size: training batch size of every stage.
        num_beams: beams of caption decoding.
        checkpoint_every: steps between checkpoints (where an interrupted training resumes).
        figure_images: images in the sub-token maps.
        precision: Lightning's ``trainer.precision`` of every training and prediction stage (``bf16-mixed`` on a GPU).
    """

    synth: tuple[str, ...]
    codebook_size: int
    backbone: tuple[tuple[str, int], ...]
    image_size: int
    pretrain_steps: int
    finetune_steps: tuple[tuple[str, int], ...]
    finetune_learning_rates: tuple[tuple[str, float], ...]
    batch_size: int
    num_beams: int
    checkpoint_every: int
    figure_images: int
    precision: str = "32-true"

    def steps(self, task: str) -> int:
        return dict(self.finetune_steps)[task]

    def to_json(self) -> dict:
        return json.loads(json.dumps(dataclasses.asdict(self)))


FULL = DemoSettings(
    synth=("--size", "small"),
    codebook_size=256,
    backbone=(),
    image_size=64,
    pretrain_steps=80,
    finetune_steps=(("vqav2", 300), ("nlvr2", 250), ("captioning", 450)),  # NLVR2 at 180 steps: 0.500 (constant)
    finetune_learning_rates=(),
    batch_size=32,
    num_beams=3,
    checkpoint_every=50,
    figure_images=4,
)
FAST = DemoSettings(
    # 1,600 NLVR2 dev pairs instead of 400: a model right on 0.55 of them is above the constant answer's 0.50 by
    # 4 standard errors, not 2.
    synth=("--size", "small", "--nlvr2-eval-sets", "400"),
    codebook_size=64,
    backbone=(),
    image_size=64,
    pretrain_steps=80,  # NLVR2 learns from this backbone; from one pre-trained 20 or 40 steps it stays at 0.50
    finetune_steps=(("vqav2", 200), ("nlvr2", 250), ("captioning", 300)),  # VQA at 100 steps: 30.42, below the prior
    finetune_learning_rates=(("captioning", 6e-4),),  # 2e-4 for 300 steps: CIDEr below the constant caption's
    batch_size=32,
    num_beams=3,
    checkpoint_every=50,
    figure_images=2,
)


# -- the run's paths and progress --------------------------------------------------------------------------------------


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

    def variant(self, name: str) -> Path:
        return self.out / name

    def chance(self) -> dict:
        return json.loads((self.data / "synth.json").read_text())["chance"]


def say(message: str) -> None:
    print(message, flush=True)


class StepProgress(L.Callback):
    """Prints one line every ``every_n_steps`` training steps: step, loss and elapsed time.

    Args:
        label: what is training (printed first).
        every_n_steps: steps between lines.
    """

    def __init__(self, label: str = "train", every_n_steps: int = 50) -> None:
        self.label = label
        self.every_n_steps = every_n_steps
        self._start = time.perf_counter()

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._start = time.perf_counter()

    def on_train_batch_end(self, trainer: L.Trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        step = trainer.global_step
        if step % self.every_n_steps and step != trainer.max_steps:
            return
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        elapsed = time.perf_counter() - self._start
        say(f"    {self.label}: step {step}/{trainer.max_steps}  loss {float(loss):.3f}  {elapsed:.0f} s")


# -- stages ----------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Stage:
    """One step of the demo: done when ``output`` exists and its marker says so.

    Attributes:
        name: ``corpus``, ``codebook`` or ``<variant>/<step>``.
        output: the file whose existence (with the marker) means the stage is done.
        run: does the work; returns a JSON-able result (scores, files written) kept in the marker.
    """

    name: str
    output: Path
    run: Callable[[], dict]


def marker_path(run: DemoRun, stage: Stage) -> Path:
    return run.out / "stages" / f"{stage.name.replace('/', '-')}.json"


def run_stage(run: DemoRun, stage: Stage) -> dict:
    """Runs ``stage`` unless it is done; returns its marker (``seconds``, ``result``, ``reused``)."""
    marker = marker_path(run, stage)
    if marker.is_file() and stage.output.exists():
        record = json.loads(marker.read_text())
        say(f"[{stage.name}] done in an earlier run ({record['seconds']:.0f} s), reused")
        return record | {"reused": True}
    say(f"[{stage.name}] ...")
    start = time.perf_counter()
    result = stage.run()
    if not stage.output.exists():
        raise DemoError(f"stage {stage.name} finished without writing {stage.output}")
    record = {"stage": stage.name, "output": str(stage.output), "seconds": time.perf_counter() - start}
    record["result"] = result
    write_json_atomic(marker, record)
    say(f"[{stage.name}] done in {record['seconds']:.0f} s")
    return record | {"reused": False}


def call(name: str, command: Callable[[Sequence[str]], int], argv: list[str]) -> None:
    """Runs an ``mmoe`` command in-process; DemoError when it fails."""
    try:
        with command_line(argv):
            code = command(argv)
    except SystemExit as stop:  # argparse / LightningCLI exit on bad configs
        code = stop.code if isinstance(stop.code, int) else 1
    if code not in (0, None):
        raise DemoError(f"stage {name}: `mmoe {' '.join(argv)}` exited with status {code}")


@contextlib.contextmanager
def command_line(argv: list[str]):
    """``sys.argv`` set to ``mmoe <argv>`` for the duration (LightningCLI reads the command line from it)."""
    saved = sys.argv
    sys.argv = ["mmoe", *argv]
    try:
        yield
    finally:
        sys.argv = saved


def quietly(name: str, command: Callable[[Sequence[str]], int], argv: list[str]) -> None:
    """``call`` with the command's own stdout (its JSON summary) dropped: the demo prints its own summary."""
    with contextlib.redirect_stdout(_Sink()):
        call(name, command, argv)


class _Sink:
    """A text stream that drops everything."""

    def write(self, text: str) -> int:
        return len(text)

    def flush(self) -> None:
        pass


# -- configs ---------------------------------------------------------------------------------------------------------


def load_config(relative: str) -> dict:
    """A YAML config of the repository's ``configs/``."""
    path = CONFIGS / relative
    if not path.is_file():
        raise DemoError(f"config {path} does not exist (mmoe demo reads the configs/ of the repository checkout)")
    return yaml.safe_load(path.read_text())


def repoint(value, data: Path):
    """``value`` with every path under the configs' ``data/synthetic`` moved to ``data`` (recursively)."""
    if isinstance(value, dict):
        return {key: repoint(item, data) for key, item in value.items()}
    if isinstance(value, list):
        return [repoint(item, data) for item in value]
    if isinstance(value, str) and (value == CONFIG_DATA_ROOT or value.startswith(CONFIG_DATA_ROOT + "/")):
        return str(data) + value[len(CONFIG_DATA_ROOT) :]
    return value


def point_trainer(config: dict, out: Path, steps: int, run: DemoRun, label: str) -> None:
    """Sets a config's trainer to ``steps`` steps without validation, one CSV logger and checkpoints under ``out``,
    progress lines instead of a progress bar."""
    trainer = config["trainer"]
    trainer.update(
        max_steps=steps,
        val_check_interval=steps,
        limit_val_batches=0,
        default_root_dir=str(out),
        enable_progress_bar=False,
        enable_model_summary=False,
        precision=run.settings.precision,
    )
    trainer["logger"] = [
        {
            "class_path": "lightning.pytorch.loggers.CSVLogger",
            "init_args": {"save_dir": str(out), "name": "csv", "version": 0},
        }
    ]
    callbacks = []
    for callback in trainer.get("callbacks", []):
        kind = callback["class_path"].rsplit(".", 1)[-1]
        if kind == "ModelCheckpoint":  # no validation metric to monitor: keep only the latest, as last.ckpt
            callback = {
                "class_path": callback["class_path"],
                "init_args": {
                    "dirpath": str(out / "checkpoints"),
                    "save_top_k": 0,
                    "save_last": True,
                    "every_n_train_steps": run.settings.checkpoint_every,
                },
            }
        elif "save_dir" in callback.get("init_args", {}):
            callback["init_args"]["save_dir"] = str(out)
        callbacks.append(callback)
    progress = {"label": label, "every_n_steps": max(10, steps // 6)}
    callbacks.append({"class_path": f"{__name__}.StepProgress", "init_args": progress})
    trainer["callbacks"] = callbacks


def write_config(config: dict, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def pretrain_config(run: DemoRun, variant: str, out: Path) -> dict:
    """``configs/pretrain/tiny_<variant>.yaml`` pointed at the demo's corpus, codebook and ``out``."""
    config = repoint(load_config(f"pretrain/tiny_{variant}.yaml"), run.data)
    steps = run.settings.pretrain_steps
    point_trainer(config, out, steps, run, f"pretrain {variant}")
    model = config["model"]["init_args"]
    model["backbone"].update(dict(run.settings.backbone), image_size=run.settings.image_size)
    model["visual_codebook"] = str(run.codebook)
    data = config["data"]["init_args"]
    data.update(image_size=run.settings.image_size, batch_size=run.settings.batch_size, batches_per_epoch=steps)
    return config


def finetune_config(run: DemoRun, task: FineTuneTask, backbone: Path, out: Path) -> dict:
    """``configs/finetune/<task>_tiny.yaml`` pointed at the demo's corpus and ``out``, starting from ``backbone``
    (whose architecture it keeps)."""
    config = repoint(load_config(f"finetune/{task.name}_tiny.yaml"), run.data)
    point_trainer(config, out, run.settings.steps(task.name), run, f"fine-tune {task.name}")
    model = config["model"]["init_args"]
    model.update(backbone=None, pretrained=str(backbone))
    rates = dict(run.settings.finetune_learning_rates)
    if task.name in rates:
        model["learning_rate"] = rates[task.name]
    if "results_dir" in model:
        model["results_dir"] = None
    if "num_beams" in model:
        model["num_beams"] = run.settings.num_beams
    config["data"]["init_args"].update(image_size=run.settings.image_size, batch_size=run.settings.batch_size)
    return config


def train(name: str, config: Path, out: Path) -> Path:
    """``mmoe fit --config config``, resumed from ``out/checkpoints/last.ckpt`` when an earlier run left one;
    returns that checkpoint."""
    from mmoe.tasks.cli import lightning_command

    last = out / "checkpoints" / "last.ckpt"
    argv = ["fit", "--config", str(config)]
    if last.is_file():
        say(f"    resuming from {last}")
        argv += ["--ckpt_path", str(last)]
    call(name, lightning_command, argv)
    return last


# -- fine-tuning tasks -----------------------------------------------------------------------------------------------


def score_vqa(run: DemoRun, predictions: Path) -> dict:
    from mmoe.metrics.vqa import evaluate_vqa_files

    vqa = run.data / "vqav2"
    report = evaluate_vqa_files(
        vqa / "v2_OpenEnded_mscoco_val2014_questions.json", vqa / "v2_mscoco_val2014_annotations.json", predictions
    )
    return {"overall": report["overall"], "perAnswerType": report["perAnswerType"]}


def score_nlvr2(run: DemoRun, predictions: Path) -> dict:
    from mmoe.metrics.nlvr2 import evaluate_nlvr2_files

    return evaluate_nlvr2_files(run.data / "nlvr2" / "dev.json", predictions)


def score_captions(run: DemoRun, predictions: Path) -> dict:
    import warnings

    from mmoe.metrics.caption_words import word_precision
    from mmoe.metrics.captions import read_caption_files
    from mmoe.metrics.captions import score_captions as coco_scores

    # What `mmoe eval caption --karpathy ... --split test` computes, with the references and captions read once for
    # both the COCO metrics and the colour-word check.
    karpathy = run.data / "coco" / "karpathy" / "dataset_coco.json"
    references, captions = read_caption_files(predictions, karpathy=karpathy, split="test")
    with warnings.catch_warnings(), contextlib.redirect_stdout(_Sink()):  # pycocoevalcap prints its progress
        warnings.simplefilter("ignore", ResourceWarning)
        report = coco_scores(references, captions, meteor=False, spice=False)  # the table shows neither
    scores = {name: value for name, value in report.items() if isinstance(value, float)}
    colours = word_precision(captions, references)
    return scores | {"colour_word_precision": colours["precision"], "colour_word_chance": colours["chance"]}


def row(task: str, metric: str, value: float, chance: float, baseline: str) -> dict:
    return {"task": task, "metric": metric, "value": value, "chance": chance, "baseline": baseline}


def vqa_rows(scores: dict, chance: dict) -> list[dict]:
    prior = chance["vqav2_val_prior_accuracy"]["overall"]
    blind = chance["vqav2_val_question_prior_accuracy"]["overall"]
    baseline = f"top training answer per question type (VQA paper's prior); image-blind per question: {blind:.2f}"
    return [row("VQAv2 val", "accuracy (%)", scores["overall"], prior, baseline)]


def nlvr2_rows(scores: dict, chance: dict) -> list[dict]:
    levels = chance["nlvr2"]
    return [
        row("NLVR2 dev", "accuracy", scores["accuracy"], levels["accuracy_constant_answer"], "constant answer"),
        row("NLVR2 dev", "consistency", scores["consistency"], levels["consistency_random"], "random answers"),
    ]


def caption_rows(scores: dict, chance: dict) -> list[dict]:
    constant = chance["captioning_karpathy_test_constant_caption"]
    rows = [
        row("COCO captions Karpathy test", name, scores[name], constant[name], "most common training caption")
        for name in ("Bleu_4", "CIDEr")
    ]
    if "colour_word_precision" not in scores:  # scored by an older mmoe demo: no colour check in its marker
        return rows
    colours = row(
        "COCO captions Karpathy test", "colour words right (%)", round(100 * scores["colour_word_precision"], 2),
        round(100 * scores["colour_word_chance"], 2), "the same colour words on a random image",
    )  # fmt: skip
    return [*rows, colours]


@dataclass(frozen=True)
class FineTuneTask:
    """A benchmark the demo fine-tunes and scores.

    Attributes:
        name: the config's name (``configs/finetune/<name>_tiny.yaml``).
        eval_shards: the shard folder predicted on and scored.
        predictions: file name of the predictions.
        score: (run, predictions file) -> the official scores.
        rows: (scores, chance levels of synth.json) -> table rows.
    """

    name: str
    eval_shards: str
    predictions: str
    score: Callable[[DemoRun, Path], dict]
    rows: Callable[[dict, dict], list[dict]]


TASKS = (
    FineTuneTask("vqav2", "vqav2-val2014", "val_results.json", score_vqa, vqa_rows),
    FineTuneTask("nlvr2", "nlvr2-dev", "dev_predictions.csv", score_nlvr2, nlvr2_rows),
    FineTuneTask("captioning", "coco-karpathy-test", "test_captions.json", score_captions, caption_rows),
)


# -- the stages ------------------------------------------------------------------------------------------------------


def corpus_stage(run: DemoRun) -> Stage:
    from mmoe.data.cli import data_command

    def build() -> dict:
        quietly("corpus", data_command, ["synth", "--out", str(run.data), "--shards", *run.settings.synth])
        return {"files": [str(run.data / "synth.json"), str(run.shards)]}

    return Stage("corpus", run.shards / "pretrain-text" / "manifest.json", build)


def codebook_stage(run: DemoRun) -> Stage:
    from mmoe.tasks.cli import tokenizer_command

    def fit() -> dict:
        argv = ["fit", "--data", str(run.shards / "pretrain-images"), str(run.shards / "pretrain-pairs")]
        argv += ["--out", str(run.codebook), "--size", str(run.settings.codebook_size)]
        quietly("codebook", tokenizer_command, argv + ["--image-size", str(run.settings.image_size)])
        return {"files": [str(run.codebook)]}

    return Stage("codebook", run.codebook, fit)


def pretrain_stage(run: DemoRun, variant: str) -> Stage:
    out = run.variant(variant) / "pretrain"
    name = f"{variant}/pretrain"

    def fit() -> dict:
        config = write_config(pretrain_config(run, variant, out), out / "config.yaml")
        last = train(name, config, out)
        return {"files": [str(config), str(last), str(out / "routing_stats.json"), str(out / "csv")]}

    return Stage(name, out / "checkpoints" / "last.ckpt", fit)


def export_stage(run: DemoRun, variant: str) -> Stage:
    target = run.variant(variant) / "backbone_pretrained.pt"

    def export() -> dict:
        from mmoe.tasks.checkpoint import export_backbone, load_backbone

        export_backbone(load_backbone(run.variant(variant) / "pretrain" / "checkpoints" / "last.ckpt"), target)
        return {"files": [str(target)]}

    return Stage(f"{variant}/export", target, export)


def finetune_stage(run: DemoRun, variant: str, task: FineTuneTask) -> Stage:
    out = run.variant(variant) / task.name
    name = f"{variant}/{task.name}"

    def fit() -> dict:
        backbone = run.variant(variant) / "backbone_pretrained.pt"
        config = write_config(finetune_config(run, task, backbone, out), out / "config.yaml")
        last = train(name, config, out)
        return {"files": [str(config), str(last), str(out / "csv")]}

    return Stage(name, out / "checkpoints" / "last.ckpt", fit)


def evaluate_stage(run: DemoRun, variant: str, task: FineTuneTask) -> Stage:
    out = run.variant(variant) / task.name
    scores_file = out / "scores.json"

    def evaluate() -> dict:
        from mmoe.tasks.cli import lightning_command

        predictions = out / task.predictions
        argv = ["predict", "--config", str(out / "config.yaml"), "--ckpt_path", str(out / "checkpoints" / "last.ckpt")]
        argv += [f"--data.init_args.test_shards={run.shards / task.eval_shards}", "--trainer.logger=false"]
        call(
            f"{variant}/{task.name}-eval",
            lightning_command,
            argv + [f"--model.init_args.predictions_file={predictions}"],
        )
        scores = task.score(run, predictions)
        write_json_atomic(scores_file, scores)
        return {"scores": scores, "files": [str(predictions), str(scores_file)]}

    return Stage(f"{variant}/{task.name}-eval", scores_file, evaluate)


def figures_stage(run: DemoRun, variant: str) -> Stage:
    out = run.variant(variant) / "figures"
    pretrained = run.variant(variant) / "backbone_pretrained.pt"

    def draw() -> dict:
        from mmoe.tasks.checkpoint import export_backbone, load_backbone
        from mmoe.viz.cli import viz_command

        finetuned = run.variant(variant) / "backbone_vqav2.pt"
        export_backbone(load_backbone(run.variant(variant) / "vqav2" / "checkpoints" / "last.ckpt"), finetuned)
        images = str(run.shards / "coco-karpathy-test")
        argv = ["subtoken-map", "--ckpt", str(pretrained), "--ckpt", str(finetuned), "--images", images]
        quietly("figures", viz_command, argv + ["--out", str(out), "--num-images", str(run.settings.figure_images)])
        stats = run.variant(variant) / "pretrain" / "routing_stats.json"
        quietly("figures", viz_command, ["heatmap", "--stats", str(stats), "--out", str(out)])
        return {"files": [str(finetuned), *sorted(str(path) for path in out.glob("*.png"))]}

    return Stage(f"{variant}/figures", out / f"subtoken_map_{pretrained.stem}.png", draw)


def variant_stages(run: DemoRun, variant: str) -> list[Stage]:
    """The stages of one variant, in order (a dense backbone has no routing to draw)."""
    stages = [pretrain_stage(run, variant), export_stage(run, variant)]
    for task in TASKS:
        stages += [finetune_stage(run, variant, task), evaluate_stage(run, variant, task)]
    if variant != "dense":
        stages.append(figures_stage(run, variant))
    return stages


# -- results ---------------------------------------------------------------------------------------------------------


def variant_rows(run: DemoRun, variant: str, records: dict[str, dict]) -> list[dict]:
    chance = run.chance()
    rows = []
    for task in TASKS:
        rows += task.rows(records[f"{variant}/{task.name}-eval"]["result"]["scores"], chance)
    return rows


def number(value: float) -> str:
    return f"{value:.2f}" if abs(value) >= 2 else f"{value:.3f}"


def format_table(rows_by_variant: dict[str, list[dict]]) -> str:
    """A plain-text table: task, metric, one value column per variant, chance level and its baseline."""
    variants = list(rows_by_variant)
    first = rows_by_variant[variants[0]]
    header = ["task", "metric", *(variants if len(variants) > 1 else ["value"]), "chance", "chance baseline"]
    lines = [header]
    for index, base in enumerate(first):
        values = [number(rows_by_variant[v][index]["value"]) for v in variants]
        lines.append([base["task"], base["metric"], *values, number(base["chance"]), base["baseline"]])
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    return "\n".join("  ".join(cell.ljust(width) for cell, width in zip(line, widths, strict=True)).rstrip()
                     for line in lines)  # fmt: skip


def stage_files(records: dict[str, dict]) -> list[str]:
    return [path for record in records.values() for path in record["result"].get("files", [])]


def device_name() -> str:
    import torch

    return torch.cuda.get_device_name() if torch.cuda.is_available() else f"CPU, {torch.get_num_threads()} threads"


def results(run: DemoRun, variants: list[str], records: dict[str, dict], seconds: float) -> dict:
    """What ``DIR/results.json`` holds: settings, chance levels, per-variant rows, stage times and files."""
    return {
        "out": str(run.out),
        "settings": run.settings.to_json(),
        "variants": {variant: variant_rows(run, variant, records) for variant in variants},
        "chance": run.chance(),
        "stages": {
            name: {"seconds": record["seconds"], "reused": record["reused"]} for name, record in records.items()
        },
        "seconds_this_run": seconds,
        "device": device_name(),
        "files": stage_files(records),
    }


# -- the command -----------------------------------------------------------------------------------------------------


def check_settings(run: DemoRun) -> None:
    """Records the settings in ``DIR/demo.json``; a directory made with other settings is refused, not mixed."""
    path = run.out / "demo.json"
    settings = run.settings.to_json()
    if path.is_file():
        stored = json.loads(path.read_text()).get("settings")
        # A demo.json written before the precision option or the learning-rate overrides has neither: those runs
        # trained in 32-true with the configs' learning rates.
        older = {"precision": "32-true", "finetune_learning_rates": []}
        stored = older | stored if isinstance(stored, dict) else {}
        if stored != settings:
            keys = dict.fromkeys([*settings, *stored])
            changed = "; ".join(
                f"{key}: {stored.get(key)!r} there, {settings.get(key)!r} now"
                for key in keys
                if stored.get(key) != settings.get(key)
            )
            raise DemoError(
                f"{run.out} holds a demo run made with other settings ({changed}; see {path}): use another --out, "
                "or that run's --fast and --precision choices with the version that made it"
            )
        return
    run.out.mkdir(parents=True, exist_ok=True)
    write_json_atomic(path, {"settings": settings})


def parse(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="mmoe demo",
        description="Synthetic corpus -> codebook -> tiny MoE pre-training -> VQAv2 / NLVR2 / captioning fine-tuning "
        "and official scores -> routing maps. Finished stages are reused on a re-run.",
    )
    parser.add_argument("--out", default="runs/demo", help="output directory (default runs/demo)")
    parser.add_argument("--variant", choices=(*VARIANTS, "all"), default="mhmoe", help="MoE variant (default mhmoe)")
    parser.add_argument("--fast", action="store_true", help="smaller corpus, model and step counts (for tests)")
    parser.add_argument(
        "--precision",
        choices=("32-true", "bf16-mixed", "16-mixed"),
        default="32-true",
        help="Lightning precision of every training and prediction stage (default 32-true; bf16-mixed on a GPU)",
    )
    return parser.parse_args(list(argv))


def demo_command(argv: Sequence[str]) -> int:
    """Runs ``mmoe demo``; returns 0, or 1 when a stage fails (the message names it)."""
    args = parse(argv)
    if args.precision == "16-mixed":
        import torch

        if not torch.cuda.is_available():  # Lightning would quietly train in bf16 instead
            print("mmoe demo: error: --precision 16-mixed needs a CUDA GPU; use bf16-mixed on a CPU", file=sys.stderr)
            return 2
    run = DemoRun(Path(args.out), dataclasses.replace(FAST if args.fast else FULL, precision=args.precision))
    variants = list(VARIANTS) if args.variant == "all" else [args.variant]
    for name in ("lightning.pytorch", "lightning.fabric"):
        logging.getLogger(name).setLevel(logging.WARNING)
    start = time.perf_counter()
    try:
        check_settings(run)
        stages = [corpus_stage(run), codebook_stage(run)]
        for variant in variants:
            stages += variant_stages(run, variant)
        records = {stage.name: run_stage(run, stage) for stage in stages}
    except DemoError as error:
        print(f"mmoe demo: error: {error}", file=sys.stderr)
        return 1
    report = results(run, variants, records, time.perf_counter() - start)
    write_json_atomic(run.out / "results.json", report)
    say(f"\nResults ({report['seconds_this_run']:.0f} s this run, {report['device']})\n")
    say(format_table(report["variants"]))
    say("\nFiles:")
    for path in [*report["files"], str(run.out / "results.json")]:
        say(f"  {path}")
    return 0
