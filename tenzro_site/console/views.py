"""Console pages (thin): parse input with ``forms``, read with ``selectors``, write with services.

Reads are open to everyone; writes are POST-only (CSRF-checked) and need a staff user:
anonymous users are redirected to the login page, other users get 403. Bad input re-renders
the form with its errors (HTTP 400) and changes nothing.
"""
from __future__ import annotations

import csv
from functools import wraps

from django.contrib import messages
from django.contrib.auth.views import redirect_to_login
from asgiref.sync import async_to_sync
from django.http import Http404, HttpResponseForbidden, StreamingHttpResponse
from django.shortcuts import redirect, render
from django.views.decorators.http import require_POST

from registry import governance
from router.apps import current
from settlement import services as settlement_services
from settlement.disputes import operator_dispute
from tenzro_site.console import forms, selectors
from tenzro_site.console import serving as serving_selectors


def staff_required(view):
    """Let staff users through; redirect anonymous users to the login page, refuse others with 403."""
    @wraps(view)
    def wrapper(request, *args, **kwargs):
        if not request.user.is_authenticated:
            return redirect_to_login(request.get_full_path())
        if not request.user.is_staff:
            return HttpResponseForbidden("only staff users can change the network's state")
        return view(request, *args, **kwargs)
    return wrapper


def _voter(request) -> str:
    """The governance voter id of the logged-in staff user (``user:<username>``)."""
    return f"user:{request.user.get_username()}"


def _filter(request, form_class):
    """Bind a query-string filter form; an invalid one is ignored with a warning (still a 200)."""
    form = form_class(request.GET or None)
    if form.is_bound and not form.is_valid():
        messages.warning(request, "ignored invalid filter: " + "; ".join(
            f"{k}: {' '.join(v)}" for k, v in form.errors.items()))
        return form, {}
    return form, (form.cleaned_data if form.is_bound else {})


def index(request):
    """``/``: models and their coverage, live providers, recent failures, preparation job states."""
    return render(request, "console/overview.html", {
        "nav_section": "overview", "models": selectors.model_summaries(),
        "providers": selectors.provider_rows(live_only=True), "failures": selectors.recent_failures(),
        "prepare": selectors.prepare_summary()})


def governance_page(request, form=None, status: int = 200):
    """``/governance/``: policy in force, proposals with quorum progress, the create form, the audit trail."""
    filt, q = _filter(request, forms.ProposalFilter)
    ctx = selectors.governance_state(status=q.get("status") or None)
    ctx.update(nav_section="governance", form=form or forms.ProposalForm(), filter=filt,
               voter=_voter(request) if request.user.is_authenticated else None)
    return render(request, "console/governance.html", ctx, status=status)


@require_POST
@staff_required
def proposal_create(request):
    """``POST /governance/proposals``: open a proposal as ``user:<username>`` (validated as the RPC does)."""
    form = forms.ProposalForm(request.POST)
    if form.is_valid():
        try:
            p = governance.create_proposal(form.cleaned_data["title"], form.cleaned_data["changes"],
                                           _voter(request), form.cleaned_data["description"])
        except governance.GovernanceError as exc:
            form.add_governance_error(exc.field, str(exc))
        else:
            messages.success(request, f"proposal #{p.pk} opened")
            return redirect("console-governance")
    return governance_page(request, form=form, status=400)


@require_POST
@staff_required
def proposal_vote(request, proposal_id: int):
    """``POST /governance/proposals/<id>/vote``: the staff user's final vote; applies the change at quorum."""
    form = forms.VoteForm(request.POST)
    if not form.is_valid():
        messages.error(request, "approve: choose yes or no")
        return redirect("console-governance")
    try:
        p = governance.vote(proposal_id, _voter(request), form.cleaned_data["approve"] == "yes")
    except governance.GovernanceError as exc:
        messages.error(request, f"{exc.field}: {exc}")
    else:
        messages.success(request, f"vote recorded; proposal #{p.pk} is {p.status}")
    return redirect("console-governance")


@require_POST
@staff_required
def proposal_withdraw(request, proposal_id: int):
    """``POST /governance/proposals/<id>/withdraw``: withdraw an open proposal (audited)."""
    try:
        governance.withdraw(proposal_id, _voter(request))
    except governance.GovernanceError as exc:
        messages.error(request, f"{exc.field}: {exc}")
    else:
        messages.success(request, f"proposal #{proposal_id} withdrawn")
    return redirect("console-governance")


def providers(request):
    """``/providers/``: every provider (``?live=1``, ``?role=``) with roles, GPU, residency counts,
    committed tps, reputation, status and last heartbeat."""
    filt, q = _filter(request, forms.ProviderFilter)
    return render(request, "console/providers.html", {
        "nav_section": "providers", "filter": filt,
        "rows": selectors.provider_rows(live_only=q.get("live", False), role=q.get("role") or None)})


def provider(request, provider: str):
    """``/providers/<id>``: one provider's record, holdings (compact ranges) and failure record."""
    ctx = selectors.provider_detail(provider)
    if ctx is None:
        raise Http404(f"no provider {provider}")
    return render(request, "console/provider.html", {"nav_section": "providers", **ctx,
                                                     **selectors.provider_economy(provider)})


def coverage_index(request):
    """``/coverage/``: the published models, each linking to its heatmap."""
    return render(request, "console/coverage_index.html", {"nav_section": "coverage",
                                                            "models": selectors.model_summaries()})


