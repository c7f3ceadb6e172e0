"""JSON-RPC 2.0 at ``POST /rpc``: one async view, a method table, params validated by DRF serializers.

Methods register with ``@rpc_method(name, params=Serializer, operator=False)``; a method is a
plain or async function ``(params: dict) -> JSON-able result`` that calls a service module.
Errors (DESIGN §6): -32700 parse error, -32600 invalid request, -32601 method not found,
-32602 invalid params, -32603 internal error, -32000 planning error, -32001 auth refused,
-32004 execution error; each has a human-readable ``message`` and a ``data`` object that names
the field. Batches and notifications follow the spec; clients never see a traceback.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass
from typing import Any, Callable

from asgiref.sync import sync_to_async
from django.conf import settings
from django.core.cache import cache
from django.core.exceptions import RequestDataTooBig
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.views.decorators.csrf import csrf_exempt
from rest_framework import serializers

from tenzro_site.operator import is_operator

log = logging.getLogger(__name__)

PARSE_ERROR = -32700
INVALID_REQUEST = -32600
METHOD_NOT_FOUND = -32601
INVALID_PARAMS = -32602
INTERNAL_ERROR = -32603
PLANNING_ERROR = -32000
AUTH_REFUSED = -32001
EXECUTION_ERROR = -32004


class RpcError(Exception):
    """An error to return as a JSON-RPC error object (code, message, data)."""

    def __init__(self, code: int, message: str, data: dict | None = None):
        super().__init__(message)
        self.code = code
        self.message = message
        self.data = data or {}

    def to_json(self) -> dict:
        """The JSON-RPC ``error`` member."""
        return {"code": self.code, "message": self.message, "data": self.data}


@dataclass
class Method:
    """A registered JSON-RPC method."""

    name: str
    func: Callable[[dict], Any]
    params: type[serializers.Serializer] | None
    operator: bool
    pass_operator: bool = False


METHODS: dict[str, Method] = {}


def rpc_method(name: str, params: type[serializers.Serializer] | None = None, operator: bool = False,
               pass_operator: bool = False):
    """Register ``func`` as JSON-RPC method ``name``; ``operator`` requires the operator bearer token;
    ``pass_operator`` adds ``_operator: bool`` (whether the caller holds it) to the validated params."""
    def deco(func):
        METHODS[name] = Method(name, func, params, operator, pass_operator)
        return func
    return deco


def first_error(errors, prefix: str = "") -> tuple[str, str]:
    """(field path, message) of the first DRF validation error, e.g. ("routings[2].experts", "...")."""
    if isinstance(errors, dict) and errors:
        key, value = next(iter(errors.items()))
        if key == "non_field_errors":  # an error of the object itself: name the object
            return first_error(value, prefix)
        return first_error(value, f"{prefix}.{key}" if prefix else str(key))
    if isinstance(errors, list):
        for i, item in enumerate(errors):
            if item:  # DRF reports valid list items as empty dicts
                return first_error(item, prefix if isinstance(item, str) else f"{prefix}[{i}]")
    return prefix, str(errors)


_JSON_TYPES = (
    (serializers.BooleanField, (bool,), "a boolean (true or false)"),
    (serializers.IntegerField, (int,), "an integer"),
    (serializers.FloatField, (int, float), "a number"),
    (serializers.ChoiceField, None, None),
    (serializers.CharField, (str,), "a string"),
)


def strict_types(fields, data, prefix: str = "") -> None:
    """Refuse JSON values of the wrong type before DRF coerces them ("0" → 0, "yes" → True).

    Walks nested serializers and lists. Raises ``RpcError(-32602)`` naming the field.
    """
    if not isinstance(data, dict):
        return
    for name, field in fields.items():
        if name not in data or data[name] is None:
            continue
        value, path = data[name], f"{prefix}{name}"
        if isinstance(field, serializers.ListSerializer) and isinstance(value, list):
            for i, item in enumerate(value):
                strict_types(field.child.fields, item, f"{path}[{i}].")
            continue
        if isinstance(field, serializers.Serializer):
            strict_types(field.fields, value, f"{path}.")
            continue
        for cls, types, what in _JSON_TYPES:
            if isinstance(field, cls):
                ok = types is None or (isinstance(value, types) and not (bool not in types and isinstance(value, bool)))
                if not ok:
                    raise RpcError(INVALID_PARAMS, f"invalid params: {path} must be {what}, got {type(value).__name__}",
                                   {"field": path})
                break


def validate_params(serializer_cls, params: dict) -> dict:
    """Validate ``params`` with a DRF serializer; raises ``RpcError(-32602)`` naming the field.

    JSON types are checked strictly first (see ``strict_types``); unknown fields are refused.
    """
    if serializer_cls is None:
        return params
    ser = serializer_cls(data=params)
    strict_types(ser.fields, params)
    if not ser.is_valid():
        field, msg = first_error(ser.errors)
        raise RpcError(INVALID_PARAMS, f"invalid params: {field}: {msg}" if field else f"invalid params: {msg}",
                       {"field": field, "errors": json.loads(json.dumps(ser.errors, default=str))})
    unknown = sorted(set(params) - set(ser.fields))
    if unknown:
        raise RpcError(INVALID_PARAMS, f"invalid params: unknown field {unknown[0]!r}", {"field": unknown[0]})
    return dict(ser.validated_data)


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


async def handle_one(obj: Any, authorization: str | None) -> dict | None:
    """Handle one request object; returns the response object, or None for a notification.

    A malformed request is always answered (JSON-RPC 2.0 §5: it is not a valid notification).
    """
    if not isinstance(obj, dict):
        return _error(None, RpcError(INVALID_REQUEST, "a request must be a JSON object", {"field": "request"}))
    req_id = obj.get("id")
    if req_id is not None and (isinstance(req_id, bool) or not isinstance(req_id, (str, int, float))):
        return _error(None, RpcError(INVALID_REQUEST, "id must be a string, a number or null", {"field": "id"}))
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
        if method.pass_operator:
            params["_operator"] = is_operator(authorization)
        result = await _call(method, params)
    except RpcError as err:
        return None if is_notification else _error(req_id, err)
    except Exception:  # never leak a traceback to a client
        log.exception("JSON-RPC method failed")
        return None if is_notification else _error(
            req_id, RpcError(INTERNAL_ERROR, "internal error; the site log has the details", {}))
    return None if is_notification else {"jsonrpc": "2.0", "id": req_id, "result": result}


def _error(req_id, err: RpcError) -> dict:
    return {"jsonrpc": "2.0", "id": req_id, "error": err.to_json()}


async def _rate_limited(request: HttpRequest) -> bool:
    """Fixed one-minute window per client address (cache-backed, shared across processes with Redis)."""
    limit = settings.TENZRO["RPC_RATE_PER_MINUTE"]
    if limit <= 0:
        return False
    key = f"rpc-rate:{request.META.get('REMOTE_ADDR', '?')}:{int(time.time() // 60)}"
    if await cache.aadd(key, 1, timeout=70):
        return False
    try:
        return await cache.aincr(key) > limit
    except ValueError:
        return False


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
        payload = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        return JsonResponse(_error(None, RpcError(PARSE_ERROR, f"parse error: {exc}", {"field": "body"})))
    except RecursionError:
        return JsonResponse(_error(None, RpcError(PARSE_ERROR, "parse error: JSON nested too deeply",
                                                  {"field": "body"})))
    auth = request.headers.get("Authorization")
    if isinstance(payload, list):
        if not payload:
            return JsonResponse(_error(None, RpcError(INVALID_REQUEST, "empty batch", {"field": "batch"})))
        responses = [r for r in await asyncio.gather(*(handle_one(o, auth) for o in payload)) if r is not None]
        return JsonResponse(responses, safe=False) if responses else HttpResponse(status=204)
    response = await handle_one(payload, auth)
    return JsonResponse(response) if response is not None else HttpResponse(status=204)
