"""``scripts/gpu_check.sh``: its plan of CUDA checks probed on the CPU (``--dry-run``), and the run's bookkeeping on
stand-in checks: a failed, a timed-out (its process group stopped) and a skipped check recorded as such in the
results file and the summary table."""

from __future__ import annotations

import importlib
import json
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
#: What the plan covers: the CUDA tests, the fused kernels, the tiny pre-training (its corpus and codebook first), the
#: tiny classification fit, the NCCL run and the two benchmarks.
CHECKS = ["pytest_cuda", "triton_kernels", "corpus", "codebook", "pretrain_bf16", "classification_bf16", "nccl_ddp",
          "moe_layer_bench", "backbone_bench"]  # fmt: skip


@pytest.fixture(scope="module")
def gpu_check():
    """``scripts/gpu_check.py`` imported as its command runs it (its folder first on the path, for its runner)."""
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        return importlib.import_module("gpu_check"), importlib.import_module("gpu_check_runner")
    finally:
        sys.path.remove(str(ROOT / "scripts"))


@pytest.mark.slow
def test_dry_run_prints_the_plan_and_every_probe_passes(tmp_path):
    environment = os.environ | {"OMP_NUM_THREADS": "1"}
    command = ["bash", "scripts/gpu_check.sh", "--dry-run", "--out", str(tmp_path / "results.json")]
    done = subprocess.run(command, cwd=ROOT, env=environment, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    planned = re.findall(r"^  (\w+) \(timeout \d+ s", done.stdout, flags=re.M)
    probed = re.findall(r"^probe (\w+): ok ", done.stdout, flags=re.M)
    assert planned == probed == CHECKS, done.stdout
    if torch.cuda.device_count() < 2:
        assert re.search(r"^  nccl_ddp .*\(skipped here: \d CUDA device\(s\) here; the NCCL run needs 2\)", done.stdout,
                         flags=re.M)  # fmt: skip
    assert list(tmp_path.iterdir()) == []  # nothing ran


def test_the_plan_fits_the_time_box_and_runs_what_each_check_needs_first(gpu_check, tmp_path):
    plan_module, runner = gpu_check
    checks = plan_module.plan(tmp_path, gpus=2)
    assert [check.name for check in checks] == CHECKS
    assert sum(check.timeout_s for check in checks) <= plan_module.TOTAL_SECONDS
    # Every timed-out check also waits out SIGTERM's and SIGKILL's grace: still within 8 minutes.
    assert plan_module.TOTAL_SECONDS + len(checks) * 2 * runner.STOP_GRACE_S <= 8 * 60
    for index, check in enumerate(checks):
        assert set(check.needs) <= {earlier.name for earlier in checks[:index]}, check.name
        assert check.skip is None and check.output in {"", *runner.OUTPUT_READERS}
    one_gpu = {check.name: check.skip for check in plan_module.plan(tmp_path, gpus=1)}
    assert one_gpu["nccl_ddp"] == "1 CUDA device(s) here; the NCCL run needs 2"
    selected = plan_module.selected(checks, ["pretrain_bf16"])
    assert [check.name for check in selected] == ["corpus", "codebook", "pretrain_bf16"]


def alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie waiting for its parent does not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    return state != "Z"


def test_failed_timed_out_and_skipped_checks_are_recorded_and_tabled(gpu_check, tmp_path, capsys):
    plan_module, runner = gpu_check
    python, pid_file = sys.executable, tmp_path / "sleeper.pid"
    checks = [
        runner.Check("passes", (python, "-c", "print('on the device')"), 120, (), expect="on the device"),
        runner.Check("fails", (python, "-c", "import sys; print('boom'); sys.exit(3)"), 120, ()),
        # The shell leaves a child behind: stopping the check must stop the child too.
        runner.Check("hangs", ("sh", "-c", f"sleep 600 & echo $! > {pid_file}; wait"), 8, ()),
        runner.Check("after_fails", (python, "-c", "pass"), 120, (), needs=("fails",)),
        runner.Check("device_unused", (python, "-c", "print('GPU available: False')"), 120, (),
                     expect="GPU available: True"),
        runner.Check("missing", (str(tmp_path / "no-such-program"),), 120, ()),
    ]  # fmt: skip
    out = tmp_path / "results.json"
    results = runner.run_all(checks, out, dict(os.environ), {"gpus": []})
    assert plan_module.report(results, out) == 1

    recorded = json.loads(out.read_text())
    assert recorded["passed"] is False
    by_name = {check["name"]: check for check in recorded["checks"]}
    assert list(by_name) == [check.name for check in checks]
    assert {name: check["status"] for name, check in by_name.items()} == {
        "passes": "passed", "fails": "failed", "hangs": "failed", "after_fails": "skipped", "device_unused": "failed",
        "missing": "failed",
    }  # fmt: skip
    assert (by_name["fails"]["exit_code"], by_name["fails"]["reason"]) == (3, "exit code 3")
    assert by_name["hangs"]["exit_code"] is None and by_name["hangs"]["reason"] == "timed out after 8 s"
    assert by_name["after_fails"]["reason"] == "needs fails (failed)" and by_name["after_fails"]["log"] is None
    assert by_name["device_unused"]["reason"] == "no line with 'GPU available: True'"
    assert (
        by_name["missing"]["reason"].startswith("cannot start: ") and "no-such-program" in by_name["missing"]["reason"]
    )
    assert by_name["fails"]["command"] == shlex.join(checks[1].argv)
    assert "boom" in Path(by_name["fails"]["log"]).read_text()
    assert Path(by_name["fails"]["log"]).parent == tmp_path / "results.logs"

    sleeper = int(pid_file.read_text())
    deadline = time.monotonic() + 60
    while alive(sleeper) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not alive(sleeper)

    table = capsys.readouterr().out
    assert re.search(r"^check\s+status\s+exit\s+seconds\s+notes$", table, flags=re.M)
    assert re.search(r"^passes\s+passed\s+0\s", table, flags=re.M)
    assert re.search(r"^fails\s+failed\s+3\s+[\d.]+\s+exit code 3$", table, flags=re.M)
    assert re.search(r"^hangs\s+failed\s+-\s+[\d.]+\s+timed out after 8 s$", table, flags=re.M)
    assert re.search(r"^after_fails\s+skipped\s+-\s+0\.0\s+needs fails \(failed\)$", table, flags=re.M)


def test_outputs_are_read_for_counts_ratios_and_the_device_unused(gpu_check):
    _, runner = gpu_check
    problems, parsed = runner.read_pytest(
        "SKIPPED [1] needs a CUDA device\n12 passed, 1 skipped, 99 deselected in 3.2s"
    )
    assert problems == ["1 test(s) skipped"] and parsed == {"tests": {"passed": 12, "skipped": 1, "deselected": 99}}
    assert runner.read_pytest("no tests ran in 0.1s")[0] == ["no test passed"]
    lines = [
        {"case": "fast", "ratio": 1.1, "target": 1.3, "ok": True},
        {"case": "slow", "ratio": 1.9, "target": 1.3, "ok": False},
        {"case": "cuda_no_host_sync", "ok": False, "error": "a host sync"},
        {"summary": {"fast": 1.1}, "all_ok": False},
    ]
    text = "\n".join(["{not json", *map(json.dumps, lines)])
    problems, parsed = runner.read_benchmark(text)
    assert problems == ["cuda_no_host_sync: a host sync"]
    assert parsed["ratios"] == {"fast": 1.1, "slow": 1.9} and parsed["targets_missed"] == ["slow"]
    assert runner.read_benchmark(json.dumps(lines[0]))[0] == ["no summary line"]
    fit = "mmoe fit: step 25/30  loss 7.5  9 tokens/s\nmmoe fit: step 30/30  loss 7.25  9 tokens/s\n"
    fit += "mmoe fit: trained on 12,345 tokens in 2.5 s: 4,938 tokens/s\n"
    assert runner.read_fit(fit) == ([], {"last_step": 30, "last_loss": 7.25, "tokens_per_s": 4938})
