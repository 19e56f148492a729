"""URLs as they may be shown or stored: without the credentials a user may have put in them.

A shard URL can carry a password (``https://user:token@host/...``) or a signed query (an S3 presigned URL's
``X-Amz-Signature``, ``X-Amz-Credential``; a ``token=``); warnings, "lost" lines, error messages and the skip ledger
kept in checkpoints show ``***`` in their place.
"""

from __future__ import annotations

import re

#: ``scheme://userinfo@``: the userinfo is replaced.
USERINFO = re.compile(r"(?P<scheme>\b[A-Za-z][A-Za-z0-9+.-]*://)[^/?#@\s]+@")
#: Query parameters that hold a secret (case-insensitive): their values are replaced.
SECRET_QUERY = re.compile(
    r"(?P<name>[?&;](?:X-Amz-[A-Za-z-]+|X-Goog-[A-Za-z-]+|[A-Za-z_]*token|signature|sig|key|secret|password"
    r"|credential|Policy|Key-Pair-Id)=)[^&;#\s'\"]*",
    re.IGNORECASE,
)


def redact(text: str, url: str = "") -> str:
    """``text`` with every URL's userinfo and secret query values shown as ``***``, and those of ``url`` wherever
    they appear (a library may quote them without the URL around them, as botocore quotes a bucket name)."""
    text = str(text)
    for secret in secrets_of(url):
        text = text.replace(secret, "***")
    text = USERINFO.sub(r"\g<scheme>***@", text)
    return SECRET_QUERY.sub(r"\g<name>***", text)


def secrets_of(url: str) -> list[str]:
    """The userinfo and secret query values of ``url``, longest first."""
    found = [match.group(0)[len(match["scheme"]) : -1] for match in USERINFO.finditer(url)]
    found += [match.group(0)[len(match["name"]) :] for match in SECRET_QUERY.finditer(url)]
    return sorted((secret for secret in found if secret), key=len, reverse=True)


def redacted(error: BaseException, url: str) -> BaseException:
    """``error`` with its message redacted (:func:`redact`, with ``url``'s secrets); its class and cause kept."""
    error.args = tuple(redact(arg, url) if isinstance(arg, str) else arg for arg in error.args)
    return error
