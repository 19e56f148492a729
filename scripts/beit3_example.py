"""From a released-layout BEiT-3 checkpoint to a MoE fine-tuning run, end to end and offline, at tiny scale.

A randomly initialised torchscale ``BEiT3`` (the implementation the released weights come from) is saved in the
released file layout (``{"model": {"beit3.*": ...}}``) and stands in for a downloaded ``beit3_*.pth``; a tiny
SentencePiece model trained on the synthetic corpus's texts stands in for ``beit3.spm``. Then, with mmoe's own
commands: ``mmoe upcycle`` turns its dense FFNs into X-MoE experts (the MoE plan of
``configs/finetune/vqav2_tiny.yaml``), ``mmoe fit`` fine-tunes on the synthetic VQAv2 split with that tokenizer,
``mmoe predict`` answers the val questions and the official scorer grades them. Prints one JSON summary (accuracy,
chance levels, seconds per stage).

    .venv/bin/python scripts/beit3_example.py --out runs/beit3_example [--steps 300]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import sys
import time
import warnings
from pathlib import Path

import sentencepiece
import torch

from mmoe.cli import main
from mmoe.config.launch import run_lightning
from mmoe.data.answers import ANSWERS_FILE
from mmoe.data.synth.chance import ChanceLevels
from mmoe.data.synth.layout import SUMMARY_FILE, VQA_TRAIN_SPLIT, VQA_VAL_SPLIT
from mmoe.metrics.vqa import evaluate_vqa_files
from mmoe.pipeline.launch import CONFIGS
from mmoe.runtime.layout import RunLayout

#: The tiny BEiT-3: the shape of configs/finetune/vqav2_tiny.yaml's backbone (64-wide heads, as every BEiT-3).
SHAPE = dict(encoder_embed_dim=192, encoder_attention_heads=3, encoder_ffn_embed_dim=768, encoder_layers=4,
             img_size=64, patch_size=16, max_source_positions=66)  # fmt: skip
#: SentencePiece pieces of the stand-in tokenizer; BEiT-3's embedding keeps 8 rows past its tokenizer's ids.
PIECES, UNUSED_ROWS = 400, 8


def mmoe(*argv: str) -> None:
    """``mmoe <argv>`` in this process; exits with its status when it fails."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="LightningCLI's args parameter")
        code = main(list(argv))
    if code not in (0, None):
        sys.exit(f"`mmoe {' '.join(argv[:2])} ...` exited with status {code}")


def corpus_texts(data: Path) -> list[str]:
    """The questions and captions of the synthetic corpus's training splits (what the tokenizer is trained on)."""
    questions = json.loads((data / "vqav2" / "v2_OpenEnded_mscoco_train2014_questions.json").read_text())
    captions = json.loads((data / "coco" / "karpathy" / "dataset_coco.json").read_text())
    texts = [question["question"] for question in questions["questions"]]
    texts += [sentence["raw"] for image in captions["images"] for sentence in image["sentences"]]
    return texts


def train_sentencepiece(texts: list[str], path: Path) -> None:
    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(texts), model_writer=model, vocab_size=PIECES, minloglevel=2, hard_vocab_limit=False
    )
    path.write_bytes(model.getvalue())


