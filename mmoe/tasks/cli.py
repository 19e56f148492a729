"""``mmoe fit | validate | test | predict`` through LightningCLI, and ``mmoe tokenizer fit``."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI

LIGHTNING_SUBCOMMANDS = ("fit", "validate", "test", "predict")


class MMoECLI(LightningCLI):
    """LightningCLI over any mmoe task (``model.class_path``) and DataModule (``data.class_path``).

    Every knob is a typed ``__init__`` argument, so ``mmoe fit --help`` and ``--print_config`` explain the run, and
    an unknown key in a config is an error.

    With ``--ckpt_path`` LightningCLI sets the model's arguments to the hyper-parameters saved in the checkpoint, over
    the config file; here a model argument named on the command line (``--model.init_args.num_beams 5``) keeps its
    value, so decoding and output options can change between training and prediction.
    """

    def parse_arguments(self, parser: LightningArgumentParser, args) -> None:
        self.command_line_model_arguments = command_line_model_arguments(sys.argv[1:] if args is None else args)
        super().parse_arguments(parser, args)

    def _parse_ckpt_path(self) -> None:
        """LightningCLI's merge of the checkpoint's hyper-parameters into the config, less the arguments named on the
        command line."""
        subcommand = self.config.get("subcommand")
        ckpt_path = self.config[subcommand].get("ckpt_path") if subcommand else None
        if not ckpt_path or not Path(ckpt_path).is_file():
            return
        hparams = torch.load(ckpt_path, weights_only=True, map_location="cpu").get("hyper_parameters", {})
        for name in ("_instantiator", *self.command_line_model_arguments):
            hparams.pop(name, None)
        if "_class_path" in hparams:
            hparams = {"class_path": hparams.pop("_class_path"), "dict_kwargs": hparams}
        if not hparams:
            return
        try:
            self.config = self.parser.parse_object({subcommand: {"model": hparams}}, self.config)
        except SystemExit:
            print(f"mmoe {subcommand}: the hyper-parameters saved in {ckpt_path} do not parse (above)", file=sys.stderr)
            raise


def command_line_model_arguments(args) -> set[str]:
    """Top-level model arguments set by ``--model.<name>`` or ``--model.init_args.<name>`` options in ``args`` (a
    list of strings; a dict or Namespace from code names none)."""
    if not isinstance(args, (list, tuple)):
        return set()
    names = set()
    for token in args:
        if isinstance(token, str) and token.startswith("--model."):
            key = token[len("--model.") :].split("=", 1)[0]
            key = key.removeprefix("init_args.")
            names.add(key.split(".", 1)[0])
    return names


def lightning_command(argv: Sequence[str]) -> int:
    MMoECLI(
        L.LightningModule,
        L.LightningDataModule,
        subclass_mode_model=True,
        subclass_mode_data=True,
        # From the console script argv is sys.argv[1:] itself; LightningCLI reads that when args is None.
        args=None if list(argv) == sys.argv[1:] else list(argv),
        save_config_kwargs={"overwrite": True},
        auto_configure_optimizers=False,
    )
    return 0


def tokenizer_command(argv: Sequence[str]) -> int:
    """``mmoe tokenizer fit --data SHARDS --out codebook.pt``: learn the visual codebook (MIM targets)."""
    parser = argparse.ArgumentParser(prog="mmoe tokenizer", description=tokenizer_command.__doc__)
    sub = parser.add_subparsers(dest="action", required=True)
    fit = sub.add_parser("fit", help="k-means visual codebook over patches of training images")
    fit.add_argument("--data", required=True, nargs="+", help="shard files, directories or brace patterns with images")
    fit.add_argument("--out", required=True, help="codebook file to write")
    fit.add_argument("--size", type=int, default=512, help="number of visual tokens K")
    fit.add_argument("--image-size", type=int, default=64, help="image side the backbone sees")
    fit.add_argument("--patch-size", type=int, default=16)
    fit.add_argument("--pool", type=int, default=4, help="patches are average-pooled to pool x pool")
    fit.add_argument("--max-patches", type=int, default=200_000)
    fit.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(list(argv))

    from mmoe.data.pipelines import eval_image_batches
    from mmoe.tasks.visual_codebook import fit_codebook

    try:
        batches = eval_image_batches(args.data, image_size=args.image_size, batch_size=64)
        codebook = fit_codebook(
            batches, args.size, args.patch_size, args.pool, max_patches=args.max_patches, seed=args.seed
        )
    except (FileNotFoundError, ValueError) as error:
        print(f"mmoe tokenizer fit: {error}", file=sys.stderr)
        return 2
    codebook.save(args.out)
    print(json.dumps({"codebook": args.out, "size": codebook.size, "patch_size": args.patch_size}))
    return 0


def export_command(argv: Sequence[str]) -> int:
    """``mmoe export-backbone --ckpt task.ckpt --out backbone.pt``: the backbone of a task checkpoint, for fine-tuning
    (the fine-tuning configs' ``pretrained`` argument reads either file)."""
    parser = argparse.ArgumentParser(prog="mmoe export-backbone", description=export_command.__doc__)
    parser.add_argument(
        "--ckpt", required=True, help="Lightning checkpoint of an mmoe task (e.g. checkpoints/last.ckpt)"
    )
    parser.add_argument("--out", required=True, help="backbone file to write (atomically)")
    args = parser.parse_args(list(argv))

    from mmoe.tasks.checkpoint import export_backbone, load_backbone

    try:
        backbone = load_backbone(args.ckpt)
    except (FileNotFoundError, ValueError) as error:
        print(f"mmoe export-backbone: {error}", file=sys.stderr)
        return 2
    export_backbone(backbone, args.out)
    print(json.dumps({"backbone": args.out, "parameters": sum(p.numel() for p in backbone.parameters())}))
    return 0
