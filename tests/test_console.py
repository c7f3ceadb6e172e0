"""Operator console (server side): pages render from real records, writes need staff, bad input changes nothing."""
from __future__ import annotations

import json
import re

import pytest
from django.contrib.auth import get_user_model
from nacl.signing import SigningKey

from prepare.jobs import create_job
from prepare.models import PrepareJob
from registry import governance
from registry.heartbeat import ingest
from moe.identity import provider_id
from registry.models import AuditEntry, MoeModel, Proposal, Provider
from tenzro_site.console.charts import bar_chart
from tests.conftest import QWEN, holding, signed_heartbeat

pytestmark = pytest.mark.django_db

PAGES = ["/", "/governance/", "/providers/", "/coverage/", "/coverage/m", "/prepare/", "/serving/"]


def two_providers() -> tuple[str, str]:
    """Providers a (experts 0-3 of layers 0-1, 1500 tps, GPU) and b (experts 0-1 of layer 0), both live."""
    ka, kb = SigningKey(bytes([1]) * 32), SigningKey(bytes([2]) * 32)
    ingest(signed_heartbeat(ka, [holding("m", layer, e, committed_tps=1500) for layer in (0, 1) for e in range(4)],
                            name="gpu-a", moe_gpu=True))
    ingest(signed_heartbeat(kb, [holding("m", 0, e, residency="Cold") for e in range(2)], name="cpu-b"))
    Provider.objects.update(connected=True)
    MoeModel.objects.create(model_id="m", family="qwen3_moe", num_experts=4, top_k=2, hidden_size=8,
                            expert_d_ff=4, moe_layers=[0, 1])
    return provider_id(ka), provider_id(kb)


def staff(client, name="alice"):
    user = get_user_model().objects.create_user(name, password="pw-" + name, is_staff=True)
    client.force_login(user)
    return user


def test_every_page_renders_real_records(client):
    a, b = two_providers()
    Provider.objects.filter(provider=b).update(batch_failures=3, batches_served=7)
    for url in PAGES + [f"/providers/{a}"]:
        r = client.get(url)
        assert r.status_code == 200, url
        html = r.content.decode()
        assert "/static/django_htmx/htmx-2.min.js" in html and "/static/console/console.css" in html
        # No asset from another host (a CDN): every src/href is this site's. (A bare "cdn" test
        # failed on a random CSRF token that happened to contain those letters.)
        assert not re.search(r'(?:src|href)="(?:https?:)?//', html), url
    overview = client.get("/").content.decode()
    assert "gpu-a" in overview and "cpu-b" in overview and ">3<" in overview  # b's failed batches
    cov = client.get("/coverage/m").content.decode()
    # layer 0 experts 0-1 have 2 holders (= min), layer 0 experts 2-3 and layer 1 have 1 (below min); all hot.
    assert cov.count('class="rok hot"') == 2 and cov.count('class="r1 hot"') == 6
    assert cov.count("<tr><td>") >= 6 and "Expert slots by replication" in cov
    holders = client.get("/coverage/m/holders?layer=0&expert=1").content.decode()
    assert "gpu-a" in holders and "cpu-b" in holders and "Cold" in holders and "2 distinct holders" in holders
    page = client.get(f"/providers/{a}").content.decode()
    assert "<code>0-3</code>" in page and "1500" in page
    assert "cpu-b" not in client.get("/providers/?role=Router").content.decode()


def test_odd_query_strings_never_500(client):
    two_providers()
    odd = ["?status=Nope", "?live=maybe&role=%00", "?layer=-1&expert=x", "?page=999999999999999999999",
           "?status[]=1&status=Open", "?%ff=%fe", "?next=javascript:alert(1)"]
    for url in PAGES + ["/providers/" + "0" * 64, "/coverage/m/holders", "/coverage/%E2%9C%93", "/login/"]:
        for q in odd:
            r = client.get(url + q)
            assert r.status_code in (200, 400, 404), (url, q, r.status_code)
    assert client.get("/coverage/m/holders?layer=-1&expert=0").status_code == 400
    assert client.get("/providers/nobody").status_code == 404
    assert client.get("/coverage/nope").status_code == 404  # an unknown model is not an empty heatmap
    assert "ignored invalid filter" in client.get("/governance/?status=Nope").content.decode()


