"""Ranged reads of a checkpoint over HTTP, against a local HTTP server serving a fixture."""
from __future__ import annotations

import re
import threading
from functools import partial
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest

from prepare.checkpoint import Checkpoint

from moe.codec import CheckpointError
from prepare.layouts import load_expert, load_gate, spec_from_config
from prepare.remote import HttpCheckpoint, open_checkpoint
from tests.conftest import DEEPSEEK, QWEN


class RangeHandler(SimpleHTTPRequestHandler):
    """Static files with single-range ``Range`` support, an ETag, and fault injection."""

    server_version = "RangeTest/1"

    def log_message(self, *args):
        pass

    def do_GET(self):
        st = self.server.state
        st["log"].append((self.path, self.headers.get("Range")))
        if st["fail"] > 0:
            st["fail"] -= 1
            self.send_error(503)
            return
        path = self.translate_path(self.path)
        try:
            data = open(path, "rb").read()
        except OSError:
            self.send_error(404)
            return
        rng = self.headers.get("Range")
        m = re.match(r"bytes=(\d+)-(\d+)$", rng or "")
        if m is None or st["ignore_range"]:
            self._send(200, data, len(data))
            return
        a, b = int(m.group(1)), min(int(m.group(2)), len(data) - 1)
        body = data[a:b + 1]
        if st["truncate"]:
            body = body[:-1]
        self._send(206, body, len(data), f"bytes {a}-{b}/{len(data)}")

    def _send(self, status, body, total, content_range=None):
        self.server.state["bytes"] += len(body)
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("ETag", f'"{self.server.state["etag"]}"')
        if content_range:
            self.send_header("Content-Range", content_range)
        self.end_headers()
        self.wfile.write(body)


@pytest.fixture
def server():
    root = QWEN.parent
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), partial(RangeHandler, directory=str(root)))
    httpd.state = {"log": [], "bytes": 0, "fail": 0, "ignore_range": False, "truncate": False, "etag": "v1"}
    t = threading.Thread(target=httpd.serve_forever, daemon=True)
    t.start()
    yield httpd, f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


@pytest.mark.parametrize("fixture", [QWEN, DEEPSEEK], ids=["single-file", "sharded"])
def test_http_extraction_equals_local_and_reads_only_needed_bytes(server, fixture, tmp_path):
    httpd, url = server
    remote = open_checkpoint(f"{url}/{fixture.name}/", cache_dir=tmp_path / "hdr")
    assert isinstance(remote, HttpCheckpoint)
    local = Checkpoint(fixture)
    spec = spec_from_config(remote.config)
    layer = spec.moe_layers()[-1]
    before = httpd.state["bytes"]
    w_r, w_l = load_expert(remote, spec, layer, 3), load_expert(local, spec, layer, 3)
    for p in ("gate_proj", "up_proj", "down_proj"):
        np.testing.assert_array_equal(getattr(w_r, p), getattr(w_l, p))
    np.testing.assert_array_equal(load_gate(remote, spec, layer).weight, load_gate(local, spec, layer).weight)
    served = httpd.state["bytes"] - before
    tensor_bytes = sum(local.location(n)[2] for n in spec.expert_tensor_names(layer, 3).values())
    header_bytes = sum(8 + len(local.header(s).tensors) * 200 for s in local.shards)
    assert served < tensor_bytes + header_bytes + 4 * spec.num_experts * spec.hidden_size
    assert served < min(s.stat().st_size for s in local.shards) or len(local.shards) > 1
    assert all(r is not None for path, r in httpd.state["log"] if path.endswith(".safetensors"))
    # a second checkpoint object reads headers from the disk cache: only 8-byte probes and tensors
    again = HttpCheckpoint(f"{url}/{fixture.name}/", cache_dir=tmp_path / "hdr")
    httpd.state["log"].clear()
    load_expert(again, spec, layer, 3)
    sizes = [int(r.split("-")[1]) - int(r.split("=")[1].split("-")[0]) + 1 for p, r in httpd.state["log"] if r]
    assert all(sz == 8 or sz == 2 * spec.moe_intermediate_size * spec.hidden_size for sz in sizes)


