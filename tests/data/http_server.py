"""A loopback HTTP server for remote-shard tests whose behaviour a test sets: bodies that change between requests
(each with its ETag), Range and If-Match honoured or ignored, a connection cut or stalled after some bytes."""

from __future__ import annotations

import hashlib
import io
import socket
import tarfile
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def text_shard(letter: str, count: int = 6, size: int = 4000) -> bytes:
    """A tar of ``count`` samples ``k<i>.txt``, each ``size`` times ``letter``."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.GNU_FORMAT) as archive:
        for index in range(count):
            info = tarfile.TarInfo(f"k{index}.txt")
            info.size = size
            archive.addfile(info, io.BytesIO(letter.encode() * size))
    return buffer.getvalue()


@dataclass
class Plan:
    """What the server does for a ``.tar`` path (any other is not found).

    ``bodies``: the body of the n-th GET (the last one repeats); ``cut_after``: bytes sent before the first GET's
    connection is dropped; ``stall_after``: the byte of the object at which every GET stalls until the test ends;
    ``ranges`` / ``if_match``: whether those headers are honoured; ``etag``: whether an ETag is sent;
    ``requests``: the headers of each GET."""

    bodies: list[bytes]
    cut_after: int | None = None
    stall_after: int | None = None
    ranges: bool = True
    if_match: bool = True
    etag: bool = True
    requests: list[dict[str, str]] = field(default_factory=list)
    released: threading.Event = field(default_factory=threading.Event)


class PlannedHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    plan: Plan

    def log_message(self, *args) -> None:
        pass

    def do_HEAD(self) -> None:
        self.respond(head=True)

    def do_GET(self) -> None:
        self.respond(head=False)

    def respond(self, head: bool) -> None:
        plan = self.plan
        if not self.path.partition("?")[0].endswith(".tar"):
            self.send_error(404)
            return
        if not head:
            plan.requests.append(dict(self.headers))
        body = plan.bodies[min(len(plan.requests) - 1, len(plan.bodies) - 1) if plan.requests else 0]
        etag = f'"{hashlib.sha1(body).hexdigest()}"'
        if plan.if_match and self.headers.get("If-Match") not in (None, etag):
            self.send_response(412)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        start = int(self.headers["Range"].removeprefix("bytes=").rstrip("-")) if self.headers.get("Range") else 0
        start = start if plan.ranges else 0
        self.send_response(206 if start else 200)
        if start:
            self.send_header("Content-Range", f"bytes {start}-{len(body) - 1}/{len(body)}")
        self.send_header("Content-Length", str(len(body) - start))
        if plan.etag:
            self.send_header("ETag", etag)
        self.send_header("Accept-Ranges", "bytes" if plan.ranges else "none")
        self.end_headers()
        if not head:
            self.send_body(body, start, first=len(plan.requests) == 1)

    def send_body(self, body: bytes, start: int, first: bool) -> None:
        plan = self.plan
        if plan.stall_after is not None:  # stalls at that byte of the object, whatever range was asked for
            self.wfile.write(body[start : max(start, plan.stall_after)])
            self.wfile.flush()
            plan.released.wait(60)
            self.close_connection = True
        elif first and plan.cut_after is not None:
            self.wfile.write(body[start : plan.cut_after])
            self.wfile.flush()
            time.sleep(0.2)  # the client reads what was sent before it sees the connection drop
            self.connection.shutdown(socket.SHUT_RDWR)
            self.close_connection = True
        else:
            self.wfile.write(body[start:])


class EndlessHandler(BaseHTTPRequestHandler):
    """A tar member header claiming 6 GiB, then ``A``s until the client hangs up (at most 64 MiB)."""

    protocol_version = "HTTP/1.1"

    def log_message(self, *args) -> None:
        pass

    def do_GET(self) -> None:
        if not self.path.endswith(".tar"):
            self.send_error(404)
            return
        self.send_response(200)
        self.send_header("Connection", "close")
        self.end_headers()
        info = tarfile.TarInfo("k1.txt")
        info.size = 6 << 30
        self.wfile.write(info.tobuf(format=tarfile.GNU_FORMAT))
        try:
            for _ in range(64):
                self.wfile.write(b"A" * (1 << 20))
        except OSError:
            pass
        self.close_connection = True


def serve(handler: type[BaseHTTPRequestHandler]) -> tuple[ThreadingHTTPServer, str]:
    """``handler`` served from a thread on a free loopback port, and the server's URL."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    server.handle_error = lambda request, address: None  # a client hanging up mid-body is what these tests do
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}"
