"""Every tutorial page's ``bash`` blocks run as written (read from the page by tests/tutorial_commands.py), in order,
in a fresh working directory, through ``mmoe.cli.main`` in this process (or, for the commands of :data:`IN_A_PROCESS`,
as a process of their own), at tiny sizes: :data:`TINY_SIZES` appends each kind of command's size options (a ``fit``
whose page states its ``--trainer.max_steps`` runs as written), :data:`NOT_RUN` names each command not run here and
why. The pages chain as a reader's session does: the pre-training page's corpus, run and exported backbone are what
the fine-tuning, router and scale-out pages start from. README's and data/README.md's img2dataset commands run as
written too, on a folder of img2dataset's files alone.
"""

from __future__ import annotations

import contextlib
import csv
import io
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from PIL import Image

from mmoe.cli import main
from mmoe.model import MultiwayConfig, MultiwayTransformer, to_beit3
from mmoe.runtime.checkpoint import load_backbone
from mmoe.tasks import from_pretrained
from tests.cli_fixtures import tiny_sentencepiece
from tests.data.img2dataset_layout import Attempt, write_shard
from tests.tutorial_commands import MMOE, TUTORIALS, bash_blocks, block_commands, mmoe_arguments, page_commands

REPO = Path(__file__).resolve().parents[1]

#: A tiny run of any training config: two steps, small batches, no loader workers; then how much it validates.
TINY_RUN = ["--trainer.max_steps", "2", "--trainer.val_check_interval", "2", "--trainer.enable_progress_bar", "false",
            "--trainer.enable_model_summary", "false", "--data.init_args.batch_size", "4",
            "--data.init_args.num_workers", "0"]  # fmt: skip
ONE_VALIDATION_BATCH, NO_VALIDATION = ["--trainer.limit_val_batches", "1"], ["--trainer.limit_val_batches", "0"]

#: The stand-in ``beit3.spm``'s pieces and its text embedding's rows: the pieces' 42 ids and 8 unused rows, as the
#: released file's 64,002 ids and 64,010 rows.
STAND_IN_PIECES, STAND_IN_TEXT_ROWS = 40, 50

#: The base VQAv2 config at the tiny shape, on the synthetic corpus, in float32 (the beit3_weights page's stand-in
#: files have the tiny shape), written into the working directory by :func:`write_beit3_stand_ins`.
TINY_BASE_VQA = {
    "trainer": {"precision": "32-true"},
    "model": {"init_args": {"answer_vocab": "data/synthetic/shards/vqav2-train2014/answers.json",
                            "backbone": {"dim": 192, "depth": 4, "num_heads": 3, "ffn_dim": 768, "image_size": 64}}},
    "data": {"init_args": {"data_root": "data/synthetic", "train_shards": "shards/vqav2-train2014",
                           "val_shards": "shards/vqav2-val2014", "test_shards": "shards/vqav2-test-dev2015",
                           "eval_batch_size": 8}},
}  # fmt: skip

#: The options appended to each kind of command (:func:`tiny_sizes`) so that it runs at tiny size. The tiny
#: fine-tunings skip validation (captioning's runs the Java caption scorers); the page's own evaluation scores them.
TINY_SIZES: dict[str, list[str]] = {
    "data synth": ["--size", "tiny"],
    "fit configs/pretrain": [*TINY_RUN, *ONE_VALIDATION_BATCH, "--model.init_args.zero_shot_probes", "false"],
    "fit configs/finetune": [*TINY_RUN, *NO_VALIDATION],
    "fit configs/finetune/vqav2_base.yaml": [
        "--config",
        "tiny_base_vqa.yaml",
        "--model.init_args.backbone.vocab_size",
        str(STAND_IN_TEXT_ROWS),
        *TINY_RUN,
        *ONE_VALIDATION_BATCH,
    ],
    "upcycle": ["--config", "tiny_base_vqa.yaml"],
    "predict configs/finetune": ["--trainer.enable_progress_bar", "false", "--data.init_args.num_workers", "0"],
    "infer captioning": ["--beam", "1"],
    "eval caption": ["--no-spice", "--no-meteor"],
    "analyze routing": ["--batches", "1"],
    "viz subtoken-map": ["--num-images", "2", "--num-texts", "1"],
    "viz heatmap": ["--batches", "1"],
}

