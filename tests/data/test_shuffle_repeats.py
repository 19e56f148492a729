"""The default shuffle buffer on a corpus smaller than it: a pre-training stream reads the corpus again and again
(``repeat``), so the buffer holds several copies of each sample; still no batch holds one sample twice."""

from __future__ import annotations

import pytest

from mmoe.data.converters.own_data import convert_own_pairs
from mmoe.data.datamodules import PretrainDataModule
from tests.data.test_own_data import picture, write_csv

SAMPLES, BATCH, STEPS = 45, 8, 40  # 320 pairs read: 7 passes over the corpus, the buffer (1000) holding ~22 copies


@pytest.fixture(scope="module")
def small_corpus(tmp_path_factory):
    """``mmoe data convert pairs`` of 45 distinct pictures in 3 shards."""
    root = tmp_path_factory.mktemp("small")
    rows = []
    for index in range(SAMPLES):
        picture(root / "images" / f"{index}.png", (index * 5, 255 - index * 5, index % 7 * 30))
        rows.append({"image": f"{index}.png", "caption": f"picture number {index}"})
    table = write_csv(root / "pairs.csv", rows)
    manifest = convert_own_pairs(table, root / "images", root / "pairs", shard_size=15)
    assert (manifest.samples, manifest.shards) == (SAMPLES, 3)
    return root / "pairs"


@pytest.mark.parametrize("workers", [0, 2])
def test_no_batch_holds_a_sample_twice_under_the_default_buffer(small_corpus, workers):
    module = PretrainDataModule(
        pair_shards=str(small_corpus), image_weight=0.0, text_weight=0.0, batch_size=BATCH, image_size=32,
        patch_size=16, batches_per_epoch=STEPS, num_workers=workers, crop_scale=None, hflip=False,
    )  # fmt: skip
    assert module.shuffle_buffer > SAMPLES  # the default, larger than the corpus
    batches = [batch["key"] for batch in module.train_dataloader()]
    assert len(batches) == STEPS and all(len(keys) == BATCH for keys in batches)
    repeated = [keys for keys in batches if len(set(keys)) < len(keys)]
    assert repeated == []
    seen = [key for keys in batches for key in keys]
    assert len(set(seen)) == SAMPLES  # every sample is drawn, the stream still shuffled across the corpus