def test_anonymous_and_non_staff_cannot_write(client):
    p = governance.create_proposal("t", {"min_replication": 1}, "operator")
    before = (Proposal.objects.count(), AuditEntry.objects.count(), governance.policy_json())
    writes = [("/governance/proposals", {"title": "x", "min_replication": 3}),
              (f"/governance/proposals/{p.pk}/vote", {"approve": "yes"}),
              (f"/governance/proposals/{p.pk}/withdraw", {})]
    for url, data in writes:
        r = client.post(url, data)
        assert r.status_code == 302 and r["Location"].startswith("/login/"), url
    get_user_model().objects.create_user("bob", password="pw")
    client.login(username="bob", password="pw")
    for url, data in writes:
        assert client.post(url, data).status_code == 403, url
    staff(client)
    assert client.get(writes[0][0]).status_code == 405  # writes are POST only
    assert (Proposal.objects.count(), AuditEntry.objects.count(), governance.policy_json()) == before


def test_csrf_is_enforced_on_console_writes(client):
    from django.test import Client
    csrf_client = Client(enforce_csrf_checks=True)
    staff(csrf_client)
    assert csrf_client.post("/governance/proposals", {"title": "x", "min_replication": 3}).status_code == 403
    assert Proposal.objects.count() == 0


def test_staff_create_vote_apply_and_withdraw(client):
    staff(client)  # electorate: operator + user:alice → quorum 2
    r = client.post("/governance/proposals", {"title": "min 3", "description": "more copies",
                                              "min_replication": "3", "hot_threshold_tps": ""})
    assert r.status_code == 302
    p = Proposal.objects.get()
    assert (p.proposer, p.changes, p.status) == ("user:alice", {"min_replication": 3}, "Open")
    client.post(f"/governance/proposals/{p.pk}/vote", {"approve": "yes"})
    page = client.get("/governance/").content.decode()
    assert "1 / 2 yes" in page and "user:alice: yes" in page
    assert governance.policy_json()["min_replication"] == 2
    # A second vote by the same user is refused (votes are final) and shown as an error.
    r = client.post(f"/governance/proposals/{p.pk}/vote", {"approve": "no"}, follow=True)
    assert "already voted" in r.content.decode()
    governance.vote(p.pk, "operator", True)
    assert governance.policy_json()["min_replication"] == 3
    assert "min_replication 2 → 3 (policy v2)" in client.get("/governance/").content.decode()
    q = governance.create_proposal("later", {"max_replication": 4}, "operator")
    client.post(f"/governance/proposals/{q.pk}/withdraw")
    assert Proposal.objects.get(pk=q.pk).status == "Withdrawn"
    assert AuditEntry.objects.filter(actor="user:alice", action="withdrawn").exists()


@pytest.mark.parametrize("data, field, message", [
    ({"title": "", "min_replication": "3"}, "title", "required"),
    ({"title": "x"}, None, "set at least one policy field"),
    ({"title": "x", "min_replication": "abc"}, "min_replication", "whole number"),
    ({"title": "x", "min_replication": "0"}, "min_replication", "min_replication"),
    ({"title": "x", "min_replication": "9"}, "max_replication", "must be >= min_replication"),  # max 8 in force
    ({"title": "x", "settlement_holder_share_bps": "10001"}, "settlement_holder_share_bps", "[0, 10000]"),
    ({"title": "x", "dispute_min_overlap": "nan"}, "dispute_min_overlap", ""),
])
def test_proposal_form_validates_like_the_rpc(client, data, field, message):
    staff(client)
    r = client.post("/governance/proposals", data)
    assert r.status_code == 400
    form = r.context["form"]
    errors = form.errors.get(field or "__all__")
    assert errors and message in " ".join(errors), form.errors
    assert Proposal.objects.count() == 0 and AuditEntry.objects.count() == 0
    # The RPC refuses the same change with the same field.
    changes = {k: v for k, v in data.items() if k != "title"}
    if field and field != "title" and not {"abc", "nan"} & set(changes.values()):
        with pytest.raises(governance.GovernanceError) as exc:
            governance.validate_changes({k: json.loads(v) for k, v in changes.items()})
        assert exc.value.field == f"changes.{field}"


