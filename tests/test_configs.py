"""Every run the shipped configs describe parses with the ``mmoe fit`` parser (typos in keys are errors): each whole
config, and each pre-training base (tiny, base) with each variant's part over it. A part changes only the MoE layers
and the run folder; the run folder is stated once; fine-tuning configs give the schedule a length and the image size
once; every config's backbone has its size's shape, ``MultiwayConfig.preset``."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

import pytest
import yaml

from mmoe.config.cli import fill_run_folder, lightning_command
from mmoe.config.launch import read_config
from mmoe.model.config import PRESETS

pytestmark = pytest.mark.filterwarnings("ignore:LightningCLI's args parameter")

ROOT = Path(__file__).resolve().parents[1]
PRETRAIN = ROOT / "configs" / "pretrain"
TINY = PRETRAIN / "tiny.yaml"
BASE = PRETRAIN / "base.yaml"
#: The pre-training sizes: each is configs/pretrain/<size>.yaml (dense) and a part per MoE variant in
#: configs/pretrain/<size>/.
SIZES = ("tiny", "base")
#: The parts of each size's base config: (size, variant) -> file.
PARTS = {(size, path.stem): path for size in SIZES for path in sorted((PRETRAIN / size).glob("*.yaml"))}
#: The trainer parts the fine-tuning configs extend (``extends: trainer/<size>.yaml``).
FINETUNE_TRAINERS = ROOT / "configs" / "finetune" / "trainer"
#: Every config that is a whole run by itself.
WHOLE = sorted(
    path
    for path in (ROOT / "configs").rglob("*.yaml")
    if path.parent not in {PRETRAIN / size for size in SIZES} | {FINETUNE_TRAINERS}
)
#: Every run the configs describe: each whole config, and each size's base with each of its parts over it.
RUNS = [(path,) for path in WHOLE] + [(PRETRAIN / f"{size}.yaml", part) for (size, _), part in PARTS.items()]

#: What each tiny part sets: the MoE plan of the tiny backbone (the dense base has none).
TINY_MOE = {
    "xmoe": {"num_experts": 8, "top_k": 1, "router": "xmoe", "gate": "softmax", "every": 2, "mode": "per_modality"},
    "mhmoe": {"num_experts": 8, "top_k": 1, "router": "xmoe", "gate": "softmax", "heads": 4, "beta": 1.0, "every": 2,
              "mode": "per_modality"},
    "stratified": {"num_experts": 8, "top_k": 2, "router": "linear", "gate": "softmax", "strata": [4, 4], "every": 2,
                   "mode": "per_modality"},
    "switch": {"num_experts": 8, "top_k": 1, "router": "linear", "gate": "softmax", "every": 2, "mode": "per_modality"},
    "fine_grained": {"num_experts": 32, "top_k": 4, "beta": 0.25, "router": "linear", "gate": "softmax", "every": 2,
                     "mode": "per_modality"},
    "shared_experts": {"num_experts": 32, "top_k": 3, "beta": 0.25, "shared_experts": 1, "router": "linear",
                       "gate": "softmax", "every": 2, "mode": "per_modality"},
    "loss_free": {"num_experts": 8, "top_k": 1, "router": "linear", "gate": "softmax", "bias_update_rate": 0.001,
                  "every": 2, "mode": "per_modality"},
    "expert_choice": {"num_experts": 8, "routing": "expert_choice", "capacity_factor": 1.0, "router": "linear",
                      "gate": "softmax", "every": 2, "mode": "per_modality"},
    "global_balance": {"num_experts": 8, "top_k": 1, "router": "linear", "gate": "softmax", "balance_batch": "global",
                       "every": 2, "mode": "per_modality"},
    "limoe": {"num_experts": 16, "top_k": 1, "router": "linear", "gate": "softmax", "capacity_factor": 1.0,
              "capacity_priority": "batch_priority", "local_entropy_weight": 1.0e-2, "global_entropy_weight": 1.0e-2,
              "global_entropy_min_experts": 4.0, "every": 2, "mode": "shared"},
    "moma": {"num_experts": 8, "experts_by_modality": {"vision": 4, "language": 8}, "routing": "expert_choice",
             "capacity_factor": 1.0, "router": "linear", "gate": "softmax", "every": 2, "mode": "per_modality"},
    "deepseek": {"num_experts": 32, "top_k": 3, "beta": 0.25, "shared_experts": 1, "router": "linear",
                 "gate": "sigmoid",
                 "renormalize": True, "routed_scaling_factor": 2.5, "bias_update_rate": 0.001,
                 "balance_batch": "sequence", "balance_choices": "all", "every": 2, "mode": "per_modality"},
    "soft_moe": {"num_experts": 8, "routing": "soft", "slots_per_expert": 1, "layers": [2, 3], "mode": "per_modality"},
    "top_p": {"num_experts": 8, "top_k": 1, "router": "linear", "gate": "softmax", "renormalize": False, "top_p": 0.4,
              "target_active_experts": 2.0, "top_p_rate": 0.5, "dynamic_loss_weight": 1.0e-4, "every": 2,
              "mode": "per_modality"},
    "null_experts": {"num_experts": 8, "top_k": 2, "null_experts": 8, "router": "linear", "gate": "softmax",
                     "every": 2, "mode": "per_modality"},
    "moe_plus_plus": {"num_experts": 8, "top_k": 2, "null_experts": 2, "copy_experts": 2, "constant_experts": 4,
                      "gating_residual": True,
                      "router": "linear", "gate": "softmax", "every": 2, "mode": "per_modality"},
    "remoe": {"num_experts": 8, "top_k": 1, "router": "linear", "gate": "relu", "renormalize": False,
              "relu_l1_initial": 3.0e-4, "relu_l1_multiplier": 1.2, "relu_l1_balanced": True, "every": 2,
              "mode": "per_modality"},
}  # fmt: skip
#: What each base part sets: the MoE plan of the base backbone (BEiT-3 base; the dense base has none).
BASE_MOE = {
    "switch": {"num_experts": 8, "top_k": 1, "router": "linear", "gate": "softmax", "every": 2, "mode": "per_modality"},
    "xmoe": {"num_experts": 8, "top_k": 2, "renormalize": True, "router": "xmoe", "gate": "softmax", "every": 2,
             "mode": "per_modality"},
    "mhmoe": {"num_experts": 8, "top_k": 2, "renormalize": False, "router": "xmoe", "gate": "softmax", "heads": 4,
              "beta": 1.0, "every": 2, "mode": "per_modality"},
    "stratified": {"num_experts": 8, "top_k": 2, "renormalize": False, "capacity_factor": 1.0, "router": "linear",
                   "gate": "softmax", "strata": [4, 4], "every": 2, "mode": "per_modality"},
    "limoe": TINY_MOE["limoe"],
    "moma": TINY_MOE["moma"] | {"num_experts": 4, "experts_by_modality": {"vision": 4, "language": 4}},
    "deepseek": TINY_MOE["deepseek"] | {"num_experts": 64, "top_k": 7, "beta": 0.125},
    "soft_moe": {"num_experts": 8, "routing": "soft", "slots_per_expert": 16, "layers": [6, 7, 8, 9, 10, 11],
                 "mode": "per_modality"},
    "top_p": TINY_MOE["top_p"],
    "null_experts": TINY_MOE["null_experts"],
    "moe_plus_plus": TINY_MOE["moe_plus_plus"],
    "remoe": TINY_MOE["remoe"] | {"relu_l1_initial": 1.0e-8},
}  # fmt: skip
#: Each size's MoE plans, by variant.
# Mixture-of-Depths over the image patches (Raposo et al. 2024): dense FFNs, depth routing in every other layer.
TINY_MOE["mod"] = BASE_MOE["mod"] = None
MOE_PLANS = {"tiny": TINY_MOE, "base": BASE_MOE}
#: The backbone fields a part sets beside the MoE plan.
PART_BACKBONE = {
    ("tiny", "mod"): {"depth_routing": {"capacity": 0.5, "every": 2, "weight": "sigmoid"}},
    ("base", "mod"): {"depth_routing": {"capacity": 0.125, "every": 2, "weight": "sigmoid"}},
}
#: The model arguments a part sets beside the MoE plan: Stratified MoE averages its balance loss over the SMoE blocks
#: (Xu et al. 2023, §3.2).
PART_MODEL_ARGUMENTS = {
    ("base", "stratified"): {"balance_reduce": "mean"},
    # DeepSeek-V3's sequence-wise balance loss weight, beside its loss-free bias.
    ("tiny", "deepseek"): {"balance_coefficient": 1.0e-4},
    ("base", "deepseek"): {"balance_coefficient": 1.0e-4},
    # ReMoE: the load-balanced L1 penalty replaces the balance loss.
    ("tiny", "remoe"): {"balance_coefficient": 0.0},
    ("base", "remoe"): {"balance_coefficient": 0.0},
}


def run_name(configs: tuple[Path, ...]) -> str:
    return "+".join(f"{path.parent.name}/{path.stem}" for path in configs)


def print_config(configs: tuple[Path, ...], *options: str) -> tuple[int, dict | None, str]:
    """``mmoe fit --config C1 --config C2 ... OPTIONS --print_config`` in this process: (exit code, the printed
    config, stderr)."""
    argv = ["fit"]
    for config in configs:
        argv += ["--config", str(config)]
    printed, errors = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(errors), pytest.raises(SystemExit) as stop:
        lightning_command([*argv, *options, "--print_config"])
    code = stop.value.code or 0
    return code, yaml.safe_load(printed.getvalue()) if code == 0 else None, errors.getvalue()


def test_the_pretraining_configs_exist():
    assert TINY.is_file() and BASE.is_file()  # dense: a size's base alone
    assert set(PARTS) == {(size, variant) for size in SIZES for variant in MOE_PLANS[size]}


def test_every_task_and_size_has_a_fine_tuning_config():
    names = {path.stem for path in WHOLE if path.parent.name == "finetune"}
    assert {f"{task}_{size}" for task in ("vqav2", "nlvr2", "captioning") for size in ("tiny", "base")} <= names


@pytest.mark.parametrize("configs", RUNS, ids=run_name)
def test_config_parses_with_the_fit_parser(configs, monkeypatch):
    monkeypatch.chdir(ROOT)
    code, config, errors = print_config(configs)
    assert code == 0, errors
    model, data = config["model"], config["data"]
    assert model["class_path"].split(".")[:2] == ["mmoe", "tasks"]
    assert data["class_path"].startswith("mmoe.data.datamodules.")
    assert config["trainer"]["max_steps"] > 0  # iterable loaders: the schedule needs a step count
    # The run folder is stated once: the loggers and the callbacks' folders follow it (mmoe.config.cli.fill_run_folder).
    assert config["trainer"]["default_root_dir"].startswith("runs/") and config["trainer"]["logger"] is None
    for callback in config["trainer"]["callbacks"]:
        assert not {"dirpath", "save_dir"} & {name for name, value in callback["init_args"].items() if value}
    if configs[0].parent.name == "finetune":
        assert config["trainer"]["check_val_every_n_epoch"] is None
        # The data's image size is the backbone's, linked by the CLI: given once, in the model.
        assert "image_size" not in yaml.safe_load(configs[0].read_text())["data"]["init_args"]
        assert "image_size" in model["init_args"]["backbone"]


def without_variant(config, model_arguments=()) -> dict:
    """A parsed config less what a part may set (the MoE plan, the run folder, ``model_arguments``) and the files it
    was read from."""
    config = config.clone()
    del config["config"]
    config.model.init_args.backbone.moe = None
    config.model.init_args.backbone.depth_routing = None
    config.trainer.default_root_dir = None
    for name in model_arguments:
        config.model.init_args[name] = None
    return config.as_dict()


@pytest.mark.parametrize(
    ("size", "variant"), sorted(PARTS), ids=[f"{size}/{variant}" for size, variant in sorted(PARTS)]
)
def test_a_part_sets_the_moe_layers_and_the_run_folder_and_nothing_else(size, variant):
    plan, arguments = MOE_PLANS[size][variant], PART_MODEL_ARGUMENTS.get((size, variant), {})
    part = yaml.safe_load(PARTS[size, variant].read_text())
    assert part == {
        "trainer": {"default_root_dir": f"runs/pretrain/{size}_{variant}"},
        "model": {"init_args": {"backbone": {"moe": plan, **PART_BACKBONE.get((size, variant), {})}, **arguments}},
    }
    whole = PRETRAIN / f"{size}.yaml"
    base, composed = read_config([whole]).fit, read_config([whole, PARTS[size, variant]]).fit
    backbone = composed.model.init_args.backbone
    moe = backbone.moe.as_dict() if plan is not None else None
    assert moe is None if plan is None else {name: moe[name] for name in plan} == plan
    for name, fields in PART_BACKBONE.get((size, variant), {}).items():
        assert {field: backbone[name][field] for field in fields} == fields
    assert {name: composed.model.init_args[name] for name in arguments} == arguments
    assert without_variant(composed, arguments) == without_variant(base, arguments)
    assert base.model.init_args.backbone.moe is None and base.trainer.default_root_dir == f"runs/pretrain/{size}_dense"
    # The folders the per-variant files used to repeat, now from the one run folder.
    fill_run_folder(composed.trainer)
    root = f"runs/pretrain/{size}_{variant}"
    loggers = [(logger.class_path.rsplit(".", 1)[1], logger.init_args.save_dir, logger.init_args.name)
               for logger in composed.trainer.logger]  # fmt: skip
    assert loggers == [("TensorBoardLogger", root, "tensorboard"), ("ContinuingCSVLogger", root, "csv")]
    callbacks = {callback.class_path.rsplit(".", 1)[1]: callback.init_args for callback in composed.trainer.callbacks}
    assert callbacks["ModelCheckpoint"].dirpath == f"{root}/checkpoints"
    assert callbacks["RoutingStatsCallback"].save_dir == root


#: The backbone fields a fine-tuning config may set apart from its size's preset: BEiT-3 fine-tunes the base model at
#: the task's resolution (480 px VQAv2 and captioning, 384 px retrieval), its position embeddings interpolated.
FINETUNING_RESOLUTION = {"base": {"image_size"}}


@pytest.mark.parametrize("config", WHOLE, ids=lambda path: run_name((path,)))
def test_a_backbone_has_the_shape_of_its_sizes_preset(config):
    """The tiny and base shapes are written in each config (a part sets none) and in ``PRESETS``: a change to one
    alone fails here."""
    size = config.stem.rsplit("_", 1)[-1]  # pretrain/tiny.yaml, finetune/vqav2_tiny.yaml: tiny
    free = FINETUNING_RESOLUTION.get(size, set()) if config.parent.name == "finetune" else set()
    backbone = read_config([config]).fit.model.init_args.backbone
    shape = {name: value for name, value in PRESETS[size].items() if name not in free}
    assert {name: backbone[name] for name in shape} == shape


def test_an_unknown_key_in_a_part_is_an_error(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    typo = tmp_path / "typo.yaml"
    typo.write_text(yaml.safe_dump({"model": {"init_args": {"backbone": {"moe": {"num_expert": 4}}}}}))
    code, _, errors = print_config((TINY, PARTS["tiny", "xmoe"], typo))
    assert code != 0 and "num_expert" in errors


PRETRAINING_RUNS = [configs for configs in RUNS if configs[0].parent == PRETRAIN]


@pytest.mark.parametrize("configs", PRETRAINING_RUNS, ids=run_name)
def test_a_pretraining_config_takes_vqkd_targets_in_place_of_its_codebook(configs, monkeypatch):
    """BEiT-3's targets: each pre-training config names the option (commented, the file is not shipped), and the two
    options its comment gives turn the k-means codebook into the VQ-KD tokenizer."""
    monkeypatch.chdir(ROOT)
    assert "vqkd_tokenizer" in configs[0].read_text()
    tokenizer = "data/pretrain/vqkd_encoder_base_decoder_3x768x12_clip-d5036aa7.pth"
    options = ("--model.init_args.visual_codebook=null", f"--model.init_args.vqkd_tokenizer={tokenizer}")
    code, config, errors = print_config(configs, *options)
    assert code == 0, errors
    targets = config["model"]["init_args"]
    assert targets["visual_codebook"] is None and targets["teacher_checkpoint"] is None
    assert targets["vqkd_tokenizer"] == tokenizer


def readme_shard_names() -> set[str]:
    """The split folder names data/README.md gives: ``--out data/shards/<name>`` (and ``--holdout-out``) of its
    commands, and the synthetic corpus's list (``coco-karpathy-{train-restval,val,test}`` expanded)."""
    text = (ROOT / "data" / "README.md").read_text()
    names = set(re.findall(r"data/shards/([a-z0-9][a-z0-9.-]*[a-z0-9])", text))
    for stem, choices in re.findall(r"`([a-z0-9-]+)-\{([a-z0-9,-]+)\}`", text):
        names |= {f"{stem}-{choice}" for choice in choices.split(",")}
    return names


def shard_paths(config: Path) -> list[str]:
    data = yaml.safe_load(config.read_text())["data"]["init_args"]
    values = [data[key] for key in data if key.endswith("_shards") and data[key]]
    return [path for value in values for path in (value if isinstance(value, list) else [value])]


@pytest.mark.parametrize("config", WHOLE, ids=lambda path: run_name((path,)))
def test_shard_paths_follow_the_data_readme_layout(config):
    """Every shard path is ``shards/<name>`` under the config's corpus (``data``, or ``data/synthetic`` for the tiny
    configs), as data/README.md lays them out; the base configs' names are the folders its commands write."""
    data_root = yaml.safe_load(config.read_text())["data"]["init_args"]["data_root"]
    assert data_root == ("data/synthetic" if config.stem.endswith("tiny") else "data")
    paths = shard_paths(config)
    assert paths and all(re.fullmatch(r"shards/[a-z0-9][a-z0-9.-]*", path) for path in paths), paths
    if config.stem.endswith("base"):
        assert {path.removeprefix("shards/") for path in paths} <= readme_shard_names()
