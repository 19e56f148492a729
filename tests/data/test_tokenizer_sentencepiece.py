"""BEiT-3's text tokenizer: a SentencePiece model from a local file, numbered with XLM-R's ids, selectable in the
configs and in ``mmoe data convert``; a tiny SentencePiece model is trained here on the fly (nothing is downloaded)."""

from __future__ import annotations

import json
import pickle

import numpy as np
import pytest
import sentencepiece
import torch

from mmoe.data.datamodules import CaptioningDataModule
from mmoe.data.masking import MaskingConfig, mask_caption, mask_text
from mmoe.data.tokenizer import TextTokenizer, token_ids_of
from mmoe.model import MultiwayConfig
from mmoe.model.config import PRESETS
from mmoe.tasks.captioning import CaptioningFineTuning
from tests.cli_fixtures import SENTENCES, instantiate, run_mmoe, small_shards, tiny_sentencepiece

PIECES = 40


@pytest.fixture(scope="module")
def spm(tmp_path_factory) -> str:
    return tiny_sentencepiece(tmp_path_factory.mktemp("spm") / "tiny.spm", PIECES)


def test_ids_are_numbered_as_xlmr_numbers_them(spm):
    tokenizer = TextTokenizer(64, spm)
    ids = tokenizer.ids
    assert (ids.start, ids.pad, ids.end, ids.mask, ids.size) == (0, 1, 2, PIECES + 1, PIECES + 2)
    processor = sentencepiece.SentencePieceProcessor(model_file=spm)
    text = "a red circle above a blue square"
    assert tokenizer.encode(text) == [0, *(piece + 1 for piece in processor.encode(text)), 2]
    assert tokenizer.decode(tokenizer.encode(text)) == text
    assert 3 in tokenizer.encode("a red zebra ¿")  # a character the model never saw: XLM-R's <unk>
    batch, padding = tokenizer(["a red circle", "two green triangles left of a yellow star"])
    assert (batch[padding] == 1).all() and not padding[:, 0].any() and padding[0].any()
    assert tokenizer.token_string(0) == "<start>" and tokenizer.token_string(PIECES + 1) == "<mask>"


def test_it_pickles_without_the_model_and_encodes_the_same_after(spm):
    tokenizer = TextTokenizer(16, spm)
    copy = pickle.loads(pickle.dumps(tokenizer))
    assert (
        copy.encode("a small purple circle") == tokenizer.encode("a small purple circle") and copy.ids == tokenizer.ids
    )
    assert len(pickle.dumps(tokenizer)) < 1000


def test_masks_use_the_tokenizers_ids(spm):
    tokenizer = TextTokenizer(16, spm)
    ids, _ = tokenizer(SENTENCES[:6])
    rng = np.random.default_rng(0)
    masked = mask_text(ids, 0.5, rng, MaskingConfig(mask_token_fraction=0.5, random_token_fraction=0.5), tokenizer.ids)
    chosen = masked.mask
    assert not chosen[ids <= 2].any()  # start, pad and end are never chosen
    replaced = masked.input_ids[chosen]
    assert (replaced == tokenizer.ids.mask).any()
    randoms = replaced[replaced != tokenizer.ids.mask]
    assert ((randoms >= 3) & (randoms < tokenizer.ids.mask)).all()
    caption = mask_caption(ids, 0.6, rng, text_ids=tokenizer.ids)
    assert not caption.mask[ids == 0].any() and not caption.mask[ids == 1].any()


def test_missing_or_foreign_files_are_named(spm, tmp_path):
    with pytest.raises(FileNotFoundError, match="nowhere.spm does not exist"):
        TextTokenizer(16, tmp_path / "nowhere.spm")
    (tmp_path / "bad.spm").write_text("not a model")
    with pytest.raises(ValueError, match="bad.spm is not a SentencePiece model"):
        TextTokenizer(16, tmp_path / "bad.spm")


