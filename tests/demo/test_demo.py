"""``mmoe demo``: stage markers and reuse (fast), and the whole pipeline on a reduced setting (slow)."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mmoe.cli import main
from mmoe.config.launch import read_config
from mmoe.config.run_spec import read_spec, spec_callbacks
from mmoe.data.synth.scenes import COLORS
from mmoe.metrics.caption_words import word_precision
from mmoe.metrics.captions import load_karpathy_references
from mmoe.metrics.nlvr2 import evaluate_nlvr2_files
from mmoe.metrics.retrieval import evaluate_retrieval_file
from mmoe.metrics.vqa import evaluate_vqa_files
from mmoe.pipeline import (
    CONFIGS,
    PipelineError,
    PipelineRun,
    Stage,
    StageKey,
    benchmark_named,
    finetune_spec,
    predict_spec,
    pretrain_spec,
    run_stage,
)
from mmoe.pipeline.benchmarks import trained_benchmarks
from mmoe.pipeline.compare import compared_files
from mmoe.pipeline.settings import DEMO as FULL
from mmoe.pipeline.settings import DEMO_FAST as FAST
from mmoe.pipeline.settings import record_demo_settings
from mmoe.pipeline.tables import format_table
from mmoe.runtime.routing_callback import RoutingStatsCallback
from tests.tutorial_commands import tutorial_demo_argv

#: The benchmarks the demo fine-tunes (both presets give the same steps).
DEMO_BENCHMARKS = trained_benchmarks(FAST)


def check_settings(run: PipelineRun) -> None:
    record_demo_settings(run.out, run.settings)


def writing_stage(path: Path, calls: list[int]) -> Stage:
    def run() -> dict:
        calls.append(1)
        path.write_text("done")
        return {"files": [str(path)]}

    return Stage(StageKey.of("variant", "step"), path, run)


def test_a_done_stage_is_reused_and_a_stage_without_marker_reruns(tmp_path):
    run, calls = PipelineRun(tmp_path, FAST), []
    stage = writing_stage(tmp_path / "output.txt", calls)
    first = run_stage(run, stage)
    assert calls == [1] and not first["reused"] and first["result"]["files"] == [str(tmp_path / "output.txt")]
    assert json.loads((tmp_path / "stages" / "variant-step.json").read_text())["stage"] == "variant/step"
    assert run_stage(run, stage)["reused"] and calls == [1]
    (tmp_path / "stages" / "variant-step.json").unlink()  # interrupted before the marker: the stage runs again
    assert not run_stage(run, stage)["reused"] and calls == [1, 1]


def test_a_stage_that_writes_nothing_is_an_error_and_leaves_no_marker(tmp_path):
    run = PipelineRun(tmp_path, FAST)
    with pytest.raises(PipelineError, match="without writing"):
        run_stage(run, Stage(StageKey.of("empty"), tmp_path / "never.txt", dict))
    assert not (tmp_path / "stages" / "empty.json").exists()


def test_a_directory_made_with_other_settings_is_refused(tmp_path):
    check_settings(PipelineRun(tmp_path, FAST))
    check_settings(PipelineRun(tmp_path, FAST))  # same settings: fine
    with pytest.raises(PipelineError, match="other settings") as refused:
        check_settings(PipelineRun(tmp_path, FULL))
    # The message names what differs, e.g. the step counts of a run folder made by an older version.
    assert f"codebook_size: {FAST.codebook_size} there, {FULL.codebook_size} now" in str(refused.value)
    assert "precision:" not in str(refused.value)  # equal in both: not listed


def stage_specs(run: PipelineRun, variant: str = "mhmoe") -> dict:
    """The ``mmoe fit`` run specs of the demo's training stages."""
    launches = {"pretrain": pretrain_spec(run, variant, run.pretraining(variant), run.settings.pretrain_steps)}
    for benchmark in DEMO_BENCHMARKS:
        layout = run.finetuning(variant, benchmark.name)
        model = benchmark.model_options(run)
        steps = run.settings.steps(benchmark.name)
        launches[benchmark.name] = finetune_spec(run, benchmark.task, model, run.backbone(variant), layout, steps)
    return launches


def stage_configs(run: PipelineRun, variant: str = "mhmoe") -> dict:
    """The configs ``mmoe fit`` runs in the demo's training stages, parsed by the CLI's own parser."""
    return {name: read_spec(launch) for name, launch in stage_specs(run, variant).items()}


def test_precision_reaches_every_stage_and_is_part_of_the_settings(tmp_path):
    bf16 = PipelineRun(tmp_path, dataclasses.replace(FAST, precision="bf16-mixed"))
    assert {config.trainer.precision for config in stage_configs(bf16).values()} == {"bf16-mixed"}
    check_settings(bf16)
    with pytest.raises(PipelineError, match="other settings"):
        check_settings(PipelineRun(tmp_path, FAST))


