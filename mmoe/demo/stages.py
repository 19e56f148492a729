"""The demo's stages: each a call of mmoe's own commands or Python APIs, done once and reused (a marker per stage).
Training and prediction run ``mmoe fit`` / ``predict`` with a config shipped in ``mmoe/configs`` and command-line
overrides that point it at the run directory (each marker keeps the command)."""

from __future__ import annotations

import contextlib
import json
import shlex
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import lightning as L
import yaml

from mmoe.atomic import write_json_atomic
from mmoe.demo.report import caption_rows, nlvr2_rows, say, vqa_rows
from mmoe.demo.settings import CONFIG_DATA_ROOT, CONFIGS, DemoError, DemoRun, DemoSettings


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
        with warnings.catch_warnings():  # LightningCLI warns that these arguments are not the process's own
            warnings.filterwarnings("ignore", message="LightningCLI's args parameter")
            code = command(argv)
    except SystemExit as stop:  # argparse / LightningCLI exit on bad configs
        code = stop.code if isinstance(stop.code, int) else 1
    if code not in (0, None):
        raise DemoError(f"stage {name}: `{shlex.join(['mmoe', *argv])}` exited with status {code}")


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


def config_file(relative: str) -> Path:
    """A config shipped with the package (``mmoe/configs/<relative>``)."""
    path = CONFIGS / relative
    if not path.is_file():
        raise DemoError(f"config {path} does not exist (mmoe demo reads the configs shipped in the mmoe package)")
    return path


def repoint(value, data: Path):
    """``value`` with every path under the configs' ``data/synthetic`` moved to ``data`` (recursively)."""
    if isinstance(value, dict):
        return {key: repoint(item, data) for key, item in value.items()}
    if isinstance(value, list):
        return [repoint(item, data) for item in value]
    if isinstance(value, str) and (value == CONFIG_DATA_ROOT or value.startswith(CONFIG_DATA_ROOT + "/")):
        return str(data) + value[len(CONFIG_DATA_ROOT) :]
    return value


def corpus_arguments(config: Path, data: Path) -> list[str]:
    """``--key=value`` for every value of ``config`` that names a path under ``data/synthetic``, moved to ``data``
    (the config is read, not rewritten)."""

    def walk(value, key: str) -> list[str]:
        if isinstance(value, dict):
            return [argument for name, item in value.items() for argument in walk(item, f"{key}.{name}".lstrip("."))]
        moved = repoint(value, data)
        return [] if moved == value else [option(key, moved)]

    return walk(yaml.safe_load(config.read_text()), "")


def option(key: str, value) -> str:
    """``--key=value``: a string or path as it is, anything else (numbers, booleans, None, lists) as JSON."""
    return f"--{key}={value if isinstance(value, str | Path) else json.dumps(value)}"


