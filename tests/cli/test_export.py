"""``mmoe export`` on a checkpoint of ``mmoe fit``: a fine-tuned task model and its backbone come back bit for bit
from the folder (moved elsewhere), in their dtype; and every command that uses a checkpoint's weights (``infer``,
``predict``, ``export``, ``export-backbone``, ``upcycle``) refuses one with a NaN written in, in one line, before any
work."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
import yaml
from PIL import Image
from safetensors.torch import save_file

import mmoe.tasks
from mmoe.cli import main
from mmoe.infer.load import load_fine_tuned
from mmoe.model import MoEPlan, MultiwayConfig, MultiwayTransformer, from_pretrained
from mmoe.model.pretrained import PretrainedFolderError, read_weights
from mmoe.runtime.checkpoint import config_to_dict, export_backbone, load_backbone
from mmoe.tasks.vqa import VQAFineTuning
from tests.cli_fixtures import run_mmoe, small_shards

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::UserWarning")]

BACKBONE = MultiwayConfig.preset("test", moe=MoEPlan(num_experts=4, every=2, heads=2))
#: The weight a NaN is written into: one expert of a MoE layer, deep in the state dict.
SPOILED = "backbone.layers.1.ffn.0.experts.fc1_weight"
#: A weight of a plain linear layer (the image's FFN of the first, dense layer), which meets float32 inputs.
DENSE_WEIGHT = "backbone.layers.0.ffn.0.fc1.weight"


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A VQA checkpoint of two `mmoe fit` steps with its config, a copy of it with a NaN written into
    :data:`SPOILED`, and a dense exported backbone with a NaN."""
    root = tmp_path_factory.mktemp("export")
    shards = small_shards(root)
    run = root / "vqa_run"
    config = {
        "seed_everything": 0,
        "trainer": {"max_steps": 2, "accelerator": "cpu", "logger": False, "enable_progress_bar": False,
                    "enable_model_summary": False, "limit_val_batches": 0, "default_root_dir": str(run)},
        "model": {"class_path": "mmoe.tasks.vqa.VQAFineTuning",
                  "init_args": {"backbone": config_to_dict(BACKBONE), "optimizer": {"warmup_steps": 1},
                                "answer_vocab": str(shards / "vqav2-train2014" / "answers.json")}},
        "data": {"class_path": "mmoe.data.datamodules.VQADataModule",
                 "init_args": {"train_shards": str(shards / "vqav2-train2014"),
                               "test_shards": str(shards / "vqav2-val2014"), "batch_size": 2, "eval_batch_size": 4,
                               "max_text_length": 24, "num_workers": 0}},
    }  # fmt: skip
    (root / "vqa.yaml").write_text(yaml.safe_dump(config))
    assert main(["fit", "--config", str(root / "vqa.yaml")]) == 0
    checkpoint = next((run / "checkpoints").glob("*.ckpt"))
    state = torch.load(checkpoint, map_location="cpu", weights_only=True)
    state["state_dict"][SPOILED].view(-1)[5] = float("nan")
    torch.save(state, root / "nan.ckpt")
    dense = MultiwayTransformer(MultiwayConfig.preset("test"))
    with torch.no_grad():
        dense.layers[0].ffn[0].fc1.weight[0, 0] = float("inf")
    export_backbone(dense, root / "dense_nan.pt")
    image = root / "photo.png"
    Image.new("RGB", (40, 30), (200, 30, 30)).save(image)
    return {"root": root, "config": root / "vqa.yaml", "ckpt": checkpoint, "nan_ckpt": root / "nan.ckpt",
            "nan_dense": root / "dense_nan.pt", "image": image,
            "answers": shards / "vqav2-train2014" / "answers.json"}  # fmt: skip


