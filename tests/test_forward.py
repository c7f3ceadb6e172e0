"""The distributed forward's data plane in one process: receipts, wire, failover, replans, partial.

Holders here are real ``HolderAgent`` execute paths (decode carrier → expert FFN → encode →
sign) called through an in-process ``send``; the failure modes are injected around them.
"""
from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import tempfile

import numpy as np
import pytest
from nacl.signing import SigningKey
from safetensors.numpy import load_file
from threadpoolctl import threadpool_limits

from moe import receipts, wire
from holders.agent import AgentConfig, HolderAgent
from moe.ffn import expert_forward
from router.forward import (BatchAnswer, ForwardError, HolderFault, _Rows, ForwardConfig, LayerForward,
                             renormalized)
from moe.gating import route
from moe.identity import SignatureError, canonical_json, provider_id
from moe.receipts import ReceiptError, make_receipt, verify_receipt
from tenzro_site.verify import monolithic
from prepare.checkpoint import Checkpoint
from prepare.layouts import load_expert, load_gate, spec_from_config
from moe.shardmap import HoldingInfo, ProviderInfo, ReplicationPolicy, ShardView
from tests.conftest import DEEPSEEK, QWEN

MODEL = "m"


# -- receipts ------------------------------------------------------------------------------
def _signed(rows, key=None, request_id="r1", tokens=(3, 5, 9), carrier=b"abc"):
    key = key or SigningKey.generate()
    rec = make_receipt(key, request_id=request_id, model_id=MODEL, layer=1, expert=4, tokens=list(tokens),
                       carrier_kind="f32", carrier=carrier, rows=rows, blob_hash="ab" * 32, quant="bf16")
    return key, rec


def _check(rec, key, rows, request_id="r1", tokens=(3, 5, 9), carrier=b"abc"):
    return verify_receipt(rec, provider=provider_id(key), request_id=request_id, model_id=MODEL, layer=1, expert=4,
                          tokens=list(tokens), carrier_kind="f32", carrier=carrier, rows=rows)


@pytest.fixture
def out_rows():
    return np.random.default_rng(1).standard_normal((3, 64)).astype(np.float32)


def test_receipt_round_trip(out_rows):
    key, rec = _signed(out_rows)
    assert _check(rec, key, out_rows) is rec
    assert rec["d_model"] == 64 and len(rec["commitment"]) == 64


def _top_by_sorting(row: np.ndarray, k: int) -> list[int]:
    """The definition: indices by |value| descending, ties to the lower index."""
    return sorted(range(row.size), key=lambda i: (-abs(float(row[i])), i))[:k]


@pytest.mark.parametrize("family", ["normal", "bf16", "small_ints", "sparse", "equal_class_maxima"])
@pytest.mark.parametrize("h", [256, 2048, 96])
def test_top_features_match_the_definition_on_tie_heavy_rows(family, h):
    rng = np.random.default_rng([h, len(family)])
    x = rng.standard_normal((6, h)).astype(np.float32)
    if family == "bf16":  # 8 mantissa bits: equal magnitudes across classes are common
        x = wire.decode_rows(wire.encode_rows(x, "bf16"), "bf16", h, 6)
    elif family == "small_ints":
        x = rng.integers(-3, 4, (6, h)).astype(np.float32)
    elif family == "sparse":
        x = np.where(rng.random((6, h)) < 0.01, x, np.float32(0))
        x[0] = 0.0
        x[1, ::7] = -0.0
    elif family == "equal_class_maxima":  # every class maximum equal: the prefilter must keep them all
        x = np.abs(x) % np.float32(0.5)
        x[:, ::3] = np.float32(0.75)
        x[:, 5::11] = np.float32(-0.75)
    for k in (1, 3, 8):
        idx, val = receipts.top_features(x, k)
        assert idx.dtype == np.uint32 and val.dtype == np.float32 and idx.shape == (6, k)
        for r in range(6):
            assert idx[r].tolist() == _top_by_sorting(x[r], k), (family, h, k, r)
            assert np.array_equal(val[r].view(np.uint32), x[r, idx[r]].view(np.uint32))


