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
import re
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


MAX_DEPTH = 64  # nesting of arrays/objects a request body may have (every surface's bodies need < 10)
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.S)  # a JSON string literal (unrolled loop)
_NOT_BRACKET = bytes(b for b in range(256) if b not in b"[]{}")
_MAYBE_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F]|\xed[\xa0-\xbf]")  # an escape, or one passed raw


def _too_deep(raw: bytes, limit: int) -> bool:
    """Whether the arrays/objects of JSON text ``raw`` nest deeper than ``limit`` (or its
    brackets do not balance), found without recursion: strings dropped, brackets kept, then
    each pass removes the innermost ``[]``/``{}`` pairs (one level); C-speed passes, at most
    ``limit`` of them, none when the body has fewer brackets than ``limit``."""
    opened = 0
    for bracket in (b"[", b"{"):  # find() is memchr: a large body with few brackets costs ~2 scans
        i = raw.find(bracket)
        while i >= 0 and opened <= limit:
            opened += 1
            i = raw.find(bracket, i + 1)
    if opened <= limit:
        return False
    s = _STRING.sub(b"", raw).translate(None, _NOT_BRACKET)
    for _ in range(limit):
        if not s:
            return False
        # mark, then drop: "{[]}" loses one level per pass, not two
        s = s.replace(b"[]", b"\0").replace(b"{}", b"\0").replace(b"\0", b"")
    return bool(s)


def _lone_surrogate(value: Any) -> str | None:
    """The path (``messages[0].content``) of the first string (key or value) in parsed JSON
    ``value`` holding a lone UTF-16 surrogate (not Unicode text: no UTF-8 encoding, no
    tokenizer, no database takes it), or None. Iterative: the depth is already bounded."""
    todo = [("", value)]
    while todo:
        path, v = todo.pop()
        if isinstance(v, str):
            try:
                v.encode("utf-8")
            except UnicodeEncodeError:
                return path or "body"
        elif isinstance(v, dict):
            for k, item in v.items():
                todo.append((f"{path}.{k}" if path else str(k), k))
                todo.append((f"{path}.{k}" if path else str(k), item))
        elif isinstance(v, list):
            todo.extend((f"{path}[{i}]", item) for i, item in enumerate(v))
    return None


def loads(body: str | bytes, max_depth: int = MAX_DEPTH) -> Any:
    """``json.loads`` for request bodies, the one parser of every JSON view and endpoint.

    Refused with ``ValueError`` (bad UTF-8 or JSON, an integer over Python's 4,300-digit
    limit) or ``ParamError`` (a ``ValueError`` naming ``field`` when it can): the
    non-standard ``NaN``/``Infinity`` literals (echoing them would make the response invalid
    JSON); arrays/objects nested deeper than ``max_depth`` (checked before parsing, so no
    ``RecursionError`` and no deep structure for later code to recurse into); a string with
    a lone UTF-16 surrogate such as ``"\\ud800"`` (valid JSON syntax but not Unicode text:
    it cannot be encoded, tokenized or stored), ``field`` being its path."""
    raw = body.encode("utf-8", "surrogatepass") if isinstance(body, str) else bytes(body)
    if _too_deep(raw, max_depth):
        raise ParamError(f"JSON nested too deeply: arrays and objects may nest at most {max_depth} levels")
    value = json.loads(raw, parse_constant=_no_constant)
    if (b"\\" in raw or b"\xed" in raw) and _MAYBE_SURROGATE.search(raw) is not None:
        path = _lone_surrogate(value)
        if path is not None:
            raise ParamError(f"{path}: a string holds a lone UTF-16 surrogate (such as \\ud800), which is not "
                             f"Unicode text", path)
    return value


def valid_id(req_id: Any) -> bool:
    """Whether ``req_id`` is a JSON-RPC id this side echoes: a string, a finite number (not a
    bool; ``1e400`` parses to infinity) or null."""
    if req_id is None or isinstance(req_id, str):
        return True
    if isinstance(req_id, bool) or not isinstance(req_id, (int, float)):
        return False
    return not isinstance(req_id, float) or math.isfinite(req_id)
