"""Thin HTTP views of the expert-coverage market (``registry.market``; Kvasir contract §1.0).

Paths answer with and without a trailing slash (never a redirect); bodies are JSON (empty =
``{}``; unparseable or over ``MAX_BODY`` → 400 "request body is not JSON", nested deeper than
``moe.jsonrpc.MAX_DEPTH`` or holding a lone surrogate → 400 "request body refused: …"); every error is
``{"error": "<sentence>"}``.
"""
from __future__ import annotations

from django.http import JsonResponse
from django.views.decorators.csrf import csrf_exempt

from moe import jsonrpc
from moe.jsonrpc import ParamError
from registry import market

MAX_BODY = 1 << 20


def _error(status: int, message: str) -> JsonResponse:
    return JsonResponse({"error": message}, status=status)


def _body(request) -> dict:
    if int(request.META.get("CONTENT_LENGTH") or 0) > MAX_BODY:
        raise market.MarketError(400, "request body is not JSON")
    raw = request.body
    if len(raw) > MAX_BODY:
        raise market.MarketError(400, "request body is not JSON")
    if not raw.strip():
        return {}
    try:
        body = jsonrpc.loads(raw)
    except ParamError as exc:  # nested too deeply, a lone surrogate
        raise market.MarketError(400, f"request body refused: {exc}") from None
    except ValueError:  # bad UTF-8 or JSON
        raise market.MarketError(400, "request body is not JSON") from None
    if not isinstance(body, dict):
        raise market.MarketError(400, "request body is not JSON")
    return body


def _endpoint(method: str, auth: bool):
    def deco(fn):
        @csrf_exempt
        def view(request):
            if request.method != method:
                return _error(405, f"use {method}")
            try:
                wallet = market.authenticate(request.headers) if auth else None
                body = _body(request) if method == "POST" else {}
                return JsonResponse(fn(request, wallet, body))
            except market.MarketError as exc:
                return _error(exc.status, exc.message)
        view.__doc__ = fn.__doc__
        view.__name__ = fn.__name__
        return view
    return deco


@_endpoint("POST", auth=False)
def challenge(request, wallet, body):
    """``POST /api/auth/challenge {wallet}`` → ``{nonce, message}``."""
    return market.issue_challenge(body.get("wallet"), client=request.META.get("REMOTE_ADDR") or "?")


@_endpoint("POST", auth=False)
def node_token(request, wallet, body):
    """``POST /api/auth/node-token {wallet, nonce, signature}`` → ``{node_token, wallet, expires_in}``."""
    return market.issue_node_token(body.get("wallet"), body.get("nonce"), body.get("signature"))


@_endpoint("POST", auth=True)
def coverage(request, wallet, body):
    """``POST /api/expert-coverage`` (worker heartbeat) → ``{ok, workers, wired, listen_port, session}``."""
    return market.post_coverage(wallet, body)


@_endpoint("GET", auth=True)
def demand(request, wallet, body):
    """``GET /api/expert-demand[?model=]`` → per model, per expert layer, the replica segments."""
    return market.demand(request.GET.get("model") or None)


@_endpoint("POST", auth=True)
def volunteer(request, wallet, body):
    """``POST /api/expert-volunteer {model?, max_experts?}`` → an assignment or ``{assigned: false}``."""
    return market.volunteer(wallet, body)


@_endpoint("GET", auth=True)
def dispatch_map(request, wallet, body):
    """``GET /api/expert-dispatch-map?model=&layer=&stale=`` (service token) → ``{model, rows}``."""
    return market.dispatch_map(wallet, request.GET)


@_endpoint("GET", auth=True)
def recruitment(request, wallet, body):
    """``GET /api/moe/recruitment`` → ``{saturate_at, boost, target_base, models}``."""
    return market.recruitment(wallet)


@_endpoint("GET", auth=True)
def relay_sessions(request, wallet, body):
    """``GET /api/expert-relay/sessions`` (service token) → ``{sessions}``."""
    return market.relay_sessions(wallet)


@_endpoint("POST", auth=True)
def relay_register(request, wallet, body):
    """``POST /api/expert-relay/register`` (service token) → refused with 501 (see ``market.relay_register``)."""
    return market.relay_register(wallet, body)