def released_layout_beit3(vocab_size: int, path: Path) -> None:
    """A randomly initialised torchscale BEiT3, saved as unilm saves its models."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from torchscale.architecture.config import EncoderConfig
        from torchscale.model.BEiT3 import BEiT3
    args = EncoderConfig(vocab_size=vocab_size, multiway=True, layernorm_embedding=False, normalize_output=True,
                         no_output_layer=True, subln=True, **SHAPE)  # fmt: skip
    torch.manual_seed(0)
    state = {f"beit3.{key}": value for key, value in BEiT3(args).state_dict().items()}
    torch.save({"model": state}, path)


def fit_options(run_dir: Path, data: Path, upcycled: Path, spm: Path, steps: int) -> dict:
    """Options over ``vqav2_tiny.yaml``: the corpus in ``data``, the upcycled backbone and the stand-in tokenizer,
    ``steps`` steps without validation, the checkpoint written where :class:`RunLayout` looks for it once training
    ends."""
    checkpoints = RunLayout(run_dir).checkpoints
    checkpoint = {"dirpath": str(checkpoints), "save_last": True, "save_top_k": 0, "every_n_train_steps": steps}
    return {
        "data": {"init_args": {"data_root": str(data)}},
        "model": {
            "init_args": {
                "backbone": None, "pretrained": str(upcycled), "text_tokenizer": str(spm),
                "answer_vocab": str(data / "shards" / VQA_TRAIN_SPLIT / ANSWERS_FILE),
            }
        },
        "trainer": {
            "max_steps": steps, "val_check_interval": steps, "limit_val_batches": 0, "default_root_dir": str(run_dir),
            "enable_progress_bar": False, "logger": False,
            "callbacks": [{"class_path": "lightning.pytorch.callbacks.ModelCheckpoint", "init_args": checkpoint}],
        },
    }  # fmt: skip


def lightning(subcommand: str, config: Path, options: dict) -> None:
    """``mmoe <subcommand> --config config`` with ``options`` in this process; exits with its status when it fails."""
    try:
        run_lightning(subcommand, [config], options)
    except SystemExit as stop:
        if stop.code not in (0, None):
            sys.exit(f"`mmoe {subcommand}` exited with status {stop.code}")


def run(out: Path, steps: int) -> dict:
    seconds = {}
    clock = time.perf_counter()

    def lap(name: str) -> None:
        nonlocal clock
        seconds[name] = round(time.perf_counter() - clock, 1)
        clock = time.perf_counter()

    data, config = out / "data", CONFIGS / "finetune" / "vqav2_tiny.yaml"
    with contextlib.redirect_stdout(io.StringIO()):
        mmoe("data", "synth", "--out", str(data), "--shards")
    lap("corpus")
    spm = out / "tiny.spm"
    train_sentencepiece(corpus_texts(data), spm)
    pieces = sentencepiece.SentencePieceProcessor(model_file=str(spm)).get_piece_size()
    released = out / "beit3_tiny_patch16_64.pth"
    released_layout_beit3(pieces + 2 + UNUSED_ROWS, released)
    lap("released_file")
    upcycled = out / "upcycled.pt"
    with contextlib.redirect_stdout(io.StringIO()):
        mmoe("upcycle", "--ckpt", str(released), "--config", str(config), "--out", str(upcycled))
    lap("upcycle")
    run_dir = out / "vqav2"
    options = fit_options(run_dir, data, upcycled, spm, steps)
    lightning("fit", config, options)
    lap("fit")
    checkpoint = RunLayout(run_dir).last_checkpoint
    predictions = out / "val_results.json"
    options["ckpt_path"] = str(checkpoint)
    options["model"]["init_args"]["predictions_file"] = str(predictions)
    options["data"]["init_args"]["test_shards"] = str(data / "shards" / VQA_VAL_SPLIT)
    lightning("predict", config, options)
    lap("predict")
    vqa = data / "vqav2"
    report = evaluate_vqa_files(
        vqa / "v2_OpenEnded_mscoco_val2014_questions.json", vqa / "v2_mscoco_val2014_annotations.json", predictions
    )
    chance = ChanceLevels.from_summary(json.loads((data / SUMMARY_FILE).read_text())["chance"])
    return {
        "vqa_val_accuracy": report["overall"],
        "chance_prior": chance.vqa_prior,
        "chance_question_prior": chance.vqa_question_prior,
        "steps": steps,
        "tokenizer_pieces": pieces,
        "seconds": seconds,
        "files": [str(released), str(spm), str(upcycled), str(checkpoint), str(predictions)],
    }


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="runs/beit3_example", help="output folder (default runs/beit3_example)")
    parser.add_argument("--steps", type=int, default=300, help="fine-tuning steps (default 300)")
    return parser.parse_args(argv)


if __name__ == "__main__":
    args = parse(sys.argv[1:])
    print(json.dumps(run(Path(args.out), args.steps), indent=2))
