"""Running the checks of ``scripts/gpu_check.py``: each command in its own process group with its output in a log
file and stopped at its timeout, its output read (pytest's counts, a benchmark's JSON lines, ``mmoe fit``'s progress
lines), the results file rewritten whole after every check, and the summary table."""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from mmoe.atomic import write_json_atomic

ROOT = Path(__file__).resolve().parents[1]
#: How long a timed-out check's processes get between SIGTERM and SIGKILL.
STOP_GRACE_S = 3.0


@dataclass(frozen=True)
class Check:
    """One command of the run.

    Attributes:
        name: its key in the results and its log's name.
        argv: the command, run in the repository root.
        timeout_s: how long it may run.
        probe: what ``--dry-run`` runs instead: exits 0 when ``argv`` would start.
        output: how its output is read (a key of :data:`OUTPUT_READERS`; "" for its exit code alone).
        expect: a fragment some line of its output must hold (that it ran on the GPU).
        needs: checks that must pass before it starts.
        skip: why it does not run on this machine; None when it does.
    """

    name: str
    argv: tuple[str, ...]
    timeout_s: float
    probe: tuple[str, ...]
    output: str = ""
    expect: str | None = None
    needs: tuple[str, ...] = ()
    skip: str | None = None


@dataclass
class Result:
    """What one check did: ``status`` passed, failed or skipped, ``reason`` why it did not pass, ``parsed`` what was
    read from its output; ``exit_code`` None when it timed out or did not start."""

    name: str
    command: str
    status: str
    exit_code: int | None
    seconds: float
    timeout_s: float
    reason: str = ""
    log: str | None = None
    parsed: dict[str, Any] = field(default_factory=dict)


def read_pytest(text: str) -> tuple[list[str], dict[str, Any]]:
    """The counts of pytest's last summary line; on a GPU machine a skipped test means the device was not seen."""
    counts: dict[str, int] = {}
    for line in reversed(text.splitlines()):
        found = re.findall(r"(\d+) (passed|failed|skipped|errors?|xfailed|xpassed|deselected)\b", line)
        if found:
            counts = {outcome: int(number) for number, outcome in found}
            break
    problems = [f"{counts['skipped']} test(s) skipped"] if counts.get("skipped") else []
    if not counts.get("passed"):
        problems.append("no test passed")
    return problems, {"tests": counts}


def json_object(line: str) -> dict | None:
    """``line`` decoded where it is a JSON object (a benchmark's result), else None (a warning, a log line)."""
    if not line.startswith("{"):
        return None
    try:
        decoded = json.loads(line)
    except ValueError:
        return None
    return decoded if isinstance(decoded, dict) else None


def read_benchmark(text: str) -> tuple[list[str], dict[str, Any]]:
    """The JSON lines of a benchmark: its ratios by case or comparison, the speed targets missed (reported), and its
    correctness checks that failed (lines with ``ok`` false and no ratio, e.g. a host sync in the layer)."""
    lines = [line for line in map(json_object, text.splitlines()) if line is not None]
    summary = next((line for line in lines if "summary" in line), None)
    named = [(line.get("case") or line.get("comparison"), line) for line in lines if "summary" not in line]
    parsed = {
        "ratios": {name: line["ratio"] for name, line in named if "ratio" in line},
        "targets_missed": [name for name, line in named if "ratio" in line and line.get("ok") is False],
        "lines": lines,
    }
    problems = [
        f"{name}: {line.get('error')}" for name, line in named if "ratio" not in line and line.get("ok") is False
    ]
    if summary is None:
        problems.append("no summary line")
    return problems, parsed


def read_fit(text: str) -> tuple[list[str], dict[str, Any]]:
    """The last logged step and loss of ``mmoe fit`` and its tokens/s over the run (:mod:`mmoe.runtime.throughput`)."""
    steps = re.findall(r"mmoe fit: step (\d+)/\d+\s+loss (\S+)", text)
    total = re.search(r"mmoe fit: trained on [\d,]+ tokens in [\d.]+ s: ([\d,]+) tokens/s", text)
    parsed: dict[str, Any] = {}
    if steps:
        parsed |= {"last_step": int(steps[-1][0]), "last_loss": float(steps[-1][1])}
    if total:
        parsed["tokens_per_s"] = int(total.group(1).replace(",", ""))
    return ([] if steps else ["no training step logged"]), parsed


OUTPUT_READERS: dict[str, Callable[[str], tuple[list[str], dict[str, Any]]]] = {
    "pytest": read_pytest,
    "benchmark": read_benchmark,
    "fit": read_fit,
}


