"""Receipts economy services (docs/DESIGN.md §7; reference §7.4–7.6, §8 with the §14 fixes).

- ``record_forward(s)``: after each forward (background; a group in one transaction), keep
  the sampled verified batches in full (``settlement.audit.is_sampled`` under the router
  secret) and write one pending
  settlement per holder that served remote, receipt-verified batches.
- ``settle_many`` / ``settle_forward(s)`` / ``settle_pending``: claim pending settlements exactly
  once (conditional update on its state, inside the transaction that credits the holder).
- ``dispute``: re-verify a kept receipt, re-execute its carrier on a copy of the same blob
  (the site's own dispute runtime, or another live holder of that blob, never the accused),
  compare under the governance tolerances, and apply the outcome once per receipt.
- ``audit_pending``: the automatic audit of kept samples not yet disputed.
"""
from __future__ import annotations

import asyncio
import base64
import hashlib
import logging
import os
import secrets
import time

import numpy as np
from asgiref.sync import sync_to_async
from django.conf import settings
from django.db import IntegrityError, transaction
from django.db.models import F, Value
from django.db.models.functions import Least

from moe import wire
from moe.blobs import BlobStore
from router.hooks import ForwardRecord
from moe.receipts import (ReceiptError, carrier_hash, commitment_bytes, sketch, verify_stored_receipt)
from moe.runtime import RuntimeFault
from moe.content import BlobError, blob_uri
from registry.governance import current_policy
from moe.identity import load_or_create_key, provider_id, sign_body
from moe.jsonrpc import EXECUTION_ERROR
from registry.models import Holding, Provider, ReplicationPolicy
from registry.selectors import live_providers
from settlement.apps import current
from settlement.audit import Tolerances, is_sampled, verify_rows
from settlement.models import Dispute, ReceiptSample, Settlement

log = logging.getLogger(__name__)

INLINE_CARRIER_MAX = 64 * 1024  # larger carriers go to the receipt store (files), not into a row
REPUTATION_CAP = 1000
DOMAIN_FRAUD_PROOF = b"tenzro/moe/fraud-proof/v1"
DEFAULT_PRICE_PER_INPUT_TOKEN = 10
DEFAULT_MINIMUM_PRICE = 100


class EconomyError(Exception):
    """A refused economy request: JSON-RPC ``code``, ``message``, ``field`` and extra ``data``."""

    def __init__(self, code: int, message: str, field: str, **data):
        super().__init__(message)
        self.code = code
        self.message = message
        self.data = {"field": field, **data}


def now_ms() -> int:
    """Unix time in milliseconds."""
    return int(time.time() * 1000)


def router_secret() -> bytes:
    """The router's sampling secret (32 bytes): ``TENZRO_ROUTER_SECRET`` (hex) when set, else
    generated on first use into ``$TENZRO_VAR_DIR/router_secret`` (mode 0600) so every process
    of one site agrees (the way ``registry.operator`` keeps the operator token)."""
    env = os.environ.get("TENZRO_ROUTER_SECRET", "").strip()
    if env:
        return bytes.fromhex(env)
    path = settings.VAR_DIR / "router_secret"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.{secrets.token_hex(6)}.tmp")  # unique per thread too
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as fh:
            fh.write(secrets.token_hex(32))
        try:
            os.link(tmp, path)  # first writer wins
        except FileExistsError:
            pass
        os.unlink(tmp)
    return bytes.fromhex(path.read_text().strip())


def site_key():
    """The site's ed25519 key that signs fraud proofs (``$TENZRO_VAR_DIR/site.key``, created once)."""
    return load_or_create_key(settings.VAR_DIR / "site.key")


def receipt_store() -> BlobStore:
    """Content-addressed store of large kept carriers (``$TENZRO_VAR_DIR/receipts``; never served)."""
    return BlobStore(settings.VAR_DIR / "receipts")


# ----------------------------------------------------------------------------- sampling