def test_stage_specs_point_the_shipped_configs_at_the_run_directory(tmp_path):
    from lightning.pytorch.callbacks import ModelCheckpoint

    run = PipelineRun(tmp_path, FAST)
    launches = stage_specs(run)
    configs = {name: read_spec(launch) for name, launch in launches.items()}
    pretrain = configs["pretrain"]
    assert pretrain.model.init_args.visual_codebook == str(run.codebook)
    assert pretrain.data.init_args.data_root == str(run.data)
    assert pretrain.data.init_args.image_shards == "shards/pretrain-images"  # the config's, under data_root
    assert pretrain.data.init_args.batches_per_epoch == pretrain.trainer.max_steps == FAST.pretrain_steps
    assert pretrain.model.init_args.backbone.image_size == FAST.image_size
    # The pre-training objective of the settings: contrastive loss, captions' MLM vocabulary, learning rate.
    assert pretrain.model.init_args.contrastive_coefficient == FAST.contrastive_coefficient > 0
    assert (
        pretrain.model.init_args.output_vocab
        == str(run.corpus.caption_tokens)
        == configs["captioning"].model.init_args.output_vocab
    )
    assert pretrain.model.init_args.optimizer.learning_rate == FAST.pretrain_learning_rate
    plain = stage_specs(
        PipelineRun(
            tmp_path,
            FAST.replace(pretrain_learning_rate=None, contrastive_coefficient=0.0, pretrain_output_vocab=False),
        )
    )
    plain = read_spec(plain["pretrain"])
    assert plain.model.init_args.contrastive_coefficient == 0 and plain.model.init_args.output_vocab is None
    assert plain.model.init_args.optimizer.learning_rate == 1e-3  # the tiny config's
    for name, config in configs.items():
        out = tmp_path / "pretrain" / "mhmoe" if name == "pretrain" else tmp_path / "finetune" / "mhmoe" / name
        assert config.trainer.default_root_dir == str(out) and config.data.init_args.batch_size == FAST.batch_size
        assert [logger.init_args.save_dir for logger in config.trainer.logger] == [str(out)]
        assert config.trainer.callbacks == []  # the config's own callbacks are replaced by the launch's objects
        callbacks = {type(callback): callback for callback in spec_callbacks(launches[name])}
        assert Path(callbacks[ModelCheckpoint].dirpath) == out / "checkpoints"
        assert callbacks[RoutingStatsCallback].save_dir == out
        label = "pretrain mhmoe" if name == "pretrain" else f"fine-tune {name}"
        assert config.throughput.label == label and config.throughput.every_n_steps >= 10  # the progress lines
        # No path is left pointing at the configs' own corpus or run folders.
        assert not [text for text in strings(config) if text.startswith(("data/synthetic", "runs/"))]
    for benchmark in DEMO_BENCHMARKS:
        model = configs[benchmark.name].model.init_args
        assert model.backbone is None and model.pretrained == str(tmp_path / "pretrain" / "mhmoe" / "backbone.pt")
        assert configs[benchmark.name].trainer.max_steps == FAST.steps(benchmark.name)
    assert configs["captioning"].model.init_args.num_beams == FAST.num_beams
    assert configs["vqav2"].model.init_args.answer_vocab == str(run.shards / "vqav2-train2014" / "answers.json")
    assert configs["retrieval"].data.init_args.train_shards == "shards/flickr30k-karpathy-train"  # under data_root


def test_a_prediction_launch_reads_the_fine_tuning_checkpoint_and_writes_where_asked(tmp_path):
    run = PipelineRun(tmp_path, FAST)
    layout = run.finetuning("mhmoe", "vqav2")
    fit = stage_specs(run)["vqav2"]
    predict = predict_spec(fit, run.shards / "vqav2-val2014", layout.predictions("answers.json"))
    config = read_spec(predict)
    assert config.ckpt_path == str(layout.last_checkpoint) and config.trainer.logger is False
    assert config.model.init_args.predictions_file == str(layout.root / "answers.json")
    assert config.data.init_args.test_shards == str(run.shards / "vqav2-val2014")
    recorded = json.loads(json.dumps(predict.to_json()))  # what the marker records, after parsing too
    assert recorded["checkpoint"] == str(layout.last_checkpoint)
    assert recorded["trainer"]["logged"] is False and recorded["subcommand"] == "predict"


