"""``mmoe info --config C [--config C2 ...] | --ckpt C``: parameters, active parameters per token and forward FLOPs
per token of a whole model (backbone per layer, with its task head), for dense, X-MoE, MH-MoE and Stratified backbones
(MH-MoE App. D); repeated configs merge in order, as in ``mmoe fit``.

The backbone's numbers are closed forms (:mod:`mmoe.model.cost`); a head's parameters come from the checkpoint's
weights (``--ckpt``) or from building the task's head modules (``--config``: the VQAv2 answer list, the captioning
output vocabulary or the pre-training codebook named there are read for their sizes). A head's FLOPs count its
weights (2 per weight) once per prediction: a VQA / NLVR2 sample, a caption token; pre-training has two heads, the
MIM head for a masked patch and the MLM head for a masked text token, reported apart. A pre-training run with BEiT
v2's VQ-KD targets also runs the frozen tokenizer on every image: its parameters and FLOPs per image are reported
apart from the model's (``visual_tokenizer``), read from its file's shapes.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from mmoe import __version__
from mmoe.config.launch import read_config
from mmoe.data.tokenizer import DEFAULT_MAX_TEXT_LENGTH
from mmoe.io import one_line, report_error
from mmoe.model import MultiwayConfig
from mmoe.model.config import MODALITIES
from mmoe.model.cost import backbone_cost
from mmoe.model.output_vocab import load_output_vocab
from mmoe.model.vqkd import read_vqkd_shape, vqkd_cost
from mmoe.moe.cost import routed_experts
from mmoe.moe.scorers import SCORERS
from mmoe.runtime.checkpoint import PREFIX, config_from_dict, read_pretrained
from mmoe.safe_load import load_checkpoint_file
from mmoe.tasks.catalog import class_path, task_of_class_path
from mmoe.tasks.finetuning import required_argument
from mmoe.tasks.pretraining import DEFAULT_TEACHER, VQKD_OPTION, MaskedPretraining, load_teacher, teacher_width
from mmoe.tasks.visual_codebook import PatchCodebook

#: State-dict entries of mmoe tasks that are buffers, not parameters: the pre-training visual codebook's centroids.
BUFFERS = ("codebook.",)


class InfoError(ValueError):
    """Bad input to ``mmoe info``; the message names the file and the field."""


#: The pre-training heads: state-dict prefix -> what one prediction of it is.
PRETRAINING_HEADS = {"mim_head.": "MIM head (a masked patch)", "mlm_head.": "MLM head (a masked text token)"}


def head_parameters(task: str, init_args: dict, config: MultiwayConfig, source: str) -> dict[str, int]:
    """Parameters of the task heads the config's model builds (``task``: its ``model.class_path``), per head that
    makes one kind of prediction (empty for a class mmoe does not know)."""
    try:
        finetuning = task_of_class_path(task)
        if finetuning is not None:
            return finetuning.head_parameters(config, init_args)
        if task == class_path(MaskedPretraining):
            return pretraining_head_parameters(config, init_args)
    except ValueError as error:
        raise InfoError(f"config {source}: {one_line(error)}") from None
    return {}


def pretraining_head_parameters(config: MultiwayConfig, init_args: dict) -> dict[str, int]:
    """The MIM head's (over the visual targets: the teacher's width or the codebook's size) and the MLM head's."""
    if init_args.get("teacher_checkpoint"):
        teacher = load_teacher(init_args.get("teacher_model", DEFAULT_TEACHER), init_args["teacher_checkpoint"])
        targets = teacher_width(teacher)
    elif init_args.get("vqkd_tokenizer"):
        targets = read_vqkd_shape(init_args["vqkd_tokenizer"], VQKD_OPTION).num_codes
    else:
        targets = PatchCodebook.load(required_argument(init_args, "visual_codebook")).size
    words = config.vocab_size
    if init_args.get("output_vocab"):
        words = len(load_output_vocab(init_args["output_vocab"], config.vocab_size, need_end=False))
    mim, mlm = PRETRAINING_HEADS.values()
    return {mim: config.dim * targets + targets, mlm: config.dim * words + words}


def visual_tokenizer_cost(init_args: dict, config: MultiwayConfig) -> dict | None:
    """What the pre-training's VQ-KD tokenizer (``vqkd_tokenizer``) costs apart from the model: its codes and patch
    grid, parameters and forward FLOPs per image (:func:`mmoe.model.vqkd.vqkd_cost`); None without one, or when
    its file is missing (said on stderr)."""
    path = init_args.get("vqkd_tokenizer")
    if not path:
        return None
    try:
        shape = read_vqkd_shape(path, VQKD_OPTION)
    except FileNotFoundError as error:
        print(f"mmoe info: visual tokenizer not counted: {one_line(error)}", file=sys.stderr)
        return None
    grid = config.image_size // config.patch_size
    return {"kind": "BEiT v2 VQ-KD", "file": path, "codes": shape.num_codes, "grid": grid} | vqkd_cost(shape, grid)


def from_config(paths: Sequence[Path]) -> tuple[str, MultiwayConfig, dict[str, int] | None, int | None, dict | None]:
    """(task class, backbone config, head parameters (None when a file it needs is missing), text length, the visual
    tokenizer's cost) of an mmoe fit config (several files merge in order), read by the CLI's own parser
    (:func:`mmoe.config.launch.read_config`)."""
    for path in paths:
        if not path.is_file():
            raise FileNotFoundError(f"config {path} does not exist")
    path = " + ".join(map(str, paths))
    parsed = read_config(paths).fit  # a config without a model is an error of the parser's
    init_args = parsed.model.init_args.as_dict()
    if isinstance(init_args.get("backbone"), dict):
        try:
            config = config_from_dict(init_args["backbone"])
        except (TypeError, ValueError) as error:
            raise InfoError(f"config {path}: model.init_args.backbone: {error}") from None
    elif init_args.get("pretrained"):
        config = read_pretrained(init_args["pretrained"]).config
    else:
        raise InfoError(f"config {path} has neither model.init_args.backbone nor model.init_args.pretrained")
    task = parsed.model.class_path
    text_length = parsed.data.init_args.get("max_text_length") if parsed.data is not None else None
    try:
        head = head_parameters(task, init_args, config, path)
    except FileNotFoundError as error:  # the data is not there yet: the backbone's counts still stand
        print(f"mmoe info: head not counted: {one_line(error)}", file=sys.stderr)
        head = None
    tokenizer = visual_tokenizer_cost(init_args, config) if task == class_path(MaskedPretraining) else None
    return task, config, head, text_length, tokenizer


def from_checkpoint(path: Path) -> tuple[str, MultiwayConfig, dict[str, int], int | None, dict | None]:
    """(task class or kind, backbone config, head parameters counted from the weights, text length of its data, the
    cost of the visual tokenizer its hyper-parameters name) of a checkpoint."""
    state = load_checkpoint_file(path, "checkpoint")
    hyper_parameters = state.get("hyper_parameters")
    weights = state.get("state_dict")
    if isinstance(hyper_parameters, dict) and isinstance(weights, dict) and "backbone" in hyper_parameters:
        config = hyper_parameters["backbone"]
        if isinstance(config, dict):
            config = config_from_dict(config)
        task = hyper_parameters.get("_class_path") or "a Lightning checkpoint of an mmoe task"
        finetuning = task_of_class_path(task)
        head: dict[str, int] = {}
        for key, value in weights.items():
            if not key.startswith((PREFIX, *BUFFERS)):
                part = next((name for prefix, name in PRETRAINING_HEADS.items() if key.startswith(prefix)), "head")
                part = finetuning.head_of(key) if finetuning is not None else part
                head[part] = head.get(part, 0) + value.numel()
        data = state.get("datamodule_hyper_parameters")
        text_length = data.get("max_text_length") if isinstance(data, dict) else None
        return task, config, head, text_length, visual_tokenizer_cost(hyper_parameters, config)
    pretrained = read_pretrained(path)
    kind = "BEiT-3 checkpoint" if pretrained.heads else "backbone"
    heads = sum(value.numel() for value in pretrained.heads.values())
    return kind, pretrained.config, {"head": heads} if heads else {}, None, None


def report(
    source: str,
    task: str,
    config: MultiwayConfig,
    heads: dict[str, int] | None,
    text_length: int,
    tokenizer: dict | None = None,
) -> dict:
    """The JSON of ``mmoe info``: totals (the head's None when it could not be counted), each head's FLOPs per
    prediction, the backbone's layers, and the frozen visual tokenizer apart (not in the totals; None without
    one)."""
    head = None if heads is None else sum(heads.values())
    sequence = config.num_patches + 1 + text_length
    backbone = backbone_cost(config, sequence)
    return {
        "source": source,
        "task": task,
        "variant": variant_name(config),
        "total_parameters": backbone["parameters"] + (head or 0),
        "head_parameters": head,
        "head_flops_per_prediction": None if heads is None else {name: 2 * count for name, count in heads.items()},
        "backbone": backbone,
        "visual_tokenizer": tokenizer,
    }


def variant_name(config: MultiwayConfig) -> str:
    """The backbone's FFNs and routers in words; Mixture-of-Depths' routed layers after them."""
    name = moe_name(config)
    routing = config.depth_routing
    if routing is not None:
        name += f", MoD of the image patches C={routing.capacity:g} in layers {config.depth_routed_layers()}"
    return name


def moe_name(config: MultiwayConfig) -> str:
    moe = config.moe
    if moe is None:
        return "dense"
    if moe.strata is not None:
        return f"Stratified MoE, strata {moe.strata}"
    if moe.routing == "soft":
        slots = f"{moe.slots_per_expert} slot" + ("s" if moe.slots_per_expert > 1 else "")
        return f"Soft MoE, {moe.num_experts} experts x {slots} per sequence"
    router = SCORERS[moe.router].label
    heads = f" MH-MoE h={moe.heads}" if moe.heads > 1 else ""
    shared = f" + {moe.shared_experts} shared" if moe.shared_experts else ""
    if moe.zero_computation_experts:  # AdaMoE / MoE++: expected real experts per token, as the counts below
        shared += f" + {moe.zero_computation_experts} zero-computation ({routed_experts(moe):g} real per token)"
    width = f", expert width {moe.beta:g} x FFN" if moe.beta != 1.0 else ""
    choice = f"expert choice c={moe.capacity_factor:g}" if moe.routing == "expert_choice" else f"top-{moe.top_k}"
    balancing = ", loss-free bias" if moe.bias_update_rate else ""
    experts = f"{moe.num_experts} experts"
    if moe.experts_by_modality is not None:  # MoMa's modality-aware pools
        experts = " / ".join(f"{moe.experts_of(modality)} {modality}" for modality in MODALITIES)
        experts += " experts"
    return f"{router}{heads}, {experts}{shared}, {choice}{width}{balancing}"


def millions(count: int) -> str:
    return f"{count / 1e6:,.2f}M"


def mflops(count: int) -> str:
    return f"{count / 1e6:,.1f}"


def span(counts: dict, key: str, unit) -> str:
    """``counts[key]``, or ``least-most`` where a token may take more (Stratified MoE, modality pools) and the unit
    shows it."""
    least, most = unit(counts[key]), unit(counts[f"max_{key}"])
    return least if least == most else f"{least}-{most}"


def table(result: dict) -> str:
    backbone, head = result["backbone"], result["head_parameters"]
    lines = [
        f"{result['source']}: {result['task']} ({result['variant']}), counted by mmoe {result['mmoe_version']}",
        f"parameters: {millions(result['total_parameters'])} total = {millions(backbone['parameters'])} backbone "
        + ("(head not counted)" if head is None else f"+ {millions(head)} head"),
        f"per token: {span(backbone, 'active_parameters_per_token', millions)} active parameters, "
        f"{span(backbone, 'flops_per_token', mflops)} MFLOPs in the weights + "
        f"{mflops(backbone['attention_score_flops_per_token'])} in attention scores "
        f"({backbone['sequence_length']} tokens)",
    ]
    depth_routed = any("depth_routing" in layer for layer in backbone["layers"])
    for modality, counts in backbone.get("by_modality", {}).items():
        token = "an image patch (expected under depth routing)" if depth_routed and modality == "vision" else ""
        lines.append(
            f"  {token or f'a {modality} token'}: {millions(counts['active_parameters_per_token'])} active parameters, "
            f"{mflops(counts['flops_per_token'])} MFLOPs in the weights"
        )
    tokenizer = result["visual_tokenizer"]
    if tokenizer is not None:
        lines.append(
            f"visual tokenizer ({tokenizer['kind']}, {tokenizer['codes']} codes, frozen, not in the total): "
            f"{millions(tokenizer['parameters'])} parameters, {tokenizer['flops_per_image'] / 1e9:,.2f} GFLOPs per "
            f"image ({tokenizer['grid']}x{tokenizer['grid']} patches)"
        )
    lines.append("layer  ffn    parameters  active/token  MFLOPs/token")
    for layer in backbone["layers"]:
        lines.append(
            f"{layer['index']:>5}  {layer['ffn']:<5}  {millions(layer['parameters']):>10}  "
            f"{span(layer, 'active_parameters_per_token', millions):>12}  {span(layer, 'flops_per_token', mflops):>12}"
        )
    return "\n".join(lines)


def info_command(argv: Sequence[str]) -> int:
    """``mmoe info --config C | --ckpt C [--text-length T] [--json]``: whole-model counts; exit 2 on bad input."""
    parser = argparse.ArgumentParser(prog="mmoe info", description=__doc__.split("\n\n")[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument(
        "--config",
        action="append",
        help="an mmoe fit config (model.init_args.backbone, or pretrained); repeated: the files merge in order",
    )
    source.add_argument("--ckpt", help="a task checkpoint, an exported backbone or a released BEiT-3 checkpoint")
    parser.add_argument(
        "--text-length", type=int, help=f"text tokens per sequence (default: the config's or {DEFAULT_MAX_TEXT_LENGTH})"
    )
    parser.add_argument("--json", action="store_true", help="one JSON object instead of the table")
    args = parser.parse_args(list(argv))
    try:
        if args.config:
            task, config, head, text_length, tokenizer = from_config([Path(config) for config in args.config])
        else:
            task, config, head, text_length, tokenizer = from_checkpoint(Path(args.ckpt))
    except (FileNotFoundError, ValueError) as error:
        return report_error("info", error)
    text_length = args.text_length or text_length or DEFAULT_MAX_TEXT_LENGTH
    source = " + ".join(args.config) if args.config else args.ckpt
    result = report(source, task, config, head, text_length, tokenizer) | {"mmoe_version": __version__}
    print(json.dumps(result, indent=2) if args.json else table(result))
    return 0