#: The scale-out page's commands for 8 GPUs and for two machines, as the page writes them.
BASE_XMOE = ".venv/bin/mmoe fit --config configs/pretrain/base.yaml --config configs/pretrain/base/xmoe.yaml"
BASE_MHMOE = ".venv/bin/mmoe fit --config configs/pretrain/base.yaml --config configs/pretrain/base/mhmoe.yaml"
DDP, NODES = "--trainer.strategy ddp_find_unused_parameters_true", "--trainer.devices 8 --trainer.num_nodes 2"
TORCHRUN = "torchrun --nnodes 2 --nproc-per-node 8 --node-rank 0 --master-addr node0 --master-port 29500"
FSDP2 = (" --trainer.devices 8 --trainer.precision bf16-mixed --trainer.strategy "
         "lightning.pytorch.strategies.ModelParallelStrategy --trainer.strategy.init_args.data_parallel_size 8 "
         "--trainer.strategy.init_args.tensor_parallel_size 1 "
         "--trainer.strategy.init_args.save_distributed_checkpoint false "
         "--model.init_args.backbone.checkpoint_activations true")  # fmt: skip
EIGHT_GPUS = "needs 8 GPUs; the page names the CPU test that runs the same path on 2 gloo processes"

#: Commands of the tutorials that this file does not run, each with the reason.
NOT_RUN: dict[str, str] = {
    "bash scripts/setup.sh": "CI has just run it; test_setup_is_the_first_command_of_the_demo holds the page to it",
    ".venv/bin/mmoe demo --out runs/demo": "tests/demo/test_demo.py's default_demo fixture runs it, read from the "
    "page, at its full default size (ten minutes): never twice",
    f"{BASE_XMOE} --trainer.devices 8 {DDP}": EIGHT_GPUS,
    f"{BASE_XMOE} --trainer.devices 8 {DDP} --model.init_args.backbone.moe.expert_parallel 8": EIGHT_GPUS,
    BASE_MHMOE + FSDP2: EIGHT_GPUS,
    f"{TORCHRUN} {BASE_XMOE} {NODES} {DDP} --model.init_args.backbone.moe.expert_parallel 8": "needs two machines "
    "of 8 GPUs",
    f"srun {BASE_XMOE} {NODES} {DDP}": "needs a SLURM cluster of two machines of 8 GPUs",
    "sbatch pretrain_xmoe.sh": "needs a SLURM cluster of two machines of 8 GPUs",
    ".venv/bin/mmoe study claims --fast --out runs/claims_fast": "tests/study/test_study.py's fast_study fixture "
    "runs the fast study (minutes) into its own folder: never twice",
    ".venv/bin/mmoe study claims --out runs/claims --jobs 2": "about an hour on 2 CPU cores (the dry run's estimate)",
}

#: Commands that run as a process of their own (the Python running the tests, ``-m mmoe.cli``), each with the reason:
#: Lightning's DDP starts the second rank by running the process's command line again, which in this process is
#: pytest's.
IN_A_PROCESS: dict[str, str] = {
    ".venv/bin/mmoe fit --config configs/pretrain/tiny.yaml --config configs/pretrain/tiny/xmoe.yaml "
    "--trainer.accelerator cpu --trainer.devices 2 --trainer.strategy ddp_find_unused_parameters_true "
    "--model.init_args.backbone.moe.expert_parallel 2 --trainer.default_root_dir runs/pretrain/tiny_xmoe_ep2": "2 "
    "processes (DDP over gloo, expert parallelism)",
}

#: The pages this file runs, in a reader's order (the demo's page is tests/demo/test_demo.py's; demo_details.md has
#: no commands).
PAGES_RUN = ("pretrain_own_data.md", "finetune_evaluate.md", "beit3_weights.md", "compare_routers.md", "scale_out.md",
             "reproduce_claims.md")  # fmt: skip