def record_forward(record: ForwardRecord, one_in: int | None = None) -> dict:
    """Keep the sampled batches of a finished forward and write its pending settlements.

    ``one_in``: sampling rate N (default: the governance field ``receipt_sample_one_in``).
    Idempotent per forward: samples are keyed by request id and settlements unique per
    (forward_id, provider). Returns ``{"samples": [keys], "settlements": [providers]}``.
    """
    return record_forwards([record], one_in)[0]


def record_forwards(records: list[ForwardRecord], one_in: int | None = None) -> list[dict]:
    """``record_forward`` of each of ``records`` in one transaction (a generation's forwards
    arrive in groups: one commit instead of one per layer and step); one result each, in order."""
    records = list(records)
    if not any(r.verified for r in records):
        return [{"samples": [], "settlements": []} for _ in records]
    n = one_in if one_in is not None else current_policy().receipt_sample_one_in
    secret = router_secret()
    t = now_ms()
    built = [_forward_rows(r, n, secret, t) for r in records]
    with transaction.atomic():
        ReceiptSample.objects.bulk_create([x for samples, _ in built for x in samples], ignore_conflicts=True)
        Settlement.objects.bulk_create([x for _, rows in built for x in rows], ignore_conflicts=True)
        kept = set(ReceiptSample.objects.filter(key__in=[x.key for samples, _ in built for x in samples])
                   .values_list("key", flat=True))
    return [{"samples": sorted(x.key for x in samples if x.key in kept),
             "settlements": sorted(row.provider for row in rows)} for samples, rows in built]


def _forward_rows(record: ForwardRecord, n: int, secret: bytes, t: int) -> tuple[list, list]:
    """(the ``ReceiptSample`` rows kept 1 in ``n``, one pending ``Settlement`` per holder) of one
    forward, unsaved; none for a forward without verified batches."""
    samples: list[ReceiptSample] = []
    per_holder: dict[str, list] = {}
    for b in record.verified:
        per_holder.setdefault(b.provider, []).append(b)
        commit = b.receipt["commitment"]
        if not is_sampled(secret, commit, n):
            continue
        req = b.request
        proj = np.frombuffer(base64.b64decode(b.receipt["sketch"]), dtype="<f8").reshape(len(req.tokens), -1)
        inline = len(req.payload) <= INLINE_CARRIER_MAX
        samples.append(ReceiptSample(
            key=f"moe_receipt:{record.model_id}:{t:013d}:{commit[:16]}{req.request_id[:8]}",
            forward_id=record.forward_id, provider=b.provider, model_id=req.model_id, layer=req.layer,
            expert=req.expert, tokens=[int(x) for x in req.tokens], d_model=req.d_model, request_id=req.request_id,
            carrier_kind=req.carrier, output_kind=req.output, blob_hash=b.receipt.get("blob_hash", ""),
            quant=b.receipt.get("quant", ""), commitment=commit,
            commitment_rows=commitment_bytes(req.tokens, b.rows, proj), receipt=b.receipt,
            carrier_inline=req.payload if inline else None,
            carrier_hash="" if inline else receipt_store().put(req.payload),
            carrier_bytes=len(req.payload), stored_at_ms=t))
    rows = [Settlement(forward_id=record.forward_id, provider=p, model_id=record.model_id,
                       tokens=sum(len(b.request.tokens) for b in bs), batches=len(bs),
                       commitments_digest=hashlib.sha256(b"".join(bytes.fromhex(b.receipt["commitment"])
                                                                  for b in bs)).hexdigest(),
                       created_ms=t)
            for p, bs in per_holder.items()]
    return samples, rows


# ----------------------------------------------------------------------------- settlement


def price(tokens: int, price_per_input_token: int, minimum_price: int, share_bps: int) -> tuple[int, int, int]:
    """(gross, holder_amount, network_fee) of ``tokens`` (reference §8): ``gross = max(tokens ×
    price_per_input_token, minimum_price)``, ``holder_amount = gross × share_bps // 10000``,
    ``network_fee = gross − holder_amount``. Integers (smallest currency units)."""
    gross = max(int(tokens) * int(price_per_input_token), int(minimum_price))
    holder = gross * int(share_bps) // 10_000
    return gross, holder, gross - holder


