"""Every kernel variant an MoE layer launches with ``expert_kernels="triton"``, compiled ahead of time for an H100
(sm_90) on the CPU: Hopper's wgmma tensor-core path for 16-bit inputs, exact fp32 (no TF32 MMA) for 32-bit ones, no
register spills, shared memory within the H100's 227 KB.

The launches are recorded, not run: the layer runs forward and backward on CPU tensors with
:func:`mmoe.moe.triton_experts.launch` replaced by a recorder, so the variants are the ones the layer's own code
picks at GPU shapes (d 768, H 3072, 16K tokens, E 8 / 32, top-1 / top-2, MH-MoE, Sub-LN). Each is specialised as
Triton's JIT would specialise it (``native_specialize_impl``: integer widths, 16-byte divisibility, arguments equal
to 1 as constants) and compiled with Triton's bundled ``ptxas``."""

from __future__ import annotations

import re
import subprocess
from dataclasses import dataclass

import pytest
import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import get_ptxas
from triton.compiler import ASTSource, make_backend
from triton.runtime.jit import native_specialize_impl

import mmoe.moe.triton_expert_kernels as kernel_functions
import mmoe.moe.triton_experts as kernels
from mmoe.moe import MoEConfig, build_moe_layer

HOPPER = GPUTarget("cuda", 90, 32)
H100_SHARED_MEMORY = 227 * 1024

LAYERS = {
    "top-1, E 8, 16K tokens": (dict(num_experts=8, top_k=1), 16384, torch.bfloat16),
    "top-2, E 8, 16K tokens": (dict(num_experts=8, top_k=2), 16384, torch.bfloat16),
    "top-1, E 32, 16K tokens": (dict(num_experts=32, top_k=1), 16384, torch.bfloat16),
    "top-1, E 32, 2K tokens (small slices)": (dict(num_experts=32, top_k=1), 2048, torch.bfloat16),
    "MH-MoE h 4, 16K tokens": (dict(num_experts=8, top_k=1, heads=4), 16384, torch.bfloat16),
    "Sub-LN top-2, 2K tokens": (dict(num_experts=8, top_k=2, subln=True), 2048, torch.bfloat16),
    "Sub-LN top-2, fp32": (dict(num_experts=8, top_k=2, subln=True), 1024, torch.float32),
}


@dataclass(frozen=True)
class Variant:
    kernel: str
    signature: tuple
    constants: tuple
    attrs: tuple
    num_warps: int
    num_stages: int
    dtype: torch.dtype


def record_launches(options: dict, tokens: int, dtype: torch.dtype, monkeypatch) -> list[Variant]:
    backend = make_backend(HOPPER)
    variants = []

    def record(kernel, grid, args, num_warps, num_stages, **constexprs):
        signature, constants, attrs = {}, dict(constexprs), {}
        runtime = iter(args)
        for index, param in enumerate(kernel.params):
            if param.is_constexpr:
                signature[param.name] = "constexpr"
                continue
            kind, attr = native_specialize_impl(type(backend), next(runtime), False, True, True)
            signature[param.name] = kind
            if kind == "constexpr":
                constants[param.name] = 1
            else:
                attrs[(index,)] = backend.parse_attr(attr or "")
        variants.append(
            Variant(kernel.fn.__name__, tuple(signature.items()), tuple(sorted(constants.items())),
                    tuple(sorted((k, tuple(map(tuple, v))) for k, v in attrs.items())), num_warps, num_stages, dtype)
        )  # fmt: skip

    monkeypatch.setattr(kernels, "launch", record)
    monkeypatch.setattr(kernels, "usable_on", lambda x: True)
    torch.manual_seed(0)
    layer = build_moe_layer(MoEConfig(dim=768, ffn_dim=3072, expert_kernels="triton", **options)).to(dtype)
    x = torch.randn(1, tokens, 768, dtype=dtype, requires_grad=True)
    y, routing = layer(x)  # the kernels do not run: outputs are uninitialised, only the launches matter
    (y.float().sum() + routing.balance_loss).backward()
    return variants


@pytest.fixture(scope="module")
def launched_variants():
    variants: dict[Variant, list[str]] = {}
    with pytest.MonkeyPatch.context() as monkeypatch:
        for name, (options, tokens, dtype) in LAYERS.items():
            for variant in record_launches(options, tokens, dtype, monkeypatch):
                variants.setdefault(variant, []).append(name)
    return variants


