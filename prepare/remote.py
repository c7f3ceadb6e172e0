"""Checkpoints over HTTP(S): only the byte ranges a tensor needs, with HTTP Range requests.

``HttpCheckpoint(url)`` reads ``config.json`` and ``model.safetensors.index.json`` (a 404
means a single ``model.safetensors``) from the URL "directory", then each shard's header
with two ranged GETs (bytes 0-7, then the N header bytes; reference system §5.7) and each
tensor with one ranged GET of exactly its bytes. Never a whole shard: a server that
ignores ``Range`` (200 instead of 206) is an error.

* Revision pinning: a Hugging Face repo URL ``https://huggingface.co/<org>/<repo>`` becomes
  ``.../resolve/<revision>/``; the commit the Hub reports (``X-Repo-Commit``) replaces a
  branch name for every later request, and every shard's ``ETag`` is recorded on first
  contact and must not change while we read (a changed file is an error, not a mix).
* Headers are cached per shard in memory, and on disk under ``cache_dir`` keyed by URL and
  ETag when one is given.
* Retries: transport errors, 429 and 5xx are retried ``retries`` times with exponential
  backoff (``backoff`` × 2^i seconds); other 4xx fail at once with the status.
* Size checks: ``Content-Range`` must name the requested range and the shard's total size,
  and the body must have exactly the requested length. Bodies are streamed and reading stops
  one chunk past the expected length (a ranged read) or ``JSON_LIMIT`` (``config.json``, the
  index), so a server sending more is refused without being buffered.
* ``HF_TOKEN`` (or ``token``) is sent as a bearer token when set.

Pure Python; imports nothing from Django.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import time
from pathlib import Path

import httpx

from prepare.checkpoint import Checkpoint

from moe.codec import CheckpointError

_CONTENT_RANGE = re.compile(r"^bytes (\d+)-(\d+)/(\d+)$")
_HF_REPO = re.compile(r"^https://huggingface\.co/([^/]+/[^/]+)/?$")
_COMMIT = re.compile(r"^[0-9a-f]{40}$")
JSON_LIMIT = 64 * 1024 * 1024  # config.json / model.safetensors.index.json (a big index is a few MiB)


def is_url(source) -> bool:
    """Whether ``source`` is an http(s) URL rather than a local path."""
    return isinstance(source, str) and source.startswith(("http://", "https://"))


def open_checkpoint(source: str | Path, revision: str | None = None, **kw) -> Checkpoint:
    """The checkpoint at ``source``: a ``prepare.gguf.GgufCheckpoint`` for a ``.gguf`` file
    (local, or an http(s) URL read by Range requests), ``HttpCheckpoint`` for another http(s)
    URL, else the local ``Checkpoint``. Raises ``CheckpointError`` as they do."""
    from prepare.gguf import GgufCheckpoint, is_gguf

    if is_gguf(source):
        if is_url(source):
            if revision:
                raise CheckpointError(f"{source}: revision is not understood for a GGUF file URL; "
                                      "put the commit in the URL (.../resolve/<commit>/file.gguf)")
            return GgufCheckpoint(str(source), http_file=HttpFile(str(source), **kw))
        return GgufCheckpoint(source)
    if is_url(source):
        return HttpCheckpoint(str(source), revision=revision, **kw)
    return Checkpoint(source)


class HttpCheckpoint(Checkpoint):
    """A safetensors checkpoint behind an HTTP(S) URL, read by Range requests.

    ``url``: the checkpoint "directory" (files are ``url/<name>``) or a Hugging Face repo
    URL; ``revision``: branch, tag or commit for Hub URLs (default ``main``, then pinned to
    the reported commit). Attributes as ``Checkpoint`` (``shards`` are URLs) plus
    ``revision`` (the pinned commit when known) and ``requests`` (count of HTTP requests).

    Raises ``CheckpointError`` for an unreachable URL, a missing ``config.json``, a bad
    index, or any failed or inconsistent ranged read.
    """

    def __init__(self, url: str, revision: str | None = None, token: str | None = None, retries: int = 4,
                 backoff: float = 0.25, timeout: float = 30.0, cache_dir: str | Path | None = None,
                 transport: httpx.BaseTransport | None = None):
        hf = _HF_REPO.match(url)
        if hf:
            base = f"https://huggingface.co/{hf.group(1)}/resolve/{revision or 'main'}/"
        else:
            if revision:
                raise CheckpointError(f"{url}: revision is only understood for "
                                      f"https://huggingface.co/<org>/<repo> URLs")
            base = url.rstrip("/") + "/"
        self.path = url
        self.base = base
        self.revision = revision if revision and _COMMIT.match(revision) else None
        self.retries, self.backoff = retries, backoff
        self.cache_dir = Path(cache_dir) if cache_dir else None
        self.requests = 0
        token = token or os.environ.get("HF_TOKEN")
        self._client = httpx.Client(timeout=timeout, follow_redirects=True, transport=transport,
                                    headers={"Authorization": f"Bearer {token}"} if token else {})
        self._headers = {}
        self._sizes: dict[str, int] = {}
        self._prefix: dict[str, bytes] = {}
        self._etags: dict[str, str | None] = {}
        self.config = self._get_json("config.json")
        if not isinstance(self.config, dict):
            raise CheckpointError(f"{self.base}config.json must hold a JSON object")
        index = self._get_json("model.safetensors.index.json", missing_ok=True)
        if index is None:
            self._weight_map = None
            self.shards = [self.base + "model.safetensors"]
        else:
            wm = index.get("weight_map") if isinstance(index, dict) else None
            if not isinstance(wm, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in wm.items()):
                raise CheckpointError(f"{self.base}model.safetensors.index.json: 'weight_map' must map tensor "
                                      f"names to shard file names")
            for name, shard in wm.items():
                if "/" in shard or shard in ("", ".", ".."):
                    raise CheckpointError(f"{self.base}model.safetensors.index.json: tensor {name!r} names "
                                          f"shard {shard!r} outside the checkpoint")
            self._weight_map = {k: self.base + v for k, v in wm.items()}
            self.shards = sorted(set(self._weight_map.values()))

    def close(self) -> None:
        """Close the HTTP connection pool."""
        self._client.close()

    # -- HTTP ------------------------------------------------------------------------------
    def _request(self, url: str, headers: dict | None = None, *, read: int = 200,
                 limit: int = JSON_LIMIT) -> tuple[httpx.Response, bytes]:
        """GET with retries on transport errors, 429 and 5xx (exponential backoff); returns the
        response and its body, which is read only for status ``read`` (else b"") and streamed up
        to ``limit`` bytes. Raises ``CheckpointError`` when every attempt failed or the body is
        longer than ``limit`` (reading stops there: a hostile length is never buffered)."""
        last = ""
        for attempt in range(self.retries + 1):
            if attempt:
                time.sleep(self.backoff * 2 ** (attempt - 1))
            self.requests += 1
            try:
                with self._client.stream("GET", url, headers=headers or {}) as resp:
                    if resp.status_code == 429 or resp.status_code >= 500:
                        last = f"HTTP {resp.status_code}"
                        continue
                    self._pin(resp)
                    if resp.status_code != read:
                        return resp, b""
                    declared = resp.headers.get("content-length", "")
                    if declared.isdigit() and int(declared) > limit:
                        raise CheckpointError(f"{url}: the response declares {declared} bytes; at most {limit} "
                                              f"were asked for")
                    body = bytearray()
                    for chunk in resp.iter_bytes():
                        body += chunk
                        if len(body) > limit:
                            raise CheckpointError(f"{url}: the response is longer than the {limit} bytes asked "
                                                  f"for; stopped reading")
                    return resp, bytes(body)
            except httpx.TransportError as exc:
                last = f"{type(exc).__name__}: {exc}"
                continue
        raise CheckpointError(f"{url}: failed after {self.retries + 1} attempts ({last})")

    def _pin(self, resp: httpx.Response) -> None:
        """Pin a Hub branch to the commit it resolved to, for every later request."""
        commit = resp.headers.get("x-repo-commit", "")
        if self.revision is None and _COMMIT.match(commit) and "/resolve/" in self.base:
            self.revision = commit
            self.base = re.sub(r"/resolve/[^/]+/$", f"/resolve/{commit}/", self.base)

    def _get_json(self, name: str, missing_ok: bool = False):
        url = self.base + name
        resp, body = self._request(url)
        if resp.status_code == 404 and missing_ok:
            return None
        if resp.status_code != 200:
            raise CheckpointError(f"{url}: HTTP {resp.status_code}")
        try:
            return json.loads(body)
        except (ValueError, UnicodeDecodeError, RecursionError) as exc:
            raise CheckpointError(f"{url}: not JSON ({exc})") from None

    def _ranged(self, shard: str, offset: int, length: int) -> tuple[bytes, int]:
        """(body, total size) of one Range GET, every size checked."""
        end = offset + length - 1
        resp, body = self._request(shard, {"Range": f"bytes={offset}-{end}"}, read=206, limit=length)
        if resp.status_code == 200:
            raise CheckpointError(f"{shard}: the server ignored the Range header (HTTP 200); whole shards are "
                                  f"never downloaded")
        if resp.status_code != 206:
            raise CheckpointError(f"{shard}: HTTP {resp.status_code} for bytes {offset}-{end}")
        m = _CONTENT_RANGE.match(resp.headers.get("content-range", ""))
        if not m or (int(m.group(1)), int(m.group(2))) != (offset, end):
            raise CheckpointError(f"{shard}: Content-Range {resp.headers.get('content-range')!r} does not match "
                                  f"the requested bytes {offset}-{end}")
        total = int(m.group(3))
        if len(body) != length:
            raise CheckpointError(f"{shard}: short read: wanted {length} bytes at offset {offset}, "
                                  f"got {len(body)}")
        etag = resp.headers.get("etag")
        if shard not in self._etags:
            self._etags[shard] = etag
        elif etag != self._etags[shard]:
            raise CheckpointError(f"{shard}: the file changed while it was being read "
                                  f"(ETag {self._etags[shard]!r} became {etag!r})")
        if shard in self._sizes and total != self._sizes[shard]:
            raise CheckpointError(f"{shard}: size changed from {self._sizes[shard]} to {total} bytes")
        return body, total

    # -- the byte-access seam of Checkpoint ------------------------------------------------
    def _shard_size(self, shard: str) -> int:
        if shard not in self._sizes:
            data, total = self._ranged(shard, 0, 8)
            self._sizes[shard], self._prefix[shard] = total, data
        return self._sizes[shard]

    def _read_range(self, shard: str, offset: int, length: int) -> bytes:
        if offset == 0 and length == 8 and shard in self._prefix:
            return self._prefix[shard]
        cached = self._cached_header(shard, offset, length)
        if cached is not None:
            return cached
        data, total = self._ranged(shard, offset, length)
        self._sizes.setdefault(shard, total)
        if offset == 8 and self.cache_dir is not None:
            self._store_header(shard, length, data)
        return data

    def _cache_path(self, shard: str, length: int) -> Path | None:
        etag = self._etags.get(shard)
        if self.cache_dir is None or not etag:
            return None
        key = hashlib.sha256(f"{shard}\n{etag}\n{length}".encode()).hexdigest()
        return self.cache_dir / f"{key}.header"

    def _cached_header(self, shard: str, offset: int, length: int) -> bytes | None:
        path = self._cache_path(shard, length) if offset == 8 else None
        if path is not None and path.is_file():
            data = path.read_bytes()
            if len(data) == length:
                return data
        return None

    def _store_header(self, shard: str, length: int, data: bytes) -> None:
        path = self._cache_path(shard, length)
        if path is None:
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_bytes(data)
        os.replace(tmp, path)

    def _open(self, shard):  # local files only; every read above goes through HTTP
        raise CheckpointError(f"{shard}: remote shards are read with HTTP Range requests")

    def __repr__(self) -> str:
        return f"HttpCheckpoint({self.base!r}, shards={len(self.shards)}, revision={self.revision!r})"


class HttpFile(HttpCheckpoint):
    """One file behind an http(s) URL read by Range requests (a GGUF file), with the
    retries, size, Content-Range and ETag checks of ``HttpCheckpoint``; nothing else is
    fetched. ``size()`` is the file's size; ``read(offset, length)`` exactly those bytes.
    Raises ``CheckpointError`` as ``HttpCheckpoint`` does."""

    def __init__(self, url: str, token: str | None = None, retries: int = 4, backoff: float = 0.25,
                 timeout: float = 30.0, transport: httpx.BaseTransport | None = None, **_ignored):
        self.path = self.base = url
        self.revision = None
        self.retries, self.backoff = retries, backoff
        self.cache_dir = None
        self.requests = 0
        token = token or os.environ.get("HF_TOKEN")
        self._client = httpx.Client(timeout=timeout, follow_redirects=True, transport=transport,
                                    headers={"Authorization": f"Bearer {token}"} if token else {})
        self._headers, self._sizes, self._prefix, self._etags = {}, {}, {}, {}
        self.config, self._weight_map, self.shards = {}, None, [url]

    def _pin(self, resp: httpx.Response) -> None:  # the URL names the file (and its commit) already
        pass

    def size(self) -> int:
        """Total size of the file in bytes (one ranged read of its first 8 bytes)."""
        return self._shard_size(self.base)

    def read(self, offset: int, length: int) -> bytes:
        """Exactly ``length`` bytes at ``offset`` (one Range GET)."""
        return self._read_range(self.base, offset, length) if length else b""

    def __repr__(self) -> str:
        return f"HttpFile({self.base!r})"
