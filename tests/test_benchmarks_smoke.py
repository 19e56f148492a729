"""The benchmarks still run and print their machine-readable lines (one small case each; no timing is asserted)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def run_benchmark(script: str, *argv: str) -> list[dict]:
    """``python benchmarks/<name>.py argv`` in its own process; its JSON lines."""
    done = subprocess.run([sys.executable, script, *argv], cwd=ROOT, capture_output=True, text=True, timeout=600,
                          check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    return json_lines(done.stdout)


def json_lines(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


@pytest.fixture()
def run_main(monkeypatch, capsys):
    """A benchmark's ``main`` run in this process as its command line would (``sys.argv``): its JSON lines. The
    imports a process of its own would pay again are most of a small case's time; the torch thread count is put
    back."""

    def run(script: str, *argv: str) -> list[dict]:
        module = load_benchmark(Path(script).stem)
        monkeypatch.setattr(sys, "argv", [script, *argv])
        threads = torch.get_num_threads()
        capsys.readouterr()
        try:
            module.main()
        finally:
            torch.set_num_threads(threads)
        return json_lines(capsys.readouterr().out)

    return run


def load_benchmark(name: str):
    """A benchmark script imported as a module (its ``main`` does not run)."""
    spec = importlib.util.spec_from_file_location(f"benchmarks_{name}", ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_moe_layer_benchmark_runs_the_selected_case_and_writes_its_profile(tmp_path, run_main):
    argv = ["--only", "top1_1024", "--rounds", "1", "--profile", str(tmp_path), "--split"]
    lines = run_main("benchmarks/moe_layer.py", *argv)
    assert [line["case"] for line in lines[:-1]] == ["top1_1024"]
    assert lines[0]["ratio"] == pytest.approx(lines[0]["moe_s"] / lines[0]["baseline_s"], rel=0.05)
    assert list(lines[0]["split"]) == ["route", "plan", "permute", "experts", "combine", "backward"]
    assert set(lines[-1]["summary"]) == {"top1_1024"}
    assert "aten::" in (tmp_path / "top1_1024.txt").read_text()


def test_moe_layer_time_split_times_every_phase_of_the_reference_path():
    moe_layer = load_benchmark("moe_layer")
    split = moe_layer.time_split(moe_layer.make_case("t", None, 32, 64, 4, 64))
    assert list(split) == ["route", "plan", "permute", "experts", "combine", "backward"]
    assert all(seconds > 0 for seconds in split.values()), split


@pytest.mark.parametrize(
    "fields,active_hidden",
    [
        (dict(top_k=4), 4 * 16),
        (dict(top_k=3, shared_experts=1), 4 * 16),
        (dict(bias_update_rate=1e-3), 16),
        (dict(capacity_factor=2.0, routing="expert_choice"), 2 * 16),
    ],
)
def test_moe_layer_router_cases_compare_with_the_dense_ffn_of_their_active_flops(fields, active_hidden):
    moe_layer = load_benchmark("moe_layer")
    case = moe_layer.make_case("t", None, 32, 16, 8, 64, **fields)
    assert case.info["baseline_hidden"] == active_hidden and case.info["load_cv"] >= 0
    case.moe(), case.baseline()
    if "routing" in fields:
        assert 0 <= case.info["unrouted_fraction"] < 1
        assert "shared_experts" not in moe_layer.time_split(case)
    if "shared_experts" in fields:
        assert moe_layer.time_split(case)["shared_experts"] > 0


@pytest.mark.parametrize("fields", [dict(top_k=4), dict(top_k=3, shared_experts=1), dict(top_k=2, heads=2)])
def test_forced_balanced_routing_gives_every_expert_the_same_rows_and_leaves_the_layer_alone(fields):
    load_benchmark("moe_layer")  # puts benchmarks/ on the path
    from moe_balanced import RoundRobinRouter, forced_balanced

    from mmoe.moe import MoEConfig, MoELayer
    from tests.moe.reference import reference_expert

    torch.manual_seed(0)
    layer = MoELayer(MoEConfig(32, 64, num_experts=8, router="linear", **fields)).double()
    with torch.no_grad():
        layer.router.scorer.weight.normal_()  # gates far from uniform
    balanced = forced_balanced(layer)
    assert isinstance(balanced.router, RoundRobinRouter) and not isinstance(layer.router, RoundRobinRouter)
    assert balanced.experts is layer.experts and balanced.router.router is layer.router  # the same parameters
    x = torch.randn(2, 16, 32, dtype=torch.double)
    y, routing = balanced(x)
    heads, top_k = fields.get("heads", 1), fields["top_k"]
    assert routing.expert_counts.tolist() == [2 * 16 * heads * top_k // 8] * 8
    choices_SK = routing.expert_index.reshape(-1, top_k)
    assert all(len(set(row.tolist())) == top_k for row in choices_SK)  # k distinct experts per (sub-)token
    assert not torch.equal(layer(x)[1].expert_index, routing.expert_index)  # the layer itself still routes
    if heads > 1:
        return
    # Each token: its round-robin experts weighted by the router's renormalised gate values for them.
    gates_SE = layer.router(x.reshape(-1, 32), None).scores_SE
    for s, x_D in enumerate(x.reshape(-1, 32)):
        weights = gates_SE[s, choices_SK[s]] / gates_SE[s, choices_SK[s]].sum()
        want = sum(
            w * reference_expert(layer.experts, int(e), x_D) for w, e in zip(weights, choices_SK[s], strict=True)
        )
        if layer.shared_experts is not None:
            want = want + reference_expert(layer.shared_experts, 0, x_D)
        torch.testing.assert_close(y.reshape(-1, 32)[s], want)


def test_moe_layer_case_times_the_routed_and_forced_balanced_layer_and_the_grouped_gemm_floor():
    moe_layer = load_benchmark("moe_layer")
    token_choice = moe_layer.make_case("t", None, 32, 16, 8, 64, top_k=4, shared_experts=1, floor_target=1.25)
    result = moe_layer.measure(token_choice, rounds=1)
    for key in ("moe_s", "balanced_s", "floor_s", "ratio", "balanced_ratio", "floor_ratio", "balanced_floor_ratio"):
        assert result[key] > 0, key
    assert result["balanced_floor_ratio"] == pytest.approx(result["balanced_s"] / result["floor_s"], rel=0.05)
    assert result["floor_ok"] == (result["balanced_floor_ratio"] <= 1.25)
    expert_choice = moe_layer.make_case("c", None, 32, 16, 8, 64, capacity_factor=1.0, routing="expert_choice")
    assert expert_choice.balanced is None  # balanced by construction: the routed time is reported for both
    result = moe_layer.measure(expert_choice, rounds=1)
    assert result["balanced_s"] == result["moe_s"] and "floor_ok" not in result
    stratified = moe_layer.make_case("s", None, 32, 16, 8, 64, top_k=2, strata=[4, 4])
    assert stratified.balanced is None and stratified.floor is None


def test_soft_moe_case_times_the_layer_against_the_dense_ffn_of_its_flops_and_its_plain_gemm_floor():
    """Soft MoE: the dense FFN of n*p/m of an expert's width, and the dispatch / experts / combine GEMMs as the floor,
    equal to the layer when given the layer's own weights."""
    moe_layer = load_benchmark("moe_layer")
    from moe_balanced import SoftMoEFloor

    case = moe_layer.make_case("soft", None, 32, 16, 4, 64, batch=4, routing="soft", slots_per_expert=2)
    assert case.balanced is None and case.floor is not None and case.info["baseline_hidden"] == 8  # 8 slots / 16
    result = moe_layer.measure(case, rounds=1)
    assert result["balanced_s"] == result["moe_s"] and result["floor_ratio"] > 0
    from mmoe.moe import MoEConfig, build_moe_layer

    layer = build_moe_layer(MoEConfig(32, 16, num_experts=4, routing="soft", slots_per_expert=2))
    floor = SoftMoEFloor(layer, 4, 16)
    x = torch.randn(4, 16, 32)
    with torch.no_grad():
        logits = layer.logits(x)
        floor.dispatch_BSL.copy_(torch.softmax(logits, dim=1).transpose(1, 2))
        floor.combine_BLS.copy_(torch.softmax(logits, dim=-1))
        torch.testing.assert_close(floor(x), layer(x)[0])