@pytest.mark.parametrize("h", [2048, 96, 33])
def test_receipt_digest_matches_the_definitions(h):
    """The compiled one-pass digest: projections within the sketch tolerance of the float64
    BLAS product, Σ|row| likewise, the top features those of the definition, and a row holding
    NaN or Inf flagged (its top features then by numpy's partition)."""
    rng = np.random.default_rng(h)
    x = (rng.standard_normal((5, h)) * rng.choice([1e-20, 1.0, 1e20], (5, h))).astype(np.float32)
    ih = bytes(range(32))
    idx, val, proj, abssum = receipts._digest(x, ih, 8)
    exact = x.astype(np.float64) @ receipts.sketch_signs(ih, h).T
    total = np.abs(x).sum(axis=1, dtype=np.float64)
    assert np.all(np.abs(proj - exact) <= receipts.SKETCH_RTOL * total[:, None])
    assert np.allclose(abssum, total, rtol=1e-12, atol=0)
    assert np.array_equal(receipts.sketch(x, ih), proj)
    for r in range(5):
        assert idx[r].tolist() == _top_by_sorting(x[r], 8)
    for bad in (np.nan, np.inf, -np.inf):
        y = x.copy()
        y[2, h // 2] = bad
        idx_b, _, _, _ = receipts._digest(y, ih, 8)  # the non-finite value ranks first, then as before
        assert idx_b[2].tolist() == [h // 2] + [i for i in _top_by_sorting(x[2], 8) if i != h // 2][:7]
        assert all(idx_b[r].tolist() == _top_by_sorting(x[r], 8) for r in (0, 1, 3, 4))
        assert not receipts._sums(y, receipts.sketch_signs(ih, h), np.empty((5, 4)), np.empty(5))


def _commitment_by_numpy(rows, ih, theirs, tokens):
    """The router's commitment check as plain numpy steps: None when the sketch disagrees."""
    idx, val, ours, abssum = receipts._digest(rows, ih, receipts.TOP_K)
    if not np.isfinite(theirs).all() or (np.abs(theirs - ours) > receipts.SKETCH_RTOL * abssum[:, None] + 1e-30).any():
        return None
    return hashlib.sha256(receipts._pack_commitment(tokens, idx, val, theirs)).hexdigest()


@pytest.mark.parametrize("h", [256, 96, 33, 5])
@pytest.mark.parametrize("n", [0, 1, 4, 17])
def test_compiled_commitment_check_decides_as_the_numpy_steps(h, n):
    """``_commitment_of`` (one compiled call for finite rows) gives the commitment the numpy
    steps give, refuses the sketches they refuse (a projection moved past the tolerance, a
    non-finite one), and leaves rows holding NaN or Inf to those steps."""
    rng = np.random.default_rng([h, n])
    rows = (rng.standard_normal((n, h)) * rng.choice([1e-20, 1.0, 1e20], (n, h))).astype(np.float32)
    tokens = sorted(int(t) for t in rng.choice(1000, n, replace=False))
    ih = bytes(rng.integers(0, 256, 32, dtype=np.uint8))
    theirs = receipts.sketch(rows, ih)
    cases = [theirs, theirs * (1 + 1e-12)]  # agrees within the tolerance: the holder's bytes are hashed
    if n:
        far = theirs.copy()
        far[-1, 1] += 1e-6 * max(1.0, float(np.abs(rows[-1]).sum()))
        inf = theirs.copy()
        inf[0, 0] = np.inf
        cases += [far, inf]
    for th in cases:
        th = np.ascontiguousarray(th, dtype="<f8")
        want = _commitment_by_numpy(rows, ih, th, tokens)
        if want is None:
            with pytest.raises(ReceiptError, match="sketch"):
                receipts._commitment_of(rows, ih, th, th.tobytes(), tokens)
        else:
            assert receipts._commitment_of(rows, ih, th, th.tobytes(), tokens) == want
    if n:
        for bad in (np.nan, np.inf):
            y = rows.copy()
            y[0, h // 2] = bad
            th = np.ascontiguousarray(theirs, dtype="<f8")
            want = _commitment_by_numpy(y, ih, th, tokens)
            got = (receipts._commitment_of(y, ih, th, th.tobytes(), tokens) if want is not None else None)
            assert got == want


@pytest.mark.parametrize("strings", [
    dict(request_id="r" * 32, model_id="qwen3-moe-tiny", blob_hash="ab" * 32, quant="bf16"),
    dict(request_id='q"uo\\te\n', model_id="m\u00e9\u4e2d\U0001f600", blob_hash="\x00\x1f\x7f", quant=""),
])
def test_receipt_body_encoding_is_canonical_json(strings):
    """The leaf's body written directly is ``canonical_json`` of the body, byte for byte
    (escapes, non-ASCII, numpy integers, a bool layer); non-str fields take canonical_json."""
    common = dict(input_hash="cd" * 32, commitment="ef" * 32, provider="01" * 32)
    for layer, expert, tokens, d_model in [(1, 4, [3, 5, 9], 64), (True, np.int64(7), list(np.arange(5)), np.int32(96)),
                                           (0, 0, [], 1)]:
        kw = dict(strings, **common, layer=layer, expert=expert, tokens=tokens, d_model=d_model)
        assert receipts._body_json(**kw) == canonical_json(receipts._body(**kw))
    with pytest.raises(SignatureError):
        receipts._body_json(**dict(strings, **common, layer=1, expert=1, tokens=[1], d_model=2, quant=1.5))


@pytest.mark.parametrize("where", ["top", "tail"])
def test_tampered_rows_are_rejected(out_rows, where):
    key, rec = _signed(out_rows)
    bad = out_rows.copy()
    j = int(np.argmax(np.abs(bad[1]))) if where == "top" else int(np.argmin(np.abs(bad[1])))
    bad[1, j] = np.nextafter(bad[1, j], np.float32(np.inf)) if where == "top" else bad[1, j] + np.float32(1e-3)
    with pytest.raises(ReceiptError, match="sketch|commitment"):
        _check(rec, key, bad)


def test_receipt_signed_by_another_key_is_rejected(out_rows):
    key, rec = _signed(out_rows)
    other, forged = _signed(out_rows)
    with pytest.raises(ReceiptError, match="another key"):
        _check(forged, key, out_rows)
    forged["provider"] = provider_id(key)  # claims the right provider, signature is still the other key's
    with pytest.raises(ReceiptError, match="signature"):
        _check(forged, key, out_rows)


def test_missing_receipt_is_rejected(out_rows):
    key, _ = _signed(out_rows)
    with pytest.raises(ReceiptError, match="no receipt"):
        _check(None, key, out_rows)


def test_replayed_receipt_for_another_request_is_rejected(out_rows):
    key, rec = _signed(out_rows, request_id="r1")
    with pytest.raises(ReceiptError, match="another request"):
        _check(rec, key, out_rows, request_id="r2")
    rec2 = {**rec, "request_id": "r2"}  # relabelled: the signature binds the id
    with pytest.raises(ReceiptError, match="signature"):
        _check(rec2, key, out_rows, request_id="r2")


def test_receipt_binds_tokens_and_carrier(out_rows):
    key, rec = _signed(out_rows)
    with pytest.raises(ReceiptError):
        _check(rec, key, out_rows, tokens=(3, 5, 10))
    with pytest.raises(ReceiptError, match="input_hash"):
        _check(rec, key, out_rows, carrier=b"abd")


# -- wire ---------------------------------------------------------------------------------
def test_carrier_choice_and_q8_rows():
    assert wire.choose_carrier("auto", 256) == ("q8_0", "bf16")
    assert wire.choose_carrier("auto", 100) == ("f32", "bf16")
    assert wire.choose_carrier("f16", 100) == ("f16", "f16")  # a generation's auto: f16 both ways (issue 24)
    assert wire.choose_carrier("f16", 4, np.array([[1.0, -7e4, 0, 0]], np.float32)) == ("f32", "f16")
    # a holder answers f32 for a batch beyond f16's range, f16 otherwise; other encodings unchanged
    assert wire.output_encoding(np.array([[1.0, -7e4]], np.float32), "f16") == "f32"
    assert wire.output_encoding(np.array([[1.0, -6e4]], np.float32), "f16") == "f16"
    assert wire.output_encoding(np.array([[1.0, -7e4]], np.float32), "bf16") == "bf16"
    assert wire.output_encoding(np.zeros((0, 2), np.float32), "f16") == "f16"
    assert wire.choose_carrier("f32", 256) == ("f32", "f32")
    with pytest.raises(wire.WireError, match="divisible by 32"):
        wire.choose_carrier("q8_0", 100)
    x = np.random.default_rng(0).standard_normal((4, 64)).astype(np.float32)
    data = wire.encode_rows(x, "q8_0")
    assert len(data) == 4 * 2 * 34
    assert np.abs(wire.decode_rows(data, "q8_0", 64, 4) - x).max() < 0.02
    with pytest.raises(wire.WireError, match="take"):
        wire.decode_rows(data + bytes(34), "q8_0", 64, 4)
    with pytest.raises(wire.WireError, match="bf16 rows"):
        wire.decode_rows(b"\0" * 10, "bf16", 64, 4)


def test_part_frames_reassemble_and_refuse_bad_parts():
    header, payload = {"id": "a", "type": "execute", "token_indices": list(range(30_000))}, bytes(300_000)
    assert wire.split_frames({"id": "s"}, b"xy", 1 << 20) == [wire.pack_frame({"id": "s"}, b"xy")]
    frames = wire.split_frames(header, payload, 100_000)
    assert len(frames) == 5 and all(len(f) <= 100_000 for f in frames)  # 170 KB header + 300 KB payload
    r = wire.Reassembler()
    assert [r.feed(*wire.unpack_frame(f)) for f in frames[:-1]] == [None] * 4 and r.buffered > 0
    assert r.feed(*wire.unpack_frame(frames[-1])) == (header, payload) and r.buffered == 0
    with pytest.raises(wire.WireError, match="repeated"):
        r.feed(*wire.unpack_frame(frames[0]))
        r.feed(*wire.unpack_frame(frames[0]))
    assert r.buffered == 0
    with pytest.raises(wire.WireError, match="part"):
        r.feed({"id": "a", "part": 4, "parts": 4}, b"")
    small = wire.Reassembler(max_bytes=150_000)
    small.feed(*wire.unpack_frame(frames[0]))
    with pytest.raises(wire.WireError, match="buffer"):
        small.feed(*wire.unpack_frame(frames[1]))
    assert small.buffered == 0


def test_f16_rows_round_trip_and_range():
    x = np.random.default_rng(1).standard_normal((3, 100)).astype(np.float32) * 50
    data = wire.encode_rows(x, "f16")
    assert len(data) == 3 * 100 * 2 == wire.encoded_nbytes("f16", 3, 100)
    back = wire.decode_rows(data, "f16", 100, 3)
    assert np.array_equal(back, x.astype(np.float16).astype(np.float32))
    assert np.max(np.abs(back - x) / np.maximum(np.abs(x), 1e-3)) <= 2.0 ** -11
    with pytest.raises(wire.WireError, match="f16 range"):
        wire.encode_rows(np.array([[7e4]], np.float32), "f16")
    with pytest.raises(wire.WireError, match="f16 rows"):
        wire.decode_rows(data[:-2], "f16", 100, 3)


# -- forward with in-process holders --------------------------------------------------------
class Fixture:
    def __init__(self, ckpt, layer, n_holders=3, replication=2):
        self.ckpt = Checkpoint(ckpt)
        self.spec = spec_from_config(self.ckpt.config)
        self.layer = layer
        self.gate = load_gate(self.ckpt, self.spec, layer)
        ref = load_file(str(ckpt / "reference.safetensors"))
        self.x = ref[f"layer{layer}.hidden_states"].astype(np.float32)
        slots = self.gate.num_experts + (1 if self.spec.n_shared_experts else 0)
        self.weights = {e: load_expert(self.ckpt, self.spec, layer, e) for e in range(slots)}
        self.agents = [HolderAgent(AgentConfig("http://127.0.0.1:1", SigningKey.generate(), tempfile.mkdtemp(prefix="tenzro-test-holder-"), name=f"h{i}"))
                       for i in range(n_holders)]
        self.by_id = {a.provider: a for a in self.agents}
        self.held: dict[str, list[int]] = {a.provider: [] for a in self.agents}
        for e in range(slots):
            for r in range(replication):
                a = self.agents[(e + r) % n_holders]
                a.runtime.load_expert(MODEL, layer, e, self.weights[e].to_blob("f32"))
                self.held[a.provider].append(e)
        self.views = 0

    def view(self, excluded=frozenset(), gone=()):
        infos = [ProviderInfo(p, roles=("ExpertHolder",), holdings=tuple(
            HoldingInfo(MODEL, self.layer, e, "Warm", 0, None) for e in es if (p, e) not in gone and e not in gone))
            for p, es in self.held.items() if p not in excluded]
        return ShardView.build(MODEL, infos, policy=ReplicationPolicy())

    def monolithic(self):
        with threadpool_limits(limits=1):
            return monolithic(self.ckpt, self.layer, self.x)

    async def honest(self, provider, _info, req):
        answer, data = await self.by_id[provider].execution.execute_request(
            {"request_id": req.request_id, "model_id": req.model_id, "layer": req.layer, "expert": req.expert,
             "token_indices": req.tokens, "d_model": req.d_model, "output": req.output}, req.carrier, req.payload)
        rows = wire.decode_rows(data, answer["output"], req.d_model, len(req.tokens), "outputs")
        return BatchAnswer(rows, answer["receipt"], "ws", len(req.payload), len(data))

    def run(self, send=None, gone=(), **kw):
        """The forward of ``self.x``; ``kw``: ``ForwardConfig`` fields (deadline 5 s unless
        given) and ``LayerForward`` keywords."""
        names = {f.name for f in dataclasses.fields(ForwardConfig)}
        config = ForwardConfig(**{"deadline_s": 5.0, **{k: kw.pop(k) for k in list(kw) if k in names}})

        async def get_view(excluded):
            self.views += 1
            return self.view(excluded, gone)

        async def go():
            with threadpool_limits(limits=1):
                return await LayerForward(config, gate=self.gate, model_id=MODEL, layer=self.layer,
                                          hidden_states=self.x, get_view=get_view, send=send or self.honest,
                                          **{"carrier": "f32", **kw}).run()
        return asyncio.run(go())


@pytest.fixture(scope="module")
def qwen():
    """The qwen3 fixture's layer 1 on three in-process holders, warmed: the first forwards compile
    numba kernels (seconds on a cold cache), which the deadline tests must not count."""
    f = Fixture(QWEN, 1)
    for _ in range(2):
        f.run(deadline_s=600.0, attempt_timeout_s=600.0)
    return f


def test_forward_matches_monolithic_bit_for_bit(qwen):
    res = qwen.run()
    assert np.array_equal(res.output, qwen.monolithic())
    assert res.replans == 0 and not res.missing and not res.failures
    assert len(res.receipts) == res.batches and res.bytes_out > 0


def test_a_batch_above_one_frame_is_executed_whole(tmp_path):
    from tests.synth import make_checkpoint

    # H 4096, 62 tokens on each of 2 experts: 62 f32 rows are ~1 MiB, above one socket frame. The
    # router once cut such a batch 59 + 3 and the 3-row product differed from the monolithic 62-row one.
    fx = Fixture(make_checkpoint(tmp_path / "h4096", "qwen3_moe", hidden=4096, d_ff=32, experts=2, top_k=2,
                                 layers=1, tokens=62), 0, n_holders=2, replication=1)
    res = fx.run()
    assert res.batches == 2 and np.array_equal(res.output, fx.monolithic())


def test_compact_wire_is_close_and_smaller(qwen):
    exact = qwen.run()
    res = qwen.run(carrier="auto")
    rel = np.abs(res.output - exact.output).max() / np.abs(exact.output).max()
    assert 0 < rel < 2e-2
    assert res.bytes_out < exact.bytes_out * 0.3 and res.bytes_back == exact.bytes_back // 2
    half = qwen.run(carrier="f16")  # twice Q8_0's bytes out, a fraction of its error
    rel_half = np.abs(half.output - exact.output).max() / np.abs(exact.output).max()
    assert 0 < rel_half < rel / 2
    assert half.bytes_out == exact.bytes_out // 2 and half.bytes_back == exact.bytes_back // 2


def _faulty(fx, bad: str, mode: str):
    async def send(provider, info, req):
        if provider == bad:
            if mode == "error":
                raise ConnectionError("holder went away")
            if mode == "stall":
                await asyncio.sleep(30)
            ans = await fx.honest(provider, info, req)
            if mode == "tamper":
                ans.rows = ans.rows.copy()
                ans.rows[0, -1] += np.float32(1e-3)
            elif mode == "no_receipt":
                ans.receipt = None
            elif mode == "other_key":
                ans.receipt = make_receipt(SigningKey.generate(), request_id=req.request_id, model_id=MODEL,
                                           layer=req.layer, expert=req.expert, tokens=req.tokens,
                                           carrier_kind=req.carrier, carrier=req.payload, rows=ans.rows,
                                           blob_hash="", quant="f32")
            elif mode == "replay":
                ans.receipt = {**ans.receipt, "request_id": "someone-else"}
            return ans
        return await fx.honest(provider, info, req)
    return send


@pytest.mark.parametrize("mode", ["error", "tamper", "no_receipt", "other_key", "replay", "stall"])
def test_failing_holder_falls_over_to_backup_with_identical_output(qwen, mode):
    bad = min(qwen.by_id)  # the planner's primary for the experts it holds (ties go to the lower id)
    res = qwen.run(send=_faulty(qwen, bad, mode), deadline_s=1.0 if mode == "stall" else 5.0)
    assert np.array_equal(res.output, qwen.monolithic())
    assert res.failures and all(f["provider"] == bad and f["fault"] for f in res.failures)
    assert bad not in res.holders and not res.missing
    if mode == "stall":
        assert res.timings_ms["execute"] < 1000 * 3  # one deadline, then the backups answer


def test_a_holder_rejecting_a_malformed_request_is_not_at_fault(qwen):
    """-32602/-32600 from the holder: the router's request was malformed (a router/transport-side
    mismatch); the backup serves it and the honest holder keeps its score."""
    from moe.messages import answer_to_batch
    bad = min(qwen.by_id)

    async def send(provider, info, req):
        if provider == bad:
            return answer_to_batch({"ok": False, "code": -32602, "message": "hidden_states: 3 rows but 2 token "
                                                                            "indices"}, b"", req, "iroh", 0, 0)
        return await qwen.honest(provider, info, req)

    res = qwen.run(send=send)
    assert np.array_equal(res.output, qwen.monolithic())
    assert res.failures and all(f["provider"] == bad and f["fault"] is False for f in res.failures)
    assert "rejected" in res.failures[0]["error"]


def test_every_holder_of_an_expert_gone_fails_closed_naming_the_pairs(qwen):
    with pytest.raises(ForwardError) as ei:
        qwen.run(gone=(3,))
    assert ei.value.kind == "planning"
    assert ei.value.data["missing"][0]["expert"] == 3 and "l1/e3" in ei.value.message


def test_allow_partial_equals_the_reference_without_those_experts(qwen):
    res = qwen.run(gone=(3, 7), allow_partial=True)
    assert [m["expert"] for m in res.missing] == [3, 7]
    # Reference: every other expert's rows, each token's routed weights renormalized over the rest.
    routing = route(qwen.gate, qwen.x)
    outs = {}
    with threadpool_limits(limits=1):
        for e, tok in routing.tokens_by_expert().items():
            outs[e] = (tok, np.zeros((len(tok), qwen.x.shape[1]), np.float32) if e in (3, 7)
                       else expert_forward(qwen.weights[e], qwen.x[tok]))
    w = routing.weights.astype(np.float64)
    keep = ~np.isin(routing.expert_ids, [3, 7])
    w_new = np.where(keep, w * (w.sum(1, keepdims=True) / (w * keep).sum(1, keepdims=True)), 0.0)
    ref = np.zeros_like(qwen.x)
    for t in range(qwen.x.shape[0]):
        for s in range(routing.expert_ids.shape[1]):
            e = int(routing.expert_ids[t, s])
            ref[t] += np.float32(w_new[t, s]) * outs[e][1][list(outs[e][0]).index(t)]
    assert np.abs(res.output - ref).max() <= 1e-6 * np.abs(ref).max()
    touched = {t for m in res.missing for t in m["tokens"]}
    untouched = [t for t in range(qwen.x.shape[0]) if t not in touched]
    assert np.array_equal(res.output[untouched], qwen.monolithic()[untouched])


def test_replan_reaches_a_holder_that_appears_after_the_first_round(qwen):
    # Round 1: expert 5 is held only by agent 0, which fails; the replanned view adds agent 2.
    bad, other, late = sorted(qwen.by_id)
    assert 5 in qwen.held[bad] or 5 in qwen.held[other]

    async def get_view(excluded):
        qwen.views += 1
        # first round: expert 5 only on `bad`; after `bad` is excluded, `late` holds it too
        return qwen.view(excluded, gone=() if excluded else ((other, 5), (late, 5)))

    async def send(provider, info, req):
        if provider == bad:
            raise ConnectionError("down")
        return await qwen.honest(provider, info, req)

    if 5 not in qwen.held[bad]:
        qwen.by_id[bad].runtime.load_expert(MODEL, 1, 5, qwen.weights[5].to_blob("f32"))
        qwen.held[bad].append(5)
    qwen.by_id[late].runtime.load_expert(MODEL, 1, 5, qwen.weights[5].to_blob("f32"))
    qwen.held[late].append(5)

    async def go():
        with threadpool_limits(limits=1):
            return await LayerForward(ForwardConfig(), gate=qwen.gate, model_id=MODEL, layer=1, hidden_states=qwen.x,
                                      get_view=get_view, send=send, carrier="f32").run()
    res = asyncio.run(go())
    qwen.held[late].remove(5)
    assert res.replans >= 1 and np.array_equal(res.output, qwen.monolithic())


def test_rows_refuse_unsent_and_duplicate_pairs(qwen):
    routing = route(qwen.gate, qwen.x)
    rows = _Rows(routing, qwen.x.shape[1])
    e, tok = next(iter(routing.tokens_by_expert().items()))
    not_routed = next(t for t in range(qwen.x.shape[0]) if t not in set(tok.tolist()))
    with pytest.raises(HolderFault, match="never routed"):
        rows.put(e, [not_routed], np.zeros((1, qwen.x.shape[1]), np.float32))
    rows.put(e, [int(tok[0])], np.ones((1, qwen.x.shape[1]), np.float32))
    with pytest.raises(HolderFault, match="already filled"):
        rows.put(e, [int(tok[0])], np.ones((1, qwen.x.shape[1]), np.float32))


def test_missing_shared_expert_is_fatal_even_with_allow_partial():
    fx = Fixture(DEEPSEEK, 2)
    shared = fx.gate.num_experts
    assert fx.spec.n_shared_experts
    with pytest.raises(ForwardError, match="shared expert"):
        fx.run(gone=(shared,), allow_partial=True)
    routing = route(fx.gate, fx.x)
    with pytest.raises(ValueError, match="shared"):
        renormalized(routing, {shared: {0}})
    assert np.array_equal(fx.run().output, fx.monolithic())


def test_router_holding_experts_runs_them_locally(qwen):
    held = {0, 2, 5}

    def local(expert, rows):
        if expert not in held:
            return None
        return expert_forward(qwen.weights[expert], rows)

    res = qwen.run(local=local)
    assert res.transports["local"] == 3 and len(res.receipts) == res.batches - 3
    assert np.array_equal(res.output, qwen.monolithic())

    def broken(expert, rows):
        raise ValueError("local runtime lost its weights")

    res = qwen.run(local=broken)  # falls back to the remote holders
    assert res.transports["local"] == 0 and np.array_equal(res.output, qwen.monolithic())


def test_dense_layer_split_over_holders_recombines_exactly():
    from prepare.dense import dense_routing, slice_bounds, split_dense, split_forward
    from prepare.services import dense_layers, load_dense

    ck = Checkpoint(DEEPSEEK)
    assert dense_layers(ck) == [0]
    w = load_dense(ck, 0)
    x = load_file(str(DEEPSEEK / "reference.safetensors"))["layer1.hidden_states"].astype(np.float32)
    assert slice_bounds(10, 3) == [(0, 3), (3, 6), (6, 10)]
    with pytest.raises(ValueError, match="parts"):
        slice_bounds(4, 5)
    parts = split_dense(w, 3)
    agents = [HolderAgent(AgentConfig("http://127.0.0.1:1", SigningKey.generate(), tempfile.mkdtemp(prefix="tenzro-test-holder-"))) for _ in range(3)]
    for i, a in enumerate(agents):
        a.runtime.load_expert(MODEL, 0, i, parts[i].to_blob("f32"))
        a.runtime.load_expert(MODEL, 0, (i + 1) % 3, parts[(i + 1) % 3].to_blob("f32"))
    by_id = {a.provider: a for a in agents}
    infos = [ProviderInfo(a.provider, roles=("ExpertHolder",), holdings=tuple(
        HoldingInfo(MODEL, 0, e, "Warm", 0, None) for e in (i, (i + 1) % 3))) for i, a in enumerate(agents)]

    async def get_view(excluded):
        return ShardView.build(MODEL, [p for p in infos if p.provider not in excluded], policy=ReplicationPolicy())

    async def send(provider, info, req):
        answer, data = await by_id[provider].execution.execute_request(
            {"request_id": req.request_id, "model_id": req.model_id, "layer": req.layer, "expert": req.expert,
             "token_indices": req.tokens, "d_model": req.d_model, "output": req.output}, req.carrier, req.payload)
        return BatchAnswer(wire.decode_rows(data, answer["output"], req.d_model, len(req.tokens)), answer["receipt"],
                           "ws", len(req.payload), len(data))

    async def go():
        with threadpool_limits(limits=1):
            return await LayerForward(ForwardConfig(), gate=None, routing=dense_routing(x.shape[0], 3), model_id=MODEL,
                                      layer=0, hidden_states=x, get_view=get_view, send=send, carrier="f32").run()
    res = asyncio.run(go())
    with threadpool_limits(limits=1):
        assert np.array_equal(res.output, split_forward(parts, x))
        whole = expert_forward(w, x)
    assert np.abs(res.output - whole).max() <= 1e-5 * np.abs(whole).max()
    assert len(res.holders) >= 2 and len(res.receipts) == 3


# -- slow, black-hole and gone holders (issue 15) --------------------------------------------
def test_every_holder_slow_on_its_first_call_still_serves(qwen):
    # Every holder answers 1.5 deadlines late (a cold first call): the late primary is kept while
    # its backup gets the batch, and the first verified answer wins.
    async def send(provider, info, req):
        await asyncio.sleep(0.6)
        return await qwen.honest(provider, info, req)

    res = qwen.run(send=send, deadline_s=0.4)
    assert np.array_equal(res.output, qwen.monolithic())
    assert not res.missing


def test_holders_that_never_answer_fail_the_forward_after_the_attempt_timeout(qwen):
    async def send(provider, info, req):
        await asyncio.sleep(3600)

    with pytest.raises(ForwardError) as ei:
        qwen.run(send=send, deadline_s=0.2, attempt_timeout_s=0.5)
    assert ei.value.kind == "execution" and "no answer within 0.5 s" in ei.value.message


def test_black_hole_costs_one_deadline_then_only_hedged_probes(qwen):
    from router.scoreboard import Scoreboard

    bad = min(qwen.by_id)  # the view's primary for the experts it holds
    sent: list[tuple[str, str]] = []

    async def send(provider, info, req):
        sent.append((provider, req.purpose))
        if provider == bad:
            await asyncio.sleep(3600)  # declares Warm, never answers
        return await qwen.honest(provider, info, req)

    sb = Scoreboard(probation=1, cooldown_s=0.05, probe_interval_s=0.0)
    first = qwen.run(send=send, deadline_s=1.0, scoreboard=sb)
    assert np.array_equal(first.output, qwen.monolithic())
    assert first.failures and all(f["provider"] == bad and "1 s deadline" in f["error"] for f in first.failures)
    assert sb.snapshot()[bad]["consecutive_faults"] == 1  # its batches in flight together open it once
    before = len(sent)
    import time
    time.sleep(0.1)  # the cooldown ends: half-open
    assert sb.state(bad) == "half_open"
    second = qwen.run(send=send, deadline_s=1.0, scoreboard=sb)
    assert np.array_equal(second.output, qwen.monolithic())
    assert not second.failures and bad not in second.holders
    to_bad = [purpose for p, purpose in sent[before:] if p == bad]
    assert to_bad == ["selftest"]  # one hedged probe, no served batch
    assert sb.state(bad) in ("half_open", "open")  # the probe never answered


def test_a_scoreboard_spreads_batches_over_equal_holders_bit_for_bit(qwen):
    """Three proven holders, each expert on two: the forward deals batches over all three (the
    planner's ``peers``), not every batch of an expert pair to the view's first holder, and
    the output is still the monolithic forward's, bit for bit."""
    from router.scoreboard import Scoreboard

    sb = Scoreboard(probation=1)
    for p in qwen.by_id:
        sb.success(p, 2.0, 4)
    res = qwen.run(scoreboard=sb)
    assert np.array_equal(res.output, qwen.monolithic())
    assert sorted(res.holders) == sorted(qwen.by_id)
    counts = [len(v) for v in res.latencies_ms.values()]
    assert max(counts) - min(counts) <= 2, res.latencies_ms
    plain = qwen.run()
    assert len(plain.holders) < len(qwen.by_id)  # without observations: the view's order alone


def test_split_batches_are_not_dealt_to_a_holder_that_failed_recently(qwen):
    from router.scoreboard import Scoreboard

    bad = min(qwen.by_id)

    async def send(provider, info, req):
        if provider == bad:
            await asyncio.sleep(3600)
        return await qwen.honest(provider, info, req)

    sb = Scoreboard(probation=1)
    first = qwen.run(send=send, deadline_s=1.0, scoreboard=sb, split_threshold=2)
    assert first.failures and all(f["provider"] == bad for f in first.failures)
    second = qwen.run(send=send, deadline_s=1.0, scoreboard=sb, split_threshold=2)
    assert not second.failures and bad not in second.holders
    # Split batches may differ from the monolithic forward in the last bits (README), not from each other.
    assert np.array_equal(second.output, first.output)
    assert np.allclose(second.output, qwen.monolithic(), rtol=1e-5, atol=1e-6)


def test_split_threshold_zero_never_splits_and_a_negative_one_is_refused(qwen):
    """``TENZRO_PLAN_SPLIT_THRESHOLD=0`` (the README's "never split", for bit-exactness) plans one
    batch per expert and equals the monolithic forward bit for bit; a negative value is a
    ``ValueError`` naming it, not a planning failure mid-forward."""
    res = qwen.run(split_threshold=0)
    assert res.batches == len({e for e in res.routing.expert_ids.ravel().tolist()})
    assert np.array_equal(res.output, qwen.monolithic())
    with pytest.raises(ValueError, match="split_threshold"):
        qwen.run(split_threshold=-1)