@dataclass
class Compiled:
    ttgir: str
    ptx: str
    shared: int
    ptxas_report: str


def compile_for_hopper(variant: Variant, tmp_path) -> Compiled:
    backend = make_backend(HOPPER)
    function = getattr(kernel_functions, variant.kernel)
    source = ASTSource(
        fn=function,
        signature=dict(variant.signature),
        constexprs=dict(variant.constants),
        attrs={key: [list(a) for a in value] for key, value in variant.attrs},
    )
    options = backend.parse_options({"num_warps": variant.num_warps, "num_stages": variant.num_stages})
    compiled = triton.compile(source, target=HOPPER, options=options.__dict__)
    ptx_file = tmp_path / f"{variant.kernel}.ptx"
    ptx_file.write_text(compiled.asm["ptx"])
    ptxas = get_ptxas(90).path
    report = subprocess.run([ptxas, "-arch=sm_90a", "-v", str(ptx_file), "-o", "/dev/null"],
                            capture_output=True, text=True, check=True)  # fmt: skip
    return Compiled(compiled.asm["ttgir"], compiled.asm["ptx"], compiled.metadata.shared, report.stdout + report.stderr)


def describe(variant: Variant) -> str:
    constants = {k: v for k, v in variant.constants if k.isupper()}
    return f"{variant.kernel} {constants} warps={variant.num_warps} stages={variant.num_stages}"


def test_the_layer_launches_every_kernel_and_both_tile_sizes(launched_variants):
    names = {variant.kernel for variant in launched_variants}
    assert names == {"block_schedule_kernel", "gather_gemm_kernel", "weight_grad_kernel",
                     "expert_column_sums_kernel"}  # fmt: skip
    gemm_rows = {dict(v.constants)["BLOCK_M"] for v in launched_variants if v.kernel == "gather_gemm_kernel"}
    assert gemm_rows == {kernels.FP32_TILES.block_m, kernels.SMALL_SLICE_TILES.block_m,
                         kernels.LARGE_SLICE_TILES.block_m}  # fmt: skip
    epilogues = {dict(v.constants)["EPILOGUE"] for v in launched_variants if v.kernel == "gather_gemm_kernel"}
    assert epilogues == {kernel_functions.NO_EPILOGUE, kernel_functions.GELU, kernel_functions.GELU_GRAD}


def test_every_launched_variant_compiles_for_hopper_within_its_limits(launched_variants, tmp_path):
    failures = []
    for variant, layers in launched_variants.items():
        compiled = compile_for_hopper(variant, tmp_path)
        has_dot = variant.kernel in ("gather_gemm_kernel", "weight_grad_kernel")
        problems = []
        spills = [int(n) for n in re.findall(r"(\d+) bytes spill stores", compiled.ptxas_report)]
        if not spills or any(spills):
            problems.append(f"spill stores {spills}")
        if compiled.shared > H100_SHARED_MEMORY:
            problems.append(f"shared memory {compiled.shared} B > {H100_SHARED_MEMORY} B")
        if has_dot and variant.dtype != torch.float32:
            if "warp_group_dot" not in compiled.ttgir or "wgmma.mma_async" not in compiled.ptx:
                problems.append("no wgmma")
        if has_dot and variant.dtype == torch.float32 and ("mma" in compiled.ptx or "tf32" in compiled.ttgir):
            problems.append("fp32 inputs reach a tensor-core MMA (TF32), not exact fp32")
        if problems:
            failures.append(f"{describe(variant)} (from {layers[0]}): {', '.join(problems)}")
    assert not failures, "\n".join(failures)


def test_a_tf32_dot_would_be_caught(tmp_path):
    """The fp32 check can fail: the same gather GEMM asked for TF32 compiles to a tensor-core MMA."""
    launched = [v for v in launched_variants_of("Sub-LN top-2, fp32") if v.kernel == "gather_gemm_kernel"]
    constants = dict(launched[0].constants) | {"INPUT_PRECISION": "tf32"}
    tf32 = Variant(launched[0].kernel, launched[0].signature, tuple(sorted(constants.items())), launched[0].attrs,
                   launched[0].num_warps, launched[0].num_stages, torch.float32)  # fmt: skip
    assert "mma" in compile_for_hopper(tf32, tmp_path).ptx


def launched_variants_of(layer: str) -> list[Variant]:
    options, tokens, dtype = LAYERS[layer]
    with pytest.MonkeyPatch.context() as monkeypatch:
        return record_launches(options, tokens, dtype, monkeypatch)