def settle_many(pks: list[int]) -> int:
    """Claim and pay pending settlements ``pks`` exactly once, in one transaction; returns how
    many this call paid.

    Claims go by price group: ``UPDATE … SET state='settled' WHERE id IN (rows of one holder
    and one gross) AND state='pending'`` inside the transaction that credits the holders
    (``balance += holder_amount`` per claimed row, reputation +1 per paid row capped at
    ``REPUTATION_CAP`` when ``holder_amount > 0``: the only way reputation rises); only the rows
    the update claimed are paid, so a row is never paid twice. One statement per group instead
    of one per row: a generation's flush holds hundreds of rows of a handful of prices.
    The pending rows are locked first (``SELECT … FOR UPDATE`` on PostgreSQL), so a second
    worker, a retried task or another beat waits, then finds them settled and pays nothing.
    Pricing: the holder's advertised ``price_per_input_token`` / ``minimum_price`` (signed
    heartbeat; defaults 10 / 100), split by ``settlement_holder_share_bps``. One policy read,
    one price read and one credit per holder for the whole list.
    """
    if not pks:
        return 0
    with transaction.atomic():
        rows = list(Settlement.objects.select_for_update().filter(pk__in=list(pks), state=Settlement.State.PENDING)
                    .order_by("pk").values_list("pk", "provider", "tokens"))
        if not rows:
            return 0
        share = current_policy().settlement_holder_share_bps
        prices = {p: (ppt, mp) for p, ppt, mp in Provider.objects.filter(provider__in={r[1] for r in rows})
                  .values_list("provider", "price_per_input_token", "minimum_price")}
        groups: dict[tuple[str, int, int, int], list[int]] = {}  # (provider, gross, holder, fee) -> pks
        for pk, provider, tokens in rows:
            ppt, mp = prices.get(provider, (DEFAULT_PRICE_PER_INPUT_TOKEN, DEFAULT_MINIMUM_PRICE))
            groups.setdefault((provider, *price(tokens, ppt, mp, share)), []).append(pk)
        credit: dict[str, list[int]] = {}  # provider -> [amount, paid rows with an amount]
        paid = 0
        settled_at = now_ms()
        for (provider, gross, holder, fee), group in sorted(groups.items()):
            claimed = Settlement.objects.filter(pk__in=group, state=Settlement.State.PENDING).update(
                state=Settlement.State.SETTLED, gross=gross, holder_amount=holder, network_fee=fee,
                settled_at_ms=settled_at)
            paid += claimed
            if holder > 0 and claimed:
                c = credit.setdefault(provider, [0, 0])
                c[0] += holder * claimed
                c[1] += claimed
        for provider, (amount, n) in sorted(credit.items()):  # provider order: no deadlock with other writers
            Provider.objects.filter(provider=provider).update(
                balance=F("balance") + amount, reputation=Least(F("reputation") + n, Value(REPUTATION_CAP)))
        return paid


def settle_forwards(forward_ids: list[str]) -> int:
    """Settle every pending settlement of ``forward_ids`` (``settle_many``); returns how many this call paid."""
    return settle_many(list(Settlement.objects.filter(forward_id__in=list(forward_ids),
                                                      state=Settlement.State.PENDING).values_list("pk", flat=True)))


def settle_forward(forward_id: str) -> int:
    """Settle every pending settlement of ``forward_id``; returns how many this call paid."""
    return settle_forwards([forward_id])


def settle_pending(limit: int = 1000) -> int:
    """Sweep: settle up to ``limit`` pending settlements (oldest first); returns how many were paid."""
    return settle_many(list(Settlement.objects.filter(state=Settlement.State.PENDING).order_by("id")
                            .values_list("pk", flat=True)[:limit]))


# ----------------------------------------------------------------------------- disputes


def sample_carrier(s: ReceiptSample) -> bytes:
    """The exact carrier bytes kept with ``s``; raises ``EconomyError`` when the file is gone or altered."""
    if s.carrier_inline is not None:
        return bytes(s.carrier_inline)
    try:
        return receipt_store().get(s.carrier_hash, verify=True)
    except (BlobError, OSError) as exc:
        raise EconomyError(EXECUTION_ERROR, f"the kept carrier of {s.key} cannot be read: {exc}", "key") from exc


