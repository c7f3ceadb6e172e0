"""Message receipts (``moe.receipts``): the batches of one coalesced message cost one holder
signature and one router verify, and each batch's receipt still verifies alone once stored.

The format on plain keys and rows; the holder's execute path behind its HTTP ``/frame``
endpoint (streamed and whole answers) and its iroh endpoint, counting ed25519 signs and verifies; a stream that
ends without its seal; the forward storing sealed receipts that ``verify_stored_receipt`` and
the settlement sampling accept.
"""
from __future__ import annotations

import asyncio
import base64
import hashlib

import numpy as np
import pytest
from nacl.signing import SigningKey

from moe import identity, messages, receipts, wire
from moe.identity import canonical_json, provider_id
from moe.messages import BatchRequest, HolderFault, MessageSeal, StreamedBatch
from moe.receipts import (DOMAIN_RECEIPT, ReceiptError, commitment_bytes, make_entry, make_receipt, make_seal,
                          verify_receipt, verify_stored_receipt)
from moe.transports.http import HttpHolderClient, serve_http
from router.forward import ForwardConfig, LayerForward
from tests.test_coalesce import LAYER, MODEL, holder, iroh_pair, requests  # noqa: F401 (the module's agent fixture)


def batch(seed: int, n: int = 3, h: int = 16):
    rows = np.random.default_rng(seed).standard_normal((n, h)).astype(np.float32)
    return rows, rows.tobytes(), list(range(seed, seed + n))


def identity_of(rid, tokens, car, rows):
    return dict(request_id=rid, model_id="m", layer=0, expert=2, tokens=tokens, carrier_kind="f32", carrier=car,
                rows=rows)


def stored_args(rid, tokens, car, rows, receipt):
    proj = np.frombuffer(base64.b64decode(receipt["sketch"]), "<f8").reshape(len(tokens), -1)
    return dict(request_id=rid, model_id="m", layer=0, expert=2, tokens=tokens, d_model=rows.shape[1],
                carrier_kind="f32", carrier=car, commitment=commitment_bytes(tokens, rows, proj))


def test_one_seal_signs_every_batch_and_each_sealed_receipt_verifies_alone():
    key = SigningKey.generate()
    p = provider_id(key)
    entries = []
    for i in range(3):
        rows, car, toks = batch(i)
        entries.append((f"r{i}", toks, car, rows) + make_entry(key, blob_hash="b", quant="f32", index=i,
                                                              **identity_of(f"r{i}", toks, car, rows)))
    leaves = [leaf for *_, leaf in entries]
    leaves[1] = None  # request 1 failed: no entry, a zero leaf
    seal = make_seal(key, leaves)
    assert seal["leaves"][1] == "00" * 32 and seal["provider"] == p
    for rid, toks, car, rows, entry, leaf in (entries[0], entries[2]):
        assert "signature" not in entry and entry["index"] in (0, 2)
        # the leaf is the digest of exactly what a single receipt signs
        single = make_receipt(key, blob_hash="b", quant="f32", **identity_of(rid, toks, car, rows))
        body = {k: single[k] for k in ("request_id", "input_hash", "commitment", "d_model", "blob_hash", "quant",
                                       "provider")} | {"model_id": "m", "layer": 0, "expert": 2, "tokens": toks}
        assert leaf == hashlib.sha256(DOMAIN_RECEIPT + b"\x00" + canonical_json(body)).digest()
        kept = verify_receipt(entry, provider=p, seal=seal, **identity_of(rid, toks, car, rows))
        assert kept["message"] == {"leaves": seal["leaves"], "signature": seal["signature"]}
        verify_stored_receipt(kept, provider=p, **stored_args(rid, toks, car, rows, kept))
        # an older single receipt of the same batch still verifies, inline and stored
        assert verify_receipt(single, provider=p, **identity_of(rid, toks, car, rows)) is single
        verify_stored_receipt(single, provider=p, **stored_args(rid, toks, car, rows, single))

    rid, toks, car, rows, entry, _ = entries[0]
    kept = verify_receipt(entry, provider=p, seal=seal, **identity_of(rid, toks, car, rows))
    args = stored_args(rid, toks, car, rows, kept)
    other = make_seal(SigningKey.generate(), [entries[0][-1]])
    forged = dict(seal, leaves=list(reversed(seal["leaves"])))
    for bad, why in [(dict(kept, index=2), "does not sign this batch"),
                     (dict(kept, index=1), "does not sign this batch"),
                     (dict(kept, index=7), "not a request of the sealed message"),
                     (dict(kept, message={**kept["message"], "leaves": forged["leaves"]}), "seal signature"),
                     (dict(kept, message={k: other[k] for k in ("leaves", "signature")}), "seal signature"),
                     (dict(kept, commitment="0" * 64), "commitment")]:
        with pytest.raises(ReceiptError, match=why):
            verify_stored_receipt(bad, provider=p, **args)
    with pytest.raises(ReceiptError, match="without its message's seal"):
        verify_receipt(entry, provider=p, **identity_of(rid, toks, car, rows))
    with pytest.raises(ReceiptError, match="another key"):
        verify_receipt(entry, provider=p, seal=dict(seal, provider=provider_id(SigningKey.generate())),
                       **identity_of(rid, toks, car, rows))
    with pytest.raises(ReceiptError, match="another request"):  # an entry is bound to its request id
        verify_receipt(entry, provider=p, seal=seal, **identity_of("r2", toks, car, rows))