def coverage(request, model_id: str):
    """``/coverage/<model_id>``: layer × expert heatmap by replication (hot marked), holders on
    click, the under-replicated list and a histogram of slots by replication; 404 for a model with
    no slots (not published, not in the catalog, held by no one)."""
    ctx = selectors.coverage(model_id)
    if not ctx["slots"]:
        raise Http404(f"no model {model_id} is published, catalogued or held here")
    return render(request, "console/coverage.html", {"nav_section": "coverage", **ctx,
                                                     "repair_passes": selectors.repair_passes(model_id)})


def expert_holders(request, model_id: str):
    """``/coverage/<model_id>/holders?layer=&expert=``: the holders panel (htmx fragment); 400 on bad input."""
    form = forms.ExpertQuery(request.GET)
    if not form.is_valid():
        return render(request, "console/_holders.html", {"errors": form.errors}, status=400)
    q = form.cleaned_data
    return render(request, "console/_holders.html", selectors.expert_holders(model_id, q["layer"], q["expert"]))


def receipts(request):
    """``/receipts/``: kept receipt samples filtered by ``?model=&provider=&layer=&expert=``."""
    filt, q = _filter(request, forms.ReceiptFilter)
    return render(request, "console/receipts.html", {
        "nav_section": "receipts", "filter": filt,
        **selectors.receipts(model_id=q.get("model") or None, provider=q.get("provider") or None,
                             layer=q.get("layer"), expert=q.get("expert"))})


def receipt(request, key: str):
    """``/receipts/<key>``: header, signed receipt with its re-verified signature status, the
    commitment rows, the settlement and the dispute outcome; the Dispute button for staff."""
    ctx = selectors.receipt_detail(key)
    if ctx is None:
        raise Http404(f"no kept receipt {key}")
    return render(request, "console/receipt.html", {"nav_section": "receipts", "r": ctx})


@require_POST
@staff_required
def receipt_dispute(request, key: str):
    """``POST /receipts/<key>/dispute``: run the operator's dispute (``settlement.disputes.
    operator_dispute``: re-verify, re-execute on another copy of the blob, compare, apply once)
    and show the outcome.

    It runs inline in this request (a re-execution of one batch); a receipt whose automatic
    audit passed is re-checked as the operator's dispute, any other disputed receipt answers
    its stored outcome. An ``EconomyError`` (no executor, store does not verify) is shown as a
    message and changes nothing.
    """
    if selectors.receipt_detail(key) is None:
        raise Http404(f"no kept receipt {key}")
    try:
        out = async_to_sync(operator_dispute)(key)
    except settlement_services.EconomyError as exc:
        messages.error(request, f"dispute not run ({exc.data['field']}): {exc.message}")
    else:
        messages.success(request, "dispute upheld: the provider signed wrong rows; fraud proof issued"
                         if out["disputed"] else "dispute rejected: the re-executed rows match the commitment")
    return redirect("console-receipt", key=key)


def disputes(request):
    """``/disputes/``: disputes with outcomes, verification and fraud proofs (``?provider=&outcome=``)."""
    filt, q = _filter(request, forms.DisputeFilter)
    outcome = q.get("outcome") or ""
    return render(request, "console/disputes.html", {
        "nav_section": "disputes", "filter": filt,
        **selectors.disputes(provider=q.get("provider") or None,
                             upheld={"upheld": True, "rejected": False}.get(outcome))})


def _settlement_filters(request) -> tuple:
    filt, q = _filter(request, forms.SettlementFilter)
    return filt, {"model_id": q.get("model") or None, "provider": q.get("provider") or None,
                  "forward_id": q.get("forward") or None}


def settlements(request):
    """``/settlements/``: the ledger per forward and per provider, totals, network fee, tokens per minute."""
    filt, q = _settlement_filters(request)
    return render(request, "console/settlements.html", {
        "nav_section": "settlements", "filter": filt, "query": request.GET.urlencode() if filt.is_valid() else "",
        **selectors.settlement_ledger(**q)})


class _Echo:
    """A file-like whose ``write`` returns the line (csv.writer into a streaming response)."""

    def write(self, value: str) -> str:
        return value


def settlements_csv(request):
    """``/settlements.csv``: the ledger under the same filters as ``/settlements/``, streamed as CSV
    (an invalid filter answers 400 with a message rather than the unfiltered ledger)."""
    filt, q = _filter(request, forms.SettlementFilter)
    if filt.is_bound and not filt.is_valid():
        return render(request, "console/settlements.html", {"nav_section": "settlements", "filter": filt,
                      **selectors.settlement_ledger(limit=0)}, status=400)
    writer = csv.writer(_Echo())
    rows = selectors.settlement_csv_rows(q.get("model") or None, q.get("provider") or None, q.get("forward") or None)
    resp = StreamingHttpResponse((writer.writerow(r) for r in rows), content_type="text/csv; charset=utf-8")
    resp["Content-Disposition"] = 'attachment; filename="settlements.csv"'
    return resp


SERVING_POLL_S = 2  # the panel polls as often as ServingMetrics keeps a snapshot


def serving(request):
    """``/serving/``: live charts of this site process's serving metrics (the panel polls itself)."""
    return render(request, "console/serving.html", _serving_context())


def serving_panel(request):
    """``/serving/panel``: the Serving page's charts and holder table (htmx polls it every 2 s)."""
    return render(request, "console/_serving_panel.html", _serving_context())


def _serving_context() -> dict:
    return {"nav_section": "serving", "s": serving_selectors.serving_state(current().metrics.sample()),
            "poll_s": SERVING_POLL_S, "window_s": serving_selectors.WINDOW_S}