def _site_execute(s: ReceiptSample, rows: np.ndarray) -> np.ndarray | None:
    """Re-execute on the site's dispute runtime when the site's blob store has the blob; else None."""
    store = BlobStore(settings.TENZRO["BLOB_DIR"])
    if not s.blob_hash or not store.has(s.blob_hash):
        return None
    rt = current().dispute_runtime
    mid = f"blob:{s.blob_hash}"
    if not rt.has(mid, 0, 0):
        rt.load_expert(mid, 0, 0, store.get(s.blob_hash, verify=True), blob_uri(s.blob_hash))
    return rt.execute(mid, 0, 0, rows, rows.shape[0], s.d_model, metered=False)


def _other_holders(s: ReceiptSample) -> list[str]:
    """Live holders of the same blob for the same expert, the accused excluded."""
    return list(Holding.objects.filter(model_id=s.model_id, layer=s.layer, expert=s.expert,
                                       blob_uri=blob_uri(s.blob_hash), provider__in=live_providers())
                .exclude(provider_id=s.provider).order_by("provider_id").values_list("provider_id", flat=True))


async def reexecute(s: ReceiptSample, carrier: bytes) -> tuple[np.ndarray, str]:
    """Re-execute a kept batch on a copy of the same blob: (rows f32 ``[n, d_model]`` as the
    router would have decoded them, executor "site" or a provider id).

    The carrier is decoded exactly as the holder decoded it; the output passes the same wire
    encoding (``output_kind``) so an honest holder's rows are reproduced. Raises
    ``EconomyError`` (-32004 naming the blob) when no executor holds it.
    """
    n = len(s.tokens)
    x = wire.decode_rows(carrier, s.carrier_kind, s.d_model, n)
    try:
        out = await asyncio.to_thread(_site_execute, s, x)
        who = "site"
    except (RuntimeFault, BlobError, ValueError) as exc:
        log.warning("site re-execution of %s failed: %s", s.key, exc)
        out = None
    if out is None:
        from router.services import send_to_agent  # the site's agent relay (same layer, lazily)

        out = None
        for p in await sync_to_async(_other_holders)(s):
            try:
                out = await send_to_agent(s.model_id, p, s.layer, s.expert, list(s.tokens), x, purpose="dispute")
                who = p
                break
            except (ConnectionError, ValueError) as exc:
                log.warning("dispute executor %s… failed for %s: %s", p[:12], s.key, exc)
    if out is None:
        uri = blob_uri(s.blob_hash) if s.blob_hash else "(none)"
        raise EconomyError(EXECUTION_ERROR, f"no executor holds blob {uri}"
                           f" for {s.model_id} l{s.layer}/e{s.expert}: neither the site's blob store nor a live "
                           "holder other than the accused", "key", blob_uri=blob_uri(s.blob_hash) if s.blob_hash
                           else None)
    out = np.asarray(out, dtype=np.float32)
    kind = wire.output_encoding(out, s.output_kind)  # as the holder chose (f32 for f16 out of range)
    if kind != "f32":
        out = wire.decode_rows(wire.encode_rows(out, kind), kind, s.d_model, n, "outputs")
    return out, who


def sample_json(s: ReceiptSample, dispute: Dispute | None = None) -> dict:
    """A list row: ``{key, model_id, layer, expert, tokens, provider, commitment, stored_at_ms,
    forward_id, dispute}`` (``tokens`` the count; ``dispute`` null or "upheld"/"rejected")."""
    return {"key": s.key, "model_id": s.model_id, "layer": s.layer, "expert": s.expert, "tokens": len(s.tokens),
            "provider": s.provider, "commitment": s.commitment, "stored_at_ms": s.stored_at_ms,
            "forward_id": s.forward_id,
            "dispute": None if dispute is None else ("upheld" if dispute.upheld else "rejected")}


