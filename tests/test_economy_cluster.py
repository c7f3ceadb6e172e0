"""Receipts economy with real processes: a ``tenzro_cluster`` with one ``--fault corrupt:1`` agent.

With ``receipt_sample_one_in`` 1 (set by a governance proposal) every verified batch is kept;
the site's inline audits re-execute the cheat's batches on its own copy of the blobs and
uphold them; after 3 upheld disputes in a row the cheat is quarantined, the shard view drops
it, and later forwards equal the transformers reference again. Honest agents are never
penalized, and every forward is settled exactly once per holder.
"""
from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from safetensors.numpy import load_file

from moe import wire
from tests.cluster_util import env_for, rpc, rpc_served, running_cluster, wait_for
from tests.conftest import QWEN

pytestmark = pytest.mark.cluster

MODEL = "qwen3-moe-tiny"


def forward(info, x, layer):
    resp = rpc_served(info["rpc"], "tenzro_moeForward", {"model_id": MODEL, "layer": layer, "d_model": int(x.shape[1]),
                                                         "carrier": "f32",
                                                         "hidden_states": wire.b64encode(wire.encode_f32(x))})
    assert "result" in resp, resp
    return resp["result"]


def rel_err(out_b64, ref, d):
    out = wire.decode_f32(wire.b64decode(out_b64, "outputs"), d)
    return float(np.max(np.abs(out - ref)) / np.max(np.abs(ref)))


def test_cheat_is_sampled_audited_upheld_and_quarantined(tmp_path):
    env = env_for(tmp_path)
    # Split every expert with 2 or more tokens over both of its Warm replicas: the cheat then
    # serves part of every forward, whatever the router's latency ranking (on a loaded machine it
    # put the cheat's replicas behind honest ones, and it served 2 of 2,058 forwards in 300 s).
    env.update({"TENZRO_VIEW_CACHE": "0", "TENZRO_AUDIT_INTERVAL": "2", "TENZRO_PLAN_SPLIT_THRESHOLD": "1"})
    ref = load_file(str(QWEN / "reference.safetensors"))
    xs = {layer: ref[f"layer{layer}.hidden_states"].astype(np.float32) for layer in (0, 1)}
    with running_cluster(tmp_path, [QWEN], holders=4, env=env, extra=("--agent-fault", "1=corrupt:1")) as (info, _):
        url, tok = info["rpc"], info["operator_token"]
        cheat = info["agents"][1]["provider"]
        assert info["agents"][1]["fault"] == "corrupt:1"
        honest = [a["provider"] for a in info["agents"] if a["provider"] != cheat]
        prop = rpc(url, "tenzro_moeCreateProposal", {"title": "keep every receipt",
                                                     "changes": {"receipt_sample_one_in": 1}}, tok)["result"]
        rpc(url, "tenzro_moeVoteProposal", {"proposal_id": prop["id"], "approve": True}, tok)
        assert rpc(url, "tenzro_moeReplicationPolicy", {})["result"]["receipt_sample_one_in"] == 1

        def providers():
            return {p["provider"]: p for p in rpc(url, "tenzro_moeListProviders", {})["result"]["providers"]}

        def quarantined():
            return providers()[cheat]["quarantined_until_ms"] > time.time() * 1000

        def kept_lies():
            return rpc(url, "tenzro_moeListReceipts", {"provider": cheat, "limit": 1000})["result"]["count"]

        # Forward both layers until 3 of the cheat's batches are kept (every one is a lie, and 3
        # upheld in a row quarantine), then stop adding work and wait for the audits. Forwarding
        # on until the quarantine (as this test did) grew the audit backlog with every forward on
        # a loaded machine: hundreds of forwards, past the 1,000 rows the settlement check lists.
        forwards: list[dict] = []
        deadline = time.time() + 300
        while kept_lies() < 3:
            assert time.time() < deadline, (f"3 of the cheat's batches were not kept after {len(forwards)} forwards "
                                             f"(served in {sum(cheat in f['holders'] for f in forwards)})")
            with ThreadPoolExecutor(2) as pool:  # both layers at once
                forwards += pool.map(lambda layer: forward(info, xs[layer], layer), (0, 1))
        wait_for(quarantined, 300, "the cheat quarantined once its kept lies were audited")
        first = forwards[:2]
        assert all(r["forward_id"] for r in first) and first[0]["forward_id"] != first[1]["forward_id"]
        assert any(cheat in f["holders"] for f in forwards)
        upheld = rpc(url, "tenzro_moeListDisputes", {"upheld": True})["result"]["disputes"]
        assert len(upheld) >= 3 and {d["provider"] for d in upheld} == {cheat}
        assert all(d["proof"]["body"]["provider"] == cheat and d["executed_by"] != cheat for d in upheld)
        kept = rpc(url, "tenzro_moeListReceipts", {"provider": cheat, "limit": 1000})["result"]
        assert kept["count"] >= 3 and all(r["forward_id"] in {f["forward_id"] for f in forwards}
                                          for r in kept["receipts"])
        shard = rpc(url, "tenzro_moeShardMap", {"model_id": MODEL})["result"]
        assert all(h["provider"] != cheat for e in shard["holders"] for h in e["holders"])

        for layer in (0, 1):  # later forwards: the cheat is routed around, results exact again
            res = forward(info, xs[layer], layer)
            assert cheat not in res["holders"]
            assert rel_err(res["outputs"], ref[f"layer{layer}.output"], xs[layer].shape[1]) <= 1e-5

        wait_for(lambda: rpc(url, "tenzro_moeListReceipts", {"limit": 1000})["result"]["receipts"]
                 and all(r["dispute"] for r in rpc(url, "tenzro_moeListReceipts", {"limit": 1000})["result"]
                         ["receipts"]), 300, "not every kept receipt was audited")
        rejected = rpc(url, "tenzro_moeListDisputes", {"upheld": False})["result"]["disputes"]
        assert rejected and all(d["provider"] in honest for d in rejected)
        assert not [d for d in rpc(url, "tenzro_moeListDisputes", {"upheld": True, "limit": 1000})["result"]
                    ["disputes"] if d["provider"] != cheat]
        prov = providers()
        assert all(prov[h]["reputation"] >= 500 and prov[h]["quarantined_until_ms"] == 0 for h in honest)

        settled = rpc(url, "tenzro_moeListSettlements", {"forward_id": first[0]["forward_id"]})["result"]
        assert sorted(s["provider"] for s in settled["settlements"]) == sorted(first[0]["holders"])
        assert all(s["holder_amount"] > 0 and s["gross"] == s["holder_amount"] + s["network_fee"]
                   for s in settled["settlements"])
        # Settlement credits balances (and nothing else does), after each forward in the
        # background: once the last forwards are settled the balances sum to the settled amounts
        # (read at two instants, so poll); a double credit would never agree.
        sums = []

        def balances_equal_settled():
            listed = rpc(url, "tenzro_moeListSettlements", {"limit": 1})["result"]
            sums[:] = [sum(p["balance"] for p in providers().values()), listed["holder_amount_total"],
                       listed["total"]]
            return sums[0] == sums[1]

        try:
            wait_for(balances_equal_settled, 120, "balances equal to the settled amounts")
        except AssertionError as exc:
            raise AssertionError(f"{exc}: balances {sums[0]}, settled {sums[1]} in {sums[2]} settlements "
                                 f"after {len(forwards)} forwards") from None
