"""The JSON-RPC 2.0 vocabulary of every surface: error codes, one error class, the envelope.

Used by the site's ``/rpc`` view, the agent socket, the holder HTTP endpoint and the
execution methods, so an error reads the same wherever it is raised. Codes (docs/DESIGN.md §6):
-32700 parse error, -32600 invalid request, -32601 method not found, -32602 invalid
params, -32603 internal error, -32000 planning error, -32001 auth refused, -32004
execution error, -32005 busy (admission control: the router is at capacity or the
client's rate is spent; retry later). Every error's ``data`` names the offending ``field`` when there is one.

Pure Python; imports nothing from Django.
"""
from __future__ import annotations

import json
import math
from typing import Any

PARSE_ERROR = -32700
INVALID_REQUEST = -32600
METHOD_NOT_FOUND = -32601
INVALID_PARAMS = -32602
INTERNAL_ERROR = -32603
PLANNING_ERROR = -32000
AUTH_REFUSED = -32001
EXECUTION_ERROR = -32004
BUSY = -32005


class ParamError(ValueError):
    """Bad input that names the parameter at fault (``field``, or None when no single one is).

    A ``ValueError``, so numeric code raises it where it raised ``ValueError``; the RPC
    bindings answer it as -32602 with ``data.field`` instead of guessing from the message.
    """

    def __init__(self, message: str, field: str | None = None):
        super().__init__(message)
        self.field = field


class RpcError(Exception):
    """An error answered as a JSON-RPC error object.

    ``code`` (one of the constants above), ``message`` (human-readable), ``field`` (the
    parameter at fault, or None) and ``data`` (extra members of the error's ``data``).
    """

    def __init__(self, code: int, message: str, data: dict | None = None, *, field: str | None = None):
        super().__init__(message)
        self.code = code
        self.message = message
        self.data = dict(data or {})
        if field is not None:
            self.data["field"] = field

    @property
    def field(self) -> str | None:
        """The parameter at fault (``data["field"]``), or None."""
        return self.data.get("field")

    def to_json(self) -> dict:
        """The JSON-RPC ``error`` member: ``{code, message, data}``."""
        return {"code": self.code, "message": self.message, "data": self.data}

    @classmethod
    def invalid_params(cls, exc: ValueError, default_field: str) -> RpcError:
        """-32602 for ``exc``, naming its ``field`` (a ``ParamError``'s) or ``default_field``."""
        return cls(INVALID_PARAMS, str(exc), field=getattr(exc, "field", None) or default_field)

    @classmethod
    def from_json(cls, error: Any) -> RpcError:
        """Rebuild an error from a peer's ``error`` member (lenient: a malformed member becomes -32603)."""
        if not isinstance(error, dict):
            return cls(INTERNAL_ERROR, f"malformed error member: {error!r}"[:300])
        code = error.get("code")
        data = error.get("data")
        return cls(code if isinstance(code, int) and not isinstance(code, bool) else INTERNAL_ERROR,
                   str(error.get("message", "error"))[:2000], data if isinstance(data, dict) else None)


def result_response(req_id: Any, result: Any) -> dict:
    """``{"jsonrpc": "2.0", "id": req_id, "result": result}``."""
    return {"jsonrpc": "2.0", "id": req_id, "result": result}


def error_response(req_id: Any, err: RpcError) -> dict:
    """``{"jsonrpc": "2.0", "id": req_id, "error": err.to_json()}``."""
    return {"jsonrpc": "2.0", "id": req_id, "error": err.to_json()}


def request(method: str, params: dict, req_id: Any = 1) -> dict:
    """A JSON-RPC 2.0 request object."""
    return {"jsonrpc": "2.0", "id": req_id, "method": method, "params": params}


def _no_constant(name: str):
    raise ValueError(f"{name} is not JSON (non-finite numbers are refused)")


def loads(body: str | bytes) -> Any:
    """``json.loads`` for request bodies: the non-standard ``NaN``/``Infinity`` literals are
    refused (``ValueError``, answered -32700), since echoing them would make the response
    invalid JSON. Also raises ``ValueError`` (bad UTF-8 or JSON) and ``RecursionError``."""
    return json.loads(body, parse_constant=_no_constant)


def valid_id(req_id: Any) -> bool:
    """Whether ``req_id`` is a JSON-RPC id this side echoes: a string, a finite number (not a
    bool; ``1e400`` parses to infinity) or null."""
    if req_id is None or isinstance(req_id, str):
        return True
    if isinstance(req_id, bool) or not isinstance(req_id, (int, float)):
        return False
    return not isinstance(req_id, float) or math.isfinite(req_id)