def test_expert_floor_runs_the_routed_rows_balanced():
    load_benchmark("moe_layer")
    from moe_balanced import ExpertFloor

    from mmoe.moe import MoEConfig, MoELayer

    top4 = ExpertFloor(MoELayer(MoEConfig(32, 16, num_experts=8, top_k=4, shared_experts=1, heads=2)), 64)
    assert (top4.routed, top4.rows, top4.width) == (4 * 128, 4 * 128 + 128, 16)
    assert top4(torch.randn(top4.rows, 16)).shape == (top4.rows, 16)
    choice = ExpertFloor(MoELayer(MoEConfig(32, 16, num_experts=8, routing="expert_choice", capacity_factor=1.5)), 60)
    assert choice.routed == choice.rows == 8 * 12  # E * ceil(1.5 * 60 / 8)


def test_moe_layer_cuda_cases_pair_each_fused_case_with_a_graphed_twin():
    builders = {build.args[0]: build for build in load_benchmark("moe_layer").cuda_cases()}  # not built: needs CUDA
    eager = [name for name in builders if name.endswith("_triton")]
    assert len(eager) == 5
    for name in eager:
        build, twin = builders[name], builders[f"{name}_graphed"]
        assert twin.keywords == {**build.keywords, "graphed": True} and build.keywords["expert_kernels"] == "triton"
        assert twin.args[2:] == build.args[2:]  # the same shapes; only the name and the target differ
        assert twin.args[1] < build.args[1]  # graphing takes the launch cost out: a tighter target


