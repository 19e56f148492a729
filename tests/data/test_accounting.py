"""Samples a stream cannot use are counted where the user looks: a truncated shard loses every sample after the cut
(counted against its manifest), counts cross DataLoader workers and survive a resume, and a stream with no usable
sample stops with an error naming its shards instead of looping."""

from __future__ import annotations

import json
import logging

import pytest

from mmoe.data.accounting import UnusableStreamError
from mmoe.data.decoders import PairDecoder, TextDecoder, json_entry
from mmoe.data.loader import EpochDataLoader
from mmoe.data.shards import ShardWriter, resolve_shards
from mmoe.data.streams import ShardStream
from mmoe.data.tokenizer import TextTokenizer
from mmoe.data.transforms import eval_transform
from tests.data.test_shards import png_bytes


def write_split(folder, count: int, per_shard: int, name: str = "pairs", text_only: bool = False) -> list[str]:
    """Shards and the manifest a converter writes (with ``shard_samples``)."""
    counts: list[int] = []
    with ShardWriter(folder, name, max_count=per_shard) as writer:
        for i in range(count):
            sample = {"__key__": f"s{i:05d}", "txt": f"caption {i}", "json": {"index": i}}
            if not text_only:
                sample["png"] = png_bytes(i)
            writer.write(sample)
    counts = [min(per_shard, count - start) for start in range(0, count, per_shard)]
    manifest = {"name": name, "samples": count, "skipped": 0, "shards": len(writer.shards),
                "shard_files": writer.shards, "shard_samples": counts}  # fmt: skip
    (folder / "manifest.json").write_text(json.dumps(manifest))
    return resolve_shards(folder)


def truncate(path, keep: float) -> None:
    data = open(path, "rb").read()
    open(path, "wb").write(data[: int(len(data) * keep)])


def index_stream(shards, **kwargs) -> ShardStream:
    return ShardStream(shards, decode=lambda sample: json_entry(sample)["index"], name="pairs", **kwargs)


def test_a_truncated_shard_counts_every_sample_after_the_cut(tmp_path, caplog):
    shards = write_split(tmp_path, 40, 20)
    truncate(shards[0], 0.5)
    stream = index_stream(shards)
    with caplog.at_level(logging.WARNING, logger="mmoe.data"):
        read = list(stream)
    assert set(range(20, 40)) <= set(read)
    assert len(read) < 40
    count = stream.skipped["pairs"]
    assert count.lost == 40 - len(read) and count.corrupt == 0  # the cut sample itself is lost, not double counted
    assert count.shards == [shards[0]]
    assert f"lost {count.lost} samples [pairs]: shard {shards[0]}: read {20 - count.lost} of the 20" in caplog.text


@pytest.mark.parametrize("workers", [0, 2])
def test_loader_counts_what_workers_lost_and_keeps_it_across_a_resume(tmp_path, workers):
    shards = write_split(tmp_path, 60, 10)
    truncate(shards[1], 0.3)
    truncate(shards[4], 0.6)

    def loader() -> EpochDataLoader:
        decode = PairDecoder(eval_transform(8), TextTokenizer(16))
        stream = ShardStream(shards, decode, lambda items, rng: [i["key"] for i in items], 4, name="train/pair")
        return EpochDataLoader(stream, batch_size=None, num_workers=workers)

    whole = loader()
    batches = list(whole)
    lost = 60 - sum(len(batch) for batch in batches)
    assert lost > 0 and whole.skipped["train/pair"].lost == lost

    interrupted = loader()
    iterator = iter(interrupted)
    first = [next(iterator) for _ in range(6)]  # five consumed, one held back
    state = interrupted.state_dict()
    del iterator
    resumed = loader()
    resumed.load_state_dict(state)
    assert first[:5] + list(resumed) == batches
    assert resumed.skipped["train/pair"].lost == lost


def test_pair_stream_over_text_only_shards_stops_naming_them(tmp_path):
    shards = write_split(tmp_path, 8, 4, name="text", text_only=True)
    stream = ShardStream(shards, PairDecoder(eval_transform(8), TextTokenizer(16)), repeat=True, name="train/pair")
    with pytest.raises(UnusableStreamError) as error:
        next(iter(stream))
    message = str(error.value)
    assert "train/pair: 1000 samples in a row could not be used" in message
    assert "missing entry jpg|jpeg|png|webp (has json, txt)" in message and shards[0] in message


def test_repeating_stream_over_shards_without_samples_stops(tmp_path):
    broken = tmp_path / "broken-000000.tar"
    broken.write_bytes(b"this is not a tar file" * 10)
    stream = ShardStream([str(broken)], TextDecoder(TextTokenizer(16)), repeat=True, name="train/text")
    with pytest.raises(UnusableStreamError, match=r"train/text: a whole pass over the shards gave no sample"):
        next(iter(stream))


def test_datamodule_reports_skips_at_the_end_of_a_stage(tmp_path, capsys):
    from mmoe.data.datamodules import NLVR2DataModule

    shards = write_split(tmp_path / "val", 12, 6)
    truncate(shards[0], 0.5)
    module = NLVR2DataModule(val_shards=str(tmp_path / "val"), image_size=8, num_workers=0)
    list(module.val_dataloader())  # pair samples: every one lacks the NLVR2 entries, so all are corrupt or lost
    counts = module.skip_counts()["val"]
    assert counts.total == 12 and counts.lost > 0 and counts.corrupt > 0
    module.teardown("validate")
    err = capsys.readouterr().err
    assert f"mmoe validate: samples skipped: val: 12 skipped ({counts.corrupt} corrupt, {counts.lost} lost" in err