def test_retrieval_is_predicted_on_the_flickr30k_test_split_into_an_embeddings_file(tmp_path):
    run = PipelineRun(tmp_path, FAST)
    layout = run.finetuning("mhmoe", "retrieval")
    benchmark = next(b for b in DEMO_BENCHMARKS if b.name == "retrieval")
    predictions = layout.predictions(benchmark.predictions)
    config = read_spec(predict_spec(stage_specs(run)["retrieval"], run.shards / benchmark.eval_split, predictions))
    assert config.model.class_path == "mmoe.tasks.retrieval.RetrievalFineTuning"
    assert config.model.init_args.predictions_file == str(layout.root / "test_embeddings.pt")
    assert config.data.init_args.test_shards == str(run.shards / "flickr30k-karpathy-test")
    assert config.ckpt_path == str(layout.last_checkpoint)


def test_a_benchmark_without_steps_in_the_settings_has_no_stages(tmp_path):
    """The demo fine-tunes every benchmark of its settings' ``finetune_steps`` (retrieval included); settings without
    retrieval's steps (the claims study's) run the other three."""
    from mmoe.demo.recipe import random_init_stages, variant_stages

    keys = [str(stage.key) for stage in variant_stages(PipelineRun(tmp_path, FAST), "mhmoe")]
    assert keys[-3:] == ["mhmoe/retrieval", "mhmoe/retrieval/eval", "mhmoe/figures"]
    steps = {name: count for name, count in FAST.finetune_steps.items() if name != "retrieval"}
    without = PipelineRun(tmp_path, FAST.replace(finetune_steps=steps))
    keys = [str(stage.key) for stage in [*variant_stages(without, "mhmoe"), *random_init_stages(without, "mhmoe")]]
    assert not [key for key in keys if "retrieval" in key] and "mhmoe/captioning/eval" in keys


def test_retrieval_scores_are_the_official_scorers_beside_a_random_rankings(tmp_path):
    """The demo's retrieval scores equal ``mmoe eval retrieval``'s on the embeddings file, and its chance levels are
    a random ranking's of the test split in the Karpathy file: 1 / images (text -> image), captions per image /
    captions (image -> text)."""
    from mmoe.metrics.retrieval import evaluate_retrieval_file
    from mmoe.pipeline.benchmarks import retrieval_rows, score_retrieval
    from mmoe.tasks.retrieval import stack_embeddings

    run = PipelineRun(tmp_path, FAST)
    captions_per_image = [5, 5, 4, 5, 3, 5]
    split = [{"split": "train", "sentences": [{"raw": "a"}] * 5}]  # not scored
    split += [{"split": "test", "sentences": [{"raw": f"caption {i}"}] * count} for i, count in
              enumerate(captions_per_image)]  # fmt: skip
    (run.data / "flickr30k").mkdir(parents=True)
    (run.data / "flickr30k" / "dataset_flickr30k.json").write_text(json.dumps({"images": split}))
    generator = torch.Generator().manual_seed(0)
    images = torch.nn.functional.normalize(torch.randn(6, 16, generator=generator), dim=-1)
    entries = []
    for i, count in enumerate(captions_per_image):  # captions near their image, one image's far from it
        noise = torch.randn(count, 16, generator=generator) * (0.5 if i != 2 else 3.0)
        captions = torch.nn.functional.normalize(images[i] + noise, dim=-1)
        entries.append((100 + i, images[i], captions, [f"caption {i}"] * count))
    predictions = tmp_path / "test_embeddings.pt"
    torch.save(stack_embeddings(entries), predictions)

    scores = score_retrieval(run, predictions)
    official = evaluate_retrieval_file(predictions)
    assert {name: scores[name] for name in official} == official
    chance = scores["random_ranking"]
    assert chance["t2i_r1"] == pytest.approx(1 / 6)
    assert chance["i2t_r1"] == pytest.approx(sum(count / 27 for count in captions_per_image) / 6)
    rows = {row["metric"]: row for row in retrieval_rows(scores, None)}
    assert list(rows) == ["image->text R@1", "text->image R@1", "mean recall (R@1/5/10)"]
    assert (rows["image->text R@1"]["value"], rows["image->text R@1"]["chance"]) == (official["i2t_r1"],
                                                                                   chance["i2t_r1"])  # fmt: skip
    assert (rows["text->image R@1"]["value"], rows["text->image R@1"]["chance"]) == (official["t2i_r1"],
                                                                                   chance["t2i_r1"])  # fmt: skip
    assert rows["mean recall (R@1/5/10)"]["chance"] == chance["mean_recall"] < official["mean_recall"]


def strings(value) -> list[str]:
    """Every string in a parsed config, recursively."""
    if hasattr(value, "__dict__"):
        value = vars(value)
    if isinstance(value, dict):
        return [text for item in value.values() for text in strings(item)]
    if isinstance(value, list | tuple):
        return [text for item in value for text in strings(item)]
    return [value] if isinstance(value, str) else []


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU refusal")
def test_fp16_precision_without_a_gpu_is_refused(tmp_path, capsys):
    assert main(["demo", "--out", str(tmp_path / "demo"), "--fast", "--precision", "16-mixed"]) == 2
    assert "16-mixed needs a CUDA GPU" in capsys.readouterr().err
    assert not (tmp_path / "demo").exists()


