"""Every CUDA check of mmoe in one command, for the few minutes a GPU machine is lent: the CUDA-marked tests, the fused
Triton expert kernels against the reference path in fp32 and bf16 (``scripts/gpu_triton_checks.py``), a 30-step bf16
pre-training of the tiny X-MoE config on a synthetic corpus, a 20-step bf16 image classification fit (timm's Mixup /
CutMix, an EMA), the same pre-training over two NCCL processes where the machine has two GPUs, and the MoE layer
(eager, CUDA-graphed, Triton) and backbone (dense and torchscale anchors) benchmarks.

    bash scripts/gpu_check.sh [--out runs/gpu_check/results.json] [--only NAME ...] [--dry-run]

Each check is one command with its own timeout, its whole process group stopped when that runs out; the timeouts
sum to :data:`TOTAL_SECONDS` at most, so a run ends within 8 minutes however its checks end. A check's output goes
to ``<results stem>.logs/<check>.log`` beside the results file, which is rewritten whole after every check: per
check its command, exit code, seconds, status (passed, failed or skipped, with the reason) and what was read from its
output (test counts, the benchmarks' ratios, the run's final loss and tokens/s). A check fails on a non-zero exit, a
timeout, or output showing the device unused (a skipped CUDA test, no "GPU available: True" line) or a benchmark's
correctness check false; a benchmark's speed targets are reported, not judged. The last lines are a summary table.
Exit 1 when a check failed; 2 on a bad option or where no CUDA device is visible.

``--dry-run`` runs on any machine: it prints the plan and runs each check's probe instead of the check, a command that
exits 0 when the check would start (``--help``, the pytest selection collected, the benchmark's own options with
nothing selected, ``mmoe fit --print_config`` with the run's options); it exits 1 when a probe fails.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shlex
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from gpu_check_runner import ROOT, Check, Result, run_all, summary_table  # a sibling: scripts/ is on sys.path

from mmoe.io import INPUT_ERROR_EXIT, OutputPathError, check_output_path

PYTHON = ".venv/bin/python"
MMOE = ".venv/bin/mmoe"
PYTEST = (PYTHON, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider")
#: The whole run's bound: the checks' timeouts sum to this at most (tests/test_gpu_check.py checks it).
TOTAL_SECONDS = 420
PROBE_TIMEOUT_S = 180
#: Lightning's line when the trainer runs on CUDA devices, and its line when NCCL joined the processes.
ON_THE_GPU = "GPU available: True (cuda), used: True"
ON_NCCL = "distributed_backend=nccl"


def moe_layer_cuda_cases() -> list[str]:
    """The names of ``benchmarks/moe_layer.py``'s GPU cases, read from the benchmark itself (nothing is built)."""
    spec = importlib.util.spec_from_file_location("benchmarks_moe_layer", ROOT / "benchmarks" / "moe_layer.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return [build.args[0] for build in module.cuda_cases()]


def without(argv: tuple[str, ...], option: str) -> tuple[str, ...]:
    return tuple(word for word in argv if word != option)


def fit_command(work: Path, run: str, devices: int, strategy: str) -> tuple[str, ...]:
    """``mmoe fit`` of the tiny X-MoE pre-training, 30 bf16-mixed steps on ``devices`` GPUs (validated every 15) over
    the corpus and codebook the ``corpus`` and ``codebook`` checks write in ``work``, its run folder ``work/run``."""
    corpus = work / "corpus"
    return (
        MMOE, "fit", "--config", "configs/pretrain/tiny.yaml", "--config", "configs/pretrain/tiny/xmoe.yaml",
        "--trainer.accelerator", "gpu", "--trainer.devices", str(devices), "--trainer.strategy", strategy,
        "--trainer.precision", "bf16-mixed", "--trainer.max_steps", "30", "--trainer.val_check_interval", "15",
        "--trainer.log_every_n_steps", "5", "--trainer.enable_progress_bar", "false",
        "--trainer.default_root_dir", str(work / run), "--data.init_args.data_root", str(corpus),
        "--model.init_args.visual_codebook", str(corpus / "codebook.pt"),
    )  # fmt: skip


def classification_command(work: Path) -> tuple[str, ...]:
    """``mmoe fit`` of the tiny image classification config, 20 bf16-mixed steps on one GPU (validated at the end)
    with timm's Mixup / CutMix and an EMA of the weights, over the classification split of the ``corpus`` check's
    corpus, its run folder ``work/classification``."""
    corpus = work / "corpus"
    return (
        MMOE, "fit", "--config", "configs/finetune/imagenet_tiny.yaml", "--trainer.accelerator", "gpu",
        "--trainer.devices", "1", "--trainer.precision", "bf16-mixed", "--trainer.max_steps", "20",
        "--trainer.val_check_interval", "20", "--trainer.enable_progress_bar", "false",
        "--trainer.default_root_dir", str(work / "classification"), "--data.init_args.data_root", str(corpus),
        "--model.init_args.classes", str(corpus / "shards/classification-train/classes.json"),
        "--model.init_args.mixup", '{"mixup_alpha": 0.8, "cutmix_alpha": 1.0}', "--model.init_args.ema_decay", "0.99",
    )  # fmt: skip


def plan(work: Path, gpus: int) -> list[Check]:
    """The checks in the order they run: correctness first, the benchmarks last. ``work`` holds the corpus and the
    run folders; ``gpus`` the CUDA devices visible (the NCCL run needs two)."""
    corpus = work / "corpus"
    fit = fit_command(work, "pretrain", 1, "auto")
    classify = classification_command(work)
    # Several GPUs: the strategy configs/pretrain/tiny.yaml names (a step without masked patches leaves the MIM head
    # unused).
    ddp = fit_command(work, "nccl", 2, "ddp_find_unused_parameters_true")
    moe_layer = (PYTHON, "benchmarks/moe_layer.py", "--cuda", "--rounds", "5", "--only", *moe_layer_cuda_cases())
    backbone = (PYTHON, "benchmarks/backbone.py", "--cuda", "--rounds", "3", "--shapes")  # no CPU shape
    return [
        Check("pytest_cuda", (*PYTEST, "-m", "cuda", "tests"), 70, (*PYTEST, "--collect-only", "-m", "cuda", "tests"),
              output="pytest"),
        Check("triton_kernels", (*PYTEST, "scripts/gpu_triton_checks.py"), 60,
              (*PYTEST, "--collect-only", "scripts/gpu_triton_checks.py"), output="pytest"),
        Check("corpus", (MMOE, "data", "synth", "--out", str(corpus), "--size", "tiny", "--shards"), 25,
              (MMOE, "data", "synth", "--help")),
        Check("codebook", (MMOE, "tokenizer", "fit", "--data", str(corpus / "shards/pretrain-images"),
                           str(corpus / "shards/pretrain-pairs"), "--out", str(corpus / "codebook.pt"), "--size", "16"),
              20, (MMOE, "tokenizer", "fit", "--help"), needs=("corpus",)),
        Check("pretrain_bf16", fit, 60, (*fit, "--print_config"), output="fit", expect=ON_THE_GPU,
              needs=("codebook",)),
        Check("classification_bf16", classify, 30, (*classify, "--print_config"), output="fit", expect=ON_THE_GPU,
              needs=("corpus",)),
        Check("nccl_ddp", ddp, 50, (*ddp, "--print_config"), output="fit", expect=ON_NCCL, needs=("codebook",),
              skip=None if gpus >= 2 else f"{gpus} CUDA device(s) here; the NCCL run needs 2"),
        # With nothing selected (no --cuda: the names select no CPU case), a benchmark parses its options and stops.
        Check("moe_layer_bench", moe_layer, 65, without(moe_layer, "--cuda"), output="benchmark"),
        Check("backbone_bench", backbone, 40, without(backbone, "--cuda"), output="benchmark"),
    ]  # fmt: skip


def probe(check: Check, environment: Mapping[str, str]) -> str | None:
    """Runs ``check.probe``; None when it exits 0, else what went wrong (its last line of output)."""
    try:
        done = subprocess.run(check.probe, cwd=ROOT, env=dict(environment), capture_output=True, text=True,
                              stdin=subprocess.DEVNULL, timeout=PROBE_TIMEOUT_S)  # fmt: skip
    except subprocess.TimeoutExpired:
        return f"timed out after {PROBE_TIMEOUT_S} s"
    except OSError as error:
        return f"cannot start: {error}"
    if done.returncode == 0:
        return None
    last = (done.stderr.strip() or done.stdout.strip() or "no output").splitlines()[-1]
    return f"exit code {done.returncode}: {last}"


def print_plan(checks: Sequence[Check]) -> None:
    print(f"gpu_check plan: {len(checks)} checks, at most {sum(c.timeout_s for c in checks):g} s")
    for check in checks:
        after = f", after {', '.join(check.needs)}" if check.needs else ""
        skipped = f" (skipped here: {check.skip})" if check.skip else ""
        print(f"  {check.name} (timeout {check.timeout_s:g} s{after}){skipped}: {shlex.join(check.argv)}")


def dry_run(checks: Sequence[Check], environment: Mapping[str, str]) -> int:
    """Prints the plan, then each check's probe outcome; 1 when a probe failed."""
    print_plan(checks)
    with ThreadPoolExecutor(max_workers=3) as pool:
        outcomes = list(pool.map(lambda check: probe(check, environment), checks))
    for check, problem in zip(checks, outcomes, strict=True):
        print(f"probe {check.name}: {'ok' if problem is None else 'FAILED: ' + problem} ({shlex.join(check.probe)})")
    return 0 if all(problem is None for problem in outcomes) else 1


def check_environment() -> dict[str, str]:
    """The checks' environment: unbuffered Python output (a timed-out check's log ends where it stopped), and Triton
    compiling for the device, never its CPU interpreter."""
    environment = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    return environment | {"PYTHONUNBUFFERED": "1"}


def selected(checks: Sequence[Check], names: Sequence[str]) -> list[Check]:
    """The checks named and those they need, in plan order."""
    wanted = set(names)
    for check in reversed(checks):
        if check.name in wanted:
            wanted |= set(check.needs)
    return [check for check in checks if check.name in wanted]


def parse_arguments(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="gpu_check", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "gpu_check" / "results.json",
                        help="the JSON results file; the logs go to <its stem>.logs/ beside it")  # fmt: skip
    parser.add_argument("--only", nargs="+", metavar="NAME", help="run these checks (and those they need) alone")
    parser.add_argument("--dry-run", action="store_true", help="print the plan and probe each command; run nothing")
    return parser.parse_args(argv)


def error(message: str) -> int:
    print(f"gpu_check: error: {message}", file=sys.stderr)
    return INPUT_ERROR_EXIT


def report(results: Sequence[Result], out: Path) -> int:
    """Prints the summary table; the exit code: 1 when a check failed."""
    print(summary_table(results))
    print(f"gpu_check: results in {out}, logs in {out.parent / f'{out.stem}.logs'}")
    return 1 if any(result.status == "failed" for result in results) else 0


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_arguments(argv)
    gpus = torch.cuda.device_count()
    with tempfile.TemporaryDirectory(prefix="mmoe-gpu-check-") as work:
        checks = plan(Path(work), gpus)
        unknown = sorted(set(args.only or ()) - {check.name for check in checks})
        if unknown:
            names = ", ".join(check.name for check in checks)
            return error(f"--only {' '.join(unknown)}: no such check; expected some of {names}")
        checks = selected(checks, args.only) if args.only else checks
        if args.dry_run:
            return dry_run(checks, check_environment())
        if gpus == 0:
            return error("no CUDA device is visible here (--dry-run checks the plan on a CPU)")
        try:
            out = check_output_path(args.out.resolve())
        except OutputPathError as problem:
            return error(str(problem))
        machine = {"gpus": [torch.cuda.get_device_name(i) for i in range(gpus)], "torch": torch.__version__}
        results = run_all(checks, out, check_environment(), machine)
    return report(results, out)


if __name__ == "__main__":
    sys.exit(main())
