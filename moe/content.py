"""Content addresses: ``tenzro://blob/<64 hex BLAKE3>``, the one place they are built and parsed.

The catalog, heartbeats and repair rows name blobs by these URIs; the blob store
(``moe.blobs``) maps them to files. Pure Python; imports nothing from Django.
"""
from __future__ import annotations

import re

URI_PREFIX = "tenzro://blob/"
HASH_RE = re.compile(r"^[0-9a-f]{64}$")


class BlobError(ValueError):
    """A blob URI or hash is malformed, a blob is missing, or its content does not match its hash."""


def blob_uri(hash_hex: str) -> str:
    """``tenzro://blob/<hash>`` for a 64-hex BLAKE3 hash."""
    return URI_PREFIX + check_hash(hash_hex)


def check_hash(hash_hex: str) -> str:
    """Return ``hash_hex`` if it is 64 lowercase hex characters; raise ``BlobError`` otherwise."""
    if not isinstance(hash_hex, str) or not HASH_RE.match(hash_hex):
        raise BlobError("blob hash must be 64 lowercase hex characters (BLAKE3)")
    return hash_hex


def parse_blob_uri(uri: str) -> str:
    """The hash inside ``tenzro://blob/<hash>``; raises ``BlobError`` for any other form."""
    if not isinstance(uri, str) or not uri.startswith(URI_PREFIX):
        raise BlobError(f"blob URI must look like {URI_PREFIX}<64 hex BLAKE3>, got {uri!r}")
    return check_hash(uri[len(URI_PREFIX):])