class Count:
    """Counts calls of ``moe.receipts``' ed25519 ``sign`` and ``verify`` (wrapped in place)."""

    def __init__(self, monkeypatch):
        self.signs = self.verifies = 0
        real_sign, real_verify = identity.sign, identity.verify

        def sign(*a):
            self.signs += 1
            return real_sign(*a)

        def verify(*a):
            self.verifies += 1
            return real_verify(*a)

        monkeypatch.setattr(receipts, "sign", sign)
        monkeypatch.setattr(receipts, "verify", verify)


async def checked(provider, req: BatchRequest, ans) -> dict:
    """The router's check of one answer (``LayerForward.verified_receipt``)."""
    fwd = LayerForward(ForwardConfig(), gate=None, model_id=req.model_id, layer=req.layer, hidden_states=None,
                       get_view=None, send=None)
    return await fwd.verified_receipt(provider, req, ans)


@pytest.mark.parametrize("path", ["http-streamed", "http-whole", "iroh"])
@pytest.mark.parametrize("sealed", ["1", "0"])
def test_a_coalesced_message_costs_one_signature_and_one_verify(holder, monkeypatch, path, sealed):  # noqa: F811
    """Every batch of the message verifies and, stored, verifies alone; a request that fails
    (an expert not held) fails alone and leaves a zero leaf in the seal."""
    agent, x, _ = holder
    reqs = requests(x, carrier="f32", output="f32", bad_expert=9)
    monkeypatch.setenv("TENZRO_COALESCE", "1")
    monkeypatch.setenv("TENZRO_STREAM_ANSWERS", "0" if path == "http-whole" else "1")
    monkeypatch.setenv("TENZRO_MESSAGE_RECEIPTS", sealed)
    count = Count(monkeypatch)

    async def go():
        if path == "iroh":
            server, client = await iroh_pair(agent)
            send = lambda r: client.execute(server.endpoint_id, server.addrs, r)  # noqa: E731
        else:
            server = await serve_http(agent.execution.http_rpc, "127.0.0.1", 0, agent.execution.http_frame,
                                      agent.execution.http_stream)
            endpoint = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/rpc"
            client = HttpHolderClient(30)
            send = lambda r: client.execute_frame(endpoint, r)  # noqa: E731
        try:
            got = await asyncio.gather(*(send(r) for r in reqs), return_exceptions=True)
            signs = count.signs
            kept = await asyncio.gather(*(checked(agent.provider, r, a) for r, a in zip(reqs, got[:-1])))
            return got, signs, kept
        finally:
            await client.close()
            if path == "iroh":
                await server.close()
            else:
                server.close()

    got, signs, kept = asyncio.run(go())
    assert isinstance(got[-1], HolderFault)
    got, reqs = got[:-1], reqs[:-1]
    n = len(reqs)
    if sealed == "1":
        assert signs == 1 and count.verifies == 1
        assert all(a.seal is got[0].seal and receipts.is_entry(a.receipt) for a in got)
        leaves = kept[0]["message"]["leaves"]
        assert len(leaves) == n + 1 and leaves.count("00" * 32) == 1  # the failed request's leaf
        assert sorted(k["index"] for k in kept) == [i for i, leaf in enumerate(leaves) if leaf != "00" * 32]
    else:
        assert signs == n and count.verifies == n
        assert all("signature" in k and "message" not in k for k in kept)
    for req, ans, k in zip(reqs, got, kept):
        proj = np.frombuffer(base64.b64decode(k["sketch"]), "<f8").reshape(len(req.tokens), -1)
        verify_stored_receipt(k, provider=agent.provider, request_id=req.request_id, model_id=MODEL, layer=LAYER,
                              expert=req.expert, tokens=req.tokens, d_model=req.d_model, carrier_kind=req.carrier,
                              carrier=req.payload, commitment=commitment_bytes(req.tokens, ans.rows, proj))


