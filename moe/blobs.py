"""Content-addressed blob store: ``tenzro://blob/<64 hex BLAKE3>`` ↔ files on disk.

Files live at ``<root>/<hash[:2]>/<hash>``, written atomically (temporary file, fsync,
rename) so a crash never leaves a partial blob under a valid name. Pure Python; imports
nothing from Django.
"""
from __future__ import annotations

import os
import tempfile
from pathlib import Path

import blake3

from moe.content import URI_PREFIX, BlobError, blob_uri, check_hash, parse_blob_uri  # noqa: F401

def blob_hash(data: bytes) -> str:
    """BLAKE3 of ``data`` as 64 lowercase hex characters."""
    return blake3.blake3(data).hexdigest()


def verify_blob(data: bytes, expected_hash: str) -> None:
    """Raise ``BlobError`` when BLAKE3(``data``) differs from ``expected_hash``."""
    got = blob_hash(data)
    if got != expected_hash:
        raise BlobError(f"blob hash mismatch: expected {expected_hash}, content hashes to {got}")


class BlobStore:
    """A directory of content-addressed blobs.

    ``put`` is idempotent: identical content gives the identical hash and one file.
    """

    def __init__(self, root: str | os.PathLike):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)

    def path(self, hash_hex: str) -> Path:
        """Filesystem path of a blob (whether or not it exists)."""
        check_hash(hash_hex)
        return self.root / hash_hex[:2] / hash_hex

    def has(self, hash_hex: str) -> bool:
        """Whether the blob is stored."""
        return self.path(hash_hex).is_file()

    def put(self, data: bytes) -> str:
        """Store ``data`` and return its BLAKE3 hash; atomic, idempotent."""
        h = blob_hash(data)
        self.put_verified(data, h)
        return h

    def put_verified(self, data: bytes, expected_hash: str) -> None:
        """Store ``data`` under ``expected_hash`` after checking it; raises ``BlobError`` on mismatch."""
        verify_blob(data, expected_hash)
        dest = self.path(expected_hash)
        if dest.is_file() and dest.stat().st_size == len(data):
            return
        dest.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=dest.parent, prefix=".tmp-")
        try:
            with os.fdopen(fd, "wb") as fh:
                fh.write(data)
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, dest)
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise

    def get(self, hash_hex: str, verify: bool = False) -> bytes:
        """Read a blob; ``verify`` re-hashes it. Raises ``BlobError`` when missing or corrupt."""
        p = self.path(hash_hex)
        try:
            data = p.read_bytes()
        except FileNotFoundError as exc:
            raise BlobError(f"blob {hash_hex} is not in the store at {self.root}") from exc
        if verify:
            verify_blob(data, hash_hex)
        return data


# Largest blob a holder downloads (bytes): well above any expert or dense slice of today's
# checkpoints, and a bound on what a misbehaving server can make an agent buffer.
MAX_BLOB_BYTES = 4 << 30


def fetch_blob(uri: str, store: BlobStore, endpoints: list[str], client=None, timeout: float = 60.0,
               max_bytes: int | None = None) -> bytes:
    """Resolve ``tenzro://blob/<hash>``: the local ``store`` first, then each HTTP endpoint in
    order (``GET <endpoint>/blobs/<hash>``). What is fetched is verified against the BLAKE3
    hash before it is stored and returned; a peer serving wrong bytes is skipped. Reference
    system §5.5 (local store, then candidate providers).

    ``endpoints``: base URLs (``http://host:port``) of the site and of providers that hold
    the blob. ``client``: an ``httpx.Client`` to reuse. ``max_bytes`` caps a download.
    Raises ``BlobError`` for a malformed URI, or naming every endpoint tried and why when no
    one served the right bytes.
    """
    import httpx

    h = parse_blob_uri(uri)
    if store.has(h):
        data = store.get(h)
        try:
            verify_blob(data, h)
            return data
        except BlobError:
            store.path(h).unlink(missing_ok=True)  # corrupt local copy: fetch it again
    own = client is None
    client = client or httpx.Client(timeout=timeout, follow_redirects=True)
    tried = []
    try:
        for ep in dict.fromkeys(e.rstrip("/") for e in endpoints if e):
            url = f"{ep}/blobs/{h}"
            try:
                with client.stream("GET", url) as resp:
                    if resp.status_code != 200:
                        tried.append(f"{url}: HTTP {resp.status_code}")
                        continue
                    chunks, n = [], 0
                    for chunk in resp.iter_bytes():
                        n += len(chunk)
                        if max_bytes is not None and n > max_bytes:
                            raise BlobError(f"more than {max_bytes} bytes")
                        chunks.append(chunk)
                data = b"".join(chunks)
                verify_blob(data, h)
            except (httpx.HTTPError, BlobError) as exc:
                tried.append(f"{url}: {exc}")
                continue
            store.put_verified(data, h)
            return data
    finally:
        if own:
            client.close()
    raise BlobError(f"blob {h} is not in the local store and no endpoint served it"
                    + (f" ({'; '.join(tried)})" if tried else " (no endpoint known)"))