def dispute_json(d: Dispute, s: ReceiptSample) -> dict:
    """The reference's dispute result plus ``executed_by``, ``proof`` (when upheld), ``automatic``,
    ``reputation_after`` and ``quarantined_until_ms``."""
    return {"key": s.key, "model_id": s.model_id, "layer": s.layer, "expert": s.expert, "tokens": len(s.tokens),
            "provider": s.provider, "commitment": s.commitment, "disputed": d.upheld,
            "verification": d.verification, "executed_by": d.executed_by, "proof": d.proof,
            "automatic": d.automatic, "reputation_after": d.reputation_after,
            "quarantined_until_ms": d.quarantined_until_ms, "created_ms": d.created_ms}


def _tolerances(p) -> Tolerances:
    return Tolerances(p.dispute_min_overlap, p.dispute_max_rel_delta, p.dispute_min_rows_passed)


def _load_sample(key: str) -> tuple[ReceiptSample, Dispute | None]:
    s = ReceiptSample.objects.select_related("dispute").filter(key=key).first()  # one query for both
    if s is None:
        raise EconomyError(EXECUTION_ERROR, f"no kept receipt with key {key!r}", "key")
    return s, getattr(s, "dispute", None)


def _dispute_inputs(key: str) -> tuple[ReceiptSample, Dispute | None, bytes | None, ReplicationPolicy]:
    """One database hop for a dispute: (sample, its stored dispute or None, its carrier bytes
    (None when already disputed), the policy in force)."""
    s, done = _load_sample(key)
    return s, done, None if done is not None else sample_carrier(s), current_policy()


def fraud_proof(s: ReceiptSample, rows: np.ndarray, executed_by: str, verification: dict) -> dict:
    """A site-signed fraud proof: the stored receipt and request identity, the re-executed rows'
    commitment, the executor and the failing tokens; ``{body, signature, signer}``."""
    ih = bytes.fromhex(s.receipt["input_hash"])
    redone = hashlib.sha256(commitment_bytes(s.tokens, rows, sketch(rows, ih))).hexdigest()
    key = site_key()
    body = {"key": s.key, "provider": s.provider, "model_id": s.model_id, "layer": s.layer, "expert": s.expert,
            "tokens": list(s.tokens), "request_id": s.request_id, "forward_id": s.forward_id,
            "carrier_kind": s.carrier_kind, "carrier_sha256": hashlib.sha256(sample_carrier(s)).hexdigest(),
            "receipt": {k: v for k, v in s.receipt.items() if not isinstance(v, float)},
            "committed": s.commitment, "reexecuted_commitment": redone, "executed_by": executed_by,
            "rows_total": verification["rows_total"], "rows_passed": verification["rows_passed"],
            "failing_tokens": [r["token"] for r in verification["failing_rows"]], "issued_ms": now_ms()}
    return {"body": body, "signature": sign_body(key, DOMAIN_FRAUD_PROOF, body), "signer": provider_id(key)}


PENALTY_FIELDS = ["reputation", "dispute_streak", "quarantined_until_ms"]


def _penalize(prov: Provider, upheld: bool, policy: ReplicationPolicy, d: Dispute) -> None:
    """Apply one dispute's outcome to ``prov`` in memory (the caller saves ``PENALTY_FIELDS``)
    and note the result on ``d``: an upheld one costs ``dispute_penalty`` reputation and, at
    ``quarantine_after_upheld`` in a row, a quarantine of ``quarantine_ms``; an honest one
    clears the streak."""
    if upheld:
        prov.reputation = max(0, prov.reputation - policy.dispute_penalty)
        prov.dispute_streak += 1
        if prov.dispute_streak >= policy.quarantine_after_upheld:
            prov.quarantined_until_ms = now_ms() + policy.quarantine_ms
            prov.dispute_streak = 0
    else:
        prov.dispute_streak = 0  # an honest re-execution clears the streak
    d.reputation_after = prov.reputation
    d.quarantined_until_ms = prov.quarantined_until_ms