def assert_same_tensors(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert list(got) == list(expected)
    for name, tensor in expected.items():
        assert got[name].dtype == tensor.dtype, name
        assert torch.equal(got[name], tensor), name


def vqa_logits(task: VQAFineTuning) -> torch.Tensor:
    generator = torch.Generator().manual_seed(0)
    image = torch.randn(2, 3, 32, 32, generator=generator).to(task.backbone.cls_token.dtype)
    text = torch.randint(3, 50, (2, 5), generator=generator)
    with torch.no_grad():
        return task.eval()(image, text, torch.zeros(2, 5, dtype=torch.bool))[0]


def test_a_fine_tuned_task_comes_back_bit_for_bit_from_a_moved_folder(trained, tmp_path, capsys):
    code, out, err = run_mmoe(["export", "--ckpt", str(trained["ckpt"]), "--out", str(tmp_path / "vqa")], capsys)
    assert code == 0, err
    summary = json.loads(out)
    assert summary["folder"] == str(tmp_path / "vqa") and summary["task"] == "vqav2"
    assert sorted(str(p.relative_to(tmp_path / "vqa")) for p in (tmp_path / "vqa").rglob("*") if p.is_file()) == [
        "config.json", "files/answer_vocab.json", "model.safetensors"]  # fmt: skip
    config = json.loads((tmp_path / "vqa" / "config.json").read_text())
    assert config["task"]["class_path"] == "mmoe.tasks.vqa.VQAFineTuning"
    assert config["task"]["init_args"]["answer_vocab"] == "files/answer_vocab.json"
    assert config["backbone"] == config_to_dict(BACKBONE)
    shutil.move(tmp_path / "vqa", tmp_path / "elsewhere")  # the folder holds all it needs

    task = mmoe.tasks.from_pretrained(tmp_path / "elsewhere")
    saved = torch.load(trained["ckpt"], map_location="cpu", weights_only=True)["state_dict"]
    assert isinstance(task, VQAFineTuning) and summary["tensors"] == len(saved)
    assert_same_tensors(task.state_dict(), saved)
    assert task.answers == json.loads(trained["answers"].read_text())
    assert torch.equal(vqa_logits(task), vqa_logits(load_fine_tuned(trained["ckpt"], VQAFineTuning).task))
    backbone = from_pretrained(tmp_path / "elsewhere")  # the backbone of a task folder
    assert_same_tensors(backbone.state_dict(), {k[9:]: v for k, v in saved.items() if k.startswith("backbone.")})


def test_a_task_folder_reads_its_files_from_itself_only(trained, tmp_path, capsys):
    code, _, err = run_mmoe(["export", "--ckpt", str(trained["ckpt"]), "--out", str(tmp_path / "vqa")], capsys)
    assert code == 0, err
    config_file = tmp_path / "vqa" / "config.json"
    config = json.loads(config_file.read_text())
    for elsewhere in (str(trained["answers"]), "../answers.json"):
        config["task"]["init_args"]["answer_vocab"] = elsewhere
        config_file.write_text(json.dumps(config))
        with pytest.raises(
            PretrainedFolderError, match=f"answer_vocab '{re.escape(elsewhere)}' lies outside the folder"
        ):
            mmoe.tasks.from_pretrained(tmp_path / "vqa")
    config["task"]["init_args"]["answer_vocab"] = "files/answer_vocab.json"
    config_file.write_text(json.dumps(config))
    (tmp_path / "vqa" / "files" / "answer_vocab.json").unlink()
    with pytest.raises(PretrainedFolderError, match="answer_vocab.json") as error:
        mmoe.tasks.from_pretrained(tmp_path / "vqa")
    assert str(error.value).startswith(f"{tmp_path / 'vqa'}: ") and "\n" not in str(error.value)


def test_infer_answers_from_a_folder_as_from_its_checkpoint(trained, tmp_path, capsys):
    code, _, err = run_mmoe(["export", "--ckpt", str(trained["ckpt"]), "--out", str(tmp_path / "vqa")], capsys)
    assert code == 0, err
    question = ["--image", str(trained["image"]), "--question", "what color is the square?", "--top-k", "3", "--json"]
    answers = {}
    for source in (trained["ckpt"], tmp_path / "vqa"):
        code, out, err = run_mmoe(["infer", "vqa", "--ckpt", str(source), *question], capsys)
        assert code == 0, err
        answers[source] = json.loads(out)
    assert answers[tmp_path / "vqa"] == answers[trained["ckpt"]] and answers[trained["ckpt"]]["answers"]
    image = str(trained["image"])
    argv = ["infer", "nlvr2", "--ckpt", str(tmp_path / "vqa"), "--left", image, "--right", image, "--sentence", "two"]
    code, _, err = run_mmoe(argv, capsys)
    assert code == 2 and err == (
        f"mmoe infer: error: {tmp_path / 'vqa' / 'config.json'}: task class_path 'mmoe.tasks.vqa.VQAFineTuning' is a "
        "vqav2 task, not a nlvr2 task (expected 'mmoe.tasks.nlvr2.NLVR2FineTuning')\n"
    )


def test_a_bfloat16_checkpoint_keeps_its_dtype(trained, tmp_path, capsys):
    state = torch.load(trained["ckpt"], map_location="cpu", weights_only=True)
    state["state_dict"] = {name: tensor.to(torch.bfloat16) for name, tensor in state["state_dict"].items()}
    torch.save(state, tmp_path / "bf16.ckpt")
    for extra, folder in (([], "task"), (["--backbone-only"], "backbone")):
        code, _, err = run_mmoe(["export", "--ckpt", str(tmp_path / "bf16.ckpt"), "--out", str(tmp_path / folder),
                                 *extra], capsys)  # fmt: skip
        assert code == 0, err
    assert_same_tensors(mmoe.tasks.from_pretrained(tmp_path / "task").state_dict(), state["state_dict"])
    backbone = {k[9:]: v for k, v in state["state_dict"].items() if k.startswith("backbone.")}
    assert_same_tensors(from_pretrained(tmp_path / "backbone").state_dict(), backbone)


def test_backbone_only_writes_the_backbone_which_the_task_loader_refuses(trained, tmp_path, capsys):
    argv = ["export", "--ckpt", str(trained["ckpt"]), "--out", str(tmp_path / "bb"), "--backbone-only"]
    code, out, err = run_mmoe(argv, capsys)
    assert code == 0, err
    assert json.loads(out)["task"] is None
    assert sorted(path.name for path in (tmp_path / "bb").iterdir()) == ["config.json", "model.safetensors"]
    assert json.loads((tmp_path / "bb" / "config.json").read_text())["task"] is None
    saved = torch.load(trained["ckpt"], map_location="cpu", weights_only=True)["state_dict"]
    backbone = {k[9:]: v for k, v in saved.items() if k.startswith("backbone.")}
    assert_same_tensors(from_pretrained(tmp_path / "bb").state_dict(), backbone)
    with pytest.raises(PretrainedFolderError, match="holds a backbone only"):
        mmoe.tasks.from_pretrained(tmp_path / "bb")
    # An exported backbone file (no task in it) gives a backbone folder without the option.
    export_backbone(from_pretrained(tmp_path / "bb"), tmp_path / "bb.pt")
    code, _, err = run_mmoe(["export", "--ckpt", str(tmp_path / "bb.pt"), "--out", str(tmp_path / "bb2")], capsys)
    assert code == 0, err
    assert_same_tensors(from_pretrained(tmp_path / "bb2").state_dict(), backbone)


def test_a_folder_is_read_wherever_a_backbone_file_is(trained, tmp_path, capsys):
    code, _, err = run_mmoe(["export", "--ckpt", str(trained["ckpt"]), "--out", str(tmp_path / "vqa")], capsys)
    assert code == 0, err
    saved = torch.load(trained["ckpt"], map_location="cpu", weights_only=True)["state_dict"]
    backbone = {k[9:]: v for k, v in saved.items() if k.startswith("backbone.")}
    task = VQAFineTuning(answer_vocab=str(trained["answers"]), pretrained=str(tmp_path / "vqa"))
    assert_same_tensors(task.backbone.state_dict(), backbone)  # fine-tuning starts from the folder's backbone
    argv = ["export-backbone", "--ckpt", str(tmp_path / "vqa"), "--out", str(tmp_path / "bb.pt")]
    code, _, err = run_mmoe(argv, capsys)
    assert code == 0, err
    assert_same_tensors(load_backbone(tmp_path / "bb.pt").state_dict(), backbone)
    missing = tmp_path / "vqa" / "model.safetensors"
    missing.unlink()
    code, _, err = run_mmoe([*argv[:-1], str(tmp_path / "again.pt")], capsys)
    assert code == 2 and err.startswith(f"mmoe export-backbone: error: {missing} does not exist (expected a folder")
    assert err.count("\n") == 1 and not (tmp_path / "again.pt").exists()


def test_an_output_that_is_not_a_folder_of_ours_is_refused_before_any_work(trained, tmp_path, capsys):
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    argv = ["export", "--ckpt", str(tmp_path / "nowhere.ckpt"), "--out", str(tmp_path / "mine")]
    code, _, err = run_mmoe(argv, capsys)
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err
    assert f"{tmp_path / 'mine'} is a folder with other files in it" in err  # named before the checkpoint is read
    assert [path.name for path in (tmp_path / "mine").iterdir()] == ["notes.txt"]
    argv = ["export", "--ckpt", str(trained["ckpt"]), "--out", str(tmp_path / "mine" / "notes.txt" / "folder")]
    code, _, err = run_mmoe(argv, capsys)
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err
    assert f"notes.txt/folder cannot be written: File exists ({tmp_path / 'mine' / 'notes.txt'})" in err, err
    assert [path.name for path in (tmp_path / "mine").iterdir()] == ["notes.txt"]


def refusing_commands(trained, out: Path) -> dict[str, tuple[list[str], Path, str]]:
    """command -> (argv, the spoiled file, its first non-finite tensor)."""
    nan, dense, spoiled = str(trained["nan_ckpt"]), str(trained["nan_dense"]), trained["nan_ckpt"]
    (trained["root"] / "moe.yaml").write_text(yaml.safe_dump(
        {"model": {"class_path": "mmoe.tasks.nlvr2.NLVR2FineTuning",
                   "init_args": {"backbone": {"moe": {"num_experts": 4, "every": 2}}}}}))  # fmt: skip
    dense_first = "layers.0.ffn.0.fc1.weight"
    return {
        "infer": (["infer", "vqa", "--ckpt", nan, "--image", str(trained["image"]), "--question", "what color?",
                   "--out", str(out / "answers.json")], spoiled, SPOILED),
        "predict": (["predict", "--config", str(trained["config"]), "--ckpt_path", nan,
                     "--model.init_args.predictions_file", str(out / "predictions.json")], spoiled, SPOILED),
        "export": (["export", "--ckpt", nan, "--out", str(out / "folder")], spoiled, SPOILED),
        "export --backbone-only": (["export", "--ckpt", nan, "--out", str(out / "folder"), "--backbone-only"],
                                   spoiled, SPOILED),
        "export-backbone": (["export-backbone", "--ckpt", nan, "--out", str(out / "bb.pt")], spoiled, SPOILED),
        "upcycle": (["upcycle", "--ckpt", dense, "--config", str(trained["root"] / "moe.yaml"), "--out",
                     str(out / "init.pt")], trained["nan_dense"], dense_first),
        "fit --ckpt_path": (["fit", "--config", str(trained["config"]), "--ckpt_path", nan,
                             "--trainer.default_root_dir", str(out)], spoiled, SPOILED),
        "fit pretrained": (["fit", "--config", str(trained["config"]), "--model.init_args.backbone=null",
                            f"--model.init_args.pretrained={dense}", "--trainer.default_root_dir", str(out)],
                           trained["nan_dense"], dense_first),
    }  # fmt: skip


@pytest.mark.parametrize("command", ["infer", "predict", "export", "export --backbone-only", "export-backbone",
                                     "upcycle", "fit --ckpt_path", "fit pretrained"])  # fmt: skip
def test_a_checkpoint_with_a_nan_is_refused_in_one_line(trained, tmp_path, command, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    argv, spoiled, first = refusing_commands(trained, tmp_path / "out")[command]
    code, out, err = run_mmoe(argv, capsys)
    assert code == 2
    assert "Traceback" not in err
    line = err.strip().splitlines()[-1]  # Lightning may log its seed before it
    assert line.startswith(f"mmoe {argv[0]}: "), line
    assert f"{spoiled} holds non-finite weights: 1 of its " in line and f"the first {first} " in line, line
    assert not (tmp_path / "out").exists() and out == ""


class Payload:
    """Unpickled, it creates the file ``marker``: what a crafted checkpoint could run."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return open, (str(self.marker), "w")


def unexportable(trained, folder: Path) -> dict[str, tuple[Path, str]]:
    """Checkpoints ``mmoe export`` refuses: (file, what the error says)."""
    state = torch.load(trained["ckpt"], map_location="cpu", weights_only=True)
    hyper_parameters = state["hyper_parameters"]
    files = {
        "pre-training": ({"_class_path": "mmoe.tasks.pretraining.MaskedPretraining"}, "pass --backbone-only"),
        "answers moved": ({"answer_vocab": str(folder / "moved" / "answers.json")}, "model argument answer_vocab"),
        "crafted": ({"note": Payload(folder / "ran")}, "asks to import io.open"),
    }
    made = {}
    for case, (changes, says) in files.items():
        torch.save(state | {"hyper_parameters": hyper_parameters | changes}, folder / f"{case}.ckpt")
        made[case] = (folder / f"{case}.ckpt", says)
    return made


@pytest.mark.parametrize("case", ["pre-training", "answers moved", "crafted"])
def test_what_cannot_be_exported_is_one_line(trained, tmp_path, case, capsys):
    path, says = unexportable(trained, tmp_path)[case]
    code, out, err = run_mmoe(["export", "--ckpt", str(path), "--out", str(tmp_path / "folder")], capsys)
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith(f"mmoe export: error: checkpoint {path}") and says in err, err
    assert not (tmp_path / "folder").exists() and not (tmp_path / "ran").exists()
    assert all(path.suffix == ".ckpt" for path in tmp_path.iterdir())  # no staging folder left behind


def test_a_bf16_true_run_exports_and_infers_as_its_checkpoint(trained, tmp_path, capsys):
    run = tmp_path / "bf16_run"
    argv = ["fit", "--config", str(trained["config"]), "--trainer.precision", "bf16-true",
            "--trainer.default_root_dir", str(run)]  # fmt: skip
    assert main(argv) == 0
    checkpoint = next((run / "checkpoints").glob("*.ckpt"))
    code, _, err = run_mmoe(["export", "--ckpt", str(checkpoint), "--out", str(tmp_path / "vqa")], capsys)
    assert code == 0, err
    question = ["--image", str(trained["image"]), "--question", "what color is the square?", "--top-k", "3", "--json"]
    answers = {}
    for source in (checkpoint, tmp_path / "vqa"):
        code, out, err = run_mmoe(["infer", "vqa", "--ckpt", str(source), *question], capsys)
        assert code == 0 and "Traceback" not in err, err
        answers[source] = json.loads(out)
    assert answers[tmp_path / "vqa"] == answers[checkpoint] and answers[checkpoint]["answers"]
    # the folder keeps the run's dtype, and so does what loads it unless asked for another
    assert {t.dtype for t in mmoe.tasks.from_pretrained(tmp_path / "vqa").state_dict().values()} == {torch.bfloat16}
    assert {t.dtype for t in from_pretrained(tmp_path / "vqa").state_dict().values()} == {torch.bfloat16}
    task = mmoe.tasks.from_pretrained(tmp_path / "vqa", dtype=torch.float32)
    assert {t.dtype for t in task.state_dict().values()} == {torch.float32}


def with_one_tensor_in(folder: Path, name: str, dtype: torch.dtype) -> None:
    """Rewrites the weights of ``folder`` with the tensor ``name`` stored in ``dtype``."""
    weights = read_weights(folder)
    weights[name] = weights[name].to(dtype)
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})


def test_a_float_tensor_of_another_precision_reads_in_the_models_and_an_integer_one_is_named(trained, tmp_path, capsys):
    folder = tmp_path / "vqa"
    code, _, err = run_mmoe(["export", "--ckpt", str(trained["ckpt"]), "--out", str(folder)], capsys)
    assert code == 0, err
    question = ["--image", str(trained["image"]), "--question", "what color is the square?", "--json"]
    with_one_tensor_in(folder, DENSE_WEIGHT, torch.float16)
    code, out, err = run_mmoe(["infer", "vqa", "--ckpt", str(folder), *question], capsys)
    assert code == 0 and json.loads(out)["answers"], err
    task = mmoe.tasks.from_pretrained(folder)
    assert {t.dtype for t in task.state_dict().values()} == {torch.float32}  # the others' precision
    assert torch.equal(task.state_dict()[DENSE_WEIGHT], read_weights(folder)[DENSE_WEIGHT].float())
    with_one_tensor_in(folder, DENSE_WEIGHT, torch.int8)
    code, out, err = run_mmoe(["infer", "vqa", "--ckpt", str(folder), *question], capsys)
    assert code == 2 and out == ""
    weights = folder / "model.safetensors"
    assert err == (f"mmoe infer: error: {folder}: {weights} does not fit its vqav2 task: {DENSE_WEIGHT} is torch.int8 "
                   "there, torch.float32 here (expected a floating-point tensor)\n")  # fmt: skip


def set_nested(fields: dict, dotted: str, value) -> None:
    *parents, last = dotted.split(".")
    for parent in parents:
        fields = fields[parent]
    fields[last] = value


@pytest.mark.parametrize("key", ["label_smoothing", "backbone.moe.expert_warmup_schedule"])
def test_a_hyper_parameter_of_another_mmoe_version_is_one_line_naming_it(trained, tmp_path, key, capsys):
    state = torch.load(trained["ckpt"], map_location="cpu", weights_only=True)
    set_nested(state["hyper_parameters"], key, 0.1)
    torch.save(state, tmp_path / "other.ckpt")
    code, _, err = run_mmoe(["export", "--ckpt", str(trained["ckpt"]), "--out", str(tmp_path / "vqa")], capsys)
    assert code == 0, err
    config_file = tmp_path / "vqa" / "config.json"
    config = json.loads(config_file.read_text())
    in_folder = key if key.startswith("backbone.") else f"task.init_args.{key}"
    set_nested(config, in_folder, 0.1)
    config_file.write_text(json.dumps(config))
    question = ["--image", str(trained["image"]), "--question", "what color is the square?"]
    named = {tmp_path / "other.ckpt": f'checkpoint {tmp_path / "other.ckpt"}: hyper-parameter "{key}"',
             tmp_path / "vqa": f'{config_file}: field "{in_folder}"'}  # fmt: skip
    for source, says in named.items():
        code, out, err = run_mmoe(["infer", "vqa", "--ckpt", str(source), *question], capsys)
        assert code == 2 and out == "", err
        assert err == f"mmoe infer: error: {says} is unknown to this mmoe (written by another mmoe version)\n"