def trainer_arguments(
    run: DemoRun, out: Path, steps: int, label: str, routing_every: int, extra_callbacks: Sequence[dict] = ()
) -> list[str]:
    """The trainer of a demo stage: ``steps`` steps without validation, one CSV logger, the latest checkpoint as
    ``out/checkpoints/last.ckpt``, routing statistics every ``routing_every`` steps in ``out``, progress lines
    instead of a progress bar, and ``extra_callbacks`` (``{"class_path": ..., "init_args": ...}``)."""
    csv = {"save_dir": str(out), "name": "csv", "version": 0}
    logger = {"class_path": "lightning.pytorch.loggers.CSVLogger", "init_args": csv}
    callbacks = [
        {
            "class_path": "lightning.pytorch.callbacks.ModelCheckpoint",  # no validation metric: keep only the latest
            "init_args": {
                "dirpath": str(out / "checkpoints"),
                "save_top_k": 0,
                "save_last": True,
                "every_n_train_steps": run.settings.checkpoint_every,
            },
        },
        {"class_path": "lightning.pytorch.callbacks.LearningRateMonitor", "init_args": {"logging_interval": "step"}},
        {
            "class_path": "mmoe.tasks.routing_callback.RoutingStatsCallback",
            "init_args": {"every_n_steps": routing_every, "save_dir": str(out)},
        },
        {"class_path": f"{__name__}.StepProgress", "init_args": {"label": label, "every_n_steps": max(10, steps // 6)}},
        *extra_callbacks,
    ]
    trainer = {"max_steps": steps, "val_check_interval": steps, "limit_val_batches": 0, "default_root_dir": out,
               "enable_progress_bar": False, "enable_model_summary": False, "precision": run.settings.precision,
               "logger": [logger], "callbacks": callbacks}  # fmt: skip
    return [option(f"trainer.{key}", value) for key, value in trainer.items()]


def pretrain_arguments(
    run: DemoRun, variant: str, out: Path, steps: int | None = None, extra_callbacks: Sequence[dict] = ()
) -> list[str]:
    """``mmoe fit`` arguments: ``configs/pretrain/tiny_<variant>.yaml`` pointed at the demo's corpus (its codebook
    included) and ``out``, for ``steps`` (default the settings' ``pretrain_steps``)."""
    config = config_file(f"pretrain/tiny_{variant}.yaml")
    steps = run.settings.pretrain_steps if steps is None else steps
    backbone = {**dict(run.settings.backbone), "image_size": run.settings.image_size}
    label = f"pretrain {out.name if out.name != 'pretrain' else variant}"
    return [
        "--config",
        str(config),
        *corpus_arguments(config, run.data),
        *trainer_arguments(run, out, steps, label, routing_every=50, extra_callbacks=extra_callbacks),
        *(option(f"model.init_args.backbone.{key}", value) for key, value in backbone.items()),
        option("data.init_args.batch_size", run.settings.batch_size),
        option("data.init_args.batches_per_epoch", steps),
    ]


def finetune_arguments(
    run: DemoRun, task: FineTuneTask, backbone: Path, out: Path, seed: int | None = None, routing_every: int = 20
) -> list[str]:
    """``mmoe fit`` / ``predict`` arguments: ``configs/finetune/<task>_tiny.yaml`` pointed at the demo's corpus and
    ``out``, starting from ``backbone`` (whose architecture it keeps); ``seed`` replaces the config's
    ``seed_everything``; routing statistics every ``routing_every`` steps."""
    config = config_file(f"finetune/{task.name}_tiny.yaml")
    steps = run.settings.steps(task.name)
    arguments = [
        "--config",
        str(config),
        *corpus_arguments(config, run.data),
        *trainer_arguments(run, out, steps, f"fine-tune {task.name}", routing_every=routing_every),
        option("model.init_args.backbone", None),
        option("model.init_args.pretrained", backbone),
        option("data.init_args.batch_size", run.settings.batch_size),
        *task.arguments(run.settings),
    ]
    rates = dict(run.settings.finetune_learning_rates)
    if task.name in rates:
        arguments.append(option("model.init_args.optimizer.learning_rate", rates[task.name]))
    if seed is not None:
        arguments.append(option("seed_everything", seed))
    return arguments


def command_line(subcommand: str, arguments: list[str]) -> str:
    """The ``mmoe`` command a stage runs, as a shell would take it."""
    return shlex.join(["mmoe", subcommand, *arguments])


def train(name: str, arguments: list[str], out: Path) -> dict:
    """``mmoe fit <arguments>``, resumed from ``out/checkpoints/last.ckpt`` when an earlier run left one; returns
    the command and that checkpoint."""
    from mmoe.tasks.cli import lightning_command

    last = out / "checkpoints" / "last.ckpt"
    resume = ["--ckpt_path", str(last)] if last.is_file() else []
    if resume:
        say(f"    resuming from {last}")
    call(name, lightning_command, ["fit", *arguments, *resume])
    return {"command": command_line("fit", arguments), "files": [str(last), str(out / "csv")]}


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


@dataclass(frozen=True)
class FineTuneTask:
    """A benchmark the demo fine-tunes and scores.

    Attributes:
        name: the config's name (``configs/finetune/<name>_tiny.yaml``).
        arguments: (settings) -> the task's own options of ``mmoe fit`` / ``predict``.
        eval_shards: the shard folder predicted on and scored.
        predictions: file name of the predictions.
        score: (run, predictions file) -> the official scores.
        rows: (scores, chance levels of synth.json) -> table rows.
    """

    name: str
    arguments: Callable[[DemoSettings], list[str]]
    eval_shards: str
    predictions: str
    score: Callable[[DemoRun, Path], dict]
    rows: Callable[[dict, dict], list[dict]]


def caption_arguments(settings: DemoSettings) -> list[str]:
    """Beam search of the demo's width; no caption files at validation (the demo does not validate)."""
    return [option("model.init_args.num_beams", settings.num_beams), option("model.init_args.results_dir", None)]


def no_arguments(settings: DemoSettings) -> list[str]:
    return []


TASKS = (
    FineTuneTask("vqav2", no_arguments, "vqav2-val2014", "val_results.json", score_vqa, vqa_rows),
    FineTuneTask("nlvr2", no_arguments, "nlvr2-dev", "dev_predictions.csv", score_nlvr2, nlvr2_rows),
    FineTuneTask(
        "captioning", caption_arguments, "coco-karpathy-test", "test_captions.json", score_captions, caption_rows
    ),
)


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
        record = train(name, pretrain_arguments(run, variant, out), out)
        return record | {"files": [*record["files"], str(out / "routing_stats.json")]}

    return Stage(name, out / "checkpoints" / "last.ckpt", fit)


def pretrained_backbone(run: DemoRun, variant: str) -> Path:
    return run.variant(variant) / "backbone_pretrained.pt"


def export_stage(run: DemoRun, variant: str) -> Stage:
    checkpoint = run.variant(variant) / "pretrain" / "checkpoints" / "last.ckpt"
    return exporting(f"{variant}/export", checkpoint, pretrained_backbone(run, variant))


def exporting(name: str, checkpoint: Path, target: Path) -> Stage:
    """The backbone of a training checkpoint as an exported backbone file."""

    def export() -> dict:
        from mmoe.tasks.checkpoint import export_backbone, load_backbone

        export_backbone(load_backbone(checkpoint), target)
        return {"files": [str(target)]}

    return Stage(name, target, export)


def finetune_stage(run: DemoRun, variant: str, task: FineTuneTask) -> Stage:
    out = run.variant(variant) / task.name
    return fine_tuning(run, f"{variant}/{task.name}", task, pretrained_backbone(run, variant), out)


def fine_tuning(
    run: DemoRun,
    name: str,
    task: FineTuneTask,
    backbone: Path,
    out: Path,
    seed: int | None = None,
    routing_every: int = 20,
) -> Stage:
    """``mmoe fit`` of ``task`` from ``backbone`` into ``out`` (``seed``: the config's when None), routing statistics
    every ``routing_every`` steps."""

    def fit() -> dict:
        return train(name, finetune_arguments(run, task, backbone, out, seed, routing_every), out)

    return Stage(name, out / "checkpoints" / "last.ckpt", fit)


def evaluate_stage(run: DemoRun, variant: str, task: FineTuneTask) -> Stage:
    out = run.variant(variant) / task.name
    return evaluation(run, f"{variant}/{task.name}-eval", task, pretrained_backbone(run, variant), out)


def evaluation(
    run: DemoRun, name: str, task: FineTuneTask, backbone: Path, out: Path, seed: int | None = None
) -> Stage:
    """``mmoe predict`` of the fine-tuning in ``out`` (from ``backbone``) on the task's evaluation split, scored by the
    official scorers into ``out/scores.json``."""
    scores_file = out / "scores.json"

    def evaluate() -> dict:
        from mmoe.tasks.cli import lightning_command

        predictions = out / task.predictions
        arguments = finetune_arguments(run, task, backbone, out, seed)
        arguments += ["--ckpt_path", str(out / "checkpoints" / "last.ckpt"), option("trainer.logger", False)]
        arguments += [option("data.init_args.test_shards", run.shards / task.eval_shards)]
        arguments += [option("model.init_args.predictions_file", predictions)]
        call(name, lightning_command, ["predict", *arguments])
        scores = task.score(run, predictions)
        write_json_atomic(scores_file, scores)
        command = command_line("predict", arguments)
        return {"scores": scores, "command": command, "files": [str(predictions), str(scores_file)]}

    return Stage(name, scores_file, evaluate)


def figures_stage(run: DemoRun, variant: str) -> Stage:
    out = run.variant(variant) / "figures"
    pretrained = pretrained_backbone(run, variant)

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


def variant_rows(run: DemoRun, variant: str, records: dict[str, dict]) -> list[dict]:
    chance = run.chance()
    rows = []
    for task in TASKS:
        rows += task.rows(records[f"{variant}/{task.name}-eval"]["result"]["scores"], chance)
    return rows
