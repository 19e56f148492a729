"""Fine-tune one of the demo's benchmarks from a backbone file with option overrides, predict its evaluation split
and score it, as ``mmoe demo`` does (the pipeline kit's run specs, :mod:`mmoe.pipeline.launch`): the command behind
the ablations in ``tasks/*/README.md``.

    .venv/bin/python scripts/demo_ablation.py vqav2 runs/demo/pretrain/mhmoe/backbone.pt /tmp/ablation/lr1e-3 \
        --corpus runs/demo/data --steps 300 --set '{"model": {"init_args": {"optimizer": {"learning_rate": 1e-3}}}}'

``--set`` takes options nested as in a config file, merged over the demo's (``RunSpec.options``); the scores go to
``OUT/result.json`` (and are printed). A random backbone of a pre-trained one's architecture: ``mmoe demo
--random-init`` writes one.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

from mmoe.io import write_json
from mmoe.pipeline.benchmarks import BENCHMARKS
from mmoe.pipeline.launch import finetune_spec, predict_spec, run_in_stage, train
from mmoe.pipeline.layout import PipelineRun
from mmoe.pipeline.settings import DEMO
from mmoe.runtime.layout import RunLayout

#: Kinds of the synthetic VQA questions (mmoe.data.synth.language), by their leading words.
QUESTION_KINDS = ("what color", "what shape", "what pattern", "what size", "is there a", "is the",
                  "how many shapes are", "how many")  # fmt: skip


def question_kind(question: str) -> str:
    return next(kind for kind in (*QUESTION_KINDS, "") if question.startswith(kind))


def vqa_by_kind(corpus: Path, predictions: Path) -> dict:
    """Official per-question accuracy of ``predictions`` (val2014) and of the image-blind answerer
    (:func:`mmoe.data.synth.corpus.image_blind_answers`: the most common training answer of the same question text)
    per question kind."""
    from collections import defaultdict

    from mmoe.data.synth.chance import image_blind_answers
    from mmoe.io import read_json
    from mmoe.metrics.vqa import vqa_accuracy

    def read(subtype: str) -> tuple[dict, list]:
        vqa = corpus / "vqav2"
        questions = read_json(vqa / f"v2_OpenEnded_mscoco_{subtype}_questions.json", "questions")["questions"]
        annotations = read_json(vqa / f"v2_mscoco_{subtype}_annotations.json", "annotations")["annotations"]
        return {q["question_id"]: q["question"] for q in questions}, annotations

    train_questions, train = read("train2014")
    val_questions, val = read("val2014")
    guesses = image_blind_answers(train, val, train_questions | val_questions)
    humans = {a["question_id"]: [answer["answer"] for answer in a["answers"]] for a in val}
    model, blind = defaultdict(list), defaultdict(list)
    for entry in read_json(predictions, "predictions"):
        question_id = entry["question_id"]
        kind = question_kind(val_questions[question_id])
        model[kind].append(vqa_accuracy(entry["answer"], humans[question_id]))
        blind[kind].append(vqa_accuracy(guesses[question_id], humans[question_id]))
    mean = lambda values: round(100 * sum(values) / len(values), 2)  # noqa: E731
    return {kind: {"model": mean(model[kind]), "image_blind": mean(blind[kind]), "questions": len(model[kind])}
            for kind in model}  # fmt: skip


def main() -> None:
    benchmarks = {benchmark.name: benchmark for benchmark in BENCHMARKS}
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("task", choices=sorted(benchmarks))
    parser.add_argument("backbone", type=Path, help="exported backbone to start from")
    parser.add_argument("out", type=Path, help="run folder (its data/ links to --corpus)")
    parser.add_argument("--corpus", type=Path, default=Path("runs/demo/data"), help="a demo run's data folder")
    parser.add_argument("--steps", type=int, help="fine-tuning steps (default: the default demo's)")
    parser.add_argument("--seed", type=int, help="seed_everything (default: the config's)")
    parser.add_argument("--set", default="{}", help="JSON options merged over the demo's run spec")
    parser.add_argument("--eval-only", action="store_true", help="score the fit already in OUT (no training)")
    args = parser.parse_args()

    benchmark = benchmarks[args.task]
    args.out = args.out.resolve()  # the launches run from other folders
    args.out.mkdir(parents=True, exist_ok=True)
    if not (args.out / "data").exists():
        (args.out / "data").symlink_to(args.corpus.resolve())
    steps = DEMO.finetune_steps | ({args.task: args.steps} if args.steps else {})
    run = PipelineRun(args.out, DEMO.replace(finetune_steps=steps))
    layout = RunLayout(args.out / args.task)
    options, steps = benchmark.model_options(run), run.settings.steps(args.task)
    fit = finetune_spec(run, benchmark.task, options, args.backbone, layout, steps, args.seed)
    fit = dataclasses.replace(fit, options=json.loads(args.set))
    start = time.perf_counter()
    if not args.eval_only:
        train(args.task, fit)
    seconds = time.perf_counter() - start
    predictions = layout.predictions(benchmark.predictions)
    run_in_stage(f"{args.task}/eval", predict_spec(fit, run.shards / benchmark.eval_split, predictions))
    result = {
        "task": args.task,
        "backbone": str(args.backbone),
        "set": json.loads(args.set),
        "steps": run.settings.steps(args.task),
        "fit_seconds": seconds,
        "scores": benchmark.score(run, predictions),
    }
    if args.task == "vqav2":
        result["by_question_kind"] = vqa_by_kind(run.data, predictions)
    write_json(args.out / "result.json", result)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
