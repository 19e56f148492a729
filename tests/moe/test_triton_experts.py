"""The fused gather/scatter expert kernels (``MoEConfig.expert_kernels = "triton"``) against the reference path: the
block schedule, the kernels alone and whole MoE layers (outputs, input and parameter gradients) under Triton's
interpreter on the CPU (``tests/moe/triton_interpreter_checks.py``, in a fresh process), the fallback elsewhere, and the
same comparison in bf16 on a GPU where one is present."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mmoe.moe import MoEConfig, build_moe_layer
from tests.moe.triton_interpreter_checks import CASES, close_in_bf16, run_layer

ROOT = Path(__file__).resolve().parents[2]


def test_kernels_match_the_reference_under_the_interpreter():
    """Triton's standard library is built for the interpreter only when the variable is set before triton is first
    imported, which other tests may already have done in this process: the checks run in a fresh one."""
    environment = os.environ | {"TRITON_INTERPRET": "1"}
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/moe/triton_interpreter_checks.py"]
    result = subprocess.run(command, cwd=ROOT, env=environment, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert " passed" in result.stdout and "failed" not in result.stdout


def test_without_a_gpu_or_interpreter_the_layer_warns_once_and_keeps_the_reference(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    torch.manual_seed(2)
    reference = build_moe_layer(MoEConfig(dim=16, ffn_dim=32, num_experts=4))
    fused = build_moe_layer(MoEConfig(dim=16, ffn_dim=32, num_experts=4, expert_kernels="triton"))
    fused.load_state_dict(reference.state_dict())
    x = torch.randn(2, 5, 16)
    with pytest.warns(UserWarning, match="expert_kernels='triton' runs on CUDA"):
        y, _ = fused(x)
    torch.testing.assert_close(y, reference(x)[0])
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fused(x)  # once only


def test_expert_kernels_must_be_known():
    with pytest.raises(ValueError, match="expert_kernels must be one of"):
        MoEConfig(dim=16, ffn_dim=32, num_experts=4, expert_kernels="cuda")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("case", CASES)
def test_fused_layer_equals_the_reference_in_bf16_on_a_gpu(case):
    torch.manual_seed(3)
    options = CASES[case]
    reference = build_moe_layer(MoEConfig(dim=256, ffn_dim=512, num_experts=8, **options)).cuda()
    fused = build_moe_layer(MoEConfig(dim=256, ffn_dim=512, num_experts=8, expert_kernels="triton", **options)).cuda()
    fused.load_state_dict(reference.state_dict())
    x = torch.randn(4, 128, 256, device="cuda")
    padding = torch.zeros(4, 128, dtype=torch.bool, device="cuda")
    padding[1, 100:] = True
    with torch.autocast("cuda", dtype=torch.bfloat16):
        y_ref, gx_ref, grads_ref, _ = run_layer(reference, x, padding)
        y, gx, grads, _ = run_layer(fused, x, padding)
    assert close_in_bf16(y, y_ref) and close_in_bf16(gx, gx_ref)
    far = [name for name in grads if not close_in_bf16(grads[name], grads_ref[name])]
    assert not far, far


def test_the_backbone_plan_passes_the_choice_to_every_moe_layer():
    from mmoe.model.config import MoEPlan

    assert MoEPlan(expert_kernels="triton").layer_config(32, 64, subln=False).expert_kernels == "triton"
    assert MoEPlan().layer_config(32, 64, subln=False).expert_kernels == "torch"
