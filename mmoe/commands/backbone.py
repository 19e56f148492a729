"""``mmoe export-backbone`` and ``mmoe upcycle``: backbone files for ``model.init_args.pretrained``, from a task
checkpoint or by sparse upcycling of a dense backbone."""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path

import torch

from mmoe.io import check_output_path, report_error, writing_output
from mmoe.model import MoEPlan


def export_backbone_command(argv: Sequence[str]) -> int:
    """``mmoe export-backbone --ckpt task.ckpt --out backbone.pt``: the backbone of a task checkpoint, for fine-tuning
    (the fine-tuning configs' ``pretrained`` argument reads either file)."""
    parser = argparse.ArgumentParser(prog="mmoe export-backbone", description=export_backbone_command.__doc__)
    parser.add_argument(
        "--ckpt", required=True, help="Lightning checkpoint of an mmoe task (e.g. checkpoints/last.ckpt)"
    )
    parser.add_argument("--out", required=True, help="backbone file to write (atomically)")
    args = parser.parse_args(list(argv))

    from mmoe.runtime.checkpoint import export_backbone, load_backbone

    try:
        check_output_path(args.out)
        backbone = load_backbone(args.ckpt)
        with writing_output(args.out):
            export_backbone(backbone, args.out)
    except (FileNotFoundError, ValueError) as error:
        return report_error("export-backbone", error)
    print(json.dumps({"backbone": args.out, "parameters": sum(p.numel() for p in backbone.parameters())}))
    return 0


def upcycle_command(argv: Sequence[str]) -> int:
    """``mmoe upcycle --ckpt dense.pth --config moe.yaml --out init.pt``: a MoE backbone whose experts start as copies
    of a dense backbone's FFNs (sparse upcycling), for ``model.init_args.pretrained``."""
    parser = argparse.ArgumentParser(prog="mmoe upcycle", description=upcycle_command.__doc__)
    parser.add_argument(
        "--ckpt", required=True, help="dense backbone: a released BEiT-3 checkpoint or any mmoe backbone / checkpoint"
    )
    parser.add_argument(
        "--config",
        required=True,
        action="append",
        help="an mmoe config whose model.init_args.backbone.moe is the plan; repeated: the files merge in order",
    )
    parser.add_argument("--out", required=True, help="backbone file to write (atomically)")
    parser.add_argument("--noise", type=float, default=0.0, help="expert noise, a share of each weight's std")
    parser.add_argument(
        "--drop-rate",
        "--drop-ratio",
        dest="drop_ratio",
        type=float,
        default=0.0,
        help="Drop-Upcycling: the share r of each expert's intermediate units drawn again from the dense weights' "
        "statistics (0 = plain copies; the paper's best: 0.5)",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the noise, the dropped units and the new routers")
    args = parser.parse_args(list(argv))

    from mmoe.model.upcycle import upcycle
    from mmoe.runtime.checkpoint import export_backbone, load_backbone

    try:
        check_output_path(args.out)
        plan = moe_plan_of(args.config)
        dense = load_backbone(args.ckpt)
        torch.manual_seed(args.seed)
        moe = upcycle(dense, plan, noise=args.noise, seed=args.seed, drop_ratio=args.drop_ratio)
        with writing_output(args.out):
            export_backbone(moe, args.out)
    except (FileNotFoundError, ValueError) as error:
        return report_error("upcycle", error)
    layers = sorted({slot.index for slot in moe.moe_layers()})
    print(
        json.dumps({"backbone": args.out, "moe_layers": layers, "parameters": sum(p.numel() for p in moe.parameters())})
    )
    return 0


def moe_plan_of(configs: Sequence[str | Path]) -> MoEPlan:
    """The :class:`MoEPlan` at ``model.init_args.backbone.moe`` of an mmoe config (its files merged in order), read by
    the CLI's own parser."""
    from mmoe.config.launch import read_config

    for config in configs:
        if not Path(config).is_file():
            raise FileNotFoundError(f"config {config} does not exist")
    path = " + ".join(map(str, configs))
    model = read_config(configs).fit.model
    backbone = model.init_args.get("backbone") if model is not None else None
    moe = backbone.get("moe") if backbone is not None else None
    if moe is None:
        raise ValueError(f"config {path} has no model.init_args.backbone.moe (the MoE plan to upcycle into)")
    return MoEPlan(**moe.as_dict())
