"""Shard writing and reading: exact round trips, corrupt samples, split by node / worker, mixtures."""

from __future__ import annotations

import io
import json
import logging
import tarfile

import numpy as np
import pytest
import torch
from PIL import Image
from torch.utils.data import DataLoader

from mmoe.data.collate import PretrainCollator
from mmoe.data.decoders import ImageDecoder, PairDecoder, TextDecoder, json_entry
from mmoe.data.loader import EpochDataLoader
from mmoe.data.mixture import StreamMixture
from mmoe.data.shards import ShardWriter, resolve_shards
from mmoe.data.streams import SeedDomain, ShardStream, shuffled
from mmoe.data.tokenizer import TextTokenizer
from mmoe.data.transforms import eval_transform


def png_bytes(value: int, size: int = 8) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (size, size), (value % 256, 0, 0)).save(buffer, format="PNG")
    return buffer.getvalue()


def write_pairs(folder, count: int, per_shard: int, name: str = "pairs") -> list[str]:
    with ShardWriter(folder, name, max_count=per_shard) as writer:
        for i in range(count):
            writer.write({"__key__": f"s{i:05d}", "png": png_bytes(i), "txt": f"caption {i}", "json": {"index": i}})
    return [str(folder / shard) for shard in writer.shards]


def key_stream(shards, **kwargs) -> ShardStream:
    return ShardStream(shards, decode=lambda sample: json_entry(sample)["index"], **kwargs)


def test_round_trip_exact_bytes_and_fields(tmp_path):
    samples = [
        {"__key__": "a", "jpg": b"\xff\xd8raw-bytes", "txt": "héllo", "json": {"id": 1, "s": "é"}},
        {"__key__": "b", "left.png": b"L", "right.png": b"R", "json": {"identifier": "dev-1-0-0"}},
    ]
    with ShardWriter(tmp_path, "mixed", max_count=1) as writer:
        for sample in samples:
            writer.write(sample)
    assert writer.shards == ["mixed-000000.tar", "mixed-000001.tar"]
    assert not list(tmp_path.glob(".*.tmp"))
    read = list(ShardStream(resolve_shards(tmp_path), decode=lambda s: s))
    assert [s["__key__"] for s in read] == ["a", "b"]
    assert read[0]["jpg"] == b"\xff\xd8raw-bytes" and read[0]["txt"].decode() == "héllo"
    assert json.loads(read[0]["json"]) == {"id": 1, "s": "é"}
    assert read[1]["left.png"] == b"L" and read[1]["right.png"] == b"R"


def test_writer_is_byte_reproducible_and_rejects_bad_keys(tmp_path):
    for folder in ("x", "y"):
        write_pairs(tmp_path / folder, 5, 10)
    assert (tmp_path / "x/pairs-000000.tar").read_bytes() == (tmp_path / "y/pairs-000000.tar").read_bytes()
    with ShardWriter(tmp_path / "z", "bad") as writer, pytest.raises(ValueError, match="key"):
        writer.write({"__key__": "has.dot", "txt": "x"})


def test_interrupted_writer_leaves_no_shard_with_a_final_name(tmp_path):
    with pytest.raises(RuntimeError), ShardWriter(tmp_path, "part", max_count=2) as writer:
        for i in range(3):
            writer.write({"__key__": f"k{i}", "txt": "x"})
        raise RuntimeError("converter failed")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["part-000000.tar"]


def test_resolve_shards_forms(tmp_path):
    shards = write_pairs(tmp_path, 6, 2)
    assert resolve_shards(tmp_path) == shards
    assert resolve_shards(str(tmp_path / "pairs-{000000..000002}.tar")) == shards
    assert resolve_shards(str(tmp_path / "pairs-*.tar")) == shards
    with pytest.raises(FileNotFoundError):
        resolve_shards(str(tmp_path / "nothing-*.tar"))