def test_a_directory_from_before_the_precision_option_counts_as_32_true(tmp_path):
    settings = FAST.to_json()
    del settings["precision"]
    (tmp_path / "demo.json").write_text(json.dumps({"settings": settings}))
    check_settings(PipelineRun(tmp_path, FAST))
    with pytest.raises(PipelineError, match="other settings"):
        check_settings(PipelineRun(tmp_path, dataclasses.replace(FAST, precision="bf16-mixed")))


def older_form(settings: dict, optimizer_fields: tuple[str, ...]) -> dict:
    """``settings`` as a ``demo.json`` of an older version stored them: the corpus options as ``mmoe data synth``
    arguments, the per-task optimiser options in one field each of ``optimizer_fields`` (absent otherwise), and the
    per-name fields as lists of ``[name, value]`` pairs."""
    old = {key: value for key, value in settings.items() if key not in ("corpus_size", "nlvr2_eval_sets")}
    old["synth"] = ["--size", settings["corpus_size"]]
    if settings["nlvr2_eval_sets"] is not None:
        old["synth"] += ["--nlvr2-eval-sets", str(settings["nlvr2_eval_sets"])]
    optimizer = old.pop("finetune_optimizer")
    names = {"finetune_learning_rates": "learning_rate", "finetune_head_lr_multipliers": "head_lr_multiplier",
             "finetune_layer_decays": "layer_decay"}  # fmt: skip
    for field in optimizer_fields:
        old[field] = [[task, options[names[field]]] for task, options in optimizer.items() if names[field] in options]
    old["backbone"] = [[name, value] for name, value in settings["backbone"].items()]
    old["finetune_steps"] = [[name, value] for name, value in settings["finetune_steps"].items()]
    return old


def test_a_directory_from_an_older_version_is_the_same_run(tmp_path):
    """A ``demo.json`` that stored the corpus as command-line options, the optimiser overrides as three per-task
    fields and the per-name fields as pairs holds the same settings; another value is still refused."""
    fields = ("finetune_learning_rates", "finetune_head_lr_multipliers", "finetune_layer_decays")
    (tmp_path / "demo.json").write_text(json.dumps({"settings": older_form(FULL.to_json(), fields)}))
    check_settings(PipelineRun(tmp_path, FULL))
    with pytest.raises(PipelineError, match="finetune_steps"):
        check_settings(PipelineRun(tmp_path, FULL.replace(finetune_steps={**FULL.finetune_steps, "nlvr2": 1})))
    with pytest.raises(PipelineError, match="nlvr2_eval_sets"):
        check_settings(PipelineRun(tmp_path, FULL.replace(nlvr2_eval_sets=None)))


def test_a_directory_from_before_the_optimiser_overrides_used_the_configs_values(tmp_path):
    configs_values = FULL.replace(finetune_optimizer={})
    (tmp_path / "demo.json").write_text(json.dumps({"settings": older_form(configs_values.to_json(), ())}))
    check_settings(PipelineRun(tmp_path, configs_values))
    with pytest.raises(PipelineError, match="finetune_optimizer"):
        check_settings(PipelineRun(tmp_path, FULL))


def test_an_optimiser_override_must_name_an_optimizer_config_field():
    with pytest.raises(ValueError, match="'learning_rat' is not an OptimizerConfig field"):
        FULL.replace(finetune_optimizer={"vqav2": {"learning_rat": 1e-3}})


def test_fine_tuning_learning_rate_overrides_replace_only_their_tasks_rate(tmp_path):
    optimizers = {
        name: config.model.init_args.optimizer for name, config in stage_configs(PipelineRun(tmp_path, FAST)).items()
    }
    shipped = {
        benchmark.name: read_config(
            [str(CONFIGS / f"finetune/{benchmark.name}_tiny.yaml")]
        ).fit.model.init_args.optimizer
        for benchmark in DEMO_BENCHMARKS
    }
    vqa = FAST.finetune_optimizer["vqav2"]
    assert optimizers["vqav2"].learning_rate == vqa["learning_rate"] != shipped["vqav2"].learning_rate
    assert optimizers["vqav2"].head_lr_multiplier == vqa["head_lr_multiplier"] != 1.0
    assert optimizers["vqav2"].layer_decay == vqa["layer_decay"] != 1.0
    for name in ("nlvr2", "captioning", "retrieval"):
        assert optimizers[name].learning_rate == shipped[name].learning_rate
        assert optimizers[name].head_lr_multiplier == shipped[name].head_lr_multiplier
        assert optimizers[name].layer_decay == shipped[name].layer_decay
    assert shipped["vqav2"].head_lr_multiplier == 1.0 == shipped["vqav2"].layer_decay


