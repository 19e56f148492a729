"""The ``mmoe`` command.

``mmoe --version`` prints the installed version (also in ``mmoe info`` and every exported ``config.json``).

Subcommands:

* ``mmoe fit|validate|test|predict --config configs/....yaml [--config part.yaml ...]`` — LightningCLI over the mmoe
  tasks (config files merge in order; ``--help`` lists every option; ``--print_config`` shows the resolved config).
* ``mmoe data convert vqav2|coco-captions|flickr30k|nlvr2|images|tsv|text ...``, ``mmoe data answers ...``,
  ``mmoe data synth --out DIR`` — datasets converted to shards, VQA's answer vocabulary, the synthetic corpus.
* ``mmoe tokenizer fit --data SHARDS --out codebook.pt`` — learn the visual codebook for masked image modeling.
* ``mmoe eval vqa|caption|nlvr2|retrieval ...`` — a predictions file scored against the official annotation files
  by the official scorers (one JSON object on stdout).
* ``mmoe infer vqav2|nlvr2|captioning|retrieval --ckpt C ...`` (aliases ``vqa``, ``caption``, ``retrieve``) — a
  fine-tuned checkpoint on your own images, a folder of them or a converted split (answers, true/false, captions,
  the closest images to a text or texts to an image; ``--routing`` for the expert map).
* ``mmoe export --ckpt task.ckpt --out FOLDER [--backbone-only]`` — a fine-tuned task model (or its backbone) as a
  folder of ``model.safetensors`` and ``config.json``, for ``mmoe.tasks.from_pretrained`` /
  ``mmoe.model.from_pretrained``.
* ``mmoe export-backbone --ckpt task.ckpt --out backbone.pt`` — the backbone weights of a task checkpoint in torch's
  format (``model.init_args.pretrained`` reads it, or a folder of ``mmoe export``).
* ``mmoe upcycle --ckpt beit3.pth --config moe.yaml --out init.pt`` — a MoE backbone whose experts start as copies of
  a dense backbone's FFNs (sparse upcycling), e.g. from released BEiT-3 weights.
* ``mmoe info --config C [--config C2 ...] | --ckpt C`` — parameters, active parameters and forward FLOPs per token
  of a whole model (per layer, with its task head).
* ``mmoe moe-info --moe.dim 768 --moe.ffn_dim 3072 --moe.num_experts 8 [--moe.heads 4 ...]`` — parameters, active
  parameters and forward FLOPs per token of one MoE layer against the dense FFN it replaces (JSON on stdout). Every
  :class:`mmoe.moe.MoEConfig` field is an option; ``--moe config.yaml`` reads them from a file; ``--tokens M``: the
  tokens per sequence a Soft MoE layer's FLOPs per token assume (197).
* ``mmoe viz subtoken-map|heatmap --ckpt C ... --out DIR`` — routing figures (MH-MoE Fig. 1b / 8 / 10, Fig. 5).
* ``mmoe analyze routing|consistency ...`` — routing metrics of checkpoints on data, or of runs' saved statistics,
  as one JSON object (X-MoE Eq. 11, §4.5; MH-MoE Fig. 1a).
* ``mmoe demo [--out runs/demo] [--variant V|all] [--fast] [--random-init]`` — the whole pipeline (corpus,
  pre-training, fine-tuning, scores, figures) on the embedded synthetic corpus, in minutes on a CPU.
* ``mmoe study claims [--out DIR] [--fast | --scale gpu] [--dry-run] [--jobs N] [--plan FILE]`` — the X-MoE /
  MH-MoE analysis claims trained and measured at tiny scale over runs per arm, one report (Markdown, PNG, JSON);
  ``mmoe study report FOLDER [--markdown FILE]`` writes a report again from its files, training nothing.
  ``mmoe study routers --plan FILE [--out DIR] [--scale fast|cpu|gpu] [--seeds S ...] [--dry-run]`` — the routers
  compared at equal active compute over seeds, under a plan fixed with its hash before the runs.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import sys
from collections.abc import Callable, Sequence

from mmoe.host_memory import keep_freed_memory
from mmoe.process_exit import freeze_at_exit

#: The subcommands LightningCLI runs (``mmoe.config.cli.lightning_command``); they get the whole argv.
LIGHTNING_SUBCOMMANDS = ("fit", "validate", "test", "predict")


@dataclasses.dataclass(frozen=True)
class Command:
    """A subcommand's ``function(argv) -> exit code`` in ``module``, imported when the subcommand runs: ``mmoe eval``
    or ``mmoe data`` need not pay for importing Lightning."""

    module: str
    function: str

    def target(self) -> Callable[[Sequence[str]], int]:
        return getattr(importlib.import_module(self.module), self.function)

    def __call__(self, argv: Sequence[str]) -> int:
        return self.target()(argv)


def moe_info(argv: Sequence[str]) -> int:
    from jsonargparse import ArgumentParser

    from mmoe.config.safety import install_config_safety, parse_errors_in_one_line
    from mmoe.io import report_error
    from mmoe.model.cost import ffn_flops_per_token, ffn_parameters
    from mmoe.moe import MoEConfig, build_moe_layer
    from mmoe.moe.cost import active_parameters_per_token, flops_per_token, moe_parameter_count

    install_config_safety()
    parser = ArgumentParser(prog="mmoe moe-info", description="Parameter and FLOP counts of one MoE layer.")
    parser.add_class_arguments(MoEConfig, "moe")
    parser.add_argument(
        "--tokens", type=int, default=197, help="tokens per sequence a Soft MoE layer's FLOPs assume (197: 14x14+1)"
    )
    with parse_errors_in_one_line([parser], ["moe-info", *argv]):
        args = parser.parse_args(list(argv))
    try:
        config = parser.instantiate(args).moe
    except ValueError as error:
        raise SystemExit(report_error("moe-info", error)) from None
    report = {
        "config": {name: getattr(config, name) for name in MoEConfig.__dataclass_fields__},
        "parameters": moe_parameter_count(config),
        "parameters_counted": sum(p.numel() for p in build_moe_layer(config).parameters()),
        "active_parameters_per_token": active_parameters_per_token(config),
        "flops_per_token": flops_per_token(config, tokens=args.tokens),
        "dense_ffn_parameters": ffn_parameters(config.dim, config.ffn_dim, config.subln),
        "dense_ffn_flops_per_token": ffn_flops_per_token(config.dim, config.ffn_dim),
    }
    print(json.dumps(report, indent=2))
    return 0


COMMANDS: dict[str, Command] = {
    "moe-info": Command("mmoe.cli", "moe_info"),
    "info": Command("mmoe.commands.info", "info_command"),
    "infer": Command("mmoe.infer", "infer_command"),
    **{name: Command("mmoe.config.cli", "lightning_command") for name in LIGHTNING_SUBCOMMANDS},
    "tokenizer": Command("mmoe.tasks.visual_codebook", "tokenizer_command"),
    "export": Command("mmoe.commands.export", "export_command"),
    "export-backbone": Command("mmoe.commands.backbone", "export_backbone_command"),
    "upcycle": Command("mmoe.commands.backbone", "upcycle_command"),
    "eval": Command("mmoe.metrics.cli", "eval_command"),
    "data": Command("mmoe.data.cli", "data_command"),
    "viz": Command("mmoe.viz.cli", "viz_command"),
    "analyze": Command("mmoe.viz.analyze", "analyze_command"),
    "demo": Command("mmoe.demo", "demo_command"),
    "study": Command("mmoe.study", "study_command"),
}


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] in (["--version"], ["-V"]):
        from mmoe import __version__

        print(f"mmoe {__version__}")
        return 0
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        known = ", ".join(COMMANDS)
        print(f"usage: mmoe {{{known}}} [options]\n\n{__doc__.strip()}", file=sys.stderr if argv else sys.stdout)
        if argv and argv[0] not in ("-h", "--help"):
            print(f"mmoe: unknown command {argv[0]!r}; expected one of: {known}", file=sys.stderr)
            return 2
        return 0
    command = argv[0]
    keep_freed_memory()  # glibc: a training step's large buffers reused, not page-faulted in anew each step
    freeze_at_exit()  # the interpreter's shutdown does not walk every object of torch and Lightning again
    return COMMANDS[command](argv if command in LIGHTNING_SUBCOMMANDS else argv[1:])


if __name__ == "__main__":
    raise SystemExit(main())