def end_process_group(process: subprocess.Popen, timed_out: bool) -> None:
    """Stops what is left of the check's process group (its own session): SIGTERM then SIGKILL after a timeout, and
    SIGKILL for children that outlived a leader that exited (DDP ranks, loader workers)."""
    for stop in ([signal.SIGTERM] if timed_out else []) + [signal.SIGKILL]:
        try:
            os.killpg(process.pid, stop)
        except ProcessLookupError:
            return
        try:
            process.wait(timeout=STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            pass


def run_process(argv: Sequence[str], log: Path, timeout_s: float, environment: Mapping[str, str]) -> int | None:
    """Runs ``argv`` in the repository root in a session of its own, stdout and stderr into ``log``; its exit code, or
    None when it ran out of time (then stopped). Raises OSError when it cannot start."""
    with open(log, "wb") as handle:
        process = subprocess.Popen(argv, cwd=ROOT, env=dict(environment), stdout=handle, stderr=subprocess.STDOUT,
                                   stdin=subprocess.DEVNULL, start_new_session=True)  # fmt: skip
        try:
            code: int | None = process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            code = None
        end_process_group(process, timed_out=code is None)
    return code


def run_check(check: Check, log: Path, environment: Mapping[str, str]) -> Result:
    """Runs ``check`` with its output into ``log`` and judges it: failed on a timeout, a non-zero exit, or what its
    output shows (its reader's problems, no ``expect`` line)."""
    started = time.monotonic()
    try:
        code = run_process(check.argv, log, check.timeout_s, environment)
    except OSError as error:
        code, problems, parsed = None, [f"cannot start: {error}"], {}
    else:
        text = log.read_text(errors="replace")
        problems, parsed = OUTPUT_READERS[check.output](text) if check.output else ([], {})
        if check.expect is not None and check.expect not in text:
            problems.append(f"no line with {check.expect!r}")
        if code is None:
            problems.insert(0, f"timed out after {check.timeout_s:g} s")
        elif code != 0:
            problems.insert(0, f"exit code {code}")
    seconds = round(time.monotonic() - started, 1)
    status, reason = ("failed" if problems else "passed"), "; ".join(problems)
    return Result(check.name, shlex.join(check.argv), status, code, seconds, check.timeout_s, reason, str(log), parsed)


def skip_reason(check: Check, done: Sequence[Result]) -> str | None:
    """Why ``check`` does not run: the machine, or a check it needs that did not pass."""
    if check.skip is not None:
        return check.skip
    status = {result.name: result.status for result in done}
    unmet = [f"{name} ({status.get(name, 'not run')})" for name in check.needs if status.get(name) != "passed"]
    return f"needs {', '.join(unmet)}" if unmet else None


def run_all(checks: Sequence[Check], out: Path, environment: Mapping[str, str], machine: dict) -> list[Result]:
    """Runs ``checks`` in order, each logged to ``<out stem>.logs/<name>.log`` (a log left by an earlier run under a
    check's name is removed first), and rewrites ``out`` whole after each check."""
    logs = out.parent / f"{out.stem}.logs"
    logs.mkdir(parents=True, exist_ok=True)
    for check in checks:
        (logs / f"{check.name}.log").unlink(missing_ok=True)
    results: list[Result] = []
    for check in checks:
        reason = skip_reason(check, results)
        if reason is None:
            print(f"gpu_check: {check.name} (at most {check.timeout_s:g} s) ...", flush=True)
            result = run_check(check, logs / f"{check.name}.log", environment)
        else:
            result = Result(check.name, shlex.join(check.argv), "skipped", None, 0.0, check.timeout_s, reason)
        results.append(result)
        print(f"gpu_check: {check.name} {result.status} {result.reason}".rstrip(), flush=True)
        passed = all(result.status != "failed" for result in results)
        write_json_atomic(out, {"machine": machine, "passed": passed, "checks": [asdict(r) for r in results]})
    return results


def notes(result: Result) -> str:
    """A few words on what a check found: its reason when it did not pass, else the digest of its output."""
    parsed = result.parsed
    if result.status != "passed":
        return result.reason
    if "tests" in parsed:
        return ", ".join(f"{number} {outcome}" for outcome, number in parsed["tests"].items())
    if "ratios" in parsed:
        missed = parsed["targets_missed"]
        return f"{len(parsed['ratios'])} ratios" + (f"; targets missed: {', '.join(missed)}" if missed else "")
    if "last_loss" in parsed:
        return f"step {parsed['last_step']} loss {parsed['last_loss']:g}, {parsed.get('tokens_per_s', '?')} tokens/s"
    return ""


def summary_table(results: Sequence[Result]) -> str:
    width = max([len("check"), *(len(result.name) for result in results)])
    rows = [f"{'check':<{width}}  {'status':<7}  {'exit':>4}  {'seconds':>7}  notes"]
    for r in results:
        code = "-" if r.exit_code is None else str(r.exit_code)
        rows.append(f"{r.name:<{width}}  {r.status:<7}  {code:>4}  {r.seconds:>7.1f}  {notes(r)}")
    return "\n".join(rows)