def tiny_sizes(args: list[str]) -> list[str]:
    """The :data:`TINY_SIZES` options of a command, keyed by its subcommand (two words for a command group such as
    ``data synth``); for ``fit`` / ``predict`` by its first config, or else that config's folder. A ``fit`` whose
    page gives its ``--trainer.max_steps`` runs at the size the page shows: none."""
    if args[0] == "fit" and "--trainer.max_steps" in args:
        return []
    words = args[:2] if args[0] in {"data", "tokenizer", "eval", "infer", "analyze", "viz", "study"} else args[:1]
    if args[0] in {"fit", "predict"}:
        config = args[args.index("--config") + 1]
        words = [args[0], config if f"{args[0]} {config}" in TINY_SIZES else str(Path(config).parent)]
    return TINY_SIZES.get(" ".join(words), [])


def run_page(page: str) -> dict[str, str]:
    """Runs every command of ``docs/tutorials/<page>`` not in :data:`NOT_RUN` in the working directory, with its
    tiny-size options; returns each command's printed stdout, keyed by the command as the page writes it."""
    printed = {}
    for argv in page_commands(TUTORIALS / page):
        line = " ".join(argv)
        if line in NOT_RUN:
            continue
        args = mmoe_arguments(argv)
        assert args is not None, f"{page}: {line!r} is neither an mmoe command nor in NOT_RUN"
        if line in IN_A_PROCESS:
            printed[line] = run_in_a_process([*args, *tiny_sizes(args)], f"{page}: {line!r}")
            continue
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            code = main([*args, *tiny_sizes(args)])
        assert code == 0, f"{page}: {line!r} exited {code}"
        printed[line] = out.getvalue()
    return printed


def run_in_a_process(args: list[str], named: str) -> str:
    """``mmoe <args>`` as a process of its own in the working directory, one torch thread per process; its stdout."""
    environment = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "mmoe.cli", *args], env=environment, capture_output=True, text=True,
                          timeout=600)  # fmt: skip
    assert done.returncode == 0, f"{named} exited {done.returncode}: {done.stderr[-3000:]}"
    return done.stdout


def write_own_data(root: Path) -> None:
    """A reader's own image folder and two CSV tables of captions (what the own-data steps convert)."""
    rng = np.random.default_rng(0)
    (root / "images").mkdir(parents=True)
    colours = {"red": (220, 30, 30), "green": (30, 200, 60), "blue": (40, 60, 220)}
    rows = []
    for index in range(40):
        name = list(colours)[index % 3]
        pixels = rng.integers(0, 60, (64, 64, 3), dtype=np.uint8)
        corner = rng.integers(0, 32, 2)
        pixels[corner[0] : corner[0] + 24, corner[1] : corner[1] + 24] = colours[name]
        Image.fromarray(pixels).save(root / "images" / f"photo_{index}.png")
        rows.append({"image": f"photo_{index}.png", "caption": f"a {name} square on a dark ground"})
    for table, part in (("train.csv", rows[:34]), ("val.csv", rows[34:])):
        with (root / table).open("w", newline="") as file:
            writer = csv.DictWriter(file, fieldnames=["image", "caption"])
            writer.writeheader()
            writer.writerows(part)


@pytest.fixture(scope="module")
def reader_session(tmp_path_factory):
    """A reader's working directory (the shipped ``configs/`` linked in, their own data under ``data/mine``) in
    which the pre-training page has run: (directory, that page's printed output). The directory (about 1 GB of
    checkpoints once every page has run) is removed afterwards."""
    root = tmp_path_factory.mktemp("tutorials")
    (root / "configs").symlink_to(REPO / "configs", target_is_directory=True)
    write_own_data(root / "data" / "mine")
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(root)
        printed = run_page("pretrain_own_data.md")
    yield root, printed
    shutil.rmtree(root, ignore_errors=True)