def test_prepare_progress_fragment_polls_until_final(client):
    job = create_job(str(QWEN), "qwen-console", layers=[0], experts=[0, 1])
    r = client.get(f"/prepare/{job.job_id}/progress", HTTP_HX_REQUEST="true")
    assert r.status_code == 200 and 'hx-trigger="every 1s"' in r.content.decode() and "0 / 2" in r.content.decode()
    assert 'hx-trigger="every 2s"' in client.get("/prepare/").content.decode()
    PrepareJob.objects.filter(pk=job.pk).update(state="completed", completed_experts=2)
    r = client.get(f"/prepare/{job.job_id}/progress", HTTP_HX_REQUEST="true")
    assert r.status_code == 286 and "hx-trigger" not in r.content.decode() and "2 / 2" in r.content.decode()
    assert client.get(f"/prepare/{job.job_id}/progress").status_code == 200  # plain request
    assert client.get("/prepare/rows", HTTP_HX_REQUEST="true").status_code == 286


def test_bar_chart_geometry():
    chart = bar_chart("t", [("0", 0, "r0"), ("1", 5, "r1"), ("2", 10, "rok")], width=110, height=100)
    heights = [b.h for b in chart.bars]
    assert heights[0] == 0 and heights[2] == chart.baseline - 28 and heights[1] == pytest.approx(heights[2] / 2)
    assert all(b.y + b.h == pytest.approx(chart.baseline) for b in chart.bars)
    assert bar_chart("flat", [("0", 0, "")]).bars[0].h == 0
    with pytest.raises(ValueError):
        bar_chart("bad", [("x", -1, "")])


def test_bar_chart_labels_clear_the_title_and_stay_inside():
    """Issue 24 item 15: a full-height bar's value label sat on the title; the last minute label
    of the settlement chart ran past the right edge."""
    from tenzro_site.console.charts import CHAR_W, TITLE_H

    chart = bar_chart("Tokens settled per minute", [(f"10:{m:02d}", 1000 + m, "") for m in range(30)],
                      width=520, tick_every=5)
    for b in chart.bars:
        assert b.y - 3 - 10 >= TITLE_H  # the value text (10 px, baseline 3 above the bar) is below the title
        for text, x, anchor in ((b.label, b.label_x, b.label_anchor), (str(b.value), b.value_x, b.value_anchor)):
            w = len(text) * CHAR_W
            left = {"start": x, "middle": x - w / 2, "end": x - w}[anchor]
            assert 0 <= left and left + w <= chart.width, (text, x, anchor)
    assert chart.bars[-1].label_anchor == "end" and chart.bars[-1].tick


def test_model_names_read_as_english_plurals():
    """"Audit entrys" in the admin (issue 24 item 15): no consonant + "ys" plural anywhere."""
    import re

    from django.apps import apps

    bad = [str(m._meta.verbose_name_plural) for m in apps.get_models()
           if re.search(r"[^aeiou]ys$", str(m._meta.verbose_name_plural))]
    assert not bad, bad
    assert AuditEntry._meta.verbose_name_plural == "audit entries"


# ---- receipts economy pages --------------------------------------------------------------

ECON_PAGES = ["/receipts/", "/disputes/", "/settlements/", "/settlements.csv"]


@pytest.fixture
def economy():
    """See ``make_economy``."""
    return make_economy()


def make_economy():
    """Through the real services: an honest holder (two forwards, settled) and a lying one
    (one forward, settled), every batch kept (one_in=1); returns ``(honest_id, liar_id, keys)``
    with ``keys = {"honest": [...], "liar": [...]}``."""
    from django.conf import settings

    from moe.blobs import BlobStore
    from settlement import services
    from settlement.models import ReceiptSample
    from tests.test_settlement import batch, holder, record, weights

    w = weights()
    h = BlobStore(settings.TENZRO["BLOB_DIR"]).put(w.to_blob())
    hk, lk = SigningKey(bytes([21]) * 32), SigningKey(bytes([22]) * 32)
    holder(hk, name="honest-h", price_per_input_token=7, minimum_price=20)
    holder(lk, name="liar-l")
    keys: dict[str, list[str]] = {"honest": [], "liar": []}
    for who, k, lie, seeds in (("honest", hk, False, (1, 2)), ("liar", lk, True, (3,))):
        for seed in seeds:
            b = batch(k, w, h, lie=lie, seed=seed, expert=seed)
            rec = record(b)
            services.record_forward(rec, one_in=1)
            services.settle_forward(rec.forward_id)
            keys[who].append(ReceiptSample.objects.get(request_id=b.request.request_id).key)
    return provider_id(hk), provider_id(lk), keys