@pytest.mark.parametrize("shards, per_shard", [(8, 5), (1, 40)])
@pytest.mark.parametrize("num_workers", [0, 2])
def test_split_by_node_and_worker_is_disjoint_and_complete(tmp_path, shards, per_shard, num_workers):
    paths = write_pairs(tmp_path, shards * per_shard, per_shard)
    seen = []
    for rank in range(2):
        stream = key_stream(paths, shuffle_buffer=10, rank=rank, world_size=2, seed=3)
        part = list(DataLoader(stream, batch_size=None, num_workers=num_workers))
        assert part, f"rank {rank} read nothing"
        seen.append(part)
    union = sorted(int(i) for part in seen for i in part)
    assert union == list(range(shards * per_shard))  # complete, no sample twice


def test_shuffle_is_seeded_and_changes_with_the_epoch(tmp_path):
    paths = write_pairs(tmp_path, 30, 5)
    first = list(key_stream(paths, shuffle_buffer=8, seed=1))
    assert first == list(key_stream(paths, shuffle_buffer=8, seed=1)) and sorted(first) == list(range(30))
    assert first != list(range(30))
    later = key_stream(paths, shuffle_buffer=8, seed=1)
    later.set_epoch(1)
    assert list(later) != first


def test_seed_domains_keep_their_values_and_pick_the_streams(tmp_path):
    """The salts are part of every saved run's data order: the shuffle buffer draws from (seed, epoch, rank, worker,
    1), shard order from (seed, epoch) alone."""
    assert {domain.name: int(domain) for domain in SeedDomain} == {"SHUFFLE": 1, "MIXTURE": 2, "BATCH": 3, "SAMPLE": 4}
    paths = write_pairs(tmp_path, 30, 5)
    shard_order = np.random.default_rng([1, 0]).permutation(len(paths))
    in_order = [index for shard in shard_order for index in range(shard * 5, shard * 5 + 5)]
    expected = list(shuffled(in_order, 8, np.random.default_rng([1, 0, 0, 0, 1])))
    assert list(key_stream(paths, shuffle_buffer=8, seed=1)) == expected


def write_with_corruption(folder) -> list[str]:
    with ShardWriter(folder, "pairs", max_count=100) as writer:
        writer.write({"__key__": "good0", "png": png_bytes(1), "txt": "fine", "json": {"index": 0}})
        writer.write({"__key__": "badimage", "png": b"not an image", "txt": "x", "json": {"index": 1}})
        writer.write({"__key__": "notext", "png": png_bytes(2), "json": {"index": 2}})
        writer.write({"__key__": "badjson", "png": png_bytes(3), "txt": "x", "json": b"{oops"})
        writer.write({"__key__": "good1", "png": png_bytes(4), "txt": "fine too", "json": {"index": 4}})
    return [str(folder / s) for s in writer.shards]


def test_corrupt_samples_are_skipped_counted_and_reported(tmp_path, caplog):
    paths = write_with_corruption(tmp_path)
    tokenizer = TextTokenizer(16)
    pair = PairDecoder(eval_transform(8), tokenizer)

    def decode(sample):
        json_entry(sample)
        return pair(sample)

    stream = ShardStream(paths, decode=decode, name="pairs")
    with caplog.at_level(logging.WARNING, logger="mmoe.data"):
        items = list(stream)
    assert [item["key"] for item in items] == ["good0", "good1"]
    assert stream.skipped["pairs"].corrupt == 3 and stream.skipped["pairs"].lost == 0
    text = caplog.text
    for key, reason in (("badimage", "undecodable image"), ("notext", "missing entry txt"), ("badjson", "bad JSON")):
        assert f"key {key!r}" in text and reason in text
    assert "pairs-000000.tar" in text


def test_skip_counts_reach_the_main_process_from_workers(tmp_path):
    paths = write_with_corruption(tmp_path / "a") + write_with_corruption(tmp_path / "b")
    stream = ShardStream(paths, decode=PairDecoder(eval_transform(8), TextTokenizer(16)), name="pairs")
    loader = EpochDataLoader(stream, batch_size=None, num_workers=2)
    items = list(loader)
    assert len(items) == 6 and loader.skipped["pairs"].corrupt == 4  # the pair decoder does not read json