@pytest.mark.slow
def test_moe_layer_benchmark_runs_the_stratified_case(run_main):
    lines = run_main("benchmarks/moe_layer.py", "--only", "stratified_4_4_vs_top2_4096", "--rounds", "1")
    assert lines[0]["case"] == "stratified_4_4_vs_top2_4096" and lines[0]["strata"] == [4, 4]
    assert 1.0 <= lines[0]["requested_capacity"] <= 2.0  # FFN passes per token, one per stratum at most


@pytest.mark.slow
def test_backbone_benchmark_compares_the_tiny_shape(run_main):
    lines = run_main("benchmarks/backbone.py", "--shapes", "tiny", "--rounds", "1")
    models = {line["model"] for line in lines if "model" in line}
    assert {"dense", "xmoe", "mhmoe_h4"} <= models
    comparisons = [line["comparison"] for line in lines if "comparison" in line]
    assert "tiny: xmoe step / dense step" in comparisons


def test_vqkd_targets_benchmark_times_the_released_tokenizer_shape():
    from mmoe.model.vqkd import vqkd_cost

    vqkd_targets = load_benchmark("vqkd_targets")
    threads = torch.get_num_threads()
    try:
        line = vqkd_targets.per_image_case(grid=1, batch=1, rounds=1, threads=1)
    finally:
        torch.set_num_threads(threads)
    assert (line["case"], line["image_size"]) == ("per_image", 16) and line["seconds_per_image"] > 0
    assert line["gflops_per_image"] == round(vqkd_cost(vqkd_targets.RELEASED, 1)["flops_per_image"] / 1e9, 2)


def test_retrieval_benchmark_times_embedding_and_the_chunked_evaluation():
    argv = ["--rounds", "1", "--batch", "4", "--images", "40", "--dim", "16", "--chunks", "7", "200"]
    lines = run_benchmark("benchmarks/retrieval.py", *argv)
    embed = {line["modality"]: line for line in lines if line["benchmark"] == "embed"}
    assert set(embed) == {"image", "text"} and all(line["items_per_s"] > 0 for line in embed.values())
    evals = [line for line in lines if line["benchmark"] == "chunked_eval"]
    assert [line["chunk"] for line in evals] == [7, 200] and all(line["captions"] == 200 for line in evals)
    assert all(line["seconds"] >= 0 and line["peak_extra_mib"] >= 0 for line in evals)


def test_optimizer_step_benchmark_times_each_adamw_on_the_demos_captioning_parameters(run_main):
    lines = run_main("benchmarks/optimizer_step.py", "--rounds", "1")
    steps = {line["implementation"]: line for line in lines if "implementation" in line}
    assert set(steps) == {"fused", "foreach", "default"} and all(line["step_s"] > 0 for line in steps.values())
    assert len({line["parameters"] for line in steps.values()}) == 1
    ratios = {line["comparison"]: line["ratio"] for line in lines if "comparison" in line}
    expected = steps["default"]["step_s"] / steps["fused"]["step_s"]
    assert ratios["default_step / fused_step"] == pytest.approx(expected)


