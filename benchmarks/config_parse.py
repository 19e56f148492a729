"""The CPU time of ``mmoe fit``'s config parse (LightningCLI over jsonargparse), which every run and every pipeline
stage pays before its first step: the CLI with options laid over the files from Python (what a pipeline stage runs),
with the parser of the named subcommand alone (what mmoe builds) and with every subcommand's parser (LightningCLI's
own way); and one parse of the files with and without its final check of the whole config (the first of a stage's
two parses leaves it to the second, :func:`mmoe.runtime.lightning_internals.parse_config`).

Each case runs ``--rounds`` times in this process, in turn, after one round that is not counted (imports, caches);
CPU seconds of this process (``time.process_time``), which other jobs on the machine do not stretch.

Output: one JSON line per case ``{"case", "cpu_s"}`` (the median), then
``{"comparison": "named_parser / every_parser", "ratio"}`` and ``{"comparison": "unchecked / checked", "ratio"}``.

Run: ``.venv/bin/python benchmarks/config_parse.py [--rounds 7]``
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

from mmoe.config.cli import cli_arguments
from mmoe.config.launch import ParsedOnly, config_argv
from mmoe.runtime.lightning_internals import parse_config

CONFIGS = [Path(__file__).resolve().parents[1] / "configs" / "finetune" / "vqav2_tiny.yaml"]
OVERRIDES = {"trainer": {"max_steps": 7}, "seed_everything": 3}


class EveryParser(ParsedOnly):
    """LightningCLI's way: a parser for every subcommand, whichever one the arguments name."""

    def subcommands(self) -> dict[str, set[str]]:
        return self.every_subcommand()


def parsed(cli_class: type[ParsedOnly]) -> ParsedOnly:
    return cli_class(**cli_arguments(args=config_argv(CONFIGS, "fit"), save_config_callback=None), overrides=OVERRIDES)


def cpu_seconds(work: Callable[[], object]) -> float:
    start = time.process_time()
    work()
    return time.process_time() - start


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args(argv)
    cli = parsed(ParsedOnly)
    cases = {
        "named_parser": lambda: parsed(ParsedOnly),
        "every_parser": lambda: parsed(EveryParser),
        "checked": lambda: parse_config(cli.parser, config_argv(CONFIGS, "fit")),
        "unchecked": lambda: parse_config(cli.parser, config_argv(CONFIGS, "fit"), validate=False),
    }
    for work in cases.values():
        work()  # imports and caches, not counted
    times: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(args.rounds):
        for name, work in cases.items():
            times[name].append(cpu_seconds(work))
    median = {name: statistics.median(values) for name, values in times.items()}
    for name, value in median.items():
        print(json.dumps({"case": name, "cpu_s": value}))
    for numerator, denominator in (("named_parser", "every_parser"), ("unchecked", "checked")):
        ratio = median[numerator] / median[denominator]
        print(json.dumps({"comparison": f"{numerator} / {denominator}", "ratio": ratio}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