def test_receipts_browser_filters_and_receipt_page(client, economy):
    honest, liar, keys = economy
    page = client.get("/receipts/").content.decode()
    assert all(k[:40] in page for k in keys["honest"] + keys["liar"]) and "honest-h" in page and "liar-l" in page
    by_provider = client.get(f"/receipts/?provider={liar}").content.decode()
    assert keys["liar"][0][:40] in by_provider and keys["honest"][0][:40] not in by_provider
    by_expert = client.get("/receipts/?model=m&layer=0&expert=2").content.decode()
    assert keys["honest"][1][:40] in by_expert and keys["honest"][0][:40] not in by_expert
    assert "No kept receipt matches" in client.get("/receipts/?model=other").content.decode()
    r = client.get(f"/receipts/{keys['honest'][0]}")
    html = r.content.decode()
    assert r.status_code == 200 and 'id="signature-status" class="ok"' in html and "valid:" in html
    assert html.count("<tr><td>") >= 4  # one commitment row per token
    assert "Not disputed yet" in html and 'id="dispute-form"' not in html  # anonymous: no button
    assert client.get("/receipts/moe_receipt:nope").status_code == 404


def test_tampered_receipt_shows_an_invalid_signature(client, economy):
    from settlement.models import ReceiptSample

    _, _, keys = economy
    s = ReceiptSample.objects.get(key=keys["honest"][0])
    s.receipt = {**s.receipt, "signature": "00" * 64}
    s.save(update_fields=["receipt"])
    html = client.get(f"/receipts/{s.key}").content.decode()
    assert 'id="signature-status" class="bad"' in html and "INVALID" in html


def test_staff_dispute_shows_outcome_and_fraud_proof(client, economy):
    from settlement.models import Dispute

    honest, liar, keys = economy
    rep0 = Provider.objects.get(provider=liar).reputation
    staff(client)
    assert 'id="dispute-form"' in client.get(f"/receipts/{keys['liar'][0]}").content.decode()
    r = client.post(f"/receipts/{keys['liar'][0]}/dispute", follow=True)
    html = r.content.decode()
    assert r.status_code == 200 and "dispute upheld" in html and "outcome-upheld" in html and "fraud proof" in html
    assert Provider.objects.get(provider=liar).reputation < rep0
    r = client.post(f"/receipts/{keys['honest'][0]}/dispute", follow=True)
    assert "dispute rejected" in r.content.decode()
    assert Dispute.objects.count() == 2
    client.post(f"/receipts/{keys['liar'][0]}/dispute")  # again: the stored outcome, no second penalty
    assert Dispute.objects.count() == 2
    disputes = client.get("/disputes/").content.decode()
    assert "1 upheld, 1 rejected" in disputes and '"failing_tokens"' in disputes.replace("&quot;", '"')
    assert "liar-l" in client.get("/disputes/?outcome=upheld").content.decode()
    assert "liar-l" not in client.get("/disputes/?outcome=rejected").content.decode()
    assert client.post("/receipts/moe_receipt:nope/dispute").status_code == 404


