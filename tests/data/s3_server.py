"""A local S3 endpoint for the remote-shard tests: moto's server on the loopback, behind a TCP proxy that can cut
the response to a chosen object after a number of bytes (a connection dropped mid-shard)."""

from __future__ import annotations

import socket
import threading
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class Cut:
    """Cut the next ``times`` responses to GETs of ``path`` after ``after`` bytes."""

    path: str
    after: int
    times: int


@dataclass
class DroppingProxy:
    """Forwards loopback connections to ``upstream``; the GETs of each :class:`Cut`'s path lose their connection
    after ``after`` response bytes, ``times`` times. ``gets`` counts the GETs seen per path."""

    upstream: tuple[str, int]
    cuts: list[Cut] = field(default_factory=list)
    gets: Counter = field(default_factory=Counter)

    def __post_init__(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def close(self) -> None:
        self.listener.close()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _serve(self, client: socket.socket) -> None:
        server = socket.create_connection(self.upstream)
        budget: list[int | None] = [None]  # response bytes left before the cut, for the request in flight
        threading.Thread(target=self._requests, args=(client, server, budget), daemon=True).start()
        try:
            while data := server.recv(65536):
                if budget[0] is not None:
                    data = data[: budget[0]]
                    budget[0] -= len(data)
                client.sendall(data)
                if budget[0] == 0:
                    break
        except OSError:
            pass
        for end in (client, server):  # shutdown first: it wakes the other thread's recv and ends the connection now
            try:
                end.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            end.close()

    def _requests(self, client: socket.socket, server: socket.socket, budget: list[int | None]) -> None:
        try:
            while data := client.recv(65536):
                self._note(data, budget)
                server.sendall(data)
        except OSError:
            pass

    def _note(self, data: bytes, budget: list[int | None]) -> None:
        if not data.startswith(b"GET "):
            return
        path = data.split(b" ", 2)[1].split(b"?")[0].decode()
        with self.lock:
            self.gets[path] += 1
            for cut in self.cuts:
                if cut.path == path and cut.times > 0:
                    cut.times -= 1
                    budget[0] = cut.after


def upload(client, bucket: str, prefix: str, folder: Path) -> None:
    """Every file of ``folder`` to ``s3://bucket/prefix/<name>``."""
    for path in sorted(folder.iterdir()):
        client.put_object(Bucket=bucket, Key=f"{prefix}/{path.name}", Body=path.read_bytes())
