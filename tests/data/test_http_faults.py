"""Remote HTTP shards against a hostile loopback server: a dropped connection resumed from the byte reached (Range),
a stalled server timed out, a shard replaced while read not stitched, a member claiming more than its bound refused,
and credentials in a URL never shown or kept."""

from __future__ import annotations

import logging
import time

import pytest

from mmoe.data.remote import RemoteReading
from mmoe.data.streams import ShardStream
from tests.data.http_server import EndlessHandler, Plan, PlannedHandler, serve, text_shard

pytest.importorskip("aiohttp", reason="fsspec's HTTP filesystem needs aiohttp")

FAST = dict(retries=2, backoff_s=0.0, block_size=2048)
SIZE = 4000  # bytes per sample's text (4,608 bytes of tar each): a cut at 25,000 falls inside the sixth


@pytest.fixture
def planned():
    """Serves a :class:`Plan` (set by the test) at ``<url>/s/t.tar``; released and stopped at the end."""
    servers = []

    def start(plan: Plan) -> str:
        server, url = serve(type("Handler", (PlannedHandler,), {"plan": plan}))
        servers.append((server, plan))
        return f"{url}/s/t.tar"

    yield start
    for server, plan in servers:
        plan.released.set()
        server.shutdown()


def read(url: str, reading: RemoteReading, count: int = 6) -> tuple[list[bytes], ShardStream]:
    stream = ShardStream([url], lambda sample: sample["txt"], expected={url: count}, remote=reading)
    return list(stream), stream


@pytest.mark.parametrize("ranges", [True, False])
def test_a_dropped_http_read_continues_at_the_byte_it_reached(planned, caplog, ranges):
    plan = Plan([text_shard("A")], cut_after=25_000, ranges=ranges)
    with caplog.at_level(logging.WARNING, logger="mmoe.data"):
        texts, stream = read(planned(plan), RemoteReading(**FAST))
    assert texts == [b"A" * SIZE] * 6 and "" not in stream.skipped  # nothing skipped
    assert "retry 1 of 2" in caplog.text and len(plan.requests) == 2
    assert plan.requests[1].get("Range") == "bytes=25000-"  # asked for the rest, whether or not it was honoured


def test_a_stalled_http_server_times_out_and_what_it_held_back_is_counted(planned, caplog):
    plan = Plan([text_shard("A")], stall_after=25_000)
    began = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="mmoe.data"):
        texts, stream = read(planned(plan), RemoteReading(retries=1, backoff_s=0.0, read_timeout_s=0.5))
    assert time.monotonic() - began < 10
    assert 1 <= len(texts) < 6 and len(texts) + stream.skipped[""].lost == 6  # the samples before the stall, read
    assert "Timeout" in caplog.text and "retry 1 of 1" in caplog.text and len(plan.requests) == 2


@pytest.mark.parametrize(
    "if_match, ranges, etag",
    [(True, True, True), (False, True, True), (False, False, True), (False, False, False)],
    ids=["412", "etag-differs", "no-ranges", "no-ranges-no-etag"],
)
def test_an_http_shard_replaced_while_read_is_not_stitched_and_the_rest_is_counted_lost(
    planned, caplog, if_match, ranges, etag
):
    """The server refuses the stale ETag, or sends another; or sends the body again whole, the change then seen in
    the bytes before the offset (which a server with no ETag and no ranges leaves as the only sign)."""
    plan = Plan([text_shard("A"), text_shard("B")], cut_after=25_000, if_match=if_match, ranges=ranges, etag=etag)
    with caplog.at_level(logging.WARNING, logger="mmoe.data"):
        texts, stream = read(planned(plan), RemoteReading(**FAST))
    assert 1 <= len(texts) < 6 and set(texts) == {b"A" * SIZE} and len(texts) + stream.skipped[""].lost == 6
    assert "replaced while read (" in caplog.text and "at byte 25000" in caplog.text


@pytest.mark.parametrize("limit", [None, 1000])
def test_a_member_over_the_bound_is_refused_without_being_read(planned, caplog, limit):
    """6 GiB claimed on an endless body (the default bound), or an ordinary member over a small bound."""
    if limit is None:
        server, url = serve(EndlessHandler)
        url, reading, member = f"{url}/s/t.tar", RemoteReading(**FAST), "k1.txt"
    else:
        url, reading, member = planned(Plan([text_shard("A")])), RemoteReading(**FAST, max_member_bytes=limit), "k0.txt"
    began = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="mmoe.data"):
        texts, stream = read(url, reading)
    assert texts == [] and stream.skipped[""].lost == 6 and time.monotonic() - began < 10
    lost = [record.getMessage() for record in caplog.records if "lost 6 samples" in record.getMessage()]
    assert len(lost) == 1 and f"member '{member}' claims" in lost[0] and url in lost[0]
    assert f"the {reading.max_member_bytes} a remote shard's member may hold" in lost[0]
    if limit is None:
        server.shutdown()


SECRETS = ("s3cr3tPassw0rd", "sigSECRET", "tokSECRET")


def test_credentials_in_a_shard_url_are_never_logged_nor_kept_in_the_skip_ledger(planned, caplog):
    base = planned(Plan([text_shard("A")], cut_after=25_000)).removesuffix("/s/t.tar")
    authority = base.removeprefix("http://")
    query = "?X-Amz-Signature=sigSECRET&token=tokSECRET&part=1"
    shards = [f"http://AKIAUSER:s3cr3tPassw0rd@{authority}/s/t.tar{query}", f"http://u:s3cr3tPassw0rd@{authority}/404"]
    stream = ShardStream(shards, lambda s: s["txt"], expected=dict.fromkeys(shards, 6), remote=RemoteReading(**FAST))
    with caplog.at_level(logging.DEBUG, logger="mmoe.data"):
        texts = list(stream)
    count = stream.skipped[""]
    assert len(texts) == 6 and count.lost == 6 and "retry 1 of 2" in caplog.text and "lost 6 samples" in caplog.text
    kept = repr(count.to_state()) + caplog.text
    assert not [secret for secret in SECRETS if secret in kept]
    assert f"http://***@{authority}/404" in count.shards and "part=1" in caplog.text