def test_audits_listed_apart_and_operators_can_still_dispute(client, economy):
    """Issue 24 item 15: automatic audits are not operators' disputes (/disputes/ listed every
    audit as a green "rejected" dispute), and a receipt whose audit passed keeps the staff
    Dispute button; a failed audit already penalized, so it has none."""
    from asgiref.sync import async_to_sync

    from settlement import services
    from settlement.models import Dispute

    honest, liar, keys = economy
    for key in keys["honest"] + keys["liar"]:
        async_to_sync(services.audit)(key)
    assert Dispute.objects.filter(automatic=True).count() == 3
    page = client.get("/disputes/").content.decode()
    assert "Operators' disputes: 0 upheld, 0 rejected" in page and "2 passed" in page and "1 failed" in page
    operator_table = page[page.index('id="disputes"'):page.index('id="audits"')]
    assert "No operator dispute matches." in operator_table and "audit passed" not in operator_table
    audits_table = page[page.index('id="audits"'):]
    assert audits_table.count("audit passed") == 2 and audits_table.count("audit failed") == 1
    assert "audit passed" in client.get("/receipts/").content.decode()

    staff(client)
    html = client.get(f"/receipts/{keys['honest'][0]}").content.decode()
    assert 'id="dispute-form"' in html and "automatic audit" in html
    assert 'id="dispute-form"' not in client.get(f"/receipts/{keys['liar'][0]}").content.decode()
    rep = Provider.objects.get(provider=honest).reputation
    r = client.post(f"/receipts/{keys['honest'][0]}/dispute", follow=True)
    html = r.content.decode()
    assert "dispute rejected" in html and "operator's dispute" in html, html[html.find('id="dispute"'):][:1500]
    d = Dispute.objects.get(sample__key=keys["honest"][0])
    assert not d.automatic and not d.upheld and Dispute.objects.count() == 3
    assert Provider.objects.get(provider=honest).reputation == rep
    page = client.get("/disputes/").content.decode()
    assert "Operators' disputes: 0 upheld, 1 rejected" in page and "1 passed" in page
    # The failed audit answers its stored outcome: no second penalty, still the audit's record.
    rep = Provider.objects.get(provider=liar).reputation
    client.post(f"/receipts/{keys['liar'][0]}/dispute")
    assert Provider.objects.get(provider=liar).reputation == rep
    assert Dispute.objects.get(sample__key=keys["liar"][0]).automatic


def test_operator_dispute_restores_the_audit_when_it_cannot_run(economy, monkeypatch):
    from asgiref.sync import async_to_sync

    from settlement import disputes, services
    from settlement.models import Dispute

    _, _, keys = economy
    async_to_sync(services.audit)(keys["honest"][0])
    before = Dispute.objects.get(sample__key=keys["honest"][0])

    async def no_executor(key, automatic=False):
        raise services.EconomyError(-32004, "no executor holds the blob", "key")

    monkeypatch.setattr(services, "dispute", no_executor)
    with pytest.raises(services.EconomyError):
        async_to_sync(disputes.operator_dispute)(keys["honest"][0])
    after = Dispute.objects.get(sample__key=keys["honest"][0])
    assert after.automatic and after.created_ms == before.created_ms and after.verification == before.verification


def test_anonymous_and_non_staff_cannot_dispute(client, economy):
    from django.test import Client

    from settlement.models import Dispute

    _, liar, keys = economy
    rep0 = Provider.objects.get(provider=liar).reputation
    url = f"/receipts/{keys['liar'][0]}/dispute"
    r = client.post(url)
    assert r.status_code == 302 and r["Location"].startswith("/login/")
    get_user_model().objects.create_user("bob", password="pw")
    client.login(username="bob", password="pw")
    assert client.post(url).status_code == 403
    csrf_client = Client(enforce_csrf_checks=True)
    staff(csrf_client)
    assert csrf_client.post(url).status_code == 403
    staff(client, "carol")
    assert client.get(url).status_code == 405
    assert Dispute.objects.count() == 0 and Provider.objects.get(provider=liar).reputation == rep0


