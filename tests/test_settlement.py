"""Receipts economy in process: sampling, kept records, settlement exactly once, disputes
(honest, lying, tampered store, no executor), quarantine in the shard view, RPC errors."""
from __future__ import annotations

import hashlib
import uuid
from collections import Counter

import numpy as np
import pytest
from asgiref.sync import async_to_sync
from django.conf import settings
from django.test import Client
from nacl.signing import SigningKey

from moe.blobs import BlobStore
from moe.faults import FaultInjector, parse_fault
from moe.ffn import ExpertWeights, expert_forward
from router.forward import BatchRequest, VerifiedBatch
from router.hooks import ForwardRecord
from moe import wire
from moe.receipts import make_receipt
from registry.governance import current_policy
from moe.identity import provider_id, verify_body
from registry.models import Provider
from registry.operator import operator_token
from registry.selectors import live_providers
from settlement import selectors, services
from settlement.audit import is_sampled
from settlement.models import Dispute, ReceiptSample, Settlement

pytestmark = pytest.mark.django_db

H, F = 64, 32


def weights(seed=0) -> ExpertWeights:
    rng = np.random.default_rng(seed)
    return ExpertWeights(rng.standard_normal((F, H), dtype=np.float32) * 0.1,
                         rng.standard_normal((F, H), dtype=np.float32) * 0.1,
                         rng.standard_normal((H, F), dtype=np.float32) * 0.1)


@pytest.fixture
def blob():
    w = weights()
    h = BlobStore(settings.TENZRO["BLOB_DIR"]).put(w.to_blob())
    return w, h


def holder(key: SigningKey, **kw) -> Provider:
    from django.utils import timezone

    return Provider.objects.create(provider=provider_id(key), connected=True, last_heartbeat=timezone.now(), **kw)


def batch(key, w, h, *, lie=False, tokens=(0, 1, 2, 3), carrier="f32", output="f32", expert=3, seed=1):
    x = np.random.default_rng(seed).standard_normal((len(tokens), H), dtype=np.float32)
    payload = wire.encode_rows(x, carrier)
    rows = expert_forward(w, wire.decode_rows(payload, carrier, H, len(tokens)))
    if lie:
        rows = FaultInjector(parse_fault("corrupt:1")).corrupt(rows)
    rows = wire.decode_rows(wire.encode_rows(rows, output), output, H, len(tokens), "outputs")
    rid = uuid.uuid4().hex
    receipt = make_receipt(key, request_id=rid, model_id="m", layer=0, expert=expert, tokens=list(tokens),
                           carrier_kind=carrier, carrier=payload, rows=rows, blob_hash=h, quant="f32")
    req = BatchRequest(rid, "m", 0, expert, list(tokens), carrier, payload, output, H)
    return VerifiedBatch(provider_id(key), req, receipt, rows)


def record(*batches) -> ForwardRecord:
    return ForwardRecord(uuid.uuid4().hex, "m", 0, list(batches))


def test_sampling_is_keyed_by_the_secret_and_hits_one_in_n():
    commits = [hashlib.sha256(str(i).encode()).hexdigest() for i in range(20_000)]
    a = sum(is_sampled(b"a" * 32, c, 64) for c in commits)
    b = [is_sampled(b"b" * 32, c, 64) for c in commits]
    assert 200 < a < 430  # 20000/64 = 312.5, ±6σ
    assert [is_sampled(b"a" * 32, c, 64) for c in commits] != b  # another secret keeps other batches
    assert all(is_sampled(b"x", c, 1) for c in commits[:50])
    with pytest.raises(ValueError):
        is_sampled(b"x", commits[0], 0)


def test_router_secret_is_created_once_and_stable(monkeypatch):
    monkeypatch.delenv("TENZRO_ROUTER_SECRET", raising=False)
    s1 = services.router_secret()
    assert len(s1) == 32 and services.router_secret() == s1


