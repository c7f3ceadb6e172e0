"""JSON-RPC 2.0 at ``POST /rpc``: one async view over the methods every app declares.

Each installed app's ``api`` module may hold ``rpc_methods`` (a ``registry.rpc.MethodTable``);
``METHODS`` is their union, collected once at import like ``urls.py`` collects URL patterns.
Errors (``moe.jsonrpc``, docs/DESIGN.md §6): -32700 parse error, -32600 invalid request, -32601 method not found,
-32602 invalid params, -32603 internal error, -32000 planning error, -32001 auth refused,
-32004 execution error, -32005 busy (``router.admission``: batch over ``RPC_MAX_BATCH`` is
refused whole; forward methods count against the client's forward rate; a single request
answered busy gets HTTP 429 with ``Retry-After``); each has a human-readable ``message``
and a ``data`` object that names the field. Batches and notifications follow the spec; clients never see a traceback.
"""
from __future__ import annotations

import asyncio
import logging
from importlib import import_module
from typing import Any

from asgiref.sync import sync_to_async
from django.apps import apps
from django.conf import settings
from django.core.exceptions import RequestDataTooBig
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.views.decorators.csrf import csrf_exempt

from router.admission import check_forward_rate, over_rate
from moe import jsonrpc
from moe.jsonrpc import (AUTH_REFUSED, BUSY, INTERNAL_ERROR, INVALID_PARAMS, INVALID_REQUEST, METHOD_NOT_FOUND,
                              PARSE_ERROR, RpcError, error_response, result_response)
from registry.operator import is_operator
from registry.rpc import Method, validate_params

log = logging.getLogger(__name__)


def collect_methods() -> dict[str, Method]:
    """The union of ``<app>.api.rpc_methods`` over the installed apps; raises ``ValueError``
    when two apps declare one name."""
    methods: dict[str, Method] = {}
    for config in apps.get_app_configs():
        try:
            module = import_module(f"{config.name}.api")
        except ModuleNotFoundError as exc:
            if exc.name != f"{config.name}.api":
                raise
            continue
        for name, method in getattr(module, "rpc_methods", {}).items():
            if name in methods:
                raise ValueError(f"JSON-RPC method {name!r} declared by two apps")
            methods[name] = method
    return methods


METHODS = collect_methods()

async def _call(method: Method, params: dict) -> Any:
    if asyncio.iscoroutinefunction(method.func):
        return await method.func(params)
    return await sync_to_async(method.func, thread_sensitive=True)(params)


def _envelope(obj: dict) -> tuple[str, dict]:
    """(method name, params) of a request object; raises ``RpcError`` for a malformed envelope."""
    if obj.get("jsonrpc") != "2.0":
        raise RpcError(INVALID_REQUEST, 'jsonrpc must be exactly "2.0"', {"field": "jsonrpc"})
    name = obj.get("method")
    if not isinstance(name, str) or not name:
        raise RpcError(INVALID_REQUEST, "method must be a non-empty string", {"field": "method"})
    params = obj.get("params", {})
    if params == []:
        params = {}
    if not isinstance(params, dict):
        raise RpcError(INVALID_PARAMS, "params must be an object (by-name parameters) or an empty array",
                       {"field": "params"})
    return name, params