def test_settlement_ledger_totals_per_provider_and_csv(client, economy):
    import csv
    import io

    from settlement.models import Settlement

    honest, liar, _ = economy
    page = client.get("/settlements/")
    html = page.content.decode()
    sts = list(Settlement.objects.filter(state="settled"))
    assert len(sts) == 3
    fee = sum(s.network_fee for s in sts)
    assert f'id="total-fee">{fee}<' in html and 'id="total-settlements">3<' in html
    assert f'id="total-tokens">{sum(s.tokens for s in sts)}<' in html
    honest_paid = sum(s.holder_amount for s in sts if s.provider == honest)
    assert Provider.objects.get(provider=honest).balance == honest_paid and "honest-h" in html
    assert "Tokens settled per minute" in html  # the chart, from settled_at_ms
    assert page.context["chart"].bars[-1].value == sum(s.tokens for s in sts)
    filtered = client.get(f"/settlements/?provider={liar}")
    assert filtered.context["totals"]["settlements"] == 1
    assert f"?provider={liar}" in filtered.content.decode()  # the CSV link keeps the filter
    r = client.get(f"/settlements.csv?provider={honest}")
    assert r.status_code == 200 and r["Content-Type"].startswith("text/csv")
    rows = list(csv.DictReader(io.StringIO(b"".join(r.streaming_content).decode())))
    assert len(rows) == 2 and {x["provider"] for x in rows} == {honest}
    assert sum(int(x["holder_amount"]) for x in rows) == honest_paid
    assert client.get("/settlements.csv?provider=xyz").status_code == 400
    assert "ignored invalid filter" in client.get("/settlements/?provider=xyz").content.decode()


def test_economy_pages_survive_odd_query_strings(client, economy):
    odd = ["?model=%00", "?layer=-1&expert=x", "?layer=99999999999999999999", "?provider=zz&outcome=maybe",
           "?forward=%ff%fe", "?model[]=1&model=m", "?next=javascript:alert(1)"]
    for url in ECON_PAGES:
        for q in odd:
            r = client.get(url + q)
            assert r.status_code in (200, 400), (url, q, r.status_code)
            if url != "/settlements.csv":
                assert r.status_code == 200, (url, q)
    for url in ("/receipts/?layer=-1", "/receipts/?model=%00", "/disputes/?outcome=maybe", "/settlements/?forward=%ff"):
        assert "ignored invalid filter" in client.get(url).content.decode(), url
    assert client.get("/receipts/%00").status_code == 404


def test_coverage_shows_repair_passes_with_plan_accepted_and_declined(client):
    import time

    from registry import repair_service

    a, b = two_providers()
    assert "No repair pass has planned this model yet" in client.get("/coverage/m").content.decode()
    rp = repair_service.begin_pass("console-test")
    offers = repair_service.plan_offers(rp)
    rows = [r for o in offers.values() for r in o["rows"]]
    assert rows, "model m is under-replicated: the plan has rows"
    first, rest = rows[0], rows[1:]
    repair_service.record_outcome(rp.pk, first["provider"], {
        "accepted": [first], "declined": [{**r, "reason": "disk budget exhausted"} for r in rest[:1]],
        "fetched_bytes": 4096})
    repair_service.finish_pass(rp.pk, time.monotonic())
    html = client.get("/coverage/m").content.decode()
    assert f"period {rp.period}" in html and f"{len(rp.rows) if rp.rows else len(rows)} planned" in html
    assert "1 accepted" in html and f"{len(rest[:1])} declined" in html and "4.0\xa0KB fetched" in html
    if rest:
        assert "disk budget exhausted" in html


def test_provider_page_shows_balance_quarantine_receipts_disputes_settlements(client, economy):
    from asgiref.sync import async_to_sync

    from settlement import services

    honest, liar, keys = economy
    async_to_sync(services.dispute)(keys["liar"][0])
    p = Provider.objects.get(provider=liar)
    html = client.get(f"/providers/{liar}").content.decode()
    assert f'id="balance">{p.balance}<' in html and p.balance > 0
    assert keys["liar"][0][:32] in html and "outcome-upheld" in html and "Reputation after each dispute" in html
    assert "1 upheld in a row" in html and "never" in html  # one lie: streak 1, not yet quarantined
    Provider.objects.filter(provider=liar).update(quarantined_until_ms=services.now_ms() + 60_000)
    html = client.get(f"/providers/{liar}").content.decode()
    assert 'id="quarantine" class="bad"' in html and "quarantined until" in html
    assert "quarantined" in client.get("/providers/").content.decode()
    honest_page = client.get(f"/providers/{honest}").content.decode()
    assert "Never disputed" in honest_page and honest_page.count('<span class="badge state-settled">') == 2
