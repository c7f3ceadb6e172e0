"""Transports with real processes: agents' HTTP endpoints (JSON-RPC + binary frames), their iroh
endpoints (``moe/execute`` over QUIC) and the router following what holders advertise."""
from __future__ import annotations

import asyncio

import numpy as np
import pytest
from safetensors.numpy import load_file

from moe import wire
from moe.messages import BatchRequest
from moe.receipts import verify_receipt
from moe.transports import iroh
from tenzro_site.verify import max_rel_err
from tests.cluster_util import env_for, rpc, running_cluster
from tests.conftest import QWEN

pytestmark = pytest.mark.cluster


def test_forward_over_agent_http_endpoints_and_direct_execute(tmp_path):
    env = env_for(tmp_path)
    env["TENZRO_DATA_TRANSPORT"] = "http"
    ref = load_file(str(QWEN / "reference.safetensors"))
    x, want = ref["layer0.hidden_states"].astype(np.float32), ref["layer0.output"]
    with running_cluster(tmp_path, [QWEN], holders=3, env=env, extra=("--agent-http",)) as (info, _):
        res = rpc(info["rpc"], "tenzro_moeForward", {"model_id": "qwen3-moe-tiny", "layer": 0, "d_model": 256,
                                                     "carrier": "f32", "hidden_states": wire.b64encode(wire.encode_f32(x))})
        r = res["result"]
        assert r["transports"]["http"] == r["batches"] and r["transports"]["ws"] == 0
        assert r["receipts"] == r["batches"]
        assert max_rel_err(wire.decode_f32(wire.b64decode(r["outputs"], "outputs"), 256), want) <= 1e-5

        # A client talking JSON-RPC to a holder directly (reference §6.1 request, base64 Q8_0 rows).
        shard = rpc(info["rpc"], "tenzro_moeShardMap", {"model_id": "qwen3-moe-tiny"})["result"]
        h = next(h for h in shard["holders"] if h["layer"] == 0)
        holder = h["holders"][0]
        endpoint = holder["http_endpoint"]
        assert endpoint.startswith("http://127.0.0.1:") and endpoint.endswith("/rpc")
        rows = x[:5]
        q8 = wire.encode_rows(rows, "q8_0")
        direct = rpc(endpoint, "tenzro_moeExecute", {"request_id": "abc", "model_id": "qwen3-moe-tiny", "layer": 0,
                                                     "expert": h["expert"], "token_indices": [0, 1, 2, 3, 4],
                                                     "d_model": 256, "hidden_q8": wire.b64encode(q8)})["result"]
        out = wire.decode_rows(wire.b64decode(direct["outputs"], "outputs"), direct["output"], 256, 5)
        verify_receipt(direct["receipt"], provider=holder["provider"], request_id="abc", model_id="qwen3-moe-tiny",
                       layer=0, expert=h["expert"], tokens=[0, 1, 2, 3, 4], carrier_kind="q8_0", carrier=q8, rows=out)
        status = rpc(endpoint, "moe/status", {})["result"]
        assert status["provider"] == holder["provider"] and status["experts"]
        bad = rpc(endpoint, "tenzro_moeExecute", {"request_id": "x", "model_id": "qwen3-moe-tiny", "layer": 0,
                                                  "expert": h["expert"], "token_indices": [0], "d_model": 256,
                                                  "hidden_states": "!!"})
        assert bad["error"]["code"] == -32602
        assert rpc(endpoint, "nope", {})["error"]["code"] == -32601


def test_forward_over_agent_iroh_endpoints_and_direct_execute(tmp_path):
    env = env_for(tmp_path)
    env["TENZRO_DATA_TRANSPORT"] = "iroh"
    ref = load_file(str(QWEN / "reference.safetensors"))
    x, want = ref["layer0.hidden_states"].astype(np.float32), ref["layer0.output"]
    params = {"model_id": "qwen3-moe-tiny", "layer": 0, "d_model": 256, "carrier": "f32",
              "hidden_states": wire.b64encode(wire.encode_f32(x))}
    with running_cluster(tmp_path, [QWEN], holders=3, env=env, extra=("--agent-iroh",)) as (info, _):
        r = rpc(info["rpc"], "tenzro_moeForward", params)["result"]
        assert r["transports"]["iroh"] == r["batches"] and r["transports"]["ws"] == 0
        assert r["receipts"] == r["batches"] and not r["failures"]
        assert max_rel_err(wire.decode_f32(wire.b64decode(r["outputs"], "outputs"), 256), want) <= 1e-5
        # Every carrier crosses iroh (f16 rows used to be decoded as f32 and blamed on the holders);
        # a generation ("auto" = f16) runs on the holders, none of it on the site's fallback.
        for carrier in ("f16", "q8_0", "auto"):
            r = rpc(info["rpc"], "tenzro_moeForward", {**params, "carrier": carrier})["result"]
            assert r["transports"]["iroh"] == r["batches"] and not r["failures"], (carrier, r["failures"])
        g = rpc(info["rpc"], "tenzro_moeGenerate", {"model_id": "qwen3-moe-tiny", "input_ids": [1, 2, 3],
                                                    "max_new_tokens": 3, "fallback": False})["result"]["layers"]
        assert g["transports"].get("iroh", 0) == g["batches"] > 0 and not g["failures"], g

        # Every agent advertises its endpoint id (derived from its key) and a loopback address.
        providers = rpc(info["rpc"], "tenzro_moeListProviders", {})["result"]["providers"]
        assert len(providers) == 3
        for p in providers:
            assert len(p["iroh_endpoint_id"]) == 64 and p["iroh_addrs"][0].startswith("127.0.0.1:")

        # A client dialing a holder directly: the same rows and a receipt that verifies.
        p = providers[0]
        shard = rpc(info["rpc"], "tenzro_moeShardMap", {"model_id": "qwen3-moe-tiny"})["result"]
        expert = next(h["expert"] for h in shard["holders"] if h["layer"] == 0
                      and any(x["provider"] == p["provider"] for x in h["holders"]))
        req = BatchRequest("direct-1", "qwen3-moe-tiny", 0, expert, [0, 1, 2], "q8_0",
                           wire.encode_rows(x[:3], "q8_0"), "f32", 256)

        async def direct():
            client = iroh.IrohHolderClient(timeout=30, bind="127.0.0.1:0")
            try:
                return (await client.execute(p["iroh_endpoint_id"], p["iroh_addrs"], req),
                        await client.status(p["iroh_endpoint_id"], p["iroh_addrs"]))
            finally:
                await client.close()

        ans, status = asyncio.run(direct())
        verify_receipt(ans.receipt, provider=p["provider"], request_id="direct-1", model_id="qwen3-moe-tiny", layer=0,
                       expert=expert, tokens=[0, 1, 2], carrier_kind="q8_0", carrier=req.payload, rows=ans.rows)
        assert status["provider"] == p["provider"]