def test_datamodule_batches_carry_the_sentencepiece_ids(spm, tmp_path):
    shards = small_shards(tmp_path)
    module = CaptioningDataModule(
        train_shards=str(shards / "coco-karpathy-train-restval"), image_size=32, num_workers=0, text_tokenizer=spm,
        batch_size=4, mask_ratio=0.6,
    )  # fmt: skip
    batch = next(iter(module.train_dataloader()))
    assert (batch["text_targets"][:, 0] == 0).all() and (batch["text_ids"] == PIECES + 1).any()
    assert int(batch["text_targets"].max()) < PIECES + 2
    with pytest.raises(FileNotFoundError, match="data.text_tokenizer: text tokenizer .*missing.spm does not exist"):
        CaptioningDataModule(
            train_shards=str(shards / "coco-karpathy-train-restval"), text_tokenizer=str(tmp_path / "missing.spm")
        )


def backbone(vocab_size: int) -> dict:
    return PRESETS["test"] | {"vocab_size": vocab_size}


def nlvr2_config(tmp_path, shards, vocab_size: int, text_tokenizer: str | None) -> list[str]:
    config = {
        "trainer": {"accelerator": "cpu", "logger": False, "default_root_dir": str(tmp_path)},
        "model": {"class_path": "mmoe.tasks.nlvr2.NLVR2FineTuning",
                  "init_args": {"backbone": backbone(vocab_size), "text_tokenizer": text_tokenizer}},
        "data": {"class_path": "mmoe.data.datamodules.NLVR2DataModule",
                 "init_args": {"train_shards": str(shards / "nlvr2-train"), "num_workers": 0}},
    }  # fmt: skip
    path = tmp_path / f"nlvr2-{vocab_size}.yaml"
    path.write_text(json.dumps(config))
    return ["fit", "--config", str(path)]


def test_the_model_names_the_tokenizer_once_and_the_embedding_must_fit_it(spm, tmp_path, capsys):
    shards = small_shards(tmp_path)
    cli = instantiate(nlvr2_config(tmp_path, shards, PIECES + 2 + 8, spm))  # BEiT-3: 8 unused rows
    assert cli.datamodule.tokenizer.ids == TextTokenizer(16, spm).ids  # linked from the model
    with pytest.raises(SystemExit) as refused:
        instantiate(nlvr2_config(tmp_path, shards, 64010, None))  # a BEiT-3 backbone read with open_clip's ids
    assert refused.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "open_clip's BPE" in err and "64010 rows" in err and "49410 ids" in err
    with pytest.raises(SystemExit):
        instantiate(nlvr2_config(tmp_path, shards, PIECES + 2, str(tmp_path / "missing.spm")))
    assert "model.text_tokenizer: text tokenizer" in capsys.readouterr().err


def test_captioning_decodes_with_the_tokenizers_ids(spm):
    config = MultiwayConfig(**backbone(PIECES + 2))
    task = CaptioningFineTuning(backbone=config, text_tokenizer=spm, max_length=6, num_beams=2).eval()
    options = task.decoding_options()
    assert (options["bos_id"], options["eos_id"], options["pad_id"]) == (0, 2, 1)
    assert options["forbidden"] == (0, 1, PIECES + 1)
    decoded = task.generate(torch.randn(2, 3, 32, 32))
    assert decoded.tokens.shape[0] == 2 and int(decoded.tokens.max()) < PIECES + 2
    with pytest.raises(ValueError, match="49410 ids, the backbone's text embedding 42 rows"):
        CaptioningFineTuning(backbone=config, max_length=6)


def test_convert_lists_the_caption_ids_of_the_chosen_tokenizer(spm, tmp_path, capsys):
    small_shards(tmp_path)
    coco = tmp_path / "corpus" / "coco"
    argv = ["data", "convert", "coco-captions", "--karpathy", str(coco / "karpathy" / "dataset_coco.json"), "--split",
            "train", "--images", str(coco), "--out", str(tmp_path / "train-spm"), "--text-tokenizer", spm]  # fmt: skip
    code, _, err = run_mmoe(argv, capsys)
    assert code == 0, err
    listed = json.loads((tmp_path / "train-spm" / "caption_tokens.json").read_text())
    captions = [
        sentence["raw"]
        for image in json.loads((coco / "karpathy" / "dataset_coco.json").read_text())["images"]
        if image["split"] == "train"
        for sentence in image["sentences"]
    ]
    assert listed == token_ids_of(captions, TextTokenizer(16, spm)) and 2 in listed and max(listed) <= PIECES
    code, _, err = run_mmoe([*argv[:-1], str(tmp_path / "missing.spm")], capsys)
    assert code == 2 and "--text-tokenizer: text tokenizer" in err and "missing.spm does not exist" in err
