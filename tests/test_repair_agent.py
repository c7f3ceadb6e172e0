"""The agent's repair decisions on bad input: each bad row is declined with a recorded reason
and nothing else changes (the runtime holds nothing new)."""
from __future__ import annotations

import hashlib

import numpy as np

from moe.blobs import BlobStore, blob_hash
from moe.ffn import ExpertWeights
from holders.repair import RepairWorker
from moe.runtime import ExpertRuntime
from moe.placement import RepairRow, plan_release, view_from_map
from moe.shardmap import HoldingInfo, ProviderInfo, ShardView

ME = hashlib.sha256(b"me").hexdigest()
PEER = hashlib.sha256(b"peer").hexdigest()
DEAD = "http://127.0.0.1:9"  # discard port: nothing listens


def expert_blob(seed=0, h=64, f=32) -> bytes:
    rng = np.random.default_rng(seed)
    return ExpertWeights(rng.standard_normal((f, h), dtype=np.float32), rng.standard_normal((f, h), dtype=np.float32),
                         rng.standard_normal((h, f), dtype=np.float32)).to_blob()


def worker(tmp_path, budget=1 << 30) -> RepairWorker:
    rt = ExpertRuntime(budget, tmp_path / "tier")
    return RepairWorker(DEAD, ME, rt, BlobStore(tmp_path / "blobs"), http_timeout=2)


def row(uri, expert=0):
    return RepairRow("m", 0, expert, ME, uri, 1)


def test_pull_accepts_a_verified_blob(tmp_path):
    w = worker(tmp_path)
    data = expert_blob()
    h = w.store.put(data)
    out = {"accepted": [], "declined": [], "fetched_bytes": 0}
    w._pull(row(f"tenzro://blob/{h}"), None, [DEAD], None, out)
    assert out["accepted"][0]["bytes"] == len(data) and out["fetched_bytes"] == len(data)
    assert w.runtime.has("m", 0, 0) and w.runtime.holdings()[0]["blob_uri"] == f"tenzro://blob/{h}"


def test_unreachable_source_hash_mismatch_and_no_source_are_declined(tmp_path):
    import httpx

    w = worker(tmp_path)
    data = expert_blob()
    wrong = blob_hash(data + b"x")
    # The local copy under a wrong name is corrupt: dropped, then no endpoint serves it.
    w.store.path(wrong).parent.mkdir(parents=True, exist_ok=True)
    w.store.path(wrong).write_bytes(data)
    out = {"accepted": [], "declined": [], "fetched_bytes": 0}
    with httpx.Client(timeout=2) as client:
        w._pull(row(f"tenzro://blob/{wrong}"), None, [DEAD], client, out)
        w._pull(row(None, expert=1), None, [DEAD], client, out)
    reasons = [d["reason"] for d in out["declined"]]
    assert "no endpoint served it" in reasons[0] and "no blob source" in reasons[1]
    assert out["accepted"] == [] and w.runtime.holdings() == [] and not w.store.has(wrong)


def test_blob_over_the_free_budget_is_declined(tmp_path):
    w = worker(tmp_path, budget=1000)
    h = w.store.put(expert_blob())
    out = {"accepted": [], "declined": [], "fetched_bytes": 0}
    w._pull(row(f"tenzro://blob/{h}"), None, [DEAD], None, out)
    assert "does not fit the free memory budget" in out["declined"][0]["reason"]
    assert w.runtime.holdings() == []


def test_own_pass_without_site_uses_last_map_and_declines_foreign_offers(tmp_path):
    w = worker(tmp_path)
    out = w.run_pass({"rows": [{"model_id": "m", "layer": 0, "expert": 3, "provider": ME, "blob_uri": None}],
                      "models": ["m"], "interval_s": 5, "max_repairs": 2})
    assert out["declined"][0]["reason"].startswith("not in this agent's plan") and w.interval_s == 5


def test_view_from_map_round_trip_and_release_rule():
    infos = [ProviderInfo(provider=p, holdings=(HoldingInfo("m", 0, 0, "Warm", 0, None),
                                                HoldingInfo("m", 0, 1, "Warm", 0, None)))
             for p in (ME, PEER, hashlib.sha256(b"third").hexdigest())]
    view = ShardView.build("m", infos, expected=[(0, 0), (0, 1)])
    again = view_from_map(view.to_json())
    assert again.to_json()["holders"] == view.to_json()["holders"]
    rel = plan_release(view)
    assert len(rel) == 2 and all(r.target == 2 and r.replication == 3 for r in rel)  # one surplus per expert