def test_answers_of_a_stream_that_ends_without_its_seal_fail_their_receipt_check():
    key = SigningKey.generate()
    p = provider_id(key)
    rows, car, toks = batch(0)
    req = BatchRequest("r0", "m", 0, 2, toks, "f32", car, "f32", rows.shape[1])
    entry, leaf = make_entry(key, blob_hash="b", quant="f32", index=0, **identity_of("r0", toks, car, rows))

    async def go():
        stream = StreamedBatch([req, BatchRequest("r1", "m", 0, 2, toks, "f32", car, "f32", rows.shape[1])],
                               "http", 1)
        header, data = messages.batch_part("b", (messages.reply("r0", token_indices=toks, output="f32",
                                                                receipt=entry), rows.tobytes()), more=True)
        _, ans = stream.part(header, data, len(data))
        waiting = asyncio.ensure_future(checked(p, req, ans))
        await asyncio.sleep(0.01)
        assert not waiting.done()  # the rows are checked; the seal is still to come
        stream.close()  # the holder's stream broke
        with pytest.raises(ReceiptError, match="without a message seal"):
            await waiting
        # a seal that arrives later than the close changes nothing; a wrong one fails every batch
        sealed = MessageSeal(make_seal(SigningKey.generate(), [leaf]))
        ans.seal = sealed
        with pytest.raises(ReceiptError, match="another key|seal signature"):
            await checked(p, req, ans)

    asyncio.run(go())


@pytest.mark.django_db(transaction=True)
@pytest.mark.asyncio
async def test_the_agent_socket_carries_the_seal_on_the_last_streamed_answer(monkeypatch):
    """``services.send_ws`` asks for a message receipt; the agent's entries come one by one and
    the seal with the last (``more: false``): every answer verifies once it is in, with one
    signature verify for the message; an entry whose leaf the seal lacks fails alone."""
    from router import services
    from tests.test_agent_socket import authed

    monkeypatch.setenv("TENZRO_COALESCE", "1")
    monkeypatch.setenv("TENZRO_MESSAGE_RECEIPTS", "1")
    key = SigningKey.generate()
    p = provider_id(key)
    comm = await authed(key)
    rows = np.random.default_rng(1).standard_normal((4, 32)).astype(np.float32)
    reqs = [BatchRequest(f"s{i}", "m", 0, i, [i], "f32", rows[i:i + 1].tobytes(), "f32", 32) for i in range(4)]
    sent = [asyncio.ensure_future(services.send_ws(p, r)) for r in reqs]
    header, payload = wire.unpack_frame(await comm.receive_from(), wire.MESSAGE_HEADER_MAX)
    assert header["type"] == "batch" and messages.wants_seal(header) and header["stream"] is True
    leaves = [None] * 4
    order = [2, 0, 1, 3]
    for n, i in enumerate(order):
        h, data = messages.split_batch(header, payload)[i]
        out = rows[i:i + 1] * 2
        entry, leaves[i] = make_entry(key, request_id=h["id"], model_id="m", layer=0, expert=i, tokens=[i],
                                      carrier_kind="f32", carrier=data, rows=out, blob_hash="b", quant="f32", index=i)
        if i == 1:
            leaves[i] = None  # the holder "forgot" this one: its entry is not covered by the seal
        seal = make_seal(key, leaves) if n == 3 else None
        answer = (messages.reply(h["id"], token_indices=[i], output="f32", receipt=entry), out.tobytes())
        await comm.send_to(bytes_data=wire.pack_frame(*messages.batch_part(header["id"], answer, n < 3, seal=seal)))
    got = await asyncio.wait_for(asyncio.gather(*sent), 5.0)
    count = Count(monkeypatch)
    checks = await asyncio.gather(*(checked(p, r, a) for r, a in zip(reqs, got)), return_exceptions=True)
    assert count.verifies == 1 and all(a.seal is got[0].seal for a in got)
    assert isinstance(checks[1], ReceiptError) and "does not sign this batch" in str(checks[1])
    assert all(checks[i]["message"]["signature"] == got[0].seal.body["signature"] for i in (0, 2, 3))
    await comm.disconnect()