def test_record_keeps_exact_carrier_and_commitment_rows_and_settles_exactly_once(blob):
    w, h = blob
    key = SigningKey.generate()
    holder(key, price_per_input_token=7, minimum_price=20)
    b1, b2 = batch(key, w, h, seed=1), batch(key, w, h, tokens=(4, 5), seed=2)
    rec = record(b1, b2)
    out = services.record_forward(rec, one_in=1)
    assert len(out["samples"]) == 2
    s = ReceiptSample.objects.get(request_id=b1.request.request_id)
    assert bytes(s.carrier_inline) == b1.request.payload and s.forward_id == rec.forward_id
    assert hashlib.sha256(bytes(s.commitment_rows)).hexdigest() == b1.receipt["commitment"]
    got = selectors.get_receipt(s.key)
    assert got["header"]["blob_hash"] == h and len(got["commitment_rows"]) == 4
    assert len(got["commitment_rows"][0]["features"]) == 8

    services.record_forward(rec, one_in=1)  # a replayed record changes nothing
    assert ReceiptSample.objects.count() == 2 and Settlement.objects.count() == 1
    rep0 = Provider.objects.get(provider=provider_id(key)).reputation
    assert services.settle_forward(rec.forward_id) == 1
    assert services.settle_forward(rec.forward_id) == 0  # retried task
    assert services.settle_pending() == 0  # beat sweep
    st = Settlement.objects.get()
    share = current_policy().settlement_holder_share_bps
    gross = max(6 * 7, 20)
    assert (st.tokens, st.batches, st.gross, st.holder_amount, st.network_fee) == \
        (6, 2, gross, gross * share // 10000, gross - gross * share // 10000)
    digest = hashlib.sha256(bytes.fromhex(b1.receipt["commitment"]) + bytes.fromhex(b2.receipt["commitment"]))
    assert st.commitments_digest == digest.hexdigest()
    p = Provider.objects.get(provider=provider_id(key))
    assert p.balance == st.holder_amount and p.reputation == rep0 + 1
    lst = selectors.list_settlements(forward_id=rec.forward_id)
    assert lst["count"] == 1 and lst["settlements"][0]["holder_amount"] == st.holder_amount
    assert (lst["total"], lst["holder_amount_total"]) == (1, st.holder_amount)


def test_settle_many_pays_each_row_its_own_price_exactly_once():
    """Rows of two holders at several prices (under and over the minimum) settled in one call:
    each row gets its own gross, each holder the sum and +1 reputation per row; a second call
    pays nothing."""
    a, b = SigningKey.generate(), SigningKey.generate()
    holder(a, price_per_input_token=7, minimum_price=20)
    holder(b, price_per_input_token=3, minimum_price=50)
    rep = {k: Provider.objects.get(provider=provider_id(k)).reputation for k in (a, b)}
    tokens = {a: [1, 2, 2, 5, 9, 9], b: [4, 17, 30, 4]}
    rows = [Settlement.objects.create(forward_id=uuid.uuid4().hex, provider=provider_id(k), model_id="m", tokens=t,
                                      batches=1, commitments_digest="0" * 64, created_ms=1)
            for k, ts in tokens.items() for t in ts]
    assert services.settle_many([r.pk for r in rows]) == len(rows)
    assert services.settle_many([r.pk for r in rows]) == 0
    share = current_policy().settlement_holder_share_bps
    for k, (ppt, mp) in ((a, (7, 20)), (b, (3, 50))):
        got = sorted((s.tokens, s.gross, s.holder_amount, s.network_fee, s.state)
                     for s in Settlement.objects.filter(provider=provider_id(k)))
        want = sorted((t, g, g * share // 10000, g - g * share // 10000, Settlement.State.SETTLED)
                      for t in tokens[k] for g in [max(t * ppt, mp)])
        assert got == want
        p = Provider.objects.get(provider=provider_id(k))
        assert p.balance == sum(w[2] for w in want) and p.reputation == rep[k] + len(tokens[k])
        # The listing's totals cover every matching row, not only the ones a limit of 1 lists.
        lst = selectors.list_settlements(provider=provider_id(k), limit=1)
        assert (lst["count"], lst["total"], lst["holder_amount_total"]) == (1, len(want), p.balance)


def test_minimum_price_and_reputation_cap(blob):
    w, h = blob
    key = SigningKey.generate()
    holder(key, reputation=1000)
    rec = record(batch(key, w, h, tokens=(0,)))
    services.record_forward(rec, one_in=10**9)
    services.settle_forward(rec.forward_id)
    st = Settlement.objects.get()
    assert st.gross == 100  # max(1 × 10, 100)
    assert Provider.objects.get(provider=provider_id(key)).reputation == 1000


def test_sampling_rate_off_keeps_nothing_but_still_settles(blob):
    w, h = blob
    key = SigningKey.generate()
    holder(key)
    rec = record(*[batch(key, w, h, seed=i) for i in range(5)])
    out = services.record_forward(rec, one_in=2**30)
    assert out["samples"] == [] and Settlement.objects.filter(forward_id=rec.forward_id).count() == 1


def test_honest_dispute_passes_and_is_returned_again_without_penalty(blob):
    w, h = blob
    key = SigningKey.generate()
    holder(key)
    for carrier, output in (("f32", "f32"), ("q8_0", "bf16")):
        b = batch(key, w, h, carrier=carrier, output=output)
        services.record_forward(record(b), one_in=1)
        k = ReceiptSample.objects.get(request_id=b.request.request_id).key
        res = async_to_sync(services.dispute)(k)
        assert res["disputed"] is False and res["verification"]["pass"], res
        assert res["executed_by"] == "site" and res["proof"] is None
        assert res["verification"]["rows_passed"] == 4
    assert Provider.objects.get(provider=provider_id(key)).reputation == 500
    again = async_to_sync(services.dispute)(k)
    assert again["created_ms"] == res["created_ms"] and Dispute.objects.count() == 2


def test_lies_are_upheld_with_a_signed_proof_and_three_in_a_row_quarantine(blob):
    w, h = blob
    key = SigningKey.generate()
    honest = SigningKey.generate()
    holder(key)
    holder(honest)
    pid = provider_id(key)
    keys = []
    for i in range(3):
        b = batch(key, w, h, lie=True, seed=10 + i)
        services.record_forward(record(b), one_in=1)
        keys.append(ReceiptSample.objects.get(request_id=b.request.request_id).key)
    r0 = async_to_sync(services.dispute)(keys[0])
    assert r0["disputed"] is True and not r0["verification"]["pass"]
    assert r0["verification"]["failing_rows"]
    proof = r0["proof"]
    verify_body(proof["signer"], services.DOMAIN_FRAUD_PROOF, proof["body"], proof["signature"])
    assert proof["body"]["receipt"]["signature"] == ReceiptSample.objects.get(key=keys[0]).receipt["signature"]
    assert Provider.objects.get(provider=pid).reputation == 485
    assert async_to_sync(services.dispute)(keys[0])["proof"] == proof  # no second penalty
    assert Provider.objects.get(provider=pid).reputation == 485
    assert pid in set(live_providers().values_list("provider", flat=True))
    async_to_sync(services.dispute)(keys[1])
    r2 = async_to_sync(services.dispute)(keys[2])
    p = Provider.objects.get(provider=pid)
    assert p.reputation == 455 and r2["quarantined_until_ms"] > services.now_ms() + 250_000
    live = set(live_providers().values_list("provider", flat=True))
    assert pid not in live and provider_id(honest) in live
    assert Provider.objects.get(provider=provider_id(honest)).reputation == 500
    d = selectors.list_disputes(provider=pid, upheld=True)
    assert d["count"] == 3 and all(x["proof"] for x in d["disputes"])
    assert selectors.list_receipts(provider=pid)["receipts"][0]["dispute"] == "upheld"


def test_an_honest_reexecution_clears_the_streak(blob):
    w, h = blob
    key = SigningKey.generate()
    holder(key)
    seq = [True, True, False, True, True]
    for i, lie in enumerate(seq):
        b = batch(key, w, h, lie=lie, seed=20 + i)
        services.record_forward(record(b), one_in=1)
        async_to_sync(services.dispute)(ReceiptSample.objects.get(request_id=b.request.request_id).key)
    p = Provider.objects.get(provider=provider_id(key))
    assert p.quarantined_until_ms == 0 and p.dispute_streak == 2 and p.reputation == 500 - 4 * 15


def test_tampered_store_cannot_make_a_proof(blob):
    w, h = blob
    key = SigningKey.generate()
    holder(key)
    b = batch(key, w, h)
    services.record_forward(record(b), one_in=1)
    s = ReceiptSample.objects.get(request_id=b.request.request_id)
    rows = bytearray(s.commitment_rows)
    rows[-20] ^= 0xFF
    ReceiptSample.objects.filter(pk=s.pk).update(commitment_rows=bytes(rows))
    with pytest.raises(services.EconomyError, match="does not verify"):
        async_to_sync(services.dispute)(s.key)
    assert not Dispute.objects.exists() and Provider.objects.get(provider=provider_id(key)).reputation == 500


def test_unknown_key_and_no_executor_are_clear_errors(blob):
    w, _ = blob
    key = SigningKey.generate()
    holder(key)
    with pytest.raises(services.EconomyError, match="no kept receipt"):
        async_to_sync(services.dispute)("moe_receipt:nope")
    b = batch(key, w, "ab" * 32)  # a blob hash nobody has
    services.record_forward(record(b), one_in=1)
    k = ReceiptSample.objects.get(request_id=b.request.request_id).key
    with pytest.raises(services.EconomyError) as exc:
        async_to_sync(services.dispute)(k)
    assert exc.value.code == -32004 and "tenzro://blob/" + "ab" * 32 in exc.value.message
    assert not Dispute.objects.exists()
    assert async_to_sync(services.audit)(k) is None
    assert ReceiptSample.objects.get(key=k).audit_state == "skipped"


def test_audit_pending_audits_each_sample_once(blob):
    w, h = blob
    key = SigningKey.generate()
    holder(key)
    services.record_forward(record(batch(key, w, h, lie=True), batch(key, w, h, seed=3)), one_in=1)
    assert async_to_sync(services.audit_pending)() == 2
    assert async_to_sync(services.audit_pending)() == 0
    assert Counter(Dispute.objects.values_list("upheld", flat=True)) == Counter({True: 1, False: 1})


def test_audit_many_writes_what_one_by_one_disputes_write(blob):
    """A flush's audits in one hop and one transaction (``audit_many``) give each sample the
    outcome, proof, reputation after and quarantine that disputing them one at a time in the
    same order gives; unknown, already disputed and unrunnable keys are handled as ``audit``."""
    w, h = blob
    lies = [True, False, True, True, True, False]  # the streak: 1, 0, 1, 2, 3 -> quarantine, 0

    def scene(tag: int):
        key = SigningKey.generate()
        holder(key)
        keys = []
        for i, lie in enumerate(lies):
            b = batch(key, w, h, lie=lie, seed=40 + i)
            services.record_forward(record(b), one_in=1)
            keys.append(ReceiptSample.objects.get(request_id=b.request.request_id).key)
        gone = batch(key, w, "cd" * 32, seed=60 + tag)  # a blob no executor holds: skipped
        services.record_forward(record(gone), one_in=1)
        keys.append(ReceiptSample.objects.get(request_id=gone.request.request_id).key)
        return provider_id(key), keys

    def outcome(pid, keys):
        rows = [Dispute.objects.filter(sample__key=k).values_list("upheld", "reputation_after", "automatic").first()
                for k in keys]
        p = Provider.objects.get(provider=pid)
        return rows, (p.reputation, p.dispute_streak, p.quarantined_until_ms > 0), \
            [ReceiptSample.objects.get(key=k).audit_state for k in keys]

    one_pid, one_keys = scene(0)
    for k in one_keys:
        async_to_sync(services.audit)(k)
    many_pid, many_keys = scene(1)
    async_to_sync(services.dispute)(many_keys[0], automatic=True)  # already disputed: left as it is
    assert async_to_sync(services.audit_many)(many_keys + ["moe_receipt:nope"]) == len(lies) - 1
    assert outcome(many_pid, many_keys) == outcome(one_pid, one_keys)
    rows, (rep, streak, quarantined), states = outcome(many_pid, many_keys)
    assert [r[0] if r else None for r in rows] == lies + [None] and quarantined and rep == 500 - 4 * 15
    assert states[-1] == "skipped" and set(states[:-1]) == {"done"}
    upheld = Dispute.objects.filter(sample__key__in=many_keys, upheld=True)
    assert all(verify_body(d.proof["signer"], services.DOMAIN_FRAUD_PROOF, d.proof["body"], d.proof["signature"])
               is None for d in upheld)
    assert async_to_sync(services.audit_many)(many_keys) == 0  # every key disputed or skipped: nothing again


def test_audit_many_meeting_a_concurrent_dispute_penalizes_once(blob):
    """A dispute written between ``audit_many``'s read and its transaction (an operator's
    ``tenzro_moeDisputeReceipt``) fails the batch's transaction; each sample is then written on
    its own and the stored outcome wins: the lie costs one penalty, not two."""
    w, h = blob
    key = SigningKey.generate()
    holder(key)
    bs = [batch(key, w, h, lie=True, seed=70), batch(key, w, h, seed=71)]
    services.record_forward(record(*bs), one_in=1)
    keys = [ReceiptSample.objects.get(request_id=b.request.request_id).key for b in bs]
    samples, carriers, policy = services._audit_inputs(keys)
    done = [(s, *async_to_sync(services._rerun)(s, carriers[s.key], policy)) for s in samples]
    first = async_to_sync(services.dispute)(keys[0])  # the concurrent one
    disputes = services._apply_outcomes(done, [], policy)
    assert [d.upheld for d in disputes] == [True, False] and disputes[0].created_ms == first["created_ms"]
    assert Dispute.objects.count() == 2 and Provider.objects.get(provider=provider_id(key)).reputation == 485


def rpc(method, params, token=None):
    headers = {"HTTP_AUTHORIZATION": f"Bearer {token}"} if token else {}
    return Client().post("/rpc", {"jsonrpc": "2.0", "id": 1, "method": method, "params": params},
                         content_type="application/json", **headers).json()


@pytest.mark.django_db(transaction=True)
def test_rpc_and_rest_surfaces_and_bad_input(blob):
    w, h = blob
    key = SigningKey.generate()
    holder(key)
    b = batch(key, w, h)
    rec = record(b)
    services.record_forward(rec, one_in=1)
    services.settle_forward(rec.forward_id)
    k = ReceiptSample.objects.get().key
    r = rpc("tenzro_moeListReceipts", {"model_id": "m", "limit": 5})["result"]
    assert r["count"] == 1 and r["receipts"][0]["forward_id"] == rec.forward_id and r["receipts"][0]["dispute"] is None
    assert rpc("tenzro_moeListReceipts", {"limit": 0})["error"]["data"]["field"] == "limit"
    assert rpc("tenzro_moeListReceipts", {"limit": 1001})["error"]["code"] == -32602
    assert rpc("tenzro_moeListReceipts", {"before": "nope"})["error"]["data"]["field"] == "before"
    assert rpc("tenzro_moeGetReceipt", {"key": "nope"})["error"]["code"] == -32004
    assert rpc("tenzro_moeDisputeReceipt", {"key": k})["error"]["code"] == -32001
    assert not Dispute.objects.exists()
    d = rpc("tenzro_moeDisputeReceipt", {"key": k}, operator_token())["result"]
    assert d["disputed"] is False
    assert rpc("tenzro_moeListDisputes", {"upheld": False})["result"]["count"] == 1
    s = rpc("tenzro_moeListSettlements", {"provider": provider_id(key)})["result"]
    assert s["count"] == 1 and s["settlements"][0]["tokens"] == 4
    prov = rpc("tenzro_moeListProviders", {})["result"]["providers"][0]
    assert prov["balance"] == s["settlements"][0]["holder_amount"] and prov["quarantined_until_ms"] == 0
    c = Client()
    assert c.get("/api/v1/receipts", {"limit": 2}).json()["count"] == 1
    assert c.get(f"/api/v1/receipts/{k}").json()["key"] == k
    assert c.get("/api/v1/receipts/nope").status_code == 404
    assert c.post(f"/api/v1/receipts/{k}/dispute").status_code == 403
    ok = c.post(f"/api/v1/receipts/{k}/dispute", HTTP_AUTHORIZATION=f"Bearer {operator_token()}")
    assert ok.status_code == 200 and ok.json()["disputed"] is False
    assert c.get("/api/v1/disputes").json()["count"] == 1
    assert c.get("/api/v1/settlements", {"limit": 0}).status_code == 400
    assert c.get("/api/v1/settlements").json()["count"] == 1


def test_fault_parsing():
    assert str(parse_fault("corrupt:0.25")) == "corrupt:0.25" and parse_fault("stall:2").value == 2
    assert parse_fault(None) is None
    for bad in ("corrupt:0", "corrupt:1.5", "stall:-1", "melt:1", "corrupt:x"):
        with pytest.raises(ValueError, match="corrupt:P"):
            parse_fault(bad)


def test_sampling_math_for_corrupt_quarter_at_one_in_64():
    """A batch is caught when it is corrupted (P = 0.25, the agent's own draw) and kept
    (HMAC mod 64 == 0, the router's secret): q = 0.25/64 = 1/256 per batch, independent, so
    the first catch comes after a geometric number of batches: mean 256, 95 % within
    ln(0.05)/ln(1 − 1/256) = 766 and 99 % within 1177. Checked over 400 simulated cheats with
    the real injector and the real HMAC over random commitments."""
    import math
    import random

    q = 0.25 / 64
    n95 = math.ceil(math.log(0.05) / math.log(1 - q))
    assert n95 == 766
    rng = random.Random(7)
    firsts = []
    for trial in range(400):
        inj = FaultInjector(parse_fault("corrupt:0.25"), random.Random(trial))
        secret = rng.randbytes(32)
        n = 0
        while True:
            n += 1
            lied = inj.corrupt(np.ones((1, 4), np.float32)) is not None
            if lied and is_sampled(secret, rng.randbytes(32).hex(), 64):
                break
        firsts.append(n)
    mean = sum(firsts) / len(firsts)
    assert 256 * 0.8 < mean < 256 * 1.2  # σ of the mean ≈ 256/√400 = 12.8
    assert 0.92 <= sum(f <= n95 for f in firsts) / len(firsts)  # 95 % expected, ±3σ binomial
