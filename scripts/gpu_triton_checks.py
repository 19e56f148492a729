"""The fused Triton expert kernels (``MoEConfig.expert_kernels = "triton"``) against the reference path on a CUDA
device, in fp32 and bf16, outputs and gradients: the checks that ``tests/moe/triton_interpreter_checks.py`` runs
under Triton's interpreter on CPU tensors, collected here with their parametrisations and run on the GPU instead
(every tensor they create lands there: ``torch.set_default_device``), and the suite's bf16 layer check on a GPU.

Not collected by the test suite (no ``test_`` prefix, outside ``tests/``); ``scripts/gpu_check.py`` runs it:

    .venv/bin/python -m pytest -q scripts/gpu_triton_checks.py      (from the repository root)
"""

from __future__ import annotations

import importlib

import pytest
import torch

from tests.moe.test_triton_experts import test_fused_layer_equals_the_reference_in_bf16_on_a_gpu
from tests.moe.triton_interpreter_checks import (
    test_block_schedule_covers_every_row_once_within_its_expert,
    test_expert_column_sums_accumulate_each_slice_in_fp32,
    test_frozen_experts_get_no_gradient_and_launch_no_weight_gradient_kernel,
    test_fused_layer_equals_the_reference_path,
    test_gather_gemm_reads_and_writes_through_the_indices,
    test_row_offsets_are_64_bit,
)

#: The checks pytest collects from this module. The interpreter's bf16 layer check autocasts on the CPU, so it has no
#: place here: its GPU twin (autocast on CUDA, the tests' own) does.
__all__ = [
    "test_block_schedule_covers_every_row_once_within_its_expert",
    "test_expert_column_sums_accumulate_each_slice_in_fp32",
    "test_frozen_experts_get_no_gradient_and_launch_no_weight_gradient_kernel",
    "test_fused_layer_equals_the_reference_in_bf16_on_a_gpu",
    "test_fused_layer_equals_the_reference_path",
    "test_gather_gemm_reads_and_writes_through_the_indices",
    "test_row_offsets_are_64_bit",
]

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture(scope="module")
def kernels():
    """:mod:`mmoe.moe.triton_experts` compiled for the GPU (the interpreter checks' fixture of the same name builds it
    for the interpreter, and refuses to run without it)."""
    return importlib.import_module("mmoe.moe.triton_experts")


@pytest.fixture(autouse=True)
def tensors_on_the_gpu():
    torch.set_default_device("cuda")
    yield
    torch.set_default_device(None)