def test_retries_with_backoff_then_success(server):
    httpd, url = server
    httpd.state["fail"] = 2
    ck = HttpCheckpoint(f"{url}/{QWEN.name}", backoff=0.01)
    assert ck.config["model_type"] == "qwen3_moe"
    assert ck.requests >= 3
    httpd.state["fail"] = 10
    with pytest.raises(CheckpointError, match=r"failed after 3 attempts \(HTTP 503\)"):
        HttpCheckpoint(f"{url}/{QWEN.name}", retries=2, backoff=0.0)


def test_refuses_servers_that_ignore_range_truncate_or_change(server):
    httpd, url = server
    spec = spec_from_config(Checkpoint(QWEN).config)
    httpd.state["ignore_range"] = True
    with pytest.raises(CheckpointError, match="ignored the Range header"):
        load_gate(HttpCheckpoint(f"{url}/{QWEN.name}"), spec, 0)
    httpd.state["ignore_range"], httpd.state["truncate"] = False, True
    with pytest.raises(CheckpointError, match="short read"):
        load_gate(HttpCheckpoint(f"{url}/{QWEN.name}"), spec, 0)
    httpd.state["truncate"] = False
    ck = HttpCheckpoint(f"{url}/{QWEN.name}")
    load_gate(ck, spec, 0)
    httpd.state["etag"] = "v2"
    with pytest.raises(CheckpointError, match="changed while it was being read"):
        load_expert(ck, spec, 0, 1)
    with pytest.raises(CheckpointError, match="HTTP 404"):
        HttpCheckpoint(f"{url}/no_such_checkpoint")
    with pytest.raises(CheckpointError, match="revision is only understood"):
        HttpCheckpoint(f"{url}/{QWEN.name}", revision="main")


def test_hub_urls_pin_the_revision_to_the_reported_commit():
    import httpx

    commit = "a" * 40
    seen = []
    cfg = (QWEN / "config.json").read_bytes()

    def handler(request: httpx.Request):
        seen.append(str(request.url))
        if request.url.path.endswith("config.json"):
            return httpx.Response(200, content=cfg, headers={"X-Repo-Commit": commit})
        return httpx.Response(404)

    ck = HttpCheckpoint("https://huggingface.co/org/repo", transport=httpx.MockTransport(handler))
    assert seen[0] == "https://huggingface.co/org/repo/resolve/main/config.json"
    assert seen[1] == f"https://huggingface.co/org/repo/resolve/{commit}/model.safetensors.index.json"
    assert ck.revision == commit and ck.shards == [f"https://huggingface.co/org/repo/resolve/{commit}/model.safetensors"]


@pytest.mark.parametrize("declared", [True, False], ids=["content-length", "chunked"])
def test_a_206_longer_than_the_range_is_refused_without_buffering_it(declared):
    import httpx

    cfg = (QWEN / "config.json").read_bytes()
    pulled = []
    mib = 1 << 20

    class Huge(httpx.SyncByteStream):
        """400 MiB, produced lazily: ``pulled`` counts the MiB the client actually read."""

        def __iter__(self):
            for _ in range(400):
                pulled.append(1)
                yield bytes(mib)

    def handler(request: httpx.Request):
        if request.url.path.endswith("config.json"):
            return httpx.Response(200, content=cfg)
        if request.url.path.endswith(".json"):
            return httpx.Response(404)
        headers = {"Content-Range": "bytes 0-7/1000"}
        if declared:
            headers["Content-Length"] = str(400 * mib)
        return httpx.Response(206, headers=headers, stream=Huge())

    ck = HttpCheckpoint("http://ckpt.test/m", transport=httpx.MockTransport(handler), retries=0)
    with pytest.raises(CheckpointError, match="asked for"):
        ck._shard_size(ck.shards[0])
    assert len(pulled) <= 1  # stopped at the first chunk past the 8 requested bytes, not after 400 MiB
