"""What the demo prints and saves: progress lines, the results table (value and chance level per task and metric)
and ``DIR/results.json``."""

from __future__ import annotations

from mmoe.data.synth.corpus import ChanceLevels
from mmoe.demo.settings import DemoRun


def say(message: str) -> None:
    print(message, flush=True)


def row(task: str, metric: str, value: float, chance: float, baseline: str) -> dict:
    return {"task": task, "metric": metric, "value": value, "chance": chance, "baseline": baseline}


def vqa_rows(scores: dict, chance: ChanceLevels) -> list[dict]:
    blind = chance.vqa_question_prior
    baseline = f"top training answer per question type (VQA paper's prior); image-blind per question: {blind:.2f}"
    return [row("VQAv2 val", "accuracy (%)", scores["overall"], chance.vqa_prior, baseline)]


def nlvr2_rows(scores: dict, chance: ChanceLevels) -> list[dict]:
    return [
        row("NLVR2 dev", "accuracy", scores["accuracy"], chance.nlvr2_constant, "constant answer"),
        row("NLVR2 dev", "consistency", scores["consistency"], chance.nlvr2_random_consistency, "random answers"),
    ]


def caption_rows(scores: dict, chance: ChanceLevels) -> list[dict]:
    rows = [
        row(
            "COCO captions Karpathy test",
            name,
            scores[name],
            chance.caption_constant[name],
            "most common training caption",
        )  # fmt: skip
        for name in ("Bleu_4", "CIDEr")
    ]
    if "colour_word_precision" not in scores:  # scored by an older mmoe demo: no colour check in its marker
        return rows
    colours = row(
        "COCO captions Karpathy test", "colour words right (%)", round(100 * scores["colour_word_precision"], 2),
        round(100 * scores["colour_word_chance"], 2), "the same colour words on a random image",
    )  # fmt: skip
    return [*rows, colours]


def retrieval_rows(scores: dict, chance: ChanceLevels) -> list[dict]:
    """Image -> text and text -> image R@1 and the mean of the six recalls, beside a random ranking's (the scores'
    ``random_ranking``: 1 / images for text -> image, captions per image / captions for image -> text)."""
    baseline = "random ranking of the test split"
    return [
        row("Flickr30K Karpathy test", label, scores[name], scores["random_ranking"][name], baseline)
        for name, label in (("i2t_r1", "image->text R@1"), ("t2i_r1", "text->image R@1"),
                            ("mean_recall", "mean recall (R@1/5/10)"))
    ]  # fmt: skip


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
    return aligned(lines)


def aligned(lines: list[list[str]]) -> str:
    """Rows of cells as plain text, each column as wide as its widest cell."""
    widths = [max(len(line[i]) for line in lines) for i in range(len(lines[0]))]
    return "\n".join("  ".join(cell.ljust(width) for cell, width in zip(line, widths, strict=True)).rstrip()
                     for line in lines)  # fmt: skip


def stage_files(records: dict) -> list[str]:
    return [path for record in records.values() for path in record["result"].get("files", [])]


def device_name() -> str:
    import torch

    return torch.cuda.get_device_name() if torch.cuda.is_available() else f"CPU, {torch.get_num_threads()} threads"


def results(run: DemoRun, rows_by_variant: dict[str, list[dict]], records: dict, seconds: float) -> dict:
    """What ``DIR/results.json`` holds: settings, chance levels, per-variant rows, stage times and files."""
    return {
        "out": str(run.out),
        "settings": run.settings.to_json(),
        "variants": rows_by_variant,
        "chance": run.chance(),
        "stages": {
            str(key): {"seconds": record["seconds"], "reused": record["reused"]} for key, record in records.items()
        },
        "seconds_this_run": seconds,
        "device": device_name(),
        "files": stage_files(records),
    }
