"""JSON-RPC method tables: each app declares its methods, the site collects them.

An app's ``api`` module holds ``rpc_methods = MethodTable()`` and registers with
``@rpc_methods.method(name, params=Serializer, operator=False)``; a method is a plain or async
function ``(params: dict) -> JSON-able result`` that calls a service module. Params are
validated by DRF serializers with strict JSON types (``validate_params``); every failure is an
``RpcError(-32602)`` naming the field. ``tenzro_site.rpc`` serves the union of the tables at
``POST /rpc``, the way ``urls.py`` collects URL patterns.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Callable

from rest_framework import serializers

from moe.jsonrpc import INVALID_PARAMS, RpcError


@dataclass
class Method:
    """A registered JSON-RPC method."""

    name: str
    func: Callable[[dict], Any]
    params: type[serializers.Serializer] | None
    operator: bool
    pass_operator: bool = False
    forward: bool = False


class MethodTable(dict):
    """An app's JSON-RPC methods by name (a ``dict[str, Method]``)."""

    def method(self, name: str, params: type[serializers.Serializer] | None = None, operator: bool = False,
               pass_operator: bool = False, forward: bool = False):
        """Decorator: register ``func`` as method ``name``; ``operator`` requires the operator bearer
        token; ``pass_operator`` adds ``_operator: bool`` (whether the caller holds it) to the params;
        ``forward`` marks work on holders, counted against the client's forward rate.
        Raises ``ValueError`` when ``name`` is registered twice."""
        def deco(func):
            if name in self:
                raise ValueError(f"JSON-RPC method {name!r} registered twice")
            self[name] = Method(name, func, params, operator, pass_operator, forward)
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

    JSON types are checked strictly first (see ``strict_types``); unknown fields are refused,
    every field when ``serializer_cls`` is None (a method without params).
    """
    if serializer_cls is None:  # a method without params: a stray one is a client's mistake, named
        if params:
            field = sorted(params)[0]
            raise RpcError(INVALID_PARAMS, f"invalid params: unknown field {field!r} (this method takes none)",
                           {"field": field})
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