def test_a_page_gives_its_bash_commands_joined_and_without_comments(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(
        "# A page\n\n```bash\n# a whole-line comment\n.venv/bin/mmoe fit --config a.yaml \\\n"
        "    --trainer.max_steps 2  # a trailing comment\n\n"
        ".venv/bin/mmoe eval vqa --results 'my results.json'\n```\n\n"
        "```python\nprint('not a command')\n```\n\n1. A step:\n\n    ```bash\n    bash scripts/setup.sh\n    ```\n"
    )
    assert page_commands(page) == [
        [".venv/bin/mmoe", "fit", "--config", "a.yaml", "--trainer.max_steps", "2"],
        [".venv/bin/mmoe", "eval", "vqa", "--results", "my results.json"],
        ["bash", "scripts/setup.sh"],
    ]
    assert block_commands("echo '#' kept # dropped\n") == [["echo", "#", "kept"]]
    assert mmoe_arguments(["bash", "x.sh"]) is None and mmoe_arguments([".venv/bin/mmoe", "info"]) == ["info"]


def test_every_tutorial_command_is_run_or_listed_as_not_run():
    for page in sorted(TUTORIALS.glob("*.md")):
        runnable = [argv for argv in page_commands(page) if " ".join(argv) not in NOT_RUN]
        assert page.name in PAGES_RUN or not runnable, f"{page.name} has commands to run but no test runs the page"
    lines = {" ".join(argv): argv for page in TUTORIALS.glob("*.md") for argv in page_commands(page)}
    unknown = [line for line, argv in lines.items() if line not in NOT_RUN and mmoe_arguments(argv) is None]
    assert not unknown, f"commands neither run by mmoe.cli.main nor in NOT_RUN: {unknown}"
    assert set(NOT_RUN) <= set(lines), f"NOT_RUN names commands no tutorial has: {set(NOT_RUN) - set(lines)}"
    assert set(IN_A_PROCESS) <= set(lines), f"IN_A_PROCESS names commands no tutorial has: {set(IN_A_PROCESS)}"
    placeholders = [line for line in lines if any(mark in line for mark in ("...", "[-", "|", " OUT", "DIR"))]
    assert not placeholders, f"tutorial commands with placeholders: {placeholders}"


def test_setup_is_the_first_command_of_the_demo():
    commands = page_commands(TUTORIALS / "demo.md")
    assert commands[0] == ["bash", "scripts/setup.sh"] and (REPO / "scripts" / "setup.sh").is_file()
    assert all(" ".join(argv) in NOT_RUN for argv in commands), "the demo page's commands run elsewhere, never here"


def test_pretraining_on_own_and_synthetic_data_exports_a_backbone(reader_session):
    root, _ = reader_session
    assert (root / "runs" / "pretrain" / "mine_xmoe" / "checkpoints" / "last.ckpt").is_file()
    assert load_backbone(root / "runs" / "mine_xmoe.pt").config.moe is not None
    backbone = load_backbone(root / "runs" / "tiny_xmoe.pt")
    assert backbone.config.moe is not None and backbone.config.dim == 192
    assert json.loads((root / "runs" / "tiny_xmoe" / "config.json").read_text())["format"] == "mmoe-pretrained"


def test_fine_tuning_from_the_exported_backbone_infers_and_scores(reader_session, monkeypatch):
    root, _ = reader_session
    monkeypatch.chdir(root)
    printed = run_page("finetune_evaluate.md")
    scores = {line.split()[2]: json.loads(out[out.index("{") :]) for line, out in printed.items() if " eval " in line}
    assert 0.0 <= scores["vqa"]["overall"] <= 100.0 and 0.0 <= scores["nlvr2"]["accuracy"] <= 1.0
    assert 0.0 <= scores["retrieval"]["mean_recall"] <= 1.0 and "CIDEr" in scores["caption"]
    task = from_pretrained(root / "runs" / "vqav2_model")
    assert type(task).__name__ == "VQAFineTuning"
    images = sorted(path.name for path in (root / "data" / "synthetic" / "coco" / "val2014").iterdir())
    captions = json.loads((root / "runs" / "folder_captions.json").read_text())
    assert sorted(entry["file"] for entry in captions) == images and all(entry["caption"] for entry in captions)


def test_own_tables_fine_tune_a_captioning_model_that_captions_a_held_out_photo(reader_session):
    root, printed = reader_session
    run = root / "runs" / "finetune" / "mine_captioning"
    assert list((run / "checkpoints").glob("*step=10.ckpt")) and (run / "checkpoints" / "last.ckpt").is_file()
    assert (run / "results" / "captions_val_step10.json").is_file(), "the run validated on captions-val, in its folder"
    (caption,) = [out for line, out in printed.items() if line.startswith(f"{MMOE} infer captioning")]
    with (root / "data" / "mine" / "train.csv").open() as table:
        words = {word for row in csv.DictReader(table) for word in row["caption"].split()}
    # The head says only the training captions' tokens (caption_tokens.json), so every word is one of theirs.
    assert caption.split() and set(caption.split()) <= words, caption


def write_beit3_stand_ins(root: Path) -> None:
    """In place of the released ``beit3_base_patch16_224.pth`` and ``beit3.spm``: a randomly initialised backbone
    in BEiT-3's released layout and vocabulary at the tiny shape, and a small SentencePiece model; and the tiny
    shape's config part :data:`TINY_BASE_VQA`."""
    torch.manual_seed(0)
    shape = {"dim": 192, "depth": 4, "num_heads": 3, "ffn_dim": 768, "vocab_size": STAND_IN_TEXT_ROWS}
    config = MultiwayConfig.preset("beit3_base", **shape)
    torch.save({"model": to_beit3(MultiwayTransformer(config))}, root / "beit3_base_patch16_224.pth")
    tiny_sentencepiece(root / "beit3.spm", pieces=STAND_IN_PIECES)
    (root / "tiny_base_vqa.yaml").write_text(yaml.safe_dump(TINY_BASE_VQA))


def test_released_beit3_weights_upcycle_and_fine_tune(reader_session, monkeypatch):
    root, _ = reader_session
    monkeypatch.chdir(root)
    write_beit3_stand_ins(root)
    run_page("beit3_weights.md")
    upcycled = load_backbone(root / "runs" / "beit3_base_xmoe.pt")
    assert upcycled.config.moe is not None and upcycled.config.position_offset == 2  # BEiT-3's layout, now MoE
    assert upcycled.config.vocab_size == STAND_IN_TEXT_ROWS
    assert (root / "runs" / "finetune" / "vqav2_base" / "checkpoints" / "last.ckpt").is_file()


def checkpoint(run: str) -> str:
    """The last checkpoint of ``runs/pretrain/<run>``, as the pages name it."""
    return f"runs/pretrain/{run}/checkpoints/last.ckpt"


def test_two_routers_are_measured_and_drawn_side_by_side(reader_session, monkeypatch):
    root, _ = reader_session
    monkeypatch.chdir(root)
    printed = run_page("compare_routers.md")
    analyses = {report["checkpoint"]: report for line, out in printed.items() if " analyze " in line
                for report in [json.loads(out)]}  # fmt: skip
    assert set(analyses) == {checkpoint("tiny_xmoe"), checkpoint("tiny_mhmoe")}
    moe_layers = {f"layer{i}/{modality}" for i in (1, 3) for modality in ("vision", "language")}
    for report in analyses.values():
        assert set(report["activation_ratio"]) == moe_layers
        assert all(0.0 <= ratio <= 1.0 for ratio in report["activation_ratio"].values())
    figures = root / "runs" / "compare_routers"
    assert (figures / "subtoken_compare_layer1_vision.png").is_file()
    assert (figures / "subtoken_text_compare.png").is_file()
    for index in (0, 1):  # a heatmap and load bars per checkpoint, numbered in the order of --ckpt
        drawn = {path.name.split("_")[0] for path in figures.glob(f"*_{index}-checkpoints-last.png")}
        assert {"heatmap", "loads"} <= drawn


def test_a_two_process_expert_parallel_run_exports_every_expert(reader_session, monkeypatch):
    root, _ = reader_session
    monkeypatch.chdir(root)
    run_page("scale_out.md")
    sharded, whole = load_backbone(root / "runs" / "tiny_xmoe_ep2.pt"), load_backbone(root / "runs" / "tiny_xmoe.pt")
    assert sharded.config.moe.num_experts == 8 and sharded.config.moe.expert_parallel == 1
    shapes = {name: tuple(p.shape) for name, p in sharded.named_parameters()}
    assert shapes == {name: tuple(p.shape) for name, p in whole.named_parameters()}


def test_the_claims_study_plans_print_the_shipped_report_s_plan_hash(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    printed = run_page("reproduce_claims.md")
    default = printed[".venv/bin/mmoe study claims --dry-run"]
    shipped_header = (REPO / "docs" / "claims.md").read_text(encoding="utf-8").split("\n\n")[1]
    shipped_hash = shipped_header.split("Plan `")[1].split("`")[0]
    assert f"SHA-256 of its canonical JSON: `{shipped_hash}`" in default
    assert all("Estimated cost" in out for out in printed.values()) and len(printed) == 4
    assert not any(tmp_path.iterdir()), "a dry run writes nothing"


#: The pages giving the commands for an img2dataset folder: README's and the section of data/README.md it points to.
IMG2DATASET_PAGES = (REPO / "README.md", REPO / "data" / "README.md")


def img2dataset_commands(page: Path) -> list[list[str]]:
    """The commands of the one ``bash`` block of ``page`` that indexes an img2dataset folder."""
    (block,) = [body for body in bash_blocks(page.read_text(encoding="utf-8")) if f"{MMOE} data index" in body]
    return block_commands(block)


def write_img2dataset_output(folder: Path) -> None:
    """What ``img2dataset --output_format webdataset --image_size 64`` writes, and nothing else: per shard a tar
    (jpg, txt, json), a parquet and a stats file; every stored image 64 px, a third of the originals 25 px (below
    ``--min-side 64``), 2 failed downloads per shard; 48 samples to train on (768 patches: the codebook needs 512)."""
    folder.mkdir(parents=True)
    attempts = [Attempt(side=64, original=side) for side in (300, 120, 25) * 8] + [
        Attempt(status="failed_to_download")
    ] * 2
    for shard in range(3):
        write_shard(folder, shard, attempts)


def test_the_img2dataset_commands_run_as_written_on_a_folder_of_img2dataset_output_only(tmp_path, monkeypatch):
    commands = img2dataset_commands(IMG2DATASET_PAGES[0])
    assert img2dataset_commands(IMG2DATASET_PAGES[1]) == commands, "README and data/README.md give one recipe"
    monkeypatch.chdir(tmp_path)
    (tmp_path / "configs").symlink_to(REPO / "configs", target_is_directory=True)
    write_img2dataset_output(tmp_path / "data" / "cc3m")
    written = [path.name for path in (tmp_path / "data").rglob("*") if path.is_file()]
    assert len(written) == 9 and all(re.fullmatch(r"\d{5}(\.tar|\.parquet|_stats\.json)", name) for name in written)
    printed = []
    for argv in commands:
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main(mmoe_arguments(argv))
        assert code == 0, f"{' '.join(argv)!r} exited {code}: {err.getvalue()[-3000:]}"
        printed.append((out.getvalue(), err.getvalue()))
    index = json.loads(printed[0][0])
    assert index["samples"] == 48 and index["skipped_by_cause"]["too_small"] == 24
    assert index["statuses"] == {"failed_to_download": 6}
    assert index["sides_read_from"] == {"original_width/original_height": 72}
    fit_said = printed[-1][1].splitlines()
    assert len([line for line in fit_said if "6 of the 78 samples img2dataset tried" in line]) == 1
    assert (tmp_path / "runs" / "pretrain" / "cc3m_xmoe" / "checkpoints" / "last.ckpt").is_file()
