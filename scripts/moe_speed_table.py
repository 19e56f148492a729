"""The idle-machine tables of docs/moe_layer_speed.md, written from the shipped ``benchmarks/moe_layer.py`` output.

``docs/moe_layer_speed/idle_threads1.jsonl`` and ``idle_threads2.jsonl`` are the JSON lines of one run at one and at
two torch threads; each cell of the table reads "one thread / two threads". The table lies between the page's
``<!-- moe-idle:begin -->`` and ``<!-- moe-idle:end -->`` markers. The routers of 2023-25 (Soft MoE, top-p, null and
zero-computation experts, ReLU gates) have their own pair of runs, ``idle_routers_threads{1,2}.jsonl``, and table,
between ``<!-- moe-routers-idle:begin -->`` and ``<!-- moe-routers-idle:end -->``.

Run: ``.venv/bin/python scripts/moe_speed_table.py`` (rewrite the block) or ``--check`` (exit 1 when it is stale).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from mmoe.atomic import write_text_atomic

sys.path.insert(0, str(Path(__file__).resolve().parent))
from marked_block import with_block  # noqa: E402

DOCS = Path(__file__).resolve().parents[1] / "docs"
PAGE = DOCS / "moe_layer_speed.md"
RUNS = (DOCS / "moe_layer_speed" / "idle_threads1.jsonl", DOCS / "moe_layer_speed" / "idle_threads2.jsonl")
BEGIN, END = "<!-- moe-idle:begin -->", "<!-- moe-idle:end -->"
ROUTER_RUNS = tuple(DOCS / "moe_layer_speed" / f"idle_routers_threads{threads}.jsonl" for threads in (1, 2))
#: (runs, begin marker, end marker) of each table.
TABLES = ((RUNS, BEGIN, END), (ROUTER_RUNS, "<!-- moe-routers-idle:begin -->", "<!-- moe-routers-idle:end -->"))


def cases(path: Path) -> dict[str, dict]:
    lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return {line["case"]: line for line in lines if "case" in line}


def cell(one: dict, two: dict, key: str, target: float | None = None) -> str:
    text = f"{one[key]:.2f} / {two[key]:.2f}"
    if target is not None and max(one[key], two[key]) > target:
        text += " (missed)"
    return text


def table(runs: tuple[Path, Path] = RUNS) -> str:
    one, two = (cases(path) for path in runs)
    rows = [
        "| case | routed / dense | routed / floor | balanced / floor (≤ 1.25) | load max / mean |",
        "| --- | --- | --- | --- | --- |",
    ]
    for name, first in one.items():
        second = two[name]
        rows.append(
            f"| `{name}` | {cell(first, second, 'ratio')} | {cell(first, second, 'floor_ratio')} | "
            f"{cell(first, second, 'balanced_floor_ratio', 1.25)} | {first['load_max_over_mean']:.2f} |"
        )
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 when the page's table differs from the files")
    args = parser.parse_args(argv)
    try:
        wanted = PAGE.read_text(encoding="utf-8")
        for runs, begin, end in TABLES:
            wanted = with_block(PAGE, begin, end, table(runs), wanted)
    except (OSError, KeyError, ValueError) as error:  # ValueError: the page's markers (MarkerError) or a JSON line
        print(f"moe_speed_table.py: error: {error}", file=sys.stderr)
        return 2
    if args.check:
        if wanted != PAGE.read_text(encoding="utf-8"):
            print(f"{PAGE}: the idle-machine table is stale; run scripts/moe_speed_table.py", file=sys.stderr)
            return 1
        return 0
    write_text_atomic(PAGE, wanted)
    return 0


if __name__ == "__main__":
    sys.exit(main())