def test_fine_tunings_evaluations_and_figures_are_the_pool_jobs_and_wait_for_what_they_read(tmp_path, capfd):
    """The jobs of the pool's processes: each benchmark's fit (its steps its cost), its evaluation after it, and the
    routing figures after the VQA fit; every other stage runs before them in the main process. The pool then hands
    the long fits out first and an evaluation when no fit is ready."""
    from mmoe.demo.recipe import SHORT_JOB, pool_jobs, random_init_stages, variant_stages
    from mmoe.pipeline.pool import chain_costs

    run = PipelineRun(tmp_path, FAST)
    jobs = pool_jobs(run, "mhmoe", random_init=True)
    benchmarks = ["vqav2", "nlvr2", "captioning", "retrieval"]
    assert [FAST.steps(name) for name in benchmarks] == [300, 150, 500, 100]
    fits = [f"mhmoe/{name}" for name in benchmarks] + [f"mhmoe/random-init/{name}" for name in benchmarks]
    expected = []
    for fit, steps in zip(fits, [300, 150, 500, 100] * 2, strict=True):
        expected += [(fit, steps, ()), (f"{fit}/eval", SHORT_JOB, (fit,))]
    expected.append(("mhmoe/figures", SHORT_JOB, ("mhmoe/vqav2",)))
    assert [(job.name, job.cost, job.after) for job in jobs] == expected
    stages = variant_stages(run, "mhmoe") + random_init_stages(run, "mhmoe")
    assert sorted(str(stage.key) for stage in stages) == sorted(
        [job.name for job in jobs] + ["mhmoe/pretrain", "mhmoe/export", "mhmoe/random-init/init"]
    )
    assert [job.name for job in pool_jobs(run, "dense")][-1] == "dense/retrieval/eval"  # no routing to draw
    chains = chain_costs(pool_jobs(run, "mhmoe"))
    assert sorted(chains, key=lambda name: -chains[name])[:4] == [
        "mhmoe/captioning",
        "mhmoe/vqav2",
        "mhmoe/nlvr2",
        "mhmoe/retrieval",
    ]

    assert main(["demo", "--fast", "--out", str(tmp_path), "--stages", "mhmoe/nope"]) == 2
    assert "--stages mhmoe/nope: no stage of this run" in capfd.readouterr().err
    assert main(["demo", "--fast", "--out", str(tmp_path), "--stages", "mhmoe/vqav2", "mhmoe/nope"]) == 2
    assert "--stages mhmoe/nope: no stage of this run" in capfd.readouterr().err


@pytest.mark.parametrize("old", ["mhmoe/pretrain", "mhmoe/backbone_pretrained.pt"])
def test_a_demo_folder_of_the_earlier_layout_is_refused_before_any_stage(tmp_path, capfd, old):
    """A folder per variant (``mhmoe/pretrain``, ``mhmoe/backbone_pretrained.pt``) is the layout before the work
    folders the demo shares with the study: refused in one line, exit 2, nothing written."""
    (tmp_path / old).parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / old).mkdir() if old.endswith("pretrain") else (tmp_path / old).write_bytes(b"")
    before = sorted(tmp_path.rglob("*"))
    message = f"{tmp_path / old} is a demo run's folder of an earlier layout; expected a new --out"
    for variant in ("mhmoe", "xmoe"):  # whichever variant is asked for
        assert main(["demo", "--fast", "--out", str(tmp_path), "--variant", variant]) == 2
        assert capfd.readouterr().err.strip() == f"mmoe demo: error: {message}"
        assert sorted(tmp_path.rglob("*")) == before


def test_table_has_one_column_per_variant():
    rows = [{"task": "VQAv2 val", "metric": "accuracy (%)", "value": 50.0, "chance": 39.4, "baseline": "prior"}]
    single = format_table({"mhmoe": rows}).splitlines()
    assert single[0].split() == ["task", "metric", "value", "chance", "chance", "baseline"]
    assert "50.00" in single[1] and "39.40" in single[1]
    both = format_table({"xmoe": rows, "mhmoe": [dict(rows[0], value=60.0)]}).splitlines()
    assert both[0].split()[2:4] == ["xmoe", "mhmoe"] and "60.00" in both[1]


#: A line a warning writes on stderr: Python's ``path.py:LINE: Category: message``, Lightning's ``path.py:LINE:
#: message`` (its own format for its warnings), or any line naming a warning category (``...Warning``).
WARNING_LINE = re.compile(r"^\S.*\.py:\d+: |Warning\b")