def _apply_outcome(s: ReceiptSample, upheld: bool, verification: dict, executed_by: str, automatic: bool,
                   policy: ReplicationPolicy, rows: np.ndarray) -> Dispute:
    """Write the dispute once (with its fraud proof over the re-executed ``rows`` when
    ``upheld``) and apply its effect under ``policy`` in the same transaction (a concurrent
    second dispute of the same key gets the stored outcome and penalizes nothing)."""
    proof = fraud_proof(s, rows, executed_by, verification) if upheld else None
    try:
        with transaction.atomic():
            d = Dispute.objects.create(sample=s, provider=s.provider, upheld=upheld, verification=verification,
                                       executed_by=executed_by, proof=proof, automatic=automatic,
                                       created_ms=now_ms())
            prov = Provider.objects.select_for_update().filter(provider=s.provider).first()
            if prov is not None:
                _penalize(prov, upheld, policy, d)
                prov.save(update_fields=PENALTY_FIELDS)
                d.save(update_fields=["reputation_after", "quarantined_until_ms"])
            ReceiptSample.objects.filter(pk=s.pk).update(audit_state=ReceiptSample.Audit.DONE)
            return d
    except IntegrityError:
        return Dispute.objects.get(sample=s)


async def _rerun(s: ReceiptSample, carrier: bytes, policy: ReplicationPolicy) -> tuple[np.ndarray, str, dict]:
    """Verify ``s``'s stored receipt, re-execute its batch and compare under ``policy``'s
    tolerances: (re-executed rows, executor, ``verify_rows`` result). Raises ``EconomyError``
    when the stored receipt does not verify (nobody is penalized) or no executor holds the blob."""
    try:
        verify_stored_receipt(s.receipt, provider=s.provider, request_id=s.request_id, model_id=s.model_id,
                              layer=s.layer, expert=s.expert, tokens=list(s.tokens), d_model=s.d_model,
                              carrier_kind=s.carrier_kind, carrier=carrier, commitment=bytes(s.commitment_rows))
    except ReceiptError as exc:
        raise EconomyError(EXECUTION_ERROR, f"the stored receipt {s.key} does not verify ({exc}); refusing to "
                           "dispute it, nobody is penalized", "key") from exc
    rows, who = await reexecute(s, carrier)
    ver = await asyncio.to_thread(verify_rows, bytes(s.commitment_rows), rows, carrier_hash(s.carrier_kind, carrier),
                                  _tolerances(policy))
    return rows, who, ver


async def dispute(key: str, automatic: bool = False) -> dict:
    """``tenzro_moeDisputeReceipt``: re-verify, re-execute, compare, apply (module docstring).

    A receipt already disputed returns its stored outcome (no second penalty). Raises
    ``EconomyError``: unknown key (-32004), a stored receipt that does not verify (-32004,
    no penalty: a tampered store cannot manufacture a proof), no executor (-32004 naming
    the blob).
    """
    s, done, carrier, policy = await sync_to_async(_dispute_inputs)(key)
    if done is not None:
        return dispute_json(done, s)
    rows, who, ver = await _rerun(s, carrier, policy)
    upheld = not ver["pass"]
    d = await sync_to_async(_apply_outcome)(s, upheld, ver, who, automatic, policy, rows)
    if upheld:
        log.warning("dispute upheld: %s… signed wrong rows (%s); reputation now %s", s.provider[:12], key,
                    d.reputation_after)
    return dispute_json(d, s)


def _pending_audits(limit: int) -> list[str]:
    return list(ReceiptSample.objects.filter(audit_state=ReceiptSample.Audit.PENDING, dispute__isnull=True)
                .order_by("id").values_list("key", flat=True)[:limit])


async def audit(key: str) -> dict | None:
    """The automatic audit of one kept sample: ``dispute(key, automatic=True)``; idempotent (a
    disputed key returns its stored outcome). When no executor holds the blob the sample is
    marked "skipped" and None returned."""
    try:
        return await dispute(key, automatic=True)
    except EconomyError as exc:
        log.warning("audit of %s not run: %s", key, exc.message)
        await sync_to_async(ReceiptSample.objects.filter(key=key, audit_state=ReceiptSample.Audit.PENDING)
                            .update)(audit_state=ReceiptSample.Audit.SKIPPED)
        return None


