"""Zero-shot probes of pre-training validation: labels from the corpus's captions, scores against per-pair loops,
logged while a tiny run trains, and at chance for a randomly initialised backbone."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import lightning as L
import pytest
import torch
import torch.nn.functional as F

from mmoe.data.converters.coco import convert_karpathy
from mmoe.data.datamodules import PretrainDataModule
from mmoe.data.synth import corpus as synth_corpus
from mmoe.data.synth.corpus import SynthSizes, build_corpus
from mmoe.data.synth.layout import CorpusLayout
from mmoe.data.synth.scenes import COLORS, SHAPES, sample_scene
from mmoe.data.tokenizer import TextTokenizer
from mmoe.model import MultiwayConfig
from mmoe.tasks.pretraining import MaskedPretraining
from mmoe.tasks.zero_shot_probes import (
    ATTRIBUTE_CLASSES,
    ProbeEmbeddings,
    caption_labels,
    class_prompts,
    probe_metrics,
)

VAL2014_FIRST_ID = 100_001  # the synthetic corpus numbers val2014 images from here, in generation order
KEYS = ("color_acc", "shape_acc", "pairs")
COLORS_LIST = list(COLORS)
MATCHING = ("i2t_r1", "i2t_r5", "t2i_r1", "t2i_r5")


def top_object(seed: int, image_id: int):
    """The first (top) object of a val2014 scene of the synthetic corpus, drawn again from its generator."""
    return sample_scene(synth_corpus._rng(seed, "val2014", image_id - VAL2014_FIRST_ID)).shapes[0]


def first_captions(root) -> dict[str, str]:
    """Image id -> first caption of the Karpathy val images of a corpus (what its validation pairs carry)."""
    document = json.loads(CorpusLayout(root).karpathy_coco.read_text())
    return {str(i["cocoid"]): i["sentences"][0]["raw"] for i in document["images"] if i["split"] == "val"}


def test_a_caption_labels_the_top_object_of_its_scene(synthetic_corpus):
    captions = first_captions(synthetic_corpus)
    seed = json.loads(CorpusLayout(synthetic_corpus).summary.read_text())["seed"]
    assert captions
    for image_id, caption in captions.items():
        top = top_object(seed, int(image_id))
        labels = caption_labels(caption)
        assert (COLORS_LIST[labels["color"]], SHAPES[labels["shape"]]) == (top.color, top.shape), caption
    assert caption_labels("two shapes on a dark background: a small blue cross and a red circle") == {
        "color": COLORS_LIST.index("blue"),
        "shape": SHAPES.index("cross"),
    }
    assert caption_labels("nothing here") == {"color": -1, "shape": -1}


def test_prompts_cover_every_class_of_the_other_attribute():
    color_prompts, shape_prompts = class_prompts("color"), class_prompts("shape")
    assert len(color_prompts) == len(COLORS) and all(len(p) == len(SHAPES) for p in color_prompts)
    assert color_prompts[0][1] == f"a {COLORS_LIST[0]} {SHAPES[1]}"
    assert shape_prompts[2][3] == f"a {COLORS_LIST[3]} {SHAPES[2]}"
    with pytest.raises(ValueError, match="texture"):
        class_prompts("texture")


def loop_metrics(embeddings: ProbeEmbeddings) -> dict[str, float]:
    """The probes one pair at a time: a rank is 1 + the other candidates scoring at least as high as the positive."""
    image, text = embeddings.image_ND.tolist(), embeddings.text_ND.tolist()
    count = len(image)

    def dot(a, b):
        return sum(x * y for x, y in zip(a, b, strict=True))

    hits = {name: 0 for name in MATCHING}
    for i in range(count):
        i2t = 1 + sum(dot(image[i], text[j]) >= dot(image[i], text[i]) for j in range(count) if j != i)
        t2i = 1 + sum(dot(text[i], image[j]) >= dot(text[i], image[i]) for j in range(count) if j != i)
        for k in (1, 5):
            hits[f"i2t_r{k}"] += i2t <= k
            hits[f"t2i_r{k}"] += t2i <= k
    prefix = "pooled_" if embeddings.pooled else ""
    metrics = {f"val/probe/{prefix}{name}": value / count for name, value in hits.items()}
    metrics["val/probe/pairs"] = float(count)
    for attribute, labels in embeddings.labels.items():
        classes = embeddings.classes[attribute].tolist()
        right = total = 0
        for vector, label in zip(image, labels.tolist(), strict=True):
            scores = [dot(vector, c) for c in classes]
            best = max(range(len(classes)), key=lambda c: (scores[c], -c))  # the first of equal scores
            if label >= 0:
                right, total = right + (best == label), total + 1
        if total:
            metrics[f"val/probe/{attribute}_acc"] = right / total
    return metrics


def embeddings_with_structure(count: int, seed: int, pooled: bool) -> ProbeEmbeddings:
    """Captions near their images, some duplicated (ties), and labels with unlabelled pairs."""
    generator = torch.Generator().manual_seed(seed)
    image = F.normalize(torch.randn(count, 16, generator=generator), dim=-1)
    text = F.normalize(image + 1.2 * torch.randn(count, 16, generator=generator), dim=-1)
    text[3] = text[4]  # a duplicate caption: ties count against the query
    labels = {a: torch.randint(-1, len(c), (count,), generator=generator) for a, c in ATTRIBUTE_CLASSES.items()}
    classes = {
        a: F.normalize(torch.randn(len(c), 16, generator=generator), dim=-1) for a, c in ATTRIBUTE_CLASSES.items()
    }
    return ProbeEmbeddings(image, text, labels, classes, pooled)


@pytest.mark.parametrize("pooled", [False, True])
def test_probe_metrics_equal_the_per_pair_loop(pooled):
    embeddings = embeddings_with_structure(40, seed=3, pooled=pooled)
    measured, expected = probe_metrics(embeddings), loop_metrics(embeddings)
    assert measured.keys() == expected.keys()
    for name, value in expected.items():
        assert measured[name] == pytest.approx(value, abs=1e-9), name
    prefix = "pooled_" if pooled else ""
    assert 0 < measured[f"val/probe/{prefix}i2t_r1"] < measured[f"val/probe/{prefix}i2t_r5"] <= 1  # informative


def test_constant_embeddings_score_no_recall_and_the_first_class():
    count = 6
    embeddings = ProbeEmbeddings(
        torch.ones(count, 4) / 2,
        torch.ones(count, 4) / 2,
        {"color": torch.tensor([0, 0, 1, 2, -1, 0]), "shape": torch.full((count,), -1)},
        {"color": F.normalize(torch.ones(6, 4), dim=-1), "shape": F.normalize(torch.ones(4, 4), dim=-1)},
        pooled=True,
    )
    metrics = probe_metrics(embeddings)
    assert metrics["val/probe/pooled_i2t_r1"] == 0 and metrics["val/probe/pooled_t2i_r5"] == 0
    assert metrics["val/probe/color_acc"] == pytest.approx(3 / 5)  # all predicted class 0, 3 of 5 labelled
    assert "val/probe/shape_acc" not in metrics  # no labelled pair


def datamodule(corpus, val_pairs=None, **options) -> PretrainDataModule:
    """Training pairs of ``corpus``, validation pairs of its Karpathy val split (or ``val_pairs``)."""
    return PretrainDataModule(
        pair_shards=str(corpus / "shards" / "pretrain-pairs"),
        val_pair_shards=str(val_pairs or corpus / "shards" / "coco-karpathy-val"),
        image_size=32,
        batch_size=8,
        crop_scale=None,
        max_text_length=40,
        num_workers=0,
        **options,
    )


def reference_embeddings(task: MaskedPretraining, loader, captions: dict[str, str], pairs: int) -> ProbeEmbeddings:
    """The probes' vectors one pair (one prompt) at a time, labels from the corpus's caption file."""
    task.eval()
    tokenizer = TextTokenizer()
    contrastive = task.hparams.contrastive_coefficient > 0
    pad = tokenizer.ids.pad

    def image_vector(image):
        hidden = task.backbone(image=image[None]).hidden[0]
        return F.normalize(task.vision_head(hidden[0]) if contrastive else hidden[1:].mean(0), dim=-1)

    def text_vector(ids):
        hidden = task.backbone(text=torch.tensor([ids])).hidden[0]  # unpadded
        return F.normalize(task.language_head(hidden[0]) if contrastive else hidden.mean(0), dim=-1)

    images, texts, labels = [], [], {a: [] for a in ATTRIBUTE_CLASSES}
    with torch.no_grad():
        for batch in loader:
            if batch["kind"] != "pair":
                continue
            for image, ids, key in zip(batch["image"], batch["text_targets"].tolist(), batch["key"], strict=True):
                if len(images) == pairs:
                    break
                images.append(image_vector(image))
                texts.append(text_vector([token for token in ids if token != pad]))
                for attribute, label in caption_labels(captions[key]).items():
                    labels[attribute].append(label)
        classes = {
            attribute: torch.stack(
                [
                    F.normalize(torch.stack([text_vector(tokenizer.encode(p)) for p in group]).mean(0), dim=-1)
                    for group in class_prompts(attribute)
                ]
            )
            for attribute in ATTRIBUTE_CLASSES
        }
    return ProbeEmbeddings(
        torch.stack(images),
        torch.stack(texts),
        {a: torch.tensor(v) for a, v in labels.items()},
        classes,
        not contrastive,
    )


def trainer(tmp_path, **options) -> L.Trainer:
    return L.Trainer(
        accelerator="cpu",
        logger=L.pytorch.loggers.CSVLogger(tmp_path, name="csv"),
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
        **options,
    )


@pytest.mark.parametrize("contrastive", [1.0, 0.0])
def test_a_short_run_logs_the_probes_of_its_embeddings(synthetic_corpus, tmp_path, contrastive):
    torch.manual_seed(0)
    task = MaskedPretraining(
        MultiwayConfig.preset("test"),
        visual_codebook=str(synthetic_corpus / "codebook.pt"),
        contrastive_coefficient=contrastive,
        probe_pairs=3,
    )
    data = datamodule(synthetic_corpus, batches_per_epoch=2)
    run = trainer(tmp_path, max_steps=4, val_check_interval=2, limit_val_batches=2)
    run.fit(task, data)
    logged = {k: v.item() for k, v in run.callback_metrics.items() if k.startswith("val/probe/")}
    prefix = "" if contrastive else "pooled_"
    assert set(logged) == {f"val/probe/{name}" for name in (*KEYS, *(prefix + m for m in MATCHING))}
    assert all(math.isfinite(v) and 0 <= v <= 1 for k, v in logged.items() if not k.endswith("pairs"))
    assert logged["val/probe/pairs"] == 3
    rows = (tmp_path / "csv" / "version_0" / "metrics.csv").read_text().splitlines()
    assert f"val/probe/{prefix}i2t_r1" in rows[0] and sum(",val" not in r for r in rows) >= 1
    reference = loop_metrics(reference_embeddings(task, data.val_dataloader(), first_captions(synthetic_corpus), 3))
    assert logged == pytest.approx(reference, abs=1e-6)


def test_probes_can_be_turned_off(synthetic_corpus, tmp_path):
    codebook = str(synthetic_corpus / "codebook.pt")
    task = MaskedPretraining(MultiwayConfig.preset("test"), visual_codebook=codebook, zero_shot_probes=False)
    metrics = trainer(tmp_path).validate(task, datamodule(synthetic_corpus), verbose=False)[0]
    assert "val/loss" in metrics and not any(name.startswith("val/probe/") for name in metrics)
    with pytest.raises(ValueError, match="probe_pairs must be >= 2"):
        MaskedPretraining(MultiwayConfig.preset("test"), visual_codebook=codebook, probe_pairs=1)


@pytest.fixture(scope="module")
def held_out_pairs(tmp_path_factory):
    """The 100 Karpathy val pairs of a synthetic corpus with 300 val2014 images."""
    root = tmp_path_factory.mktemp("probe_corpus")
    build_corpus(root, sizes=SynthSizes(8, 300, 2, 1, 1, 1, 8, image_size=32))
    layout = CorpusLayout(root)
    convert_karpathy(layout.karpathy_coco, "val", layout.coco_images, layout.shard("coco-karpathy-val"))
    return layout.shard("coco-karpathy-val")


@pytest.mark.parametrize("contrastive", [1.0, 0.0])
def test_a_randomly_initialised_backbone_scores_at_chance(synthetic_corpus, held_out_pairs, tmp_path, contrastive):
    """Within 3 binomial standard deviations of chance over the 100 pairs: K / N for R@K, 1 / classes for accuracy
    (a constant prediction scores its class's share, which the corpus draws uniformly)."""
    torch.manual_seed(1)
    task = MaskedPretraining(
        MultiwayConfig.preset("test"),
        visual_codebook=str(synthetic_corpus / "codebook.pt"),
        contrastive_coefficient=contrastive,
    )
    data = datamodule(synthetic_corpus, held_out_pairs)
    metrics = trainer(tmp_path).validate(task, data, verbose=False)[0]
    count = metrics["val/probe/pairs"]
    assert count == 100
    chance = {"r1": 1 / count, "r5": 5 / count, "color_acc": 1 / len(COLORS), "shape_acc": 1 / len(SHAPES)}
    for name, value in metrics.items():
        if name.startswith("val/probe/") and name != "val/probe/pairs":
            level = next(level for suffix, level in chance.items() if name.endswith(suffix))
            tolerance = 3 * math.sqrt(level * (1 - level) / count)
            assert abs(value - level) <= tolerance, (name, value, level)


def test_the_first_of_two_ddp_processes_alone_probes_and_logs(synthetic_corpus, tmp_path):
    """Every process must log the same keys (or none) and run the same collective forwards: only rank 0 probes."""
    script = Path(__file__).parents[1] / "scripts" / "ddp_probes.py"
    codebook = str(synthetic_corpus / "codebook.pt")
    result = subprocess.run(
        [sys.executable, str(script), str(tmp_path), codebook, str(synthetic_corpus)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=Path(__file__).parents[2],
    )
    assert result.returncode == 0, result.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert ranks[0]["probing"] and not ranks[1]["probing"]
    assert ranks[0]["probes"]["val/probe/pairs"] == 2 and len(ranks[0]["probes"]) == 7
    assert "self.log('val/probe/" not in result.stderr  # no advice to gather what one process logs
