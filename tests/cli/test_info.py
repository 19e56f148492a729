"""``mmoe info``: whole-model counts against the modules, BEiT-3 base's published sizes, and bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from torch.utils.flop_counter import FlopCounterMode

from mmoe.cli import main
from mmoe.commands.info import variant_name
from mmoe.model import MoEPlan, MultiwayConfig, MultiwayTransformer
from mmoe.model.cost import backbone_cost, backbone_parameters
from mmoe.model.vqkd import vqkd_cost
from mmoe.moe import MoEConfig, MoELayer
from mmoe.moe.cost import active_parameters_per_token, flops_per_token, gate_cost
from mmoe.runtime.checkpoint import config_to_dict
from mmoe.tasks.captioning import CaptioningFineTuning
from mmoe.tasks.nlvr2 import NLVR2FineTuning
from mmoe.tasks.pretraining import MaskedPretraining
from mmoe.tasks.retrieval import RetrievalFineTuning
from mmoe.tasks.visual_codebook import PatchCodebook
from mmoe.tasks.vqa import VQAFineTuning
from mmoe.vocabulary import VOCAB_SIZE
from tests.model.vqkd_reference import released_state, save_released

VARIANTS = {
    "dense": None,
    "xmoe": MoEPlan(num_experts=4),
    "switch": MoEPlan(num_experts=4, router="linear", top_k=2),
    "mhmoe": MoEPlan(num_experts=4, heads=4, top_k=2),
    "stratified": MoEPlan(num_experts=4, strata=[2, 2], top_k=2),
    "fine_grained_shared": MoEPlan(num_experts=8, top_k=3, beta=0.25, shared_experts=1),
    "expert_choice": MoEPlan(num_experts=4, routing="expert_choice", capacity_factor=2.0),
    "loss_free_global": MoEPlan(num_experts=4, top_k=2, bias_update_rate=1e-3, balance_batch="global"),
}


def tiny(plan: MoEPlan | None) -> MultiwayConfig:
    return MultiwayConfig.preset("test", moe=plan)


def count(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def task_files(root: Path) -> dict:
    answers = root / "answers.json"
    answers.write_text(json.dumps(["yes", "no", "two", "red", "cat"]))
    codebook = root / "codebook.pt"
    PatchCodebook(torch.randn(12, 3 * 2 * 2), patch_size=16, pool=2).save(codebook)
    return {"answers": str(answers), "codebook": str(codebook)}


def built_tasks(config: MultiwayConfig, files: dict) -> dict:
    """class path -> (the task module, its init arguments besides the backbone); captioning refuses expert choice."""
    tasks = {
        VQAFineTuning: {"answer_vocab": files["answers"]},
        NLVR2FineTuning: {},
        CaptioningFineTuning: {"max_length": 8},
        RetrievalFineTuning: {},
        MaskedPretraining: {"visual_codebook": files["codebook"]},
    }
    if config.moe is not None and config.moe.routing == "expert_choice":
        del tasks[CaptioningFineTuning]
    return {f"{cls.__module__}.{cls.__name__}": (cls(backbone=config, **args), args) for cls, args in tasks.items()}


def run_info(argv: list[str], capsys) -> tuple[int, dict | None, str]:
    code = main(["info", *argv, "--json"])
    captured = capsys.readouterr()
    return code, json.loads(captured.out) if code == 0 else None, captured.err


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_totals_equal_the_task_modules(variant, tmp_path, capsys):
    config = tiny(VARIANTS[variant])
    for class_path, (task, args) in built_tasks(config, task_files(tmp_path)).items():
        path = tmp_path / "fit.yaml"
        document = {"model": {"class_path": class_path, "init_args": {"backbone": config_to_dict(config), **args}}}
        path.write_text(yaml.safe_dump(document))
        code, result, err = run_info(["--config", str(path)], capsys)
        assert code == 0, err
        assert result["total_parameters"] == count(task), class_path
        assert result["backbone"]["parameters"] == count(task.backbone)
        assert [layer["parameters"] for layer in result["backbone"]["layers"]] == [
            count(layer) for layer in task.backbone.layers
        ]
        # A Lightning checkpoint of the same task: the head is counted from its weights.
        ckpt = tmp_path / "task.ckpt"
        hyper_parameters = {"backbone": config_to_dict(config), "_class_path": class_path}
        torch.save({"hyper_parameters": hyper_parameters, "state_dict": task.state_dict()}, ckpt)
        code, from_ckpt, err = run_info(["--ckpt", str(ckpt)], capsys)
        assert code == 0, err
        assert from_ckpt["total_parameters"] == count(task), class_path
        assert from_ckpt["task"] == class_path
        assert from_ckpt["head_flops_per_prediction"] == result["head_flops_per_prediction"]


def test_dense_forward_flops_equal_a_counted_forward():
    """Weights' FLOPs per token against torch's FLOP counter on a text-only forward (no embedding matmul)."""
    config = tiny(None)
    batch, length = 3, 10
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        MultiwayTransformer(config).eval()(text=torch.randint(0, VOCAB_SIZE, (batch, length)))
    counts = counter.get_flop_counts()["Global"]
    linear = sum(flops for op, flops in counts.items() if "mm" in str(op) and "bmm" not in str(op))
    assert linear == batch * length * backbone_cost(config, length)["flops_per_token"]


def way_parameters(backbone: MultiwayTransformer, way: int) -> int:
    """Parameters a token of modality ``way`` passes through in the layers and the final LayerNorm (dense FFNs)."""
    marks = [f"attention.norm.{way}.", f"attention.qkv.{way}.", f"attention.inner_norm.{way}.",
             f"attention.out.{way}.", f"ffn.{way}.", f"ffn_norm.{way}.", f"final_norm.{way}."]  # fmt: skip
    return sum(p.numel() for name, p in backbone.named_parameters() if any(mark in name for mark in marks))


def test_dense_active_parameters_are_one_modality_way():
    backbone = MultiwayTransformer(tiny(None))
    cost = backbone_cost(backbone.config, 8)
    assert cost["active_parameters_per_token"] == way_parameters(backbone, 0) == way_parameters(backbone, 1)
    assert cost["active_parameters_per_token"] == cost["max_active_parameters_per_token"]


@pytest.mark.parametrize(
    "fields",
    [
        dict(router="xmoe", top_k=1),
        dict(router="linear", top_k=2),
        dict(router="xmoe", heads=2, top_k=1),
        dict(router="xmoe", top_k=3, shared_experts=1, beta=0.25),
        dict(router="linear", top_k=4, shared_experts=2, beta=0.5),
        dict(router="xmoe", heads=2, top_k=2, shared_experts=1),
    ],
)
def test_moe_active_parameters_equal_the_touched_weights(fields):
    """One token through a MoE layer: the parameter entries its objective (output and balance loss) gives a gradient
    are the closed form's active parameters, and the forward FLOPs are 2 x the weight entries it multiplies (the
    router's and the shared experts' once per sub-token)."""
    torch.manual_seed(0)
    config = MoEConfig(dim=16, ffn_dim=32, num_experts=16, subln=True, **fields)
    layer = MoELayer(config)
    out, record = layer(torch.randn(1, 1, 16))
    (out.sum() + record.balance_loss).backward()
    touched = {name: int((p.grad != 0).sum()) for name, p in layer.named_parameters() if p.grad is not None}
    chosen = record.expert_index.flatten().unique().numel()
    assert chosen == config.heads * config.top_k  # distinct experts, so the closed form's count is the exact one
    assert sum(touched.values()) == active_parameters_per_token(config)

    def is_weight(name: str) -> bool:  # not a bias, a Sub-LN affine or the temperature
        return not any(part in name for part in ("bias", "ln_", "temperature"))

    every_sub_token = [layer.router] + ([layer.shared_experts] if config.shared_experts else [])
    reused = sum(p.numel() for module in every_sub_token for n, p in module.named_parameters() if is_weight(n))
    weights = sum(entries for name, entries in touched.items() if is_weight(name))
    assert flops_per_token(config) == 2 * (weights + (config.heads - 1) * reused)


def test_stratified_gates_by_hand():
    config = MoEConfig(dim=16, ffn_dim=32, num_experts=6, strata=[4, 2], top_k=2, router="linear")
    expert = 2 * 16 * 32 + 32 + 16
    first = (2 * 16 + 16 * 6 + 2 * expert, 2 * 16 * 6 + 2 * 2 * 2 * 16 * 32)  # LN, gate over 6 experts, 2 experts
    second = (2 * 16 + 16 * 2 + 2 * expert, 2 * 16 * 2 + 2 * 2 * 2 * 16 * 32)  # gate over the last stratum's 2
    assert gate_cost(config, 0) == first and gate_cost(config, 1) == second
    assert active_parameters_per_token(config) == first[0] + second[0]
    assert flops_per_token(config) == first[1] + second[1]
    backbone = backbone_cost(tiny(VARIANTS["stratified"]), 8)
    moe_layer = backbone["layers"][1]
    assert moe_layer["active_parameters_per_token"] < moe_layer["max_active_parameters_per_token"]


def test_beit3_base_published_sizes(tmp_path, capsys):
    """BEiT-3 base (unilm README): 276M with its MLM and MIM heads, 222M for the retrieval model (`-itc`: two D x D
    projections, no bias, on top of the 220.99M backbone)."""
    config = MultiwayConfig.preset("beit3_base")
    assert backbone_parameters(config) + 2 * 768 * 768 == pytest.approx(222e6, abs=0.5e6)
    codebook = tmp_path / "codebook.pt"
    PatchCodebook(torch.randn(8192, 3), patch_size=16, pool=1).save(codebook)
    path = tmp_path / "pretrain.yaml"
    init_args = {"backbone": config_to_dict(config), "visual_codebook": str(codebook)}
    path.write_text(yaml.safe_dump({"model": {"class_path": "mmoe.tasks.pretraining.MaskedPretraining",
                                              "init_args": init_args}}))  # fmt: skip
    code, result, err = run_info(["--config", str(path)], capsys)
    assert code == 0, err
    head_biases = 64010 + 8192  # the published count leaves the two heads' biases out
    assert result["total_parameters"] - head_biases == pytest.approx(276e6, abs=0.5e6)
    mim, mlm = 768 * 8192 + 8192, 768 * 64010 + 64010  # one masked patch reads the MIM head, one masked token MLM
    assert sorted(result["head_flops_per_prediction"].values()) == [2 * mim, 2 * mlm]
    assert result["backbone"]["flops_per_token"] == 12 * (8 * 768 * 768 + 4 * 768 * 3072)
    path.write_text(yaml.safe_dump({"model": {"class_path": "mmoe.tasks.retrieval.RetrievalFineTuning",
                                              "init_args": {"backbone": config_to_dict(config)}}}))  # fmt: skip
    code, result, err = run_info(["--config", str(path)], capsys)
    assert code == 0, err
    assert result["total_parameters"] == pytest.approx(222e6, abs=0.5e6)  # README: 222M for beit3_base_itc
    flops = result["head_flops_per_prediction"]
    assert flops == {"vision_head": 2 * 768 * 768, "language_head": 2 * 768 * 768, "logit_scale": 2}


def test_vqkd_tokenizer_is_counted_apart(tmp_path, capsys):
    """Pre-training on VQ-KD targets: the MIM head has one output per code; the frozen tokenizer's parameters and
    FLOPs per image are reported beside the model's, not in its total."""
    tokenizer_file = save_released(tmp_path / "vqkd.pth", released_state(dim=64, depth=1, mlp=128, grid=2, codes=64))
    config = tiny(VARIANTS["xmoe"])
    task = MaskedPretraining(config, vqkd_tokenizer=str(tokenizer_file))
    capsys.readouterr()
    path = tmp_path / "pretrain.yaml"
    init_args = {"backbone": config_to_dict(config), "vqkd_tokenizer": str(tokenizer_file)}
    path.write_text(yaml.safe_dump({"model": {"class_path": "mmoe.tasks.pretraining.MaskedPretraining",
                                              "init_args": init_args}}))  # fmt: skip
    code, result, err = run_info(["--config", str(path)], capsys)
    assert code == 0, err
    assert result["total_parameters"] == count(task)
    tokenizer = task._vqkd[0]
    reported = result["visual_tokenizer"]
    assert (reported["codes"], reported["grid"], reported["file"]) == (64, 2, str(tokenizer_file))
    assert reported["parameters"] == sum(value.numel() for value in tokenizer.state_dict().values())
    assert reported["flops_per_image"] == vqkd_cost(tokenizer.shape, 2)["flops_per_image"]
    assert main(["info", "--config", str(path)]) == 0
    assert "visual tokenizer (BEiT v2 VQ-KD, 64 codes, frozen, not in the total)" in capsys.readouterr().out
    checkpoint = tmp_path / "pretrain.ckpt"
    hyper_parameters = {"backbone": config_to_dict(config), "vqkd_tokenizer": str(tokenizer_file)}
    torch.save({"hyper_parameters": hyper_parameters, "state_dict": task.state_dict()}, checkpoint)
    code, from_checkpoint, err = run_info(["--ckpt", str(checkpoint)], capsys)
    assert code == 0, err
    assert from_checkpoint["visual_tokenizer"] == reported
    assert from_checkpoint["total_parameters"] == count(task)
    init_args["vqkd_tokenizer"] = str(tmp_path / "absent.pth")
    path.write_text(yaml.safe_dump({"model": {"class_path": "mmoe.tasks.pretraining.MaskedPretraining",
                                              "init_args": init_args}}))  # fmt: skip
    code, result, err = run_info(["--config", str(path)], capsys)
    assert code == 0 and result["visual_tokenizer"] is None and result["head_parameters"] is None
    assert "visual tokenizer not counted: model.vqkd_tokenizer" in err and "absent.pth does not exist" in err


