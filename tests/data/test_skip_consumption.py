"""The skip report counts what the consumed batches met, not what a shuffle buffer or a DataLoader worker read ahead:
an indexed img2dataset folder with planted too-small images, read through the real loader with and without a shuffle
buffer, by 0, 1 and 2 workers, across a resume, and by ``mmoe fit``. The reference walks each shard in order: a
left-out sample is met by the run once the kept sample read after it is in a consumed batch."""

from __future__ import annotations

import re

import pytest

from mmoe.data.img2dataset import index_folder
from mmoe.data.loader import EpochDataLoader
from mmoe.data.shards import resolve_shards
from mmoe.data.streams import ShardStream
from tests.data.img2dataset_layout import Attempt, write_shard
from tests.data.test_accounting import truncate

#: Per shard: a too-small image (16 px, below ``--min-side 32``) before every third kept one, runs of two included,
#: and a kept image last, so every left-out sample has a kept one after it in its own shard.
SMALL_EVERY = 3


def write_corpus(folder, shards: int, kept_per_shard: int, truncated: str | None = None) -> dict[str, int]:
    """An indexed folder (shard ``truncated`` cut in half before indexing: the parquet's count stands, so what the cut
    lost is counted when read); returns kept key -> left-out samples read just before it (the reference's walk)."""
    folder.mkdir(parents=True)
    carried: dict[str, int] = {}
    for shard in range(shards):
        attempts, before = [], []
        for kept in range(kept_per_shard):
            small = (kept % SMALL_EVERY == 0) + (kept % (4 * SMALL_EVERY) == 0)
            before.append(small)
            attempts += [Attempt(side=16)] * small + [Attempt()]
        keys = [f"{shard:05d}{index:04d}" for index, attempt in enumerate(attempts) if attempt.side != 16]
        carried.update(zip(keys, before, strict=True))
        write_shard(folder, shard, attempts)
    if truncated is not None:
        truncate(folder / f"{truncated}.tar", 0.5)
    index_folder(folder, min_side=32)
    return carried


def key_stream(folder, shuffle_buffer: int, seed: int = 1, **options) -> ShardStream:
    """A repeating stream of batches of 4 keys (``options`` change its other arguments)."""
    options = {"batch_size": 4, "repeat": True, "name": "train/pair"} | options
    return ShardStream(
        resolve_shards(str(folder)), lambda sample: sample["__key__"], lambda items, rng: list(items),
        shuffle_buffer=shuffle_buffer, seed=seed, **options,
    )  # fmt: skip


def consumed_batches(loader: EpochDataLoader, count: int) -> list[list[str]]:
    """``count`` batches the training loop consumes (the loop asks for one more before it trains on the last)."""
    iterator = iter(loader)
    batches = [next(iterator) for _ in range(count + 1)]
    return batches[:count]


def too_small(loader: EpochDataLoader) -> int:
    count = loader.skipped["train/pair"]
    assert count.corrupt == count.lost == 0
    return count.left_out.get("too_small", 0)


@pytest.mark.parametrize("shards", [4, 1])  # 2 workers: split by shard, or every worker reads the one shard
@pytest.mark.parametrize("workers", [0, 1, 2])
@pytest.mark.parametrize("shuffle_buffer", [0, 8])
def test_the_count_is_what_consumed_batches_met_and_a_resume_continues_it(tmp_path, shards, workers, shuffle_buffer):
    carried = write_corpus(tmp_path / "cc", shards, kept_per_shard=24 // shards * 2)
    loader = EpochDataLoader(key_stream(tmp_path / "cc", shuffle_buffer), batch_size=None, num_workers=workers)
    first = consumed_batches(loader, 2)
    keys = [key for batch in first for key in batch]
    assert len(set(keys)) == len(keys) == 8  # one pass: each key once
    assert too_small(loader) == sum(carried[key] for key in keys)

    resumed = EpochDataLoader(key_stream(tmp_path / "cc", shuffle_buffer), batch_size=None, num_workers=workers)
    resumed.load_state_dict(loader.state_dict())
    keys += [key for batch in consumed_batches(resumed, 3) for key in batch]
    assert len(set(keys)) == len(keys) == 20
    assert too_small(resumed) == sum(carried[key] for key in keys) > 0


@pytest.mark.parametrize("workers", [0, 2])
def test_one_whole_pass_counts_every_left_out_sample_once(tmp_path, workers):
    carried = write_corpus(tmp_path / "cc", 4, kept_per_shard=6)
    stream = key_stream(tmp_path / "cc", shuffle_buffer=8, repeat=False)
    loader = EpochDataLoader(stream, batch_size=None, num_workers=workers)
    assert sorted(key for batch in loader for key in batch) == sorted(carried)
    assert too_small(loader) == sum(carried.values())


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::UserWarning")
def test_mmoe_fit_reports_what_its_steps_consumed_under_a_shuffle_buffer(synthetic_corpus, tmp_path, capsys):
    import yaml

    from tests.cli_fixtures import run_mmoe
    from tests.data.test_img2dataset_fit import pairs_only_config

    carried = write_corpus(tmp_path / "cc", 2, kept_per_shard=24)
    config = pairs_only_config(tmp_path / "cc", synthetic_corpus / "codebook.pt", tmp_path / "run", 2, batch_size=4)
    data = yaml.safe_load(config.read_text())
    data["data"]["init_args"].update(shuffle_buffer=16, seed=7)
    config.write_text(yaml.safe_dump(data))
    code, _, err = run_mmoe(["fit", "--config", str(config)], capsys)
    assert code == 0, err[-2000:]
    # The run's pair stream draws its order from (seed, shuffle buffer) alone: the same stream yielding keys.
    iterator = iter(key_stream(tmp_path / "cc", 16, seed=7, drop_last=True))
    expected = sum(carried[key] for _ in range(2) for key in next(iterator))
    assert expected > 0
    report = [line for line in err.splitlines() if line.startswith("mmoe fit: samples skipped")]
    assert len(report) == 1 and re.search(rf"train/pair: {expected} skipped \(0 corrupt, 0 lost, ", report[0])


@pytest.mark.parametrize("truncated", ["00001", "00003"])
def test_samples_a_truncated_shard_lost_count_when_the_sample_read_after_them_is_consumed(tmp_path, truncated):
    write_corpus(tmp_path / "cc", 4, kept_per_shard=8, truncated=truncated)
    # A buffer of 1 orders the shards as a buffer of 8 does and reads each shard's samples in order: the walk.
    walk = key_stream(tmp_path / "cc", shuffle_buffer=1, repeat=False)
    read_order = [key for batch in walk for key in batch]
    lost = walk.skipped["train/pair"].lost
    last = max(i for i, key in enumerate(read_order) if key.startswith(truncated))
    carrier = read_order[last + 1] if last + 1 < len(read_order) else None  # None: met at the end of the pass
    assert lost > 0
    for steps in range(1, 5):  # within the first pass
        loader = EpochDataLoader(key_stream(tmp_path / "cc", shuffle_buffer=8), batch_size=None, num_workers=0)
        keys = [key for batch in consumed_batches(loader, steps) for key in batch]
        assert loader.skipped["train/pair"].lost == (lost if carrier in keys else 0)
