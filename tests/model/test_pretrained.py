"""Pretrained folders (``model.safetensors`` + ``config.json``): a MoE backbone comes back bit for bit in its dtype, a
folder is written whole or not at all, and a bad folder is one line naming the file."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest
import torch

import mmoe.model.pretrained as pretrained
from mmoe.model import MoEPlan, MultiwayConfig, MultiwayTransformer, from_pretrained, save_pretrained
from mmoe.model.pretrained import PretrainedFolderError
from mmoe.safe_load import require_finite_weights

BACKBONE = MultiwayConfig.preset("test", moe=MoEPlan(num_experts=4, every=1, heads=2, top_k=2))


def moe_backbone(dtype: torch.dtype = torch.float32, seed: int = 0) -> MultiwayTransformer:
    torch.manual_seed(seed)
    return MultiwayTransformer(BACKBONE).to(dtype).eval()


def hidden(backbone: MultiwayTransformer) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1)
    dtype = backbone.cls_token.dtype
    image = torch.randn(2, 3, 32, 32, generator=generator).to(dtype)
    text = torch.randint(0, 50, (2, 6), generator=generator)
    with torch.no_grad():
        return backbone(image=image, text=text, text_padding_mask=torch.zeros(2, 6, dtype=torch.bool)).hidden


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_a_moe_backbone_comes_back_bit_for_bit_in_its_dtype(tmp_path, dtype):
    backbone = moe_backbone(dtype)
    save_pretrained(backbone, tmp_path / "folder")
    assert sorted(path.name for path in (tmp_path / "folder").iterdir()) == ["config.json", "model.safetensors"]
    loaded = from_pretrained(tmp_path / "folder")
    assert loaded.config == backbone.config
    saved, back = backbone.state_dict(), loaded.state_dict()
    assert list(back) == list(saved)
    for name, tensor in saved.items():
        assert back[name].dtype == tensor.dtype, name
        assert torch.equal(back[name], tensor), name
        # in torch's own 64-byte aligned memory, as the saved model's: the CPU kernels take the same path on both
        assert back[name].data_ptr() % 64 == 0, name
    assert torch.equal(hidden(loaded.eval()), hidden(backbone))


def test_an_earlier_folder_is_replaced_and_an_interrupted_write_leaves_it_whole(tmp_path, monkeypatch):
    folder = tmp_path / "folder"
    save_pretrained(moe_backbone(seed=0), folder)
    second = moe_backbone(seed=1)
    save_pretrained(second, folder)
    assert torch.equal(from_pretrained(folder).cls_token, second.cls_token)

    def cut_write(tensors, path, metadata=None):  # what a full disk or a kill leaves: part of a file, then an error
        Path(path).write_bytes(b"\x00" * 100)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(pretrained, "save_file", cut_write)
    with pytest.raises(OSError):
        save_pretrained(moe_backbone(seed=2), folder)
    with pytest.raises(OSError):
        save_pretrained(moe_backbone(seed=2), tmp_path / "new")
    assert sorted(path.name for path in tmp_path.iterdir()) == ["folder"]  # no staging folder left, no "new"
    assert torch.equal(from_pretrained(folder).cls_token, second.cls_token)


def test_a_file_or_a_folder_of_other_files_is_not_overwritten(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    (tmp_path / "photos").mkdir()
    (tmp_path / "photos" / "a.jpg").write_bytes(b"jpeg")
    (tmp_path / "bert").mkdir()  # another library's model folder, with a config.json of its own
    (tmp_path / "bert" / "config.json").write_text(json.dumps({"architectures": ["BertModel"]}))
    for destination, says in ((tmp_path / "notes.txt", "is a file"), (tmp_path / "photos", "other files in it"),
                              (tmp_path / "bert", "other files in it")):  # fmt: skip
        with pytest.raises(PretrainedFolderError, match=says):
            save_pretrained(moe_backbone(), destination)
    assert (tmp_path / "notes.txt").read_text() == "mine"
    assert [path.name for path in (tmp_path / "photos").iterdir()] == ["a.jpg"]
    assert json.loads((tmp_path / "bert" / "config.json").read_text()) == {"architectures": ["BertModel"]}
    (tmp_path / "empty").mkdir()
    save_pretrained(moe_backbone(), tmp_path / "empty")
    assert from_pretrained(tmp_path / "empty").config == BACKBONE


def spoil(folder: Path, case: str) -> Path:
    """Spoils a pretrained folder as ``case`` says; returns the file the error must name."""
    config, weights = folder / "config.json", folder / "model.safetensors"
    fields = json.loads(config.read_text())
    data = weights.read_bytes()
    if case == "config.json missing":
        config.unlink()
        return config
    if case == "model.safetensors missing":
        weights.unlink()
        return weights
    if case == "unknown config field":
        fields["backbone"]["num_layers"] = 4
        config.write_text(json.dumps(fields))
        return config
    if case == "not an mmoe config":
        config.write_text(json.dumps({"architectures": ["BertModel"], "hidden_size": 32}))
        return config
    if case == "shapes disagree":
        fields["backbone"] |= {"dim": 64, "ffn_dim": 128}
        config.write_text(json.dumps(fields))
        return weights
    if case == "header cut":
        weights.write_bytes(data[:64])  # inside the JSON header
        return weights
    if case == "data cut":
        weights.write_bytes(data[: len(data) - 100])
        return weights
    if case == "integer tensor":
        tensors = pretrained.read_weights(folder)
        tensors["cls_token"] = tensors["cls_token"].to(torch.int8)
        pretrained.save_file(tensors, weights)
        return weights
    if case == "NaN weights":
        tensors = pretrained.read_weights(folder)
        tensors["cls_token"][0, 0, 3] = float("nan")
        pretrained.save_file(tensors, weights)
        return weights
    raise AssertionError(case)


BAD_FOLDERS = ["config.json missing", "model.safetensors missing", "unknown config field", "not an mmoe config",
               "shapes disagree", "header cut", "data cut", "NaN weights", "integer tensor"]  # fmt: skip


@pytest.mark.parametrize("case", BAD_FOLDERS)
def test_a_bad_folder_is_one_line_naming_the_file(tmp_path, case):
    save_pretrained(moe_backbone(), tmp_path / "folder")
    named = spoil(tmp_path / "folder", case)
    with pytest.raises(PretrainedFolderError) as error:
        from_pretrained(tmp_path / "folder")
    message = str(error.value)
    assert "\n" not in message and str(named) in message
    words = {"unknown config field": 'field "backbone.num_layers" is unknown to this mmoe',
             "shapes disagree": "has shape", "NaN weights": "1 of its",
             "integer tensor": "cls_token is torch.int8 there, torch.float32 here"}  # fmt: skip
    assert words.get(case, "") in message


def test_a_folder_reads_in_its_weights_shared_dtype_or_float32_when_they_mix_or_in_the_dtype_asked(tmp_path):
    save_pretrained(moe_backbone(torch.bfloat16), tmp_path / "bf16")
    assert {t.dtype for t in from_pretrained(tmp_path / "bf16").state_dict().values()} == {torch.bfloat16}
    as_float = from_pretrained(tmp_path / "bf16", dtype=torch.float32)
    assert as_float.cls_token.dtype == torch.float32 and all(
        buffer.dtype == torch.float32 for buffer in as_float.buffers() if buffer.is_floating_point()
    )
    assert torch.equal(as_float.cls_token, moe_backbone(torch.bfloat16).cls_token.float())
    mixed = moe_backbone().state_dict()
    mixed["cls_token"] = mixed["cls_token"].half()
    save_pretrained(moe_backbone(), tmp_path / "mixed")
    pretrained.save_file(mixed, tmp_path / "mixed" / "model.safetensors")
    loaded = from_pretrained(tmp_path / "mixed")
    assert {t.dtype for t in loaded.state_dict().values()} == {torch.float32}
    assert torch.equal(loaded.cls_token, mixed["cls_token"].float())
    hidden(loaded.eval())  # runs: one dtype throughout


def test_a_folder_gets_the_permissions_of_a_new_folder(tmp_path):
    umask = os.umask(0o027)
    try:
        save_pretrained(moe_backbone(), tmp_path / "folder")
    finally:
        os.umask(umask)
    assert stat.S_IMODE((tmp_path / "folder").stat().st_mode) == 0o750
    assert {stat.S_IMODE(path.stat().st_mode) for path in (tmp_path / "folder").iterdir()} == {0o640}


def test_a_path_that_is_no_folder_is_named(tmp_path):
    (tmp_path / "file").write_text("x")
    for path, says in ((tmp_path / "nowhere", "does not exist"), (tmp_path / "file", "is not a folder")):
        with pytest.raises(PretrainedFolderError, match=f"{path} {says}"):
            from_pretrained(path)


def test_non_finite_weights_are_counted_and_the_first_is_named():
    state = {"state_dict": {"a": torch.ones(3), "b": torch.tensor([1.0, float("inf")]), "steps": torch.tensor([7]),
                            "c": torch.full((2,), float("nan"), dtype=torch.bfloat16)}}  # fmt: skip
    with pytest.raises(ValueError) as error:
        require_finite_weights(state, "run/last.ckpt")
    assert str(error.value).startswith("checkpoint run/last.ckpt holds non-finite weights: 2 of its 4 tensors")
    assert "the first b " in str(error.value)
    large = {
        "a": torch.full((100,), 3e38),
        "b": torch.full((100,), 6e4, dtype=torch.float16),
        "steps": torch.tensor([7]),
    }
    require_finite_weights({"state_dict": large}, "fine.ckpt")  # sums overflow, every element is finite
    with pytest.raises(ValueError, match="1 of its 1 tensors hold NaN or Inf, the first encoder.layers.0.w"):
        require_finite_weights({"model": {"encoder": {"layers": [{"w": torch.tensor([float("-inf")])}]}}}, "x.pth")