def test_table_output_and_missing_head_files(tmp_path, capsys):
    config = tiny(VARIANTS["stratified"])
    path = tmp_path / "vqa.yaml"
    init_args = {"backbone": config_to_dict(config), "answer_vocab": str(tmp_path / "absent.json")}
    path.write_text(yaml.safe_dump({"model": {"class_path": "mmoe.tasks.vqa.VQAFineTuning", "init_args": init_args}}))
    assert main(["info", "--config", str(path)]) == 0
    captured = capsys.readouterr()
    assert "head not counted" in captured.err and "absent.json" in captured.err
    assert "Stratified MoE, strata [2, 2]" in captured.out
    assert "(head not counted)" in captured.out
    assert len([line for line in captured.out.splitlines() if line.strip().startswith(("0 ", "1 "))]) == 2


def test_beit3_checkpoint_file(tmp_path, capsys):
    from mmoe.model.beit3 import to_beit3

    backbone = MultiwayTransformer(MultiwayConfig.preset("test", vocab_size=100, position_offset=2, output_norm=False))
    path = tmp_path / "beit3_tiny.pth"
    torch.save({"model": to_beit3(backbone)}, path)
    code, result, err = run_info(["--ckpt", str(path)], capsys)
    assert code == 0, err
    assert result["backbone"]["parameters"] == count(backbone)


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--config", "{tmp}/absent.yaml"], "absent.yaml does not exist"),
        (["--config", "{tmp}/bad.yaml"], "bad.yaml: the following arguments are required: fit.model"),
        (["--ckpt", "{tmp}/absent.pt"], "absent.pt"),
        (["--ckpt", "{tmp}/bad.yaml"], "bad.yaml"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(argv, message, tmp_path, capsys):
    (tmp_path / "bad.yaml").write_text("trainer: {max_steps: 3}\n")
    assert main(["info", *[arg.format(tmp=tmp_path) for arg in argv]]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err and err.startswith("mmoe info:")


def test_a_tiny_variant_is_read_from_the_base_and_its_part(capsys, monkeypatch):
    configs = Path(__file__).resolve().parents[2] / "configs" / "pretrain"
    monkeypatch.chdir(configs.parents[1])  # the config's codebook, data/synthetic/codebook.pt, may be absent
    argv = ["--config", str(configs / "tiny.yaml"), "--config", str(configs / "tiny" / "mhmoe.yaml")]
    code, result, err = run_info(argv, capsys)
    assert code == 0, err
    assert result["variant"] == "X-MoE MH-MoE h=4, 8 experts, top-1"
    assert result["source"] == f"{configs / 'tiny.yaml'} + {configs / 'tiny' / 'mhmoe.yaml'}"


def test_variant_names_of_the_newer_routers():
    assert variant_name(tiny(VARIANTS["fine_grained_shared"])) == (
        "X-MoE, 8 experts + 1 shared, top-3, expert width 0.25 x FFN"
    )
    assert variant_name(tiny(VARIANTS["expert_choice"])) == "X-MoE, 4 experts, expert choice c=2"
    assert variant_name(tiny(VARIANTS["loss_free_global"])) == "X-MoE, 4 experts, top-2, loss-free bias"