def _audit_inputs(keys: list[str]) -> tuple[list[ReceiptSample], dict[str, bytes | EconomyError],
                                             ReplicationPolicy]:
    """``audit_many``'s one database hop: the kept samples of ``keys`` that have no dispute
    yet (oldest first), each one's carrier bytes or the ``EconomyError`` reading them, and the
    policy in force."""
    samples = list(ReceiptSample.objects.filter(key__in=keys, dispute__isnull=True).order_by("id"))
    carriers: dict[str, bytes | EconomyError] = {}
    for s in samples:
        try:
            carriers[s.key] = sample_carrier(s)
        except EconomyError as exc:
            carriers[s.key] = exc
    return samples, carriers, current_policy()


def _apply_outcomes(done: list[tuple[ReceiptSample, np.ndarray, str, dict]], skipped: list[int],
                    policy: ReplicationPolicy) -> list[Dispute]:
    """``audit_many``'s writes: each audited sample's dispute (automatic, with its fraud proof
    when upheld) and its effect on the holder's reputation in order, in one transaction; the
    ``skipped`` sample ids marked skipped. A concurrent dispute of one of the samples makes the
    transaction fail as a whole: then each is written on its own (``_apply_outcome``: the
    stored outcome wins, nothing is penalized twice)."""
    if skipped:
        ReceiptSample.objects.filter(pk__in=skipped, audit_state=ReceiptSample.Audit.PENDING).update(
            audit_state=ReceiptSample.Audit.SKIPPED)
    if not done:
        return []
    rows = [Dispute(sample=s, provider=s.provider, upheld=not ver["pass"], verification=ver, executed_by=who,
                    proof=fraud_proof(s, out, who, ver) if not ver["pass"] else None, automatic=True,
                    created_ms=now_ms()) for s, out, who, ver in done]
    try:
        with transaction.atomic():
            provs = {p.provider: p for p in Provider.objects.select_for_update().filter(
                provider__in={s.provider for s, *_ in done})}
            for d in rows:  # in order, before the rows are written: each carries the reputation after it
                if d.provider in provs:
                    _penalize(provs[d.provider], d.upheld, policy, d)
            disputes = Dispute.objects.bulk_create(rows)
            for prov in provs.values():
                prov.save(update_fields=PENALTY_FIELDS)
            ReceiptSample.objects.filter(pk__in=[s.pk for s, *_ in done]).update(audit_state=ReceiptSample.Audit.DONE)
            return disputes
    except IntegrityError:
        return [_apply_outcome(s, not ver["pass"], ver, who, True, policy, out) for s, out, who, ver in done]


async def audit_many(keys: list[str]) -> int:
    """The automatic audits of the kept samples ``keys`` (a generation's flush, or a sweep),
    each as ``audit(key)`` does it (re-verify the stored receipt, re-execute, compare, write the
    dispute and its effect), with the samples and the policy read in one database hop and every
    outcome written in one transaction (``_apply_outcomes``): one audit took two hops and about
    eight queries of its own, ~10 % of the site's GIL samples at 16 clients. Keys already
    disputed or unknown are left as they are; a sample whose receipt does not verify or that no
    executor can re-run is marked skipped. Returns how many were audited."""
    if not keys:
        return 0
    samples, carriers, policy = await sync_to_async(_audit_inputs)(list(keys))
    done, skipped = [], []
    for s in samples:
        try:
            carrier = carriers[s.key]
            if isinstance(carrier, EconomyError):
                raise carrier
            out, who, ver = await _rerun(s, carrier, policy)
        except EconomyError as exc:
            log.warning("audit of %s not run: %s", s.key, exc.message)
            skipped.append(s.pk)
            continue
        done.append((s, out, who, ver))
    if done or skipped:
        for d in await sync_to_async(_apply_outcomes)(done, skipped, policy):
            if d.upheld:
                log.warning("dispute upheld: %s… signed wrong rows (%s); reputation now %s", d.provider[:12],
                            d.sample.key, d.reputation_after)
    return len(done)


async def audit_pending(limit: int = 100) -> int:
    """Audit up to ``limit`` kept samples that have no dispute yet (``audit_many``); returns how
    many were audited."""
    return await audit_many(await sync_to_async(_pending_audits)(limit))