async def handle_one(obj: Any, authorization: str | None, client: str | None = None) -> dict | None:
    """Handle one request object; returns the response object, or None for a notification.
    ``client`` (the caller's address) keys the per-client forward rate.

    A malformed request is always answered (JSON-RPC 2.0 §5: it is not a valid notification).
    """
    if not isinstance(obj, dict):
        return _error(None, RpcError(INVALID_REQUEST, "a request must be a JSON object", {"field": "request"}))
    req_id = obj.get("id")
    if not jsonrpc.valid_id(req_id):
        return _error(None, RpcError(INVALID_REQUEST, "id must be a string, a finite number or null", {"field": "id"}))
    try:
        name, params = _envelope(obj)
    except RpcError as err:
        return _error(req_id, err)
    is_notification = "id" not in obj
    try:
        method = METHODS.get(name)
        if method is None:
            raise RpcError(METHOD_NOT_FOUND, f"method {name!r} not found; methods: {', '.join(sorted(METHODS))}",
                           {"field": "method", "method": name})
        if method.operator and not is_operator(authorization):
            raise RpcError(AUTH_REFUSED, f"{name} needs the operator credential: Authorization: Bearer <token>",
                           {"field": "Authorization"})
        params = validate_params(method.params, params)
        if method.forward:
            await check_forward_rate(client)
        if method.pass_operator:
            params["_operator"] = is_operator(authorization)
        result = await _call(method, params)
    except RpcError as err:
        return None if is_notification else _error(req_id, err)
    except Exception:  # never leak a traceback to a client
        log.exception("JSON-RPC method failed")
        return None if is_notification else _error(
            req_id, RpcError(INTERNAL_ERROR, "internal error; the site log has the details", {}))
    return None if is_notification else result_response(req_id, result)


_error = error_response


async def _rate_limited(request: HttpRequest) -> bool:
    """Fixed one-minute window of HTTP requests per client address (``router.admission.over_rate``)."""
    return await over_rate("rpc", request.META.get("REMOTE_ADDR", "?"), settings.TENZRO["RPC_RATE_PER_MINUTE"])


def _busy_response(response: dict) -> JsonResponse:
    """A single request's answer; HTTP 429 with ``Retry-After`` when it was refused as busy."""
    err = response.get("error") or {}
    if err.get("code") != BUSY:
        return JsonResponse(response)
    retry = (err.get("data") or {}).get("retry_after_s", 1)
    return JsonResponse(response, status=429, headers={"Retry-After": str(max(1, int(retry + 0.999)))})


@csrf_exempt
async def rpc_view(request: HttpRequest) -> HttpResponse:
    """``POST /rpc``: a JSON-RPC 2.0 request or batch; always answers JSON-RPC objects."""
    if request.method != "POST":
        return JsonResponse(_error(None, RpcError(INVALID_REQUEST, "use POST with a JSON-RPC 2.0 body",
                                                  {"field": "method"})), status=405)
    if await _rate_limited(request):
        return JsonResponse(_error(None, RpcError(INVALID_REQUEST, "rate limit exceeded; retry in a minute",
                                                  {"field": "rate"})), status=429)
    try:
        body = request.body
    except RequestDataTooBig:
        return JsonResponse(_error(None, RpcError(
            INVALID_REQUEST, f"request body is over the {settings.DATA_UPLOAD_MAX_MEMORY_SIZE}-byte limit",
            {"field": "body", "limit": settings.DATA_UPLOAD_MAX_MEMORY_SIZE})), status=413)
    try:
        payload = jsonrpc.loads(body)
    except ValueError as exc:  # bad UTF-8 or JSON, a 4,300-digit integer, too deep, a lone surrogate
        return JsonResponse(_error(None, RpcError(PARSE_ERROR, f"parse error: {str(exc)[:300]}",
                                                  {"field": getattr(exc, "field", None) or "body"})))
    auth = request.headers.get("Authorization")
    client = request.META.get("REMOTE_ADDR", "?")
    if isinstance(payload, list):
        if not payload:
            return JsonResponse(_error(None, RpcError(INVALID_REQUEST, "empty batch", {"field": "batch"})))
        cap = settings.TENZRO["RPC_MAX_BATCH"]
        if len(payload) > cap:
            return JsonResponse(_error(None, RpcError(
                INVALID_REQUEST, f"batch of {len(payload)} requests is over the limit of {cap}; split it",
                {"field": "batch", "limit": cap})), status=413)
        responses = [r for r in await asyncio.gather(*(handle_one(o, auth, client) for o in payload))
                     if r is not None]
        return JsonResponse(responses, safe=False) if responses else HttpResponse(status=204)
    response = await handle_one(payload, auth, client)
    return _busy_response(response) if response is not None else HttpResponse(status=204)