def test_synth_corpus_benchmark_compares_worker_processes_with_one():
    (line,) = run_benchmark("benchmarks/synth_corpus.py", "--size", "tiny", "--nlvr2-eval-sets", "3", "--rounds", "1",
                            "--workers", "2")  # fmt: skip
    assert line["case"] == "synth_corpus" and line["workers"] == 2
    assert line["ratio"] == pytest.approx(line["workers_s"] / line["one_process_s"], rel=0.05)


def test_routing_logging_benchmark_times_the_callback_within_each_tier(tmp_path):
    routing_logging = load_benchmark("routing_logging")
    for tier in ("brief", "detailed"):
        line = routing_logging.run(tier, *routing_logging.quick_case(), tmp_path / tier)
        assert (line["tier"], line["steps"], line["every_n_steps"]) == (tier, 6, 2)
        assert 0 < line["callback_s"] < line["train_s"] and line["share"] > 0
        assert (tmp_path / tier / "tensorboard").is_dir()


def test_caption_decode_benchmark_compares_both_ways_and_their_captions(capsys):
    load_benchmark("caption_decode").main(["--rounds", "1", "--sizes", "32", "--batch", "2", "--preset", "test"])
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [line["head"] for line in lines] == ["whole_vocabulary", "output_vocab"]
    assert lines[0]["classes"] == 49410 and lines[1]["classes"] < 200
    for line in lines:
        assert line["image_size"] == 32 and line["image_tokens"] == 5 and line["same_captions"] is True
        assert line["ratio"] == pytest.approx(line["whole_s"] / line["cached_s"], rel=0.05)


def test_host_memory_benchmark_compares_a_process_with_freed_memory_kept_and_one_without():
    lines = run_benchmark("benchmarks/host_memory.py", "--rounds", "1", "--steps", "5")
    assert [line["keep_freed_memory"] for line in lines[:2]] == [False, True]
    assert all(line["step_s"] > 0 and line["max_rss_mb"] > 0 for line in lines[:2])
    # The text embedding's 38 MB gradient alone is 9,263 pages faulted in anew each step with glibc's defaults. With
    # freed memory kept, a step faults 50 to 3,100 pages as the heap settles, now and then a whole 38 MB block again
    # (9,313 in one single-step run): the mean over 5 steps stays below half of those 9,263 even with one such step.
    default, kept = (line["minor_faults_per_step"] for line in lines[:2])
    assert default > 9263 > 2 * kept, (default, kept)
    assert [line["comparison"] for line in lines[2:]] == ["kept_step / default_step",
                                                          "kept_minor_faults / default_minor_faults"]  # fmt: skip


def test_process_exit_benchmark_compares_a_frozen_exit_with_the_interpreter_s_own():
    lines = run_benchmark("benchmarks/process_exit.py", "--rounds", "1", "--module", "torch")
    assert [line["freeze_at_exit"] for line in lines[:2]] == [False, True]
    for line in lines[:2]:
        assert line["work_cpu_s"] > 0 and line["exit_cpu_s"] >= 0
        assert line["total_cpu_s"] == pytest.approx(line["work_cpu_s"] + line["exit_cpu_s"])
    assert [line["comparison"] for line in lines[2:]] == ["frozen_exit / default_exit", "frozen_total / default_total"]
    exits = lines[2]
    assert exits["ratio"] == pytest.approx(exits["frozen"] / exits["default"])
    assert (exits["default"], exits["frozen"]) == (lines[0]["exit_cpu_s"], lines[1]["exit_cpu_s"])


def test_machine_speed_prints_its_fixed_workload_in_seconds(run_main):
    (line,) = run_main("benchmarks/machine_speed.py", "--repeats", "1")
    assert line["import_torch_user_s"] > 0 and line["import_torch_wall_s"] >= line["import_torch_user_s"] / 2
    assert line["gemm_s"] > 0 and line["gemm_gflops"] == pytest.approx(2 * 1024**3 / line["gemm_s"] / 1e9, rel=0.01)
    assert line["train_step_s"] > 0 and line["torch"] == torch.__version__


