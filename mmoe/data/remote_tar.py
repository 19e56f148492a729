"""The members of a remote tar shard, each bounded in size before it is read.

A local shard ends where its file ends; a remote body need not end, so a member header's claimed size is checked
before the member is read: one over the bound is refused (a :class:`MemberTooLarge` naming shard and member) and
nothing more of the shard is read. Members are named and skipped as webdataset's ``tar_file_iterator`` does
(regular files only, no ``__*__`` metadata), so samples group by key the same way.
"""

from __future__ import annotations

import re
import tarfile
from collections.abc import Callable, Iterator
from typing import Any

from mmoe.data.redact import redact

#: Member names webdataset skips as metadata.
META = re.compile(r"__[^/]*__($|/)")


class MemberTooLarge(ValueError):
    """A tar member claims more bytes than a remote shard's member may hold."""


def tar_members(
    stream: Any, url: str, max_member_bytes: int, handler: Callable[[Exception], bool]
) -> Iterator[dict[str, Any]]:
    """``{"fname", "data", "__url__"}`` of each regular member of the tar ``stream``; errors go to ``handler``, and
    reading stops at the first (a stream cannot skip a member it could not read)."""
    try:
        archive = tarfile.open(fileobj=stream, mode="r|*")
        for member in archive:
            if not member.isreg() or META.match(member.name):
                continue
            if member.size > max_member_bytes:
                raise MemberTooLarge(
                    f"{redact(url)}: member {member.name!r} claims {member.size} bytes, more than the "
                    f"{max_member_bytes} a remote shard's member may hold (RemoteReading.max_member_bytes); "
                    "the rest of the shard is not read"
                )
            data = archive.extractfile(member).read()
            if len(data) < member.size:
                raise tarfile.ReadError(f"{redact(url)}: member {member.name!r} ends after {len(data)} bytes")
            yield {"fname": member.name, "data": data, "__url__": url}
            archive.members = []
    except Exception as error:  # noqa: BLE001 (handed to the stream's handler, which counts it)
        handler(error)
