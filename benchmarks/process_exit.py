"""The CPU time a process spends exiting, with the objects alive at exit frozen
(:func:`mmoe.process_exit.freeze_at_exit`, what the ``mmoe`` command does) and with the interpreter's own shutdown.

Each process imports ``--module`` (by default ``mmoe.config.cli``: what ``mmoe fit`` imports, torch and Lightning with
it), freezes at exit or not (``MMOE_FREEZE_AT_EXIT``), prints the CPU time it has used and exits; the parent reads the
process's whole CPU time (user + system, ``os.wait4``). Its exit is the difference. The two settings alternate for
``--rounds`` rounds.

Output: one JSON line per process ``{"freeze_at_exit", "work_cpu_s", "exit_cpu_s", "total_cpu_s"}``, then the medians
over rounds as ``{"comparison": "frozen_exit / default_exit", "ratio"}`` and
``{"comparison": "frozen_total / default_total", "ratio"}``.

Run: ``.venv/bin/python benchmarks/process_exit.py [--rounds 5] [--module mmoe.config.cli]``
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

SETTINGS = {"default": "0", "frozen": "1"}  # MMOE_FREEZE_AT_EXIT

CHILD = """
import importlib, sys, time
from mmoe.process_exit import freeze_at_exit
importlib.import_module(sys.argv[1])
freeze_at_exit()
print(time.process_time())
"""


def measure(module: str, setting: str) -> dict:
    environment = os.environ | {"MMOE_FREEZE_AT_EXIT": setting}
    child = subprocess.Popen([sys.executable, "-c", CHILD, module], stdout=subprocess.PIPE, text=True, env=environment)
    with child.stdout:
        printed = child.stdout.read()
    _, status, usage = os.wait4(child.pid, 0)  # the child's own CPU time (Popen.wait would not return it)
    code = os.waitstatus_to_exitcode(status)
    if code != 0:
        raise SystemExit(f"process_exit: the child importing {module} exited with {code}")
    work, total = float(printed), usage.ru_utime + usage.ru_stime
    return {"freeze_at_exit": setting == "1", "work_cpu_s": work, "exit_cpu_s": total - work, "total_cpu_s": total}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--module", default="mmoe.config.cli", help="what each process imports before it exits")
    args = parser.parse_args(argv)
    lines: dict[str, list[dict]] = {name: [] for name in SETTINGS}
    for _ in range(args.rounds):
        for name, setting in SETTINGS.items():
            line = measure(args.module, setting)
            lines[name].append(line)
            print(json.dumps(line), flush=True)
    for measured in ("exit", "total"):
        median = {name: statistics.median(line[f"{measured}_cpu_s"] for line in lines[name]) for name in SETTINGS}
        comparison = f"frozen_{measured} / default_{measured}"
        print(json.dumps({"comparison": comparison, "ratio": median["frozen"] / median["default"]} | median))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
