"""A small converted synthetic corpus and ``mmoe`` run in this process: shared by the CLI tests."""

from __future__ import annotations

import io
from pathlib import Path

import sentencepiece
import yaml

from mmoe.cli import main
from mmoe.config.cli import MMoECLI, cli_arguments
from mmoe.data.synth.convert import convert_layout
from mmoe.data.synth.corpus import SynthSizes, build_corpus

#: The tiny pre-training base; its variants' parts lie in ``tiny/``.
TINY_PRETRAINING = Path(__file__).resolve().parents[1] / "configs" / "pretrain" / "tiny.yaml"

#: Enough for a VQA answer vocabulary and one NLVR2 set per split, in 32-px images.
SMALL_CORPUS = {"train_images": 20, "val_images": 4, "test_images": 2, "questions_per_image": 3,
                "nlvr2_train_sets": 1, "nlvr2_eval_sets": 1, "texts": 2, "image_size": 32}  # fmt: skip


def small_shards(root: Path, **sizes: int) -> Path:
    """Builds the synthetic corpus (:data:`SMALL_CORPUS` with ``sizes`` over it) in ``root/corpus`` and converts
    it; returns the shards folder (``root/corpus/shards``: one sub-folder per split)."""
    build_corpus(root / "corpus", seed=0, sizes=SynthSizes(**(SMALL_CORPUS | sizes)))
    shards = root / "corpus" / "shards"
    convert_layout(root / "corpus", shards)
    return shards


def tiny_pretraining(variant: str) -> dict:
    """The tiny pre-training config of ``variant`` as one dict, to edit: ``configs/pretrain/tiny.yaml`` with the MoE
    plan of the variant's part (a part sets only that and the run folder: tests/test_configs.py)."""
    config = yaml.safe_load(TINY_PRETRAINING.read_text())
    if variant != "dense":
        part = yaml.safe_load((TINY_PRETRAINING.parent / "tiny" / f"{variant}.yaml").read_text())
        config["model"]["init_args"]["backbone"]["moe"] = part["model"]["init_args"]["backbone"]["moe"]
    return config


def run_mmoe(argv: list[str], capsys) -> tuple[int, str, str]:
    """``mmoe <argv>`` in this process: (exit code, stdout, stderr)."""
    try:
        code = main(argv)
    except SystemExit as stop:
        code = stop.code
    captured = capsys.readouterr()
    return code, captured.out, captured.err


class Instantiated(MMoECLI):
    """``mmoe <subcommand>`` up to the parsed config and the instantiated model, data and trainer, without running."""

    def _run_subcommand(self, subcommand: str) -> None:
        pass


def instantiate(argv: list[str]) -> Instantiated:
    return Instantiated(**cli_arguments(args=argv, save_config_callback=None))


#: Texts a tiny SentencePiece model is trained on (the synthetic world's words).
SENTENCES = [
    "a red circle above a blue square", "two green triangles left of a yellow star", "the small purple circle",
    "is there a large orange square", "how many blue shapes are there", "a picture of three red stars",
] * 20  # fmt: skip


def tiny_sentencepiece(path: Path, pieces: int = 40) -> str:
    """Trains a ``pieces``-piece SentencePiece model on :data:`SENTENCES` into ``path`` (a stand-in for
    ``beit3.spm``); returns the path."""
    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(SENTENCES), model_writer=model, vocab_size=pieces, character_coverage=1.0,
        minloglevel=2,
    )  # fmt: skip
    path.write_bytes(model.getvalue())
    return str(path)
