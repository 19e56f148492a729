"""Ship the pre-trained vs random-init comparison of a finished ``mmoe demo --random-init`` folder: its per-item
document as ``docs/demo_comparison/items.json`` (compact), its rows as ``docs/demo_comparison/comparison.json`` (as
the run's ``results.json`` holds them) and the markdown block of ``docs/demo_comparison.md`` (between its markers),
then print that block. The same run's scores of both starts go to ``docs/demo_comparison/scores.json`` and README.md's
results table (between its own markers), so the front page's table and the comparison are one run's; the same
table with each compared metric's difference, interval and verdict goes to ``docs/tutorials/demo_details.md``
(between its markers).

    .venv/bin/python scripts/demo_comparison_docs.py /tmp/demo_ri
    .venv/bin/python scripts/demo_comparison_docs.py --print    # the shipped block only, written nowhere
    .venv/bin/python scripts/demo_comparison_docs.py --check    # exit 1 if a page's block is not the shipped files'
    .venv/bin/python scripts/demo_comparison_docs.py --pages    # rewrite the pages' blocks from the shipped files

The rows must be those :func:`mmoe.pipeline.compare.rows_from_items` recomputes from the document, or nothing is
written.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from mmoe.atomic import write_text_atomic
from mmoe.io import json_excerpt, one_line, require_field, write_json
from mmoe.pipeline.compare import LEVEL, NOT_SEPARATED, PRETRAINED_AHEAD, RANDOM_INIT_AHEAD, RESAMPLES, rows_from_items
from mmoe.pipeline.comparison_items import ITEMS_FILE, read_comparison_items
from mmoe.pipeline.stages import PipelineError
from mmoe.pipeline.tables import number

sys.path.insert(0, str(Path(__file__).resolve().parent))
from marked_block import MarkerError, page_block, with_block  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
SHIPPED = REPO / "docs" / "demo_comparison"
SHIPPED_ITEMS, SHIPPED_ROWS = SHIPPED / "items.json", SHIPPED / "comparison.json"
PAGE = REPO / "docs" / "demo_comparison.md"
SHIPPED_SCORES, README = SHIPPED / "scores.json", REPO / "README.md"
#: The run's report (``mmoe demo`` writes it beside :data:`ITEMS_FILE`).
RESULTS_FILE = "results.json"
BEGIN, END = "<!-- demo-comparison:begin -->", "<!-- demo-comparison:end -->"
SCORES_BEGIN, SCORES_END = "<!-- demo-results:begin -->", "<!-- demo-results:end -->"
DETAILS = REPO / "docs" / "tutorials" / "demo_details.md"
DETAILS_BEGIN, DETAILS_END = "<!-- demo-details:begin -->", "<!-- demo-details:end -->"
#: Metrics the details page also gives as a multiple of their chance level.
CHANCE_MULTIPLE_METRICS = ("colour words right (%)",)
SCORES_HEADER = ["task", "metric", "pre-trained ({variant})", "random init", "chance", "chance baseline"]

PARAGRAPH = (
    f"Each row is the difference pre-trained - random init with its {LEVEL:.0%} paired cluster bootstrap interval "
    f"(Efron & Tibshirani's percentile interval, {RESAMPLES:,} resamples): the evaluation clusters are resampled with "
    "replacement, the same draw for both starts, each picked cluster bringing all its items (a VQA image with its "
    "questions, an NLVR2 statement set with its pairs, a captioning or retrieval test image; Davison & Hinkley 1997, "
    f"§3.8). Verdict: *{PRETRAINED_AHEAD}* when the interval's lower end is above 0, *{RANDOM_INIT_AHEAD}* when its "
    f"upper end is below 0, else *{NOT_SEPARATED}*. The interval is conditional on one pre-training and one random "
    "init, each fine-tuned once: it covers which evaluation images and statement sets the split holds, not the "
    "training seed; whether pre-training helps over several backbones per arm is claim 7 in `docs/claims.md`."
)
HEADER = ["task", "metric", "pre-trained", "random init", "difference", "95% interval", "verdict", "items", "clusters"]


def markdown(rows: list[dict]) -> str:
    """:data:`PARAGRAPH` and the table of the comparison rows."""
    lines = [HEADER, ["---"] * len(HEADER)] + [
        [row["task"], row["metric"], number(row["pretrained"]), number(row["random_init"]), number(row["difference"]),
         "[{}, {}]".format(*map(number, row["interval"])), row["verdict"], f"{row['items']:,}",
         f"{row['clusters']:,} {row['cluster']}"]
        for row in rows
    ]  # fmt: skip
    return PARAGRAPH + "\n\n" + "\n".join("| " + " | ".join(line) + " |" for line in lines)


def recomputed_rows(items: Any, rows: Any, items_name: str, rows_name: str) -> list[dict]:
    """``rows``, checked to be what :func:`rows_from_items` recomputes from ``items``; PipelineError otherwise."""
    recomputed = rows_from_items(items, items_name)
    if rows != recomputed:
        raise PipelineError(f"{rows_name} does not hold the rows {items_name} gives; expected the same run's files")
    return recomputed


def shipped_rows(items_file: Path = SHIPPED_ITEMS, rows_file: Path = SHIPPED_ROWS) -> list[dict]:
    """The shipped comparison rows, checked to be those the shipped items recompute."""
    items, rows = read_comparison_items(items_file), read_comparison_items(rows_file, "comparison rows")
    return recomputed_rows(items, rows, str(items_file), str(rows_file))


def markdown_block(items_file: Path = SHIPPED_ITEMS, rows_file: Path = SHIPPED_ROWS) -> str:
    """The markdown block of the shipped files (their rows recomputed from the items and checked first)."""
    return markdown(shipped_rows(items_file, rows_file))


def scores_table(scores: Any, where: str = "demo scores") -> str:
    """README's results table from ``{"variant": V, "pretrained": rows, "random_init": rows}`` (the rows of
    ``results.json``'s ``variants``): per row, both starts' values, the chance level (both where they differ, as
    the colour words' random-image rate does) and its baseline."""
    variant = require_field(scores, "variant", str, where, PipelineError)
    starts = [require_field(scores, start, list, where, PipelineError) for start in ("pretrained", "random_init")]
    random_rows = {(row["task"], row["metric"]): row for row in starts[1]}
    header = [cell.format(variant=variant) for cell in SCORES_HEADER]
    lines = [header, ["---"] * len(header)]
    for row in starts[0]:
        other = random_rows.get((row["task"], row["metric"]))
        if other is None:
            raise PipelineError(f"{where}: {row['task']} {row['metric']} has no random-init row; expected both starts")
        chances = {number(row["chance"]), number(other["chance"])}
        chance = " / ".join([number(row["chance"]), number(other["chance"])]) if len(chances) > 1 else chances.pop()
        lines.append([row["task"], row["metric"], number(row["value"]), number(other["value"]), chance,
                      row["baseline"]])  # fmt: skip
    return "\n".join("| " + " | ".join(line) + " |" for line in lines)


def details_block(scores: Any, rows: list[dict]) -> str:
    """The demo-in-detail page's block: README's results table, then per compared metric both starts' values, the
    difference with its interval and verdict, then each of :data:`CHANCE_MULTIPLE_METRICS` as a multiple of its
    chance level."""
    lines = [scores_table(scores), ""]
    for row in rows:
        low, high = map(number, row["interval"])
        lines.append(
            f"- {row['task']}, {row['metric']}: {number(row['pretrained'])} from the pre-trained backbone against "
            f"{number(row['random_init'])} from random init; difference {number(row['difference'])} "
            f"[{low}, {high}], *{row['verdict']}*."
        )
    for start, name in (("pretrained", "the pre-trained backbone"), ("random_init", "random init")):
        for row in scores[start]:
            if row["metric"] in CHANCE_MULTIPLE_METRICS:
                lines.append(
                    f"- {row['task']}, {row['metric']} from {name}: {row['value'] / row['chance']:.2f} times its "
                    f"chance level ({number(row['chance'])}, {row['baseline']})."
                )
    return "\n".join(lines)


def shipped_blocks(
    page: Path = PAGE, readme: Path = README, details: Path = DETAILS, scores_file: Path = SHIPPED_SCORES,
    items_file: Path = SHIPPED_ITEMS, rows_file: Path = SHIPPED_ROWS,
) -> dict[Path, tuple[str, str, str]]:  # fmt: skip
    """Each page -> (begin marker, end marker, the block the shipped files give it)."""
    rows = shipped_rows(items_file, rows_file)
    return generated_blocks(rows, read_comparison_items(scores_file, "demo scores"), page, readme, details)


def generated_blocks(rows: list[dict], scores: Any, page: Path, readme: Path, details: Path) -> dict:
    """Each page -> (begin marker, end marker, its block) for one run's comparison rows and scores."""
    return {page: (BEGIN, END, markdown(rows)), readme: (SCORES_BEGIN, SCORES_END, scores_table(scores)),
            details: (DETAILS_BEGIN, DETAILS_END, details_block(scores, rows))}  # fmt: skip


def stale_pages(**paths: Path) -> list[Path]:
    """The pages whose generated block is not the one the shipped files give (``paths``: as :func:`shipped_blocks`)."""
    return [page for page, (begin, end, block) in shipped_blocks(**paths).items()
            if page_block(page, begin, end) != block]  # fmt: skip


def run_scores(run_dir: Path, variant: str) -> dict:
    """Both starts' score rows of ``variant`` in the run's ``results.json`` (as :func:`scores_table` reads them)."""
    results_path = run_dir / RESULTS_FILE
    variants = require_field(read_comparison_items(results_path, "demo results"), "variants", dict, str(results_path),
                             PipelineError)  # fmt: skip
    rows = [require_field(variants, name, list, f"{results_path}, variants", PipelineError)
            for name in (variant, f"{variant}, random init")]  # fmt: skip
    return {"variant": variant, "pretrained": rows[0], "random_init": rows[1]}


def run_files(run_dir: Path, variant: str | None) -> tuple[str, dict, list[dict]]:
    """(the variant, its document, its rows from ``results.json``) of a finished ``mmoe demo --random-init`` folder;
    links are refused (nothing outside the folder is read)."""
    items_path, results_path = run_dir / ITEMS_FILE, run_dir / RESULTS_FILE
    for path in (items_path, results_path):
        if path.is_symlink():
            raise PipelineError(f"{path} is a link; expected a file of the run folder itself")
    documents = read_comparison_items(items_path)
    if not isinstance(documents, dict) or not documents:
        raise PipelineError(f"{items_path}: expected a JSON object variant -> document, got {json_excerpt(documents)}")
    if variant is None and len(documents) != 1:
        raise PipelineError(f"{items_path} holds variants {', '.join(documents)}; choose one with --variant")
    variant = variant if variant is not None else next(iter(documents))
    document = require_field(documents, variant, dict, str(items_path), PipelineError)
    results = read_comparison_items(results_path, "demo results")
    compared = require_field(results, "comparison", dict, str(results_path), PipelineError)
    rows = require_field(compared, variant, list, f"{results_path}, comparison", PipelineError)
    return variant, document, recomputed_rows(document, rows, f"{items_path}, {variant}", f"{results_path}, {variant}")


def ship(
    run_dir: Path, variant: str | None, items_file: Path = SHIPPED_ITEMS, rows_file: Path = SHIPPED_ROWS,
    page: Path = PAGE, scores_file: Path = SHIPPED_SCORES, readme: Path = README, details: Path = DETAILS,
) -> str:  # fmt: skip
    """Writes the shipped files, the page's block, README's results table and the details page's block from
    ``run_dir``; returns the page's block."""
    variant, document, rows = run_files(run_dir, variant)
    scores = run_scores(run_dir, variant)
    blocks = generated_blocks(rows, scores, page, readme, details)
    # The markers are checked to be in place before anything is written.
    pages = {path: with_block(path, begin, end, block) for path, (begin, end, block) in blocks.items()}
    write_json(items_file, document, indent=None)
    write_json(rows_file, rows)
    write_json(scores_file, scores)
    for path, text in pages.items():
        write_text_atomic(path, text)
    return blocks[page][2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", type=Path, nargs="?", help="a finished mmoe demo --random-init folder")
    parser.add_argument("--variant", help="the variant to ship (default: the folder's only one)")
    parser.add_argument("--print", action="store_true", help="only print the shipped files' block")
    parser.add_argument("--check", action="store_true", help="exit 1 if a page's block is not the shipped files'")
    parser.add_argument("--pages", action="store_true", help="rewrite the pages' blocks from the shipped files")
    args = parser.parse_args()
    if [args.run_dir is not None, args.print, args.check, args.pages].count(True) != 1:
        parser.error("give one of RUN_DIR, --print, --check and --pages")
    try:
        if args.check:
            stale = stale_pages()
            for page in stale:
                print(f"{page.relative_to(REPO)}: stale; rewrite it with --pages", file=sys.stderr)
            raise SystemExit(1 if stale else 0)
        if args.pages:
            for page, (begin, end, block) in shipped_blocks().items():
                write_text_atomic(page, with_block(page, begin, end, block))
            return
        print(markdown_block() if args.print else ship(args.run_dir, args.variant))
    except (PipelineError, MarkerError, OSError) as error:
        print(f"demo_comparison_docs.py: error: {one_line(error)}", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