@pytest.fixture(scope="module")
def default_demo(tmp_path_factory):
    """``mmoe demo`` (the default setting, its fine-tunings two at a time) run once, as a process of its own as a
    reader runs it (Python's default warning filters, its lanes' output on its stderr): (output directory,
    results.json, chance levels, printed text, stderr). The command is the one docs/tutorials/demo.md gives, read from
    the page (tests/tutorial_commands.py) with only its ``--out`` pointed here, so this run is that tutorial's test
    (tests/test_tutorials.py runs it nowhere else). The directory (about 1.3 GB of checkpoints and shards with
    ``--random-init``) is removed afterwards."""
    out = tmp_path_factory.mktemp("demo")
    argv = tutorial_demo_argv()
    argv[argv.index("--out") + 1] = str(out)
    environment = {name: value for name, value in os.environ.items() if name != "PYTHONWARNINGS"}
    done = subprocess.run([sys.executable, "-m", "mmoe.cli", *argv], env=environment, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads((out / "results.json").read_text())
    chance = json.loads((out / "data" / "synth.json").read_text())["chance"]
    yield out, results, chance, done.stdout, done.stderr
    shutil.rmtree(out, ignore_errors=True)


def rows_of(results: dict) -> dict:
    return {(row["task"], row["metric"]): row for row in results["variants"]["mhmoe"]}


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::UserWarning")
def test_demo_scores_are_official_files_exist_and_a_rerun_reuses_stages(default_demo):
    out, results, chance, printed, errors = default_demo
    # A normal run is quiet: no library warns on stderr. What is left there is mmoe's own accounting ("mmoe fit:
    # samples skipped: none") and the PTB tokenizer's (Java) count of the tokens it read.
    assert [line for line in errors.splitlines() if WARNING_LINE.search(line)] == []
    rows = rows_of(results)
    for task, _ in rows:
        assert task in printed

    vqa = rows["VQAv2 val", "accuracy (%)"]
    assert vqa["chance"] == chance["vqav2_val_prior_accuracy"]["overall"]
    data = out / "data" / "vqav2"
    rescored = evaluate_vqa_files(
        data / "v2_OpenEnded_mscoco_val2014_questions.json",
        data / "v2_mscoco_val2014_annotations.json",
        out / "finetune" / "mhmoe" / "vqav2" / "val_results.json",
    )
    assert rescored["overall"] == vqa["value"]  # every val question answered, scored by the official metric
    nlvr2 = rows["NLVR2 dev", "accuracy"]
    consistency = rows["NLVR2 dev", "consistency"]
    assert nlvr2["chance"] == chance["nlvr2"]["accuracy_constant_answer"]
    assert consistency["chance"] == chance["nlvr2"]["consistency_random"]
    dev = out / "data" / "nlvr2" / "dev.json"
    rescored = evaluate_nlvr2_files(dev, out / "finetune" / "mhmoe" / "nlvr2" / "dev_predictions.csv")
    assert (rescored["accuracy"], rescored["consistency"]) == (nlvr2["value"], consistency["value"])
    caption_rows = {metric: rows["COCO captions Karpathy test", metric] for metric in ("Bleu_4", "CIDEr")}
    for metric, caption in caption_rows.items():
        assert caption["chance"] == chance["captioning_karpathy_test_constant_caption"][metric]
        assert 0 <= caption["value"] <= 10

    # Every task above its chance level by a margin. The shipped run (docs/demo_comparison/scores.json, README's
    # table): VQA 53.23, NLVR2 0.621 / consistency 0.193, BLEU-4 0.422, CIDEr 1.004, colour words 81.23% against
    # 30.65%. Across training seeds (docs/tutorials/demo.md, "Across training seeds"; seed 0 an earlier default run):
    # VQA 53.39 against the per-question-type prior's 39.43 and the image-blind answerer's 47.85 (52.37 and 54.09
    # under training seeds 1 and 2); NLVR2 0.632 on 1,600 dev pairs (0.641 and 0.636 under seeds 1 and 2; 0.60 is
    # 2.7 standard errors below the lowest) and consistency 0.207 on 400 sets against 0.0625 for random answers;
    # captions BLEU-4 0.444 and CIDEr 1.034 against the most common training caption's 0.103 and 0.313, their colour
    # words right on 79.32% of uses against 30.64% for the same words on a random image (2.59 times; under training
    # seeds 1 and 2 of the same fine-tuning 1.59 and 2.62 times, so the assertions leave room for the seed-like drift
    # of another CPU's rounding).
    assert vqa["value"] > vqa["chance"] + 10
    assert vqa["value"] > chance["vqav2_val_question_prior_accuracy"]["overall"] + 3
    assert nlvr2["value"] > 0.60 and consistency["value"] > 2 * consistency["chance"]
    assert caption_rows["Bleu_4"]["value"] > 2 * caption_rows["Bleu_4"]["chance"]
    assert caption_rows["CIDEr"]["value"] > 1.5 * caption_rows["CIDEr"]["chance"]
    colours = rows["COCO captions Karpathy test", "colour words right (%)"]
    assert colours["value"] > 1.5 * colours["chance"]
    references = load_karpathy_references(out / "data" / "coco" / "karpathy" / "dataset_coco.json", "test")
    captions = json.loads((out / "finetune" / "mhmoe" / "captioning" / "test_captions.json").read_text())
    expected = word_precision({entry["image_id"]: entry["caption"] for entry in captions}, references, COLORS)
    assert (colours["value"], colours["chance"]) == (
        round(100 * expected["precision"], 2), round(100 * expected["chance"], 2)
    )  # fmt: skip

    retrieval = {metric: rows["Flickr30K Karpathy test", metric] for metric in
                 ("image->text R@1", "text->image R@1", "mean recall (R@1/5/10)")}  # fmt: skip
    rescored = evaluate_retrieval_file(out / "finetune" / "mhmoe" / "retrieval" / "test_embeddings.pt")
    assert retrieval["image->text R@1"]["value"] == rescored["i2t_r1"]
    assert retrieval["text->image R@1"]["value"] == rescored["t2i_r1"]
    assert retrieval["mean recall (R@1/5/10)"]["value"] == rescored["mean_recall"]
    images = chance["retrieval_flickr30k_test"]["images"]
    assert retrieval["text->image R@1"]["chance"] == pytest.approx(1 / images)
    assert retrieval["image->text R@1"]["chance"] == pytest.approx(1 / images)  # 5 captions per image of 5N
    # Measured: image->text R@1 0.080 and text->image R@1 0.079 against 0.004, mean recall 0.286 against 0.021.
    mean = retrieval["mean recall (R@1/5/10)"]
    assert mean["value"] > 10 * mean["chance"]
    for name in ("image->text R@1", "text->image R@1"):
        assert retrieval[name]["value"] > 10 * retrieval[name]["chance"]

    # The pre-training's zero-shot probes leave chance (docs/zero_shot_probes.md, one run at commit 9bfbfb8 after the
    # demo's 80 steps: colour 0.531 against 1/6, image->text R@5 0.422 and text->image R@1 0.180 against 5/128 and
    # 1/128); shape does not yet (0.195 against 1/4), so it is not asserted.
    probes = results["probes"]["mhmoe"]
    values, chance = probes["values"], probes["chance"]
    assert probes["step"] > 0 and values["val/probe/pairs"] == 128
    assert values["val/probe/color_acc"] > 2 * chance["val/probe/color_acc"]
    assert values["val/probe/i2t_r5"] > 3 * chance["val/probe/i2t_r5"]
    assert values["val/probe/t2i_r1"] > 5 * chance["val/probe/t2i_r1"]
    assert "Zero-shot probes of the mhmoe pre-training" in printed
    # ... and reach TensorBoard with the routing callback's load heatmaps (`tensorboard --logdir DIR/pretrain/mhmoe`).
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logs = out / "pretrain" / "mhmoe" / "tensorboard" / "version_0"
    events = EventAccumulator(str(logs), size_guidance={"images": 0})
    tags = events.Reload().Tags()
    assert "routing/load_heatmap" in tags["images"] and "val/probe/color_acc" in tags["scalars"]
    assert events.Scalars("val/probe/color_acc")[-1].value == pytest.approx(values["val/probe/color_acc"])

    for path in results["files"]:
        assert Path(path).exists(), path
    figures = sorted((out / "figures" / "mhmoe").glob("*.png"))
    assert any(p.name.startswith("subtoken_map") for p in figures) and any(
        p.name.startswith("heatmap") for p in figures
    )
    assert all(p.stat().st_size > 1000 for p in figures)

    checkpoints = {path: path.stat().st_mtime_ns for path in out.rglob("*.ckpt")}
    with contextlib.redirect_stdout(io.StringIO()):
        assert main(["demo", "--out", str(out)]) == 0
    again = json.loads((out / "results.json").read_text())
    assert all(stage["reused"] for stage in again["stages"].values())
    assert {path: path.stat().st_mtime_ns for path in out.rglob("*.ckpt")} == checkpoints  # nothing trained again
    assert again["variants"] == results["variants"]

    # --random-init adds the same fine-tunings from a fresh backbone and the paired cluster bootstrap of the difference.
    # Measured (docs/demo_comparison.md, one run): colour words right 81.23% against 44.37%, interval [29.98, 43.52]
    # over the test images, ahead under training seeds 1 and 2 too (docs/tutorials/demo.md). Only the random init and
    # the captioning fine-tuning run here (`--stages`): VQA (53.23 against 50.74) is not separated under seed 1, NLVR2
    # and retrieval under no seed, so no live assertion on them would be one the evidence supports; the whole
    # `--random-init` report is tested on stand-in predictions (tests/demo/test_demo_compare.py) and on the shipped
    # predictions (docs/demo_comparison/); pre-training's effect over several backbones is the claims study's claim 7.
    asserted = ["mhmoe/random-init/init", "mhmoe/random-init/captioning"]
    with contextlib.redirect_stdout(io.StringIO()):
        assert main(["demo", "--out", str(out), "--random-init", "--stages", *asserted]) == 0
    run = PipelineRun(out, FULL)
    benchmark = benchmark_named("captioning")
    starts = (run.finetuning("mhmoe", "captioning"), run.finetuning("mhmoe-random-init", "captioning"))
    files = [layout.predictions(benchmark.predictions) for layout in starts]
    compared = {(row["task"], row["metric"]): row for row in compared_files(run, "captioning", *files)}
    assert compared["COCO captions Karpathy test", "colour words right (%)"]["verdict"] == "pre-trained ahead"


def test_random_init_stages_start_from_a_fresh_backbone_of_the_pretrained_architecture(tmp_path):
    """``mmoe demo --random-init``: the random backbone has the exported backbone's config and other weights, drawn
    the same whatever the global generator's state; each benchmark is fine-tuned and scored from the start
    ``mhmoe-random-init``."""
    from mmoe.demo.recipe import random_init_stages
    from mmoe.model import MoEPlan, MultiwayConfig, MultiwayTransformer
    from mmoe.runtime.checkpoint import export_backbone, read_backbone_state

    run = PipelineRun(tmp_path, FAST)
    config = MultiwayConfig.preset("test", moe=MoEPlan(num_experts=4, heads=2, router="xmoe"))
    pretrained = MultiwayTransformer(config)
    run.pretraining("mhmoe").root.mkdir(parents=True)
    export_backbone(pretrained, run.backbone("mhmoe"))

    stages = random_init_stages(run, "mhmoe")
    assert [str(stage.key) for stage in stages] == ["mhmoe/random-init/init"] + [
        f"mhmoe/random-init/{benchmark.name}{suffix}" for benchmark in DEMO_BENCHMARKS for suffix in ("", "/eval")
    ]
    for benchmark, fit, evaluate in zip(DEMO_BENCHMARKS, stages[1::2], stages[2::2], strict=True):
        layout = run.finetuning("mhmoe-random-init", benchmark.name)
        assert fit.output == layout.last_checkpoint and evaluate.output == layout.scores
        assert layout.root == tmp_path / "finetune" / "mhmoe-random-init" / benchmark.name

    torch.manual_seed(123)
    record = run_stage(run, stages[0])
    random_backbone = tmp_path / "pretrain" / "mhmoe-random-init" / "backbone.pt"
    assert record["result"]["files"] == [str(random_backbone)] and random_backbone != run.backbone("mhmoe")
    random_config, random_weights = read_backbone_state(random_backbone)
    assert random_config == config
    weights = pretrained.state_dict()
    differing = [name for name, value in weights.items() if not torch.equal(value, random_weights[name])]
    assert "patch_embed.weight" in differing and "layers.0.attention.qkv.0.weight" in differing
    torch.manual_seed(456)  # another global state: the same weights again
    again = tmp_path / "again"
    other = PipelineRun(again, FAST)
    other.pretraining("mhmoe").root.mkdir(parents=True)
    export_backbone(pretrained, other.backbone("mhmoe"))
    run_stage(other, random_init_stages(other, "mhmoe")[0])
    _, weights_again = read_backbone_state(other.backbone("mhmoe-random-init"))
    assert all(torch.equal(weights_again[name], value) for name, value in random_weights.items())


def test_a_moe_override_changes_only_its_fields_of_the_variants_plan(tmp_path):
    """``moe={"num_experts": 32}`` on the Switch configs keeps their linear router (a dict replacing the whole plan
    once turned a 32-expert Switch run into X-MoE, the plan's default router)."""
    run = PipelineRun(tmp_path, FAST)
    steps = run.settings.pretrain_steps
    switch = read_spec(pretrain_spec(run, "switch", run.pretraining("switch"), steps, moe={"num_experts": 32}))
    moe = switch.model.init_args.backbone.moe
    assert (moe.num_experts, moe.router, moe.top_k) == (32, "linear", 1)
    mhmoe = read_spec(pretrain_spec(run, "mhmoe", run.pretraining("mhmoe"), steps, moe={"num_experts": 32, "heads": 8}))
    assert (mhmoe.model.init_args.backbone.moe.heads, mhmoe.model.init_args.backbone.moe.router) == (8, "xmoe")
