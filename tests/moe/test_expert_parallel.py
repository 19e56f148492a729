"""Expert parallelism with 2 CPU processes (gloo): a sharded MoE layer gives the unsharded layer's outputs, balance
loss and (data-parallel averaged) gradients on the same tokens, and its checkpoints hold every expert whatever the
world size."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from mmoe.moe import MoEConfig, MoELayer
from mmoe.moe.expert_parallel import EXPERT_PARALLEL_ATTRIBUTE, check_expert_parallel, expert_parallel_groups
from tests.gloo import spawn_gloo

WORLD = 2
CASES = (
    {"top_k": 1},
    {"top_k": 2},
    {"top_k": 2, "renormalize": False, "heads": 2},
    {"top_k": 1, "capacity_factor": 0.5},
    {"top_k": 2, "router": "linear", "subln": True},
    {"top_k": 3, "shared_experts": 1},
    {"routing": "expert_choice", "capacity_factor": 1.5, "heads": 2},
)


def rank_inputs(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(2, 9, 16, generator=generator)
    padding = torch.zeros(2, 9, dtype=torch.bool)
    padding[rank, 6:] = True  # different padding on each rank
    return x, padding


def loss_of(layer: MoELayer, x: torch.Tensor, padding: torch.Tensor):
    y, routing = layer(x, padding)
    return y, routing, y.pow(2).mean() + 0.1 * routing.balance_loss


def check_case(rank: int, options: dict) -> None:
    torch.manual_seed(0)
    config = MoEConfig(dim=16, ffn_dim=32, num_experts=4, **options)
    reference, sharded = MoELayer(config), MoELayer(config)
    sharded.load_state_dict(reference.state_dict())
    full_state = {key: value.clone() for key, value in reference.state_dict().items()}
    expert_shard = sharded.shard_experts(expert_parallel_groups(WORLD))
    assert sharded.experts.fc1_weight.shape[0] == 2 and expert_shard.first == 2 * rank

    # Reference: one process runs every rank's tokens; data-parallel averaging = mean of the ranks' gradients.
    for source in range(WORLD):
        x, padding = rank_inputs(source)
        y_ref, routing_ref, loss = loss_of(reference, x, padding)
        (loss / WORLD).backward()
        if source == rank:
            mine = (y_ref.detach(), routing_ref.balance_loss.detach(), routing_ref.expert_counts)
    x, padding = rank_inputs(rank)
    y, routing, loss = loss_of(sharded, x, padding)
    loss.backward()
    for parameter in sharded.parameters():  # what DDP does to the parameters every rank holds
        if parameter.grad is not None and not getattr(parameter, EXPERT_PARALLEL_ATTRIBUTE, False):
            dist.all_reduce(parameter.grad)
            parameter.grad /= WORLD
    torch.testing.assert_close(y.detach(), mine[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(routing.balance_loss.detach(), mine[1])
    assert torch.equal(routing.expert_counts, mine[2])
    expected = dict(reference.named_parameters())
    for name, parameter in sharded.named_parameters():
        want = expected[name].grad
        if getattr(parameter, EXPERT_PARALLEL_ATTRIBUTE, False):
            want = want[expert_shard.first : expert_shard.first + expert_shard.local]
        if want is None:
            assert parameter.grad is None, name
            continue
        torch.testing.assert_close(parameter.grad, want, rtol=1e-4, atol=1e-6, msg=f"{options} {name}")

    # Checkpoints: the sharded layer saves every expert; a full state loads into it (its slice) and into one process.
    state = sharded.state_dict()
    assert state.keys() == full_state.keys()
    for key, value in full_state.items():
        assert torch.equal(state[key], value), key
    single = MoELayer(config)
    single.load_state_dict(state)
    resharded = MoELayer(config)
    resharded.shard_experts(expert_parallel_groups(WORLD))
    resharded.load_state_dict(full_state)
    assert torch.equal(resharded.experts.fc2_weight, full_state["experts.fc2_weight"][2 * rank : 2 * rank + 2])


def every_case(rank: int) -> None:
    for options in CASES:
        check_case(rank, options)


def test_two_process_expert_parallel_layer_equals_the_unsharded_layer(tmp_path):
    spawn_gloo(every_case, WORLD, tmp_path)


@pytest.mark.parametrize(
    "experts,parallel,world,named",
    [(6, 4, 4, "num_experts=6 is not divisible by expert_parallel=4"), (8, 4, 6, "does not divide the world size 6"),
     (8, 0, 2, "expert_parallel must be >= 1")],
)  # fmt: skip
def test_bad_expert_parallel_sizes_are_one_clear_line(experts, parallel, world, named):
    with pytest.raises(ValueError, match=named) as error:
        check_expert_parallel(experts, parallel, world)
    assert "\n" not in str(error.value)


ROOT = Path(__file__).resolve().parents[2]
FIT_SCRIPT = ROOT / "tests" / "scripts" / "expert_parallel_fit.py"


def fit(out: Path, devices: int, expert_parallel: int, steps: int, resume: Path | None = None, fsdp=False) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    argv = [sys.executable, str(FIT_SCRIPT), str(out), str(devices), str(expert_parallel), str(steps)]
    argv += ([str(resume)] if resume else []) + (["--fsdp"] if fsdp else [])
    result = subprocess.run(argv, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    return torch.load(out / "final.pt", weights_only=True)


def assert_same_weights(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=1e-4, atol=1e-6, msg=key)


@pytest.mark.slow
def test_expert_parallel_fit_equals_one_process_and_resumes_at_any_world_size(tmp_path):
    """mmoe's BackboneTask with expert_parallel: 2 on 2 gloo processes reaches the weights of one process on the same
    global batch; checkpoints hold every expert and their optimiser state, so a run resumes at either size."""
    single = fit(tmp_path / "single", 1, 1, 3)
    parallel = fit(tmp_path / "parallel", 2, 2, 3)
    assert_same_weights(parallel, single)
    assert parallel["backbone.layers.0.ffn.0.experts.fc1_weight"].shape[0] == 4  # every expert in the checkpoint
    from mmoe.runtime.checkpoint import load_backbone

    loaded = load_backbone(tmp_path / "parallel" / "last.ckpt")  # as mmoe viz / analyze / export-backbone read it
    assert loaded.config.moe.expert_parallel == 1
    torch.testing.assert_close(loaded.state_dict()["layers.0.ffn.0.experts.fc1_weight"],
                               parallel["backbone.layers.0.ffn.0.experts.fc1_weight"])  # fmt: skip
    single_more = fit(tmp_path / "single_more", 1, 1, 5, resume=tmp_path / "single" / "last.ckpt")
    # one process's checkpoint resumed at EP = 2, and EP = 2's resumed in one process
    assert_same_weights(fit(tmp_path / "up", 2, 2, 5, resume=tmp_path / "single" / "last.ckpt"), single_more)
    assert_same_weights(fit(tmp_path / "down", 1, 1, 5, resume=tmp_path / "parallel" / "last.ckpt"), single_more)


def test_expert_parallel_outside_a_distributed_run_is_one_clear_line():
    from tests.scripts.expert_parallel_fit import SquaredHidden

    task = SquaredHidden(expert_parallel=2)
    with pytest.raises(ValueError, match="needs a distributed run") as error:
        task.setup("fit")
    assert "\n" not in str(error.value)
    with pytest.raises(ValueError, match="not divisible by MoEPlan.expert_parallel=3"):
        from mmoe.model import MoEPlan

        MoEPlan(num_experts=4, expert_parallel=3)


def test_stratified_plans_refuse_expert_parallelism_in_one_line():
    from mmoe.model import MoEPlan

    with pytest.raises(ValueError, match="Stratified MoE layers are not expert-sharded") as error:
        MoEPlan(num_experts=4, top_k=2, strata=[2, 2], expert_parallel=2)
    assert "\n" not in str(error.value)
    assert MoEPlan(num_experts=4, top_k=2, strata=[2, 2], expert_parallel=1).expert_parallel == 1


@pytest.mark.parametrize("strata", [None, [2, 2]])
def test_expert_parallelism_shards_plain_moe_layers_only(strata):
    """What a run's setup shards (mmoe.runtime.expert_parallel): every plain MoELayer, never a Stratified layer (even
    when a plan is changed after its checks: a Stratified layer has no shard_experts)."""
    from mmoe.model import MoEPlan, MultiwayConfig, MultiwayTransformer
    from mmoe.moe import StratifiedMoELayer
    from mmoe.runtime.expert_parallel import expert_parallel_layers

    plan = MoEPlan(num_experts=4, top_k=2, strata=strata, every=1)
    config = MultiwayConfig.preset("test", moe=plan)
    backbone = MultiwayTransformer(config)
    layers = [slot.layer for slot in backbone.moe_layers()]
    assert len(layers) == 4
    if strata is None:
        assert expert_parallel_layers(backbone) == layers
    else:
        assert all(type(layer) is StratifiedMoELayer for layer in layers)
        assert expert_parallel_layers(backbone) == []
        assert not any(hasattr(layer, "shard_experts") for layer in layers)


@pytest.mark.parametrize("frozen", [False, True])
def test_grouped_experts_keep_their_shard_with_declared_attributes(frozen):
    """GroupedExperts.keep_shard (no collective until state_dict): the rank's slice of every expert tensor, marked
    expert-parallel, with its requires_grad (frozen experts stay frozen), and the shard recorded on the module."""
    from mmoe.moe import GroupedExperts
    from mmoe.moe.expert_parallel import ExpertShard

    torch.manual_seed(0)
    experts = GroupedExperts(4, 8, 16, subln=True).requires_grad_(not frozen)
    assert experts.shard is None
    full = {name: parameter.detach().clone() for name, parameter in experts.named_parameters()}
    shard = ExpertShard(group=None, size=2, rank=1, num_experts=4)
    experts.keep_shard(shard)
    assert experts.shard is shard and experts.num_experts == 2
    for name, parameter in experts.named_parameters():
        assert torch.equal(parameter, full[name][2:4]), name
        assert getattr(parameter, EXPERT_PARALLEL_ATTRIBUTE) and parameter.requires_grad is not frozen
    with pytest.raises(ValueError, match="sharded already"):
        experts.keep_shard(shard)
