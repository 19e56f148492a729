"""The demo's stages: each a call of mmoe's own commands or Python APIs, done once and reused (a marker per stage),
with the configs it writes from ``mmoe/configs`` pointed at the run directory."""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import lightning as L
import yaml

from mmoe.atomic import write_json_atomic
from mmoe.demo.report import caption_rows, nlvr2_rows, say, vqa_rows
from mmoe.demo.settings import CONFIG_DATA_ROOT, CONFIGS, DemoError, DemoRun


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
        code = command(argv)
    except SystemExit as stop:  # argparse / LightningCLI exit on bad configs
        code = stop.code if isinstance(stop.code, int) else 1
    if code not in (0, None):
        raise DemoError(f"stage {name}: `mmoe {' '.join(argv)}` exited with status {code}")


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


def variant_rows(run: DemoRun, variant: str, records: dict[str, dict]) -> list[dict]:
    chance = run.chance()
    rows = []
    for task in TASKS:
        rows += task.rows(records[f"{variant}/{task.name}-eval"]["result"]["scores"], chance)
    return rows