def test_truncated_shard_is_reported_not_fatal(tmp_path):
    paths = write_pairs(tmp_path, 10, 5)
    data = (tmp_path / "pairs-000000.tar").read_bytes()
    (tmp_path / "pairs-000000.tar").write_bytes(data[: len(data) // 2 + 100])
    stream = key_stream(paths, name="pairs")
    keys = [int(i) for i in stream]
    assert set(range(5, 10)) <= set(keys) and stream.skipped["pairs"].total >= 1  # no manifest: a lower bound


def test_pretraining_mixture_follows_ratios_and_masks(tmp_path):
    paths = write_pairs(tmp_path, 40, 10)
    tokenizer = TextTokenizer(16)
    transform = eval_transform(32)
    streams = {
        "image": ShardStream(paths, ImageDecoder(transform), PretrainCollator("image", (2, 2)), 4, repeat=True),
        "text": ShardStream(paths, TextDecoder(tokenizer), PretrainCollator("text", (2, 2)), 4, repeat=True),
        "pair": ShardStream(paths, PairDecoder(transform, tokenizer), PretrainCollator("pair", (2, 2)), 4, repeat=True),
    }
    mixture = StreamMixture(streams, {"image": 2.0, "text": 1.0, "pair": 1.0}, seed=0, batches_per_epoch=400)
    batches = list(EpochDataLoader(mixture, batch_size=None, num_workers=0))
    counts = {name: sum(b["kind"] == name for b in batches) for name in streams}
    assert len(batches) == 400 and abs(counts["image"] / 400 - 0.5) < 0.08
    image = next(b for b in batches if b["kind"] == "image")
    assert image["image"].shape == (4, 3, 32, 32) and image["image_mask"].shape == (4, 4)
    assert (image["image_mask"].sum(1) == 2).all()  # round(0.4 * 4)
    text = next(b for b in batches if b["kind"] == "text")
    assert {"text_ids", "text_padding_mask", "text_targets", "text_mask"} <= text.keys() and "image" not in text
    pair = next(b for b in batches if b["kind"] == "pair")
    assert not pair["image_mask"].any() and pair["text_mask"].any()


def test_mixture_rejects_bad_ratios(tmp_path):
    paths = write_pairs(tmp_path, 4, 4)
    stream = key_stream(paths)
    with pytest.raises(ValueError, match="ratios"):
        StreamMixture({"image": stream}, {"image": 0.0})


def test_epoch_loader_sets_epochs_in_workers(tmp_path):
    paths = write_pairs(tmp_path, 40, 5)
    loader = EpochDataLoader(key_stream(paths, shuffle_buffer=10, seed=5), batch_size=None, num_workers=2)
    first, second = list(loader), list(loader)
    assert sorted(first) == sorted(second) == list(range(40)) and first != second
    again = EpochDataLoader(key_stream(paths, shuffle_buffer=10, seed=5), batch_size=None, num_workers=2)
    assert list(again) == first


def test_tar_members_are_plain_and_named_by_key(tmp_path):
    write_pairs(tmp_path, 2, 10)
    with tarfile.open(tmp_path / "pairs-000000.tar") as tar:
        names = tar.getnames()
        assert names[:3] == ["s00000.png", "s00000.txt", "s00000.json"]
        assert all(member.mtime == 0 for member in tar.getmembers())


def test_batches_are_seeded(tmp_path):
    paths = write_pairs(tmp_path, 16, 4)
    make = lambda: ShardStream(  # noqa: E731
        paths, TextDecoder(TextTokenizer(16)), PretrainCollator("text", (2, 2)), 8, shuffle_buffer=4, seed=11
    )
    a, b = list(make()), list(make())
    assert all(torch.equal(x["text_ids"], y["text_ids"]) for x, y in zip(a, b, strict=True))
    assert np.isclose(sum(x["text_mask"].sum().item() for x in a), 16)  # one of "caption <i>" real tokens each


def test_missing_shard_paths_fail_at_construction_naming_the_argument(tmp_path):
    from mmoe.data.datamodules import PretrainDataModule
    from mmoe.data.shards import resolve_shards

    with pytest.raises(FileNotFoundError, match="does not exist"):
        resolve_shards(str(tmp_path / "missing.tar"))
    with pytest.raises(FileNotFoundError, match=r"data\.text_shards: .*nowhere"):
        PretrainDataModule(text_shards=str(tmp_path / "nowhere"), image_size=32, num_workers=0)