def test_moe_layer_training_cases_pad_their_sequences_and_accumulate_gradients_when_asked():
    moe_layer = load_benchmark("moe_layer")
    padding = moe_layer.training_padding(4, 8, 0.25, "cpu")
    assert padding.sum(1).tolist() == [0, 1, 1, 2]  # the first sequence whole, the last 25 % short
    case = moe_layer.make_case("t", None, 32, 16, 4, 64, batch=4, padded=0.25, accumulate=True)
    assert (case.info["batch"], case.info["padded"], case.info["accumulate"]) == (4, 0.25, True)
    assert {"moe_s", "baseline_s", "balanced_s", "floor_s"} <= set(moe_layer.measure(case, rounds=1))
    layer = moe_layer.build_moe_layer(moe_layer.MoEConfig(32, 16, num_experts=4))
    x, grad = torch.randn(4, 16, 32, requires_grad=True), torch.randn(4, 16, 32)
    for accumulate in (False, True):
        sides = moe_layer.TensorOutputs(layer, moe_layer.training_padding(4, 16, 0.25, "cpu"))
        run = moe_layer.step(sides, x, grad, True, accumulate)
        run()
        first = [parameter.grad for parameter in layer.parameters()]
        assert all(g is None for g in first) != accumulate  # None as the optimiser leaves them, or kept
        if accumulate:
            first = [g.clone() for g in first]
            run()
            assert all(torch.allclose(p.grad, 2 * f, atol=1e-6) for p, f in zip(layer.parameters(), first, strict=True))


def test_depth_routing_benchmark_times_the_routed_block_against_its_floor(run_main):
    lines = run_main("benchmarks/depth_routing.py", "--rounds", "1", "--capacities", "0.25")
    cases = [(line["case"], line["capacity"]) for line in lines if "case" in line]
    assert cases == [("plain", 0.25), ("routed", 0.25), ("floor", 0.25)]
    comparisons = [line["comparison"] for line in lines if "comparison" in line]
    assert comparisons == ["C=0.25: routed step / floor step", "C=0.25: plain step / routed step"]


def test_moe_layer_top_p_case_runs_at_its_target_and_balances_only_the_real_choices():
    moe_layer = load_benchmark("moe_layer")
    from moe_balanced import forced_balanced

    case = moe_layer.make_case("p", None, 32, 16, 8, 64, top_p=0.4, target_active_experts=2.0, renormalize=False)
    assert case.info["baseline_hidden"] == 2 * 16 and 0 < case.info["calibrated_top_p"] < 1
    case.moe(), case.balanced(), case.floor()
    layer = moe_layer.build_moe_layer(moe_layer.MoEConfig(32, 16, num_experts=8, router="linear", top_p=0.5))
    x = torch.randn(1, 64, 32)
    used = (layer(x)[1].expert_index >= 0).sum(-1)
    balanced = forced_balanced(layer)(x)[1]
    assert torch.equal((balanced.expert_index >= 0).sum(-1), used)  # the same number of experts per token
    assert balanced.expert_counts.max() - balanced.expert_counts.min() <= 1  # spread over the experts in turn


def test_config_parse_benchmark_compares_the_named_parser_with_every_parser_and_a_parse_with_its_check(run_main):
    lines = run_main("benchmarks/config_parse.py", "--rounds", "1")
    cases = {line["case"]: line["cpu_s"] for line in lines if "case" in line}
    assert set(cases) == {"named_parser", "every_parser", "checked", "unchecked"} and min(cases.values()) > 0
    ratios = {line["comparison"]: line["ratio"] for line in lines if "comparison" in line}
    assert ratios["named_parser / every_parser"] == pytest.approx(cases["named_parser"] / cases["every_parser"])
    assert ratios["unchecked / checked"] == pytest.approx(cases["unchecked"] / cases["checked"])


def test_data_workers_benchmark_compares_workers_forked_from_a_fork_server_with_forked_ones():
    lines = run_benchmark("benchmarks/data_workers.py", "--rounds", "1", "--steps", "3")
    assert [line["start_method"] for line in lines[:2]] == ["fork", "forkserver"]
    assert all(line["epoch_s"] > 0 and line["cpu_s"] > 0 for line in lines[:2])
    # A worker forked from the training process shares its pages: the first write to each page it holds (the
    # parameters, AdamW's state and the heap's buffers, over 100 MB) faults after the worker starts. A worker from the
    # fork server shares none of them.
    forked, served = (line["minor_faults"] for line in lines[:2])
    assert forked > 2 * served, (forked, served)
    assert [line["comparison"] for line in lines[2:]] == [
        "server_epoch / forked_epoch",
        "server_cpu / forked_cpu",
        "server_minor_faults / forked_minor_faults",
    ]
